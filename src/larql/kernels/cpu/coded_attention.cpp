// One decode query's attention over turbo-quant's 4-bit coded rows, read in place (no decoded
// copy of the history). A coded row of one token holds, per K/V head, its key vector then (after
// every head's key) its value vector, each `[norm: float32][D' / 2 bytes of 4-bit indices]`
// (index j in byte j / 2, the first of a pair in the low nibble). A vector decodes to
// norm · c[index] in the codec's rotated basis, c the codebook's 16 centroids; with centering,
// plus the layer's rotated mean row μ. So for query q (already rotated) and head h of K/V head g:
//
//   s_t = scale · (norm_k,t · q·c[k_t] + q·μ_K)          (the mean's part: `shift`[h])
//   m = max_t s_t,  l = Σ_t e^{s_t − m},  acc = Σ_t e^{s_t − m} · norm_v,t · c[v_t]
//
// → (m, l, acc) per query head, the state the caller merges with the exact rows' (and adds
// l · μ_V to acc). A K/V head's query heads are taken together (each row decoded once for
// them), the K/V heads over torch's threads.
//
// the tensor API alone: torch/extension.h (pybind11, the C++ frontend) is bindings.cpp's
#include <torch/types.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "block_dot.h"

namespace larql {

namespace {

constexpr int64_t kNormBytes = 4;

// scores [group, n] ← e^{s − m_j} per row j, m_j its maximum → m, l [group] (l_j: its sum).
void exponentiate(float* scores, int64_t group, int64_t n, float* m, float* l) {
  for (int64_t j = 0; j < group; ++j) {
    float* s = scores + j * n;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
    float total = 0.0f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - top);
      total += s[t];
    }
    m[j] = top;
    l[j] = total;
  }
}

// The scores, weights and values of one K/V head's `group` query heads (q: their rotated
// queries [group, width]) over n coded rows → m, l [group] and acc [group, width].
void attend_coded_head(const float* q, int64_t group, int64_t width, const uint8_t* codes,
                       int64_t n, int64_t row_bytes, int64_t key_at, int64_t value_at,
                       const float* centroids, const float* shift, float scale, float* m,
                       float* l, float* acc) {
  const int64_t payload = width / 2;
  std::vector<float> scores(group * n);
  std::vector<float> decoded(width);
  float table[16];
  std::memcpy(table, centroids, sizeof(table));
  // one vector → decoded[j] = c[index j]; → its norm
  const auto decode = [&](const uint8_t* vector) {
    const uint8_t* bytes = vector + kNormBytes;
    for (int64_t b = 0; b < payload; ++b) {
      decoded[2 * b] = table[bytes[b] & 15];
      decoded[2 * b + 1] = table[bytes[b] >> 4];
    }
    float norm;
    std::memcpy(&norm, vector, sizeof(float));
    return norm;
  };
  for (int64_t t = 0; t < n; ++t) {
    const float norm = decode(codes + t * row_bytes + key_at);
    for (int64_t j = 0; j < group; ++j) {
      float dot = 0.0f;
      for (int64_t d = 0; d < width; ++d) dot += q[j * width + d] * decoded[d];
      scores[j * n + t] = scale * (norm * dot) + shift[j];
    }
  }
  exponentiate(scores.data(), group, n, m, l);
  std::fill(acc, acc + group * width, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    const float norm = decode(codes + t * row_bytes + value_at);
    for (int64_t j = 0; j < group; ++j) {
      const float w = scores[j * n + t] * norm;
      float* out = acc + j * width;
      for (int64_t d = 0; d < width; ++d) out[d] += w * decoded[d];
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LARQL_CODED_512 1
constexpr int64_t kMaxGroup = 8;  // query heads a K/V head, for the vectorised loop

// 16 indices from 8 payload bytes (two a byte, the low nibble first) → their 16 centroids.
inline __m512 decode16(const uint8_t* bytes, __m512 table) {
  const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128i low = _mm_and_si128(packed, nibble);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
  const __m512i index = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));
  return _mm512_permutexvar_ps(index, table);
}

// One coded vector (16 · V wide) → its centroids in `decoded`; → its norm.
template <int V>
inline float decode_vector(const uint8_t* vector, __m512 table, __m512 (&decoded)[V]) {
  float norm;
  std::memcpy(&norm, vector, sizeof(float));
  for (int i = 0; i < V; ++i) decoded[i] = decode16(vector + kNormBytes + 8 * i, table);
  return norm;
}

// `attend_coded_head` for width 16 · V and at most kMaxGroup query heads: a vector's 16
// centroids at a time by a permute of the 16-entry table, the scores' dot products and the
// weighted values in 512-bit lanes. The same sums in another order.
template <int V>
void attend_coded_head_512(const float* q, int64_t group, const uint8_t* codes, int64_t n,
                           int64_t row_bytes, int64_t key_at, int64_t value_at,
                           const float* centroids, const float* shift, float scale, float* m,
                           float* l, float* acc) {
  constexpr int64_t width = 16 * V;
  const __m512 table = _mm512_loadu_ps(centroids);
  std::vector<float> scores(group * n);
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* vector = codes + t * row_bytes + key_at;
    __m512 decoded[V];
    const float norm = decode_vector<V>(vector, table, decoded);
    for (int64_t j = 0; j < group; ++j) {
      __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(q + j * width), decoded[0]);
      for (int i = 1; i < V; ++i) {
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * width + 16 * i), decoded[i], dot);
      }
      scores[j * n + t] = scale * (norm * _mm512_reduce_add_ps(dot)) + shift[j];
    }
  }
  exponentiate(scores.data(), group, n, m, l);
  __m512 sums[kMaxGroup][V];
  for (int64_t j = 0; j < group; ++j) {
    for (int i = 0; i < V; ++i) sums[j][i] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* vector = codes + t * row_bytes + value_at;
    __m512 decoded[V];
    const float norm = decode_vector<V>(vector, table, decoded);
    for (int64_t j = 0; j < group; ++j) {
      const __m512 w = _mm512_set1_ps(scores[j * n + t] * norm);
      for (int i = 0; i < V; ++i) sums[j][i] = _mm512_fmadd_ps(w, decoded[i], sums[j][i]);
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc + j * width + 16 * i, sums[j][i]);
  }
}
#else
#define LARQL_CODED_512 0
#endif

}  // namespace

