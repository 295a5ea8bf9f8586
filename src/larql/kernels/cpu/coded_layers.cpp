// turbo-quant's (and kv-quant's) decode step through every layer in one call, for the rows of
// one or more sessions: decode_layers_batch's layer (decode_layer.cpp: QKV + RoPE, the output
// projection and the MLP, each weight read once for all rows) around the attention over each
// session's store as it is kept, and that store's update:
//
//   store   [sinks: exact 16-bit rows] [codes: coded rows] [recent: the newest rows, 16-bit or
//           int8 with a float16 scale per head vector]
//   attend  each row's query over its session's sinks, codes, recent rows and its own new
//           row (coded_attention.cpp, the codes read in place)
//   update  per row, by its mode: 0 the new row joins the recent rows; 1 the oldest recent row
//           is coded and the new row joins them; 2 (no recent rows kept) the new row is coded
//
// The stores' rows are written in place: each row's caller reserved room after its codes and
// recent rows, and counts the rows it wrote after the call. The arithmetic is that of the
// extension's separate calls (coded_attention, coded_encode) and of the store's own
// conversions: a float16 row is the round-to-nearest float16 of the float32 one; an int8 head
// vector x is codes round(x / s) clamped to ±127 with s = float16(max|x| / 127) (1 where 0).
#include <torch/types.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "coded_attention.h"
#include "decode_layer.h"

namespace larql {

namespace {

constexpr int64_t kPlaces = 6;  // per row: sinks, codes' first / end, recent's first / end, mode
enum Mode : int64_t { kKeepNew = 0, kCodeOldest = 1, kCodeNew = 2 };

// One row's store of one layer, as the call reads and writes it.
struct RowStore {
  uint8_t* codes;  // [capacity, row_bytes]
  void* recent;  // [capacity, 2, Hkv, D] float16 or int8
  c10::Half* scales;  // [capacity, 2, Hkv] (int8 recent rows) or null
  const c10::Half* sinks;  // [≥ sinks, 2, Hkv, D] or null
  const float* mean;  // [2, Hkv, D] or null
  int64_t sinks_rows, codes_first, codes_end, recent_first, recent_end, mode;
};

// The layer's attention and store update for its M rows, each over its own session's store.
struct CodedLayer {
  const std::vector<RowStore>& stores;
  int64_t heads, kv_heads, dim;
  const float* rotation;  // turbo-quant's [width, width]; kv-quant's [turned, turned] or null
  const Codebook* book;  // turbo-quant's codes, or null
  const GroupedCodec* grouped;  // kv-quant's codes, or null
  bool int8_recent;
  float scale;
  int64_t threads;
  int64_t book_width;  // turbo-quant's rotated width

  int64_t vectors() const { return 2 * kv_heads; }
  int64_t vector_bytes() const {
    return grouped ? grouped_vector_bytes(*grouped) : coded_vector_bytes(book_width, book->bits);
  }
  int64_t row_bytes() const { return vectors() * vector_bytes(); }

  ExactRows recent_rows(const RowStore& s, int64_t first, int64_t count) const {
    const int64_t at = first * vectors() * dim;
    if (int8_recent) {
      return ExactRows{static_cast<const int8_t*>(s.recent) + at, count, ExactRows::Int8,
                       s.scales + first * vectors()};
    }
    return ExactRows{static_cast<const c10::Half*>(s.recent) + at, count, ExactRows::Float16};
  }

  // row: its projected [q; k; v] → out [heads, dim]
  void attend(const RowStore& s, const float* row, float* out) const {
    std::vector<ExactRows> exact;
    if (s.sinks_rows > 0) exact.push_back(ExactRows{s.sinks, s.sinks_rows, ExactRows::Float16});
    if (s.recent_end > s.recent_first) {
      exact.push_back(recent_rows(s, s.recent_first, s.recent_end - s.recent_first));
    }
    exact.push_back(ExactRows{row + heads * dim, 1, ExactRows::Float32});  // the new row
    const uint8_t* codes = s.codes + s.codes_first * row_bytes();
    const int64_t n = s.codes_end - s.codes_first;
    if (grouped) {
      attend_grouped_rows(row, heads, dim, rotation, *grouped, codes, n, kv_heads, exact, scale,
                          threads, out);
    } else {
      attend_turbo(row, heads, dim, rotation, book_width, codes, n, kv_heads, *book, s.mean,
                   exact, scale, threads, out);
    }
  }

  // One token's K/V kv [2, Hkv, D] → its code row at `out`.
  void encode(const RowStore& s, const float* kv, uint8_t* out) const {
    if (!grouped) {
      encode_token(kv, kv_heads, dim, s.mean, rotation, book_width, *book, out);
      return;
    }
    for (int64_t v = 0; v < vectors(); ++v) {  // (kv-quant's layers are not centred)
      encode_grouped_vector(kv + v * dim, dim, rotation, *grouped, out + v * vector_bytes());
    }
  }

