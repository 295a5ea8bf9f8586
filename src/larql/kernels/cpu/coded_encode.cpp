// turbo-quant's encoding of K/V rows (2, 3 or 4 bits an index), the codec's arithmetic in one
// pass per vector:
//
//   x = row − μ (centering; μ = 0 without), zero-padded to D'
//   norm = ‖x‖,  u = x / norm (0 where norm ≤ 1e-12),  ũ = u · R
//   index_j = #{boundaries ≤ ũ_j}  (the Lloyd–Max cell of ũ_j)
//   with norm correction: norm ← norm / ‖c[index]‖ (where that is > 1e-12)
//
// stored as `[norm: float32][D' · bits / 8 bytes]`, index j at bits j · bits.. of one LSB-first
// bit stream (at 4 bits byte j / 2, the first of a pair in the low nibble); a token's row is its
// K heads' vectors, then its V heads'. The float sums run in
// another order than torch's, so a coordinate within rounding of a boundary can take the
// neighbouring cell; everything else is the torch codec's bytes.
#include <torch/types.h>

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "coded_attention.h"

namespace larql {

namespace {

constexpr float kZeroNorm = 1e-12f;

// One vector x [dim] (already centred) → its coded bytes at `out` (`levels` = 2^bits cells).
void encode_vector(const float* x, int64_t dim, int64_t width, int bits, const float* rotation,
                   const float* boundaries, const float* centroids, bool norm_correction,
                   float* unit, float* rotated, uint8_t* out) {
  float sum = 0.0f;
  for (int64_t i = 0; i < dim; ++i) sum += x[i] * x[i];
  float norm = std::sqrt(sum);
  for (int64_t i = 0; i < width; ++i) {
    unit[i] = i < dim && norm > kZeroNorm ? x[i] / norm : 0.0f;
  }
  std::fill(rotated, rotated + width, 0.0f);
  for (int64_t i = 0; i < dim; ++i) {
    const float u = unit[i];
    const float* row = rotation + i * width;
    for (int64_t c = 0; c < width; ++c) rotated[c] += u * row[c];
  }
  const int inner = (1 << bits) - 1;  // boundaries
  float quantised = 0.0f;
  uint8_t* payload = out + sizeof(float);
  std::memset(payload, 0, width * bits / 8);
  for (int64_t c = 0; c < width; ++c) {
    int cell = 0;
    while (cell < inner && boundaries[cell] <= rotated[c]) ++cell;
    quantised += centroids[cell] * centroids[cell];
    const int64_t bit = c * bits;
    const int word = cell << (bit % 8);  // at most 11 bits: two bytes
    payload[bit / 8] |= static_cast<uint8_t>(word);
    if ((bit % 8) + bits > 8) payload[bit / 8 + 1] |= static_cast<uint8_t>(word >> 8);
  }
  if (norm_correction) {
    const float length = std::sqrt(quantised);
    norm = norm / (length > kZeroNorm ? length : 1.0f);
  }
  std::memcpy(out, &norm, sizeof(float));
}

}  // namespace

// kv-quant's `Fp8Codec` of the coordinates z [groups · group], in the torch codec's float32
// operations:
//
//   per group: scale = max(float16(max |z| / 448), 1e-8), code_i = e4m3(z_i / scale)
//
// stored [float16 scales][e4m3 bytes]; e4m3 is torch's own conversion (round to nearest even,
// finite overflow saturating to ±448), so the bytes are the torch codec's.
static void encode_fp8_groups(const float* z, int64_t groups, int64_t group, uint8_t* out) {
  c10::Half* scales = reinterpret_cast<c10::Half*>(out);
  uint8_t* payload = out + 2 * groups;
  for (int64_t j = 0; j < groups; ++j) {
    const float* g = z + j * group;
    float top = 0.0f;
    for (int64_t i = 0; i < group; ++i) top = std::max(top, std::fabs(g[i]));
    const float scale = std::max(static_cast<float>(c10::Half(top / 448.0f)), 1e-8f);
    scales[j] = c10::Half(scale);
    for (int64_t i = 0; i < group; ++i) {
      payload[j * group + i] = c10::Float8_e4m3fn(g[i] / scale).x;
    }
  }
}

// kv-quant's `IntCodec`, in the torch codec's float32 operations:
//
//   z = [x, 0] · R (the first `turned` coordinates; [x, 0] without a rotation), zeros to width
//   per group of `group`: scale = max(float16((max z − min z) / levels), 1e-8),
//                         zero = float16(min z), index_i = clamp(round((z_i − zero) / scale))
//
// with levels = 2^bits − 1 and round half to even, stored [float16 scales][float16 zero
// points][indices, LSB first]. As with turbo-quant's codes, the rotation's sums run in another
// order than torch's, so a coordinate within rounding of a step may take the neighbouring index.
void encode_grouped_vector(const float* x, int64_t dim, const float* rotation,
                           const GroupedCodec& codec, uint8_t* out) {
  thread_local std::vector<float> z;
  z.assign(codec.width, 0.0f);
  if (rotation != nullptr) {
    for (int64_t i = 0; i < dim; ++i) {
      const float xi = x[i];
      const float* row = rotation + i * codec.turned;
      for (int64_t c = 0; c < codec.turned; ++c) z[c] += xi * row[c];
    }
  } else {
    std::copy(x, x + dim, z.begin());
  }
  const int64_t groups = codec.width / codec.group;
  if (codec.fp8) {
    encode_fp8_groups(z.data(), groups, codec.group, out);
    return;
  }
  const int levels = (1 << codec.bits) - 1;
  c10::Half* scales = reinterpret_cast<c10::Half*>(out);
  c10::Half* zeros = scales + groups;
  uint8_t* payload = out + 4 * groups;
  std::memset(payload, 0, codec.width * codec.bits / 8);
  for (int64_t j = 0; j < groups; ++j) {
    const float* g = z.data() + j * codec.group;
    float low = g[0], high = g[0];
    for (int64_t i = 1; i < codec.group; ++i) {
      low = std::min(low, g[i]);
      high = std::max(high, g[i]);
    }
    const float scale =
        std::max(static_cast<float>(c10::Half((high - low) / static_cast<float>(levels))), 1e-8f);
    const c10::Half zero_half(low);
    const float zero = static_cast<float>(zero_half);
    scales[j] = c10::Half(scale);
    zeros[j] = zero_half;
    for (int64_t i = 0; i < codec.group; ++i) {
      const float code = std::nearbyint((g[i] - zero) / scale);
      const int index = static_cast<int>(std::min<float>(levels, std::max(0.0f, code)));
      const int64_t bit = (j * codec.group + i) * codec.bits;
      payload[bit / 8] |= static_cast<uint8_t>(index << (bit % 8));
    }
  }
}

void encode_token(const float* kv, int64_t kv_heads, int64_t dim, const float* mean,
                  const float* rotation, int64_t width, const Codebook& book, uint8_t* out) {
  thread_local std::vector<float> centred, unit, rotated;
  centred.resize(dim);
  unit.resize(width);
  rotated.resize(width);
  const int64_t vector_bytes = coded_vector_bytes(width, book.bits);
  for (int64_t v = 0; v < 2 * kv_heads; ++v) {
    for (int64_t d = 0; d < dim; ++d) {
      centred[d] = mean != nullptr ? kv[v * dim + d] - mean[v * dim + d] : kv[v * dim + d];
    }
    encode_vector(centred.data(), dim, width, book.bits, rotation, book.boundaries,
                  book.centroids, book.norm_correction, unit.data(), rotated.data(),
                  out + v * vector_bytes);
  }
}

// rows: float32 or float16 [S, 2, Hkv, D]; mean: float32 [2, Hkv, D] or an empty tensor;
// rotation: float32 [D', D'] (D ≤ D', D' a multiple of 8); boundaries: float32 [2^bits − 1];
// centroids: float32 [2^bits] (bits 2, 3 or 4) → uint8 [S, 2 · Hkv · (4 + D' · bits / 8)].
torch::Tensor coded_encode(torch::Tensor rows, torch::Tensor mean, torch::Tensor rotation,
                           torch::Tensor boundaries, torch::Tensor centroids,
                           bool norm_correction) {
  TORCH_CHECK(rows.dim() == 4 && rows.size(1) == 2, "rows must be [S, 2, Hkv, D]");
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32 || rows.scalar_type() == torch::kFloat16,
              "rows must be float32 or float16");
  const int64_t count = rows.size(0), kv_heads = rows.size(2), dim = rows.size(3);
  TORCH_CHECK(rotation.dtype() == torch::kFloat32 && rotation.dim() == 2 &&
                  rotation.size(0) == rotation.size(1) && rotation.size(0) >= dim &&
                  rotation.size(0) % 8 == 0 && rotation.is_contiguous(),
              "rotation must be contiguous float32 [D', D'], D' a multiple of 8 and ≥ D");
  const int64_t levels = centroids.numel();
  TORCH_CHECK(centroids.dtype() == torch::kFloat32 && (levels == 4 || levels == 8 || levels == 16)
                  && boundaries.dtype() == torch::kFloat32 && boundaries.numel() == levels - 1,
              "a codebook of 2, 3 or 4 bits: float32 centroids [2^bits], boundaries [2^bits − 1]");
  const int bits = levels == 4 ? 2 : (levels == 8 ? 3 : 4);
  const bool centered = mean.numel() > 0;
  if (centered) {
    TORCH_CHECK(mean.dtype() == torch::kFloat32 && mean.numel() == 2 * kv_heads * dim,
                "mean must be float32 [2, Hkv, D]");
    mean = mean.contiguous();
  }
  const int64_t width = rotation.size(0);
  const int64_t vector_bytes = static_cast<int64_t>(sizeof(float)) + width * bits / 8;
  const int64_t vectors = 2 * kv_heads;  // per token
  torch::Tensor x = rows.to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty({count, vectors * vector_bytes}, torch::kUInt8);
  const float* data = x.data_ptr<float>();
  const float* mu = centered ? mean.data_ptr<float>() : nullptr;
  const float* r = rotation.data_ptr<float>();
  const float* bounds = boundaries.contiguous().data_ptr<float>();
  const float* table = centroids.contiguous().data_ptr<float>();
  uint8_t* coded = out.data_ptr<uint8_t>();
  at::parallel_for(0, count * vectors, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> centred(dim), unit(width), rotated(width);
    for (int64_t v = begin; v < end; ++v) {
      const float* row = data + v * dim;
      for (int64_t d = 0; d < dim; ++d) {
        centred[d] = centered ? row[d] - mu[(v % vectors) * dim + d] : row[d];
      }
      encode_vector(centred.data(), dim, width, bits, r, bounds, table, norm_correction,
                    unit.data(), rotated.data(), coded + v * vector_bytes);
    }
  });
  return out;
}