// q: float32 [Hq, D'] rotated queries; codes: uint8 [n, row_bytes] (row_bytes = 2 · Hkv ·
// (4 + D' / 2)); centroids: float32 [16]; shift: float32 [Hq] (scale · q·μ_K, or zeros)
// → (m [Hq], l [Hq], acc [Hq, D']) as the header says.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> coded_attention(
    torch::Tensor q, torch::Tensor codes, int64_t kv_heads, torch::Tensor centroids,
    torch::Tensor shift, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 2 && q.is_contiguous(),
              "q must be contiguous float32 [Hq, D']");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(),
              "codes must be contiguous uint8 [n, row_bytes]");
  TORCH_CHECK(centroids.dtype() == torch::kFloat32 && centroids.numel() == 16,
              "centroids must be float32 [16] (4-bit codes)");
  const int64_t heads = q.size(0), width = q.size(1), n = codes.size(0);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of K/V heads");
  TORCH_CHECK(width % 2 == 0, "the rotated width must be even");
  const int64_t vector_bytes = kNormBytes + width / 2;
  TORCH_CHECK(codes.size(1) == 2 * kv_heads * vector_bytes,
              "codes' rows must hold a key and a value vector per K/V head");
  TORCH_CHECK(shift.dtype() == torch::kFloat32 && shift.numel() == heads,
              "shift must be float32 [Hq]");
  TORCH_CHECK(n > 0, "no coded rows to attend to");
  const int64_t group = heads / kv_heads;
  torch::Tensor m = torch::empty({heads}, q.options());
  torch::Tensor l = torch::empty({heads}, q.options());
  torch::Tensor acc = torch::empty({heads, width}, q.options());
  const float* qs = q.data_ptr<float>();
  const uint8_t* data = codes.data_ptr<uint8_t>();
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t h = g * group;
      const int64_t key_at = g * vector_bytes, value_at = (kv_heads + g) * vector_bytes;
      const float* table = centroids.data_ptr<float>();
      const float* head_shift = shift.data_ptr<float>() + h;
      float* head_m = m.data_ptr<float>() + h;
      float* head_l = l.data_ptr<float>() + h;
      float* head_acc = acc.data_ptr<float>() + h * width;
#if LARQL_CODED_512
      if (group <= kMaxGroup && (width == 64 || width == 128)) {
        (width == 64 ? attend_coded_head_512<4> : attend_coded_head_512<8>)(
            qs + h * width, group, data, n, codes.size(1), key_at, value_at, table, head_shift,
            static_cast<float>(scale), head_m, head_l, head_acc);
        continue;
      }
#endif
      attend_coded_head(qs + h * width, group, width, data, n, codes.size(1), key_at, value_at,
                        table, head_shift, static_cast<float>(scale), head_m, head_l, head_acc);
    }
  });
  return {m, l, acc};
}

}  // namespace larql