  // The new row kv [2, Hkv, D] into recent slot `slot` at 16 or 8 bits.
  void keep_recent(const RowStore& s, const float* kv, int64_t slot) const {
    const int64_t n = vectors() * dim;
    if (!int8_recent) {
      c10::Half* out = static_cast<c10::Half*>(s.recent) + slot * n;
      for (int64_t i = 0; i < n; ++i) out[i] = c10::Half(kv[i]);
      return;
    }
    int8_t* out = static_cast<int8_t*>(s.recent) + slot * n;
    for (int64_t v = 0; v < vectors(); ++v) {
      const float* x = kv + v * dim;
      float top = 0.0f;
      for (int64_t d = 0; d < dim; ++d) top = std::max(top, std::abs(x[d]));
      const c10::Half stored(top / 127.0f);
      const float divisor = static_cast<float>(stored) > 0.0f ? static_cast<float>(stored) : 1.0f;
      for (int64_t d = 0; d < dim; ++d) {
        const float code = std::nearbyint(x[d] / divisor);
        out[v * dim + d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
      }
      s.scales[slot * vectors() + v] = stored;
    }
  }

  void update(const RowStore& s, const float* row) const {
    const float* kv = row + heads * dim;  // the new row's K heads, then its V heads
    uint8_t* coded = s.codes + s.codes_end * row_bytes();
    if (s.mode == kCodeNew) {
      encode(s, kv, coded);
      return;
    }
    if (s.mode == kCodeOldest) {
      thread_local std::vector<float> oldest;
      oldest.resize(vectors() * dim);
      const ExactRows leaving = recent_rows(s, s.recent_first, 1);
      for (int64_t v = 0; v < vectors(); ++v) leaving.load(0, v, vectors(), dim, &oldest[v * dim]);
      encode(s, oldest.data(), coded);
    }
    keep_recent(s, kv, s.recent_end);
  }
};

template <typename T>
T* data_or_null(const std::vector<torch::Tensor>& list, size_t m) {
  return list.empty() ? nullptr : static_cast<T*>(list[m].data_ptr());
}

// Layer l's row stores, their shapes checked against the call's widths.
std::vector<RowStore> row_stores(const std::vector<torch::Tensor>& codes,
                                 const std::vector<torch::Tensor>& recent,
                                 const std::vector<torch::Tensor>& scales,
                                 const std::vector<torch::Tensor>& sinks,
                                 const std::vector<torch::Tensor>& means,
                                 const std::vector<int64_t>& places, int64_t m_rows,
                                 int64_t kv_heads, int64_t dim, int64_t row_bytes,
                                 bool int8_recent) {
  const size_t rows = static_cast<size_t>(m_rows);
  TORCH_CHECK(codes.size() == rows && recent.size() == rows,
              "one codes and one recent-rows storage per row, per layer");
  TORCH_CHECK((scales.empty() || scales.size() == rows) && (sinks.empty() || sinks.size() == rows)
                  && (means.empty() || means.size() == rows),
              "recent scales, sinks and means: none, or one per row");
  TORCH_CHECK(int8_recent == !scales.empty(), "int8 recent rows come with their scales");
  std::vector<RowStore> stores(rows);
  for (size_t m = 0; m < rows; ++m) {
    const int64_t* p = places.data() + m * kPlaces;
    RowStore& s = stores[m];
    s.sinks_rows = p[0];
    s.codes_first = p[1];
    s.codes_end = p[2];
    s.recent_first = p[3];
    s.recent_end = p[4];
    s.mode = p[5];
    TORCH_CHECK(s.mode >= kKeepNew && s.mode <= kCodeNew, "a row's mode must be 0, 1 or 2");
    const torch::Tensor& c = codes[m];
    TORCH_CHECK(c.dtype() == torch::kUInt8 && c.dim() == 2 && c.size(1) == row_bytes &&
                    c.is_contiguous(),
                "codes must be contiguous uint8 [capacity, row_bytes]");
    const int64_t code_room = s.mode == kKeepNew ? s.codes_end : s.codes_end + 1;
    TORCH_CHECK(0 <= s.codes_first && s.codes_first <= s.codes_end && code_room <= c.size(0),
                "the codes' rows (and the one a row codes) must lie in their storage");
    const torch::Tensor& r = recent[m];
    if (s.mode != kCodeNew || r.numel() > 0) {
      TORCH_CHECK(r.dim() == 4 && r.size(1) == 2 && r.size(2) == kv_heads && r.size(3) == dim &&
                      r.is_contiguous() &&
                      r.scalar_type() == (int8_recent ? torch::kInt8 : torch::kFloat16),
                  "recent rows must be contiguous [capacity, 2, Hkv, D], float16 or int8");
      const int64_t recent_room = s.mode == kCodeNew ? s.recent_end : s.recent_end + 1;
      TORCH_CHECK(0 <= s.recent_first && s.recent_first <= s.recent_end &&
                      recent_room <= r.size(0) && (s.mode != kCodeOldest || s.recent_first <
                      s.recent_end),
                  "the recent rows (and the new one) must lie in their storage");
    } else {
      TORCH_CHECK(s.recent_first == s.recent_end, "no recent storage, no recent rows");
    }
    s.codes = c.data_ptr<uint8_t>();
    s.recent = r.numel() > 0 ? r.data_ptr() : nullptr;
    if (int8_recent) {
      TORCH_CHECK(scales[m].scalar_type() == torch::kFloat16 && scales[m].is_contiguous() &&
                      scales[m].numel() == r.size(0) * 2 * kv_heads,
                  "recent scales must be contiguous float16 [capacity, 2, Hkv, 1]");
    }
    s.scales = data_or_null<c10::Half>(scales, m);
    if (!sinks.empty()) {
      const torch::Tensor& k = sinks[m];
      TORCH_CHECK(k.scalar_type() == torch::kFloat16 && k.is_contiguous() &&
                      k.numel() >= s.sinks_rows * 2 * kv_heads * dim,
                  "sinks must be contiguous float16 [≥ sinks, 2, Hkv, D]");
    } else {
      TORCH_CHECK(s.sinks_rows == 0, "sink rows need their storage");
    }
    s.sinks = data_or_null<const c10::Half>(sinks, m);
    if (!means.empty()) {
      TORCH_CHECK(means[m].dtype() == torch::kFloat32 && means[m].is_contiguous() &&
                      means[m].numel() == 2 * kv_heads * dim,
                  "means must be contiguous float32 [2, Hkv, D]");
    }
    s.mean = data_or_null<const float>(means, m);
  }
  return stores;
}

}  // namespace

// Every layer of a quantised decode step for M rows, one a session (decode_layers_batch's
// arguments up to sin, then per layer l and row m): codes[l][m] uint8 [capacity, row_bytes];
// recent[l][m] [capacity, 2, Hkv, D] float16, or int8 with recent_scales[l][m] float16
// [capacity, 2, Hkv, 1] (recent_scales[l] empty for float16 rows); sinks[l][m] float16
// [≥ sinks, 2, Hkv, D] (sinks[l] empty without sink rows); means[l][m] float32 [2, Hkv, D]
// (means[l] empty without centering); places [M · 6]: per row its sink rows, its codes' first
// row and end, its recent rows' first and end, and its mode (the header's), the same at every
// layer. The codec: `group` 0 for turbo-quant's (rotation [D', D'], centroids [2^bits],
// boundaries [2^bits − 1], norm_correction), else kv-quant's integer codes of `bits` in groups
// of `group` over `width` coordinates (`fp8`: its e4m3 codes, bits 8; rotation [Rn, Rn] or
// empty; centroids and boundaries empty) → the residuals after the last layer [M, H]; each row's codes and recent rows written
// past their ends.
torch::Tensor decode_layers_coded(torch::Tensor h, Tensors norms, double eps, Tensors qkv,
                                  Tensors wo, Tensors gate_up, Tensors down, PerLayerInts formats,
                                  OptionalTensors qkv_bias, OptionalTensors o_bias, Tensors cos,
                                  Tensors sin, PerLayerTensors codes, PerLayerTensors recent,
                                  PerLayerTensors recent_scales, PerLayerTensors sinks,
                                  PerLayerTensors means, std::vector<int64_t> places,
                                  int64_t heads, double scale, int64_t activation_bits,
                                  int64_t bits, int64_t group, int64_t width,
                                  torch::Tensor rotation, torch::Tensor centroids,
                                  torch::Tensor boundaries, bool norm_correction, bool fp8) {
  const size_t layers = norms.size();
  for (const size_t n : {qkv.size(), wo.size(), gate_up.size(), down.size(), formats.size(),
                         qkv_bias.size(), o_bias.size(), cos.size(), sin.size(), codes.size(),
                         recent.size(), recent_scales.size(), sinks.size(), means.size()}) {
    TORCH_CHECK(n == layers, "every per-layer argument needs one entry per layer");
  }
  TORCH_CHECK(h.dim() == 2 && h.dtype() == torch::kFloat32, "h must be float32 [M, H]");
  const int64_t m_rows = h.size(0);
  TORCH_CHECK(static_cast<int64_t>(places.size()) == kPlaces * m_rows, "six places per row");
  TORCH_CHECK(m_rows > 0 && layers > 0 && !codes[0].empty(), "at least one row and layer");
  const bool rotated = rotation.numel() > 0;
  if (rotated) {
    TORCH_CHECK(rotation.dtype() == torch::kFloat32 && rotation.dim() == 2 &&
                    rotation.size(0) == rotation.size(1) && rotation.is_contiguous(),
                "rotation must be contiguous float32 [R, R]");
  }
  const torch::Tensor table = centroids.contiguous(), cells = boundaries.contiguous();
  Codebook book{};
  GroupedCodec grouped{};
  if (group == 0) {  // turbo-quant's codes
    TORCH_CHECK(!fp8, "fp8 codes are kv-quant's");
    TORCH_CHECK(bits >= 2 && bits <= 4 && centroids.dtype() == torch::kFloat32 &&
                    centroids.numel() == (1 << bits) && boundaries.dtype() == torch::kFloat32 &&
                    boundaries.numel() == (1 << bits) - 1,
                "a codebook of 2, 3 or 4 bits: float32 centroids [2^bits], boundaries "
                "[2^bits − 1]");
    TORCH_CHECK(rotated && rotation.size(0) == width && width % 8 == 0,
                "turbo-quant's codes need their rotation [D', D'], D' a multiple of 8");
    book = Codebook{table.data_ptr<float>(), cells.data_ptr<float>(), static_cast<int>(bits),
                    norm_correction};
  } else {  // kv-quant's
    TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "integer codes of 2, 4 or 8 bits");
    TORCH_CHECK(!fp8 || bits == 8, "fp8 codes are 8 bits");
    TORCH_CHECK(group > 0 && width % group == 0 && width % 8 == 0,
                "width must be whole groups, a multiple of 8");
    TORCH_CHECK(!rotated || rotation.size(0) <= width, "the rotation is wider than the codes");
    grouped = GroupedCodec{static_cast<int>(bits), group, width, rotated ? rotation.size(0) : 0,
                           fp8};
  }
  const int64_t vector_bytes =
      group == 0 ? coded_vector_bytes(width, static_cast<int>(bits))
                 : grouped_vector_bytes(grouped);
  // the head geometry: 2 · Hkv vectors a code row, (Hq + 2 · Hkv) · D rows of W_qkv
  const bool int8_recent = !recent_scales[0].empty();
  TORCH_CHECK(codes[0][0].dim() == 2, "codes must be [capacity, row_bytes]");
  const int64_t kv_heads = codes[0][0].size(1) / vector_bytes / 2;
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of K/V heads");
  const int64_t projected = qkv[0].size(0), head_rows = heads + 2 * kv_heads;
  TORCH_CHECK(projected % head_rows == 0, "W_qkv's rows must be (Hq + 2 · Hkv) heads");
  const int64_t dim = projected / head_rows;
  TORCH_CHECK(dim <= width && (!rotated || dim <= rotation.size(0)),
              "the head is wider than the codes or the rotation");
  TORCH_CHECK(group == 0 || means[0].empty(), "kv-quant's codes are not centred");
  const int64_t row_bytes = 2 * kv_heads * vector_bytes;
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> keys(m_rows);
  for (int64_t m = 0; m < m_rows; ++m) {
    const int64_t* p = places.data() + m * kPlaces;
    keys[m] = p[0] + (p[2] - p[1]) + (p[4] - p[3]) + 1;
  }
  const int64_t width_h = h.size(1), q_dim = heads * dim, kv_dim = kv_heads * dim;
  for (size_t l = 0; l < layers; ++l) {
    const std::vector<RowStore> stores =
        row_stores(codes[l], recent[l], recent_scales[l], sinks[l], means[l], places, m_rows,
                   kv_heads, dim, row_bytes, int8_recent);
    const LayerMatrices w =
        checked_layer(qkv[l], wo[l], gate_up[l], down[l], formats[l], width_h, q_dim, kv_dim);
    const CodedLayer layer{stores, heads, kv_heads, dim,
                           rotated ? rotation.data_ptr<float>() : nullptr,
                           group == 0 ? &book : nullptr, group == 0 ? nullptr : &grouped,
                           int8_recent, static_cast<float>(scale), threads, width};
    const auto attend = [&](const float* projected_rows, float* attn) {
      const int64_t stride = w.qkv.rows;
      attend_sessions(m_rows, keys, threads, [&](int64_t m) {
        layer.attend(stores[m], projected_rows + m * stride, attn + m * q_dim);
      });
      const int64_t grain = m_rows >= threads ? 1 : m_rows;  // a few µs a row
      at::parallel_for(0, m_rows, grain, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) layer.update(stores[m], projected_rows + m * stride);
      });
    };
    h = layer_around(h, norms[l], eps, w, qkv_bias[l], o_bias[l], cos[l], sin[l], heads,
                     kv_heads, dim, activation_bits, attend);
  }
  return h;
}

}  // namespace larql