// rows: float32 or float16 [S, 2, Hkv, D]; mean: float32 [2, Hkv, D] or an empty tensor;
// rotation: float32 [Rn, Rn] (D ≤ Rn ≤ width) or an empty tensor; bits 2, 4 or 8; width whole
// groups, a multiple of 8 → uint8 [S, 2 · Hkv · (4 · width / group + width · bits / 8)].
torch::Tensor grouped_encode(torch::Tensor rows, torch::Tensor mean, torch::Tensor rotation,
                             int64_t bits, int64_t group, int64_t width, bool fp8) {
  TORCH_CHECK(rows.dim() == 4 && rows.size(1) == 2, "rows must be [S, 2, Hkv, D]");
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32 || rows.scalar_type() == torch::kFloat16,
              "rows must be float32 or float16");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  TORCH_CHECK(!fp8 || bits == 8, "fp8 codes are 8 bits");
  const int64_t count = rows.size(0), kv_heads = rows.size(2), dim = rows.size(3);
  TORCH_CHECK(group > 0 && width % group == 0 && width % 8 == 0 && width >= dim,
              "width must be whole groups, a multiple of 8, at least the head");
  const bool rotated = rotation.numel() > 0;
  if (rotated) {
    TORCH_CHECK(rotation.dtype() == torch::kFloat32 && rotation.dim() == 2 &&
                    rotation.size(0) == rotation.size(1) && rotation.size(0) >= dim &&
                    rotation.size(0) <= width && rotation.is_contiguous(),
                "rotation must be contiguous float32 [Rn, Rn] with D ≤ Rn ≤ width");
  }
  const bool centered = mean.numel() > 0;
  if (centered) {
    TORCH_CHECK(mean.dtype() == torch::kFloat32 && mean.numel() == 2 * kv_heads * dim,
                "mean must be float32 [2, Hkv, D]");
    mean = mean.contiguous();
  }
  const GroupedCodec codec{static_cast<int>(bits), group, width, rotated ? rotation.size(0) : 0,
                           fp8};
  const int64_t vector_bytes = grouped_vector_bytes(codec), vectors = 2 * kv_heads;
  torch::Tensor x = rows.to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty({count, vectors * vector_bytes}, torch::kUInt8);
  const float* data = x.data_ptr<float>();
  const float* mu = centered ? mean.data_ptr<float>() : nullptr;
  const float* r = rotated ? rotation.data_ptr<float>() : nullptr;
  uint8_t* coded = out.data_ptr<uint8_t>();
  at::parallel_for(0, count * vectors, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> centred(dim);
    for (int64_t v = begin; v < end; ++v) {
      for (int64_t d = 0; d < dim; ++d) {
        centred[d] = data[v * dim + d] - (centered ? mu[(v % vectors) * dim + d] : 0.0f);
      }
      encode_grouped_vector(centred.data(), dim, r, codec, coded + v * vector_bytes);
    }
  });
  return out;
}

}  // namespace larql
