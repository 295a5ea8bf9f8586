// One decode query's attention over a turbo-quant layer: its coded rows (2, 3 or 4 bits an
// index) read in place (no decoded copy of the history) and its exact rows (sinks, recent rows,
// the new row). A coded row of one token holds, per K/V head, its key vector then (after every
// head's key) its value vector, each `[norm: float32][D' · bits / 8 bytes of indices]` (index j
// at bits j · bits.. of one LSB-first bit stream: at 4 bits byte j / 2, the first of a pair in
// the low nibble). A vector decodes to norm · c[index] · R in the model's basis, c the
// codebook's 2^bits centroids, R the codec's symmetric orthogonal rotation [D', D'];
// with centering, plus the layer's mean row μ. For query q and the rotated query q̃ = q · R:
//
//   coded rows:  s_t = scale · (norm_k,t · q̃·c[k_t] + q·μ_K)
//                m = max_t s_t,  l = Σ_t e^{s_t − m},
//                acc = (Σ_t e^{s_t − m} · norm_v,t · c[v_t]) · R + l · μ_V
//   exact rows:  s_e = scale · q·k_e  (in the model's basis: q̃·k̃ = q·k, R orthogonal)
//   out = (e^{m − M} · acc + Σ_e e^{s_e − M} v_e) / (e^{m − M} · l + Σ_e e^{s_e − M}),
//   M = max(m, max_e s_e)
//
// The coded rows' scores and weighted values stay in the rotated basis (their sum is rotated
// back once); a K/V head's query heads are taken together (each row decoded once for them), the
// K/V heads over torch's threads.
//
// the tensor API alone: torch/extension.h (pybind11, the C++ frontend) is bindings.cpp's
#include <torch/types.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <vector>

#include "block_dot.h"
#include "coded_attention.h"
#include "decode_attention.h"

namespace larql {

namespace {

constexpr int64_t kNormBytes = 4;

constexpr int64_t kChunkRows = 256;  // fewest coded rows worth a chunk of their own
constexpr int64_t kMergeRows = 64;  // fewest exact rows worth merging over the threads

// scores [group, n] ← e^{s − m_j} per row j, m_j its maximum → m, l [group] (l_j: its sum).
void exponentiate(float* scores, int64_t group, int64_t n, float* m, float* l) {
  for (int64_t j = 0; j < group; ++j) std::tie(m[j], l[j]) = larql::exponentiate(scores + j * n, n);
}

// Index j of a vector's packed indices (`bits` each, one LSB-first bit stream).
inline int index_at(const uint8_t* bytes, int64_t j, int bits) {
  const int64_t bit = j * bits;
  const int64_t byte = bit / 8;
  const int shift = static_cast<int>(bit % 8);
  int word = bytes[byte];
  if (shift + bits > 8) word |= bytes[byte + 1] << 8;  // an index across two bytes (3 bits)
  return (word >> shift) & ((1 << bits) - 1);
}

#if LARQL_AVX2
// 8 indices of `bits` ∈ {2, 3, 4, 8} bits (`bits` bytes of the bit stream from `bytes`) → 8
// int32 lanes: index i at bits · i of the little-endian word.
inline __m256i indices8(const uint8_t* bytes, int bits) {
  if (bits == 8) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  }
  uint32_t word;  // loads of fixed widths: a copy of `bits` bytes through memory would stall
  if (bits == 4) {  // the wider load after it
    std::memcpy(&word, bytes, 4);
  } else {
    uint16_t low;
    std::memcpy(&low, bytes, 2);
    word = bits == 2 ? low : low | static_cast<uint32_t>(bytes[2]) << 16;
  }
  const __m256i shifts = _mm256_mullo_epi32(_mm256_set1_epi32(bits),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                          _mm256_set1_epi32((1 << bits) - 1));
}

// A codebook of up to 16 centroids in two vectors of 8, looked up 8 indices at a time.
struct Centroids8 {
  __m256 low, high;
  explicit Centroids8(const float* centroids, int bits) {
    float padded[16] = {};
    std::memcpy(padded, centroids, sizeof(float) << bits);
    low = _mm256_loadu_ps(padded);
    high = _mm256_loadu_ps(padded + 8);
  }
  __m256 operator()(__m256i index) const {  // centroid i of the low or the high 8 (bit 3)
    const __m256 in_high = _mm256_castsi256_ps(_mm256_slli_epi32(index, 28));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, index),
                            _mm256_permutevar8x32_ps(high, index), in_high);
  }
};
#endif

// The scores, weights and values of one K/V head's `group` query heads (q: their rotated
// queries [group, width]) over n coded rows → m, l [group] and acc [group, width]: each vector
// decoded into a buffer (8 coordinates at a time where AVX2 runs), then its dot products and
// weighted values. The loop of machines without AVX-512, and of other widths everywhere.
void attend_coded_head(const float* q, int64_t group, int64_t width, int bits,
                       const uint8_t* codes, int64_t n, int64_t row_bytes, int64_t key_at,
                       int64_t value_at, const float* centroids, const float* shift, float scale,
                       float* m, float* l, float* acc) {
  std::vector<float> scores(group * n);
  std::vector<float> decoded(width);
#if LARQL_AVX2
  const Centroids8 table(centroids, bits);
#endif
  // one vector → decoded[j] = c[index j]; → its norm
  const auto decode = [&](const uint8_t* vector) {
    const uint8_t* bytes = vector + kNormBytes;
    int64_t j = 0;
#if LARQL_AVX2
    for (; j + 8 <= width; j += 8) {  // 8 indices: `bits` whole bytes
      _mm256_storeu_ps(decoded.data() + j, table(indices8(bytes + j * bits / 8, bits)));
    }
#endif
    for (; j < width; ++j) decoded[j] = centroids[index_at(bytes, j, bits)];
    float norm;
    std::memcpy(&norm, vector, sizeof(float));
    return norm;
  };
  for (int64_t t = 0; t < n; ++t) {
    const float norm = decode(codes + t * row_bytes + key_at);
    for (int64_t j = 0; j < group; ++j) {
      scores[j * n + t] = scale * (norm * dot(q + j * width, decoded.data(), width)) + shift[j];
    }
  }
  exponentiate(scores.data(), group, n, m, l);
  std::fill(acc, acc + group * width, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    const float norm = decode(codes + t * row_bytes + value_at);
    for (int64_t j = 0; j < group; ++j) {
      add_scaled(acc + j * width, decoded.data(), scores[j * n + t] * norm, width);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LARQL_CODED_512 1
constexpr int64_t kMaxGroup = 8;  // query heads a K/V head, for the vectorised loop

// 16 indices of `Bits` bits (2 · Bits bytes of the bit stream from `bytes`) → 16 int32 lanes.
template <int Bits>
inline __m512i indices16(const uint8_t* bytes) {
  __m512i index;
  if constexpr (Bits == 8) {
    index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  } else if constexpr (Bits == 4) {  // two a byte, the low nibble first
    const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
    const __m128i nibble = _mm_set1_epi8(0x0f);
    const __m128i low = _mm_and_si128(packed, nibble);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    index = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));
  } else if constexpr (Bits == 2) {  // 32 bits: index i at bits 2i
    int32_t word;
    std::memcpy(&word, bytes, sizeof(word));
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                             28, 30);
    index = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(word), shifts),
                             _mm512_set1_epi32(3));
  } else {  // 48 bits: index i at bits 3i, in bytes 3i / 8 and the next (16-bit lanes)
    uint32_t low;  // the 6 bytes as two loads joined in a register (a 6-byte copy through
    uint16_t high;  // memory stalls the 8-byte load that follows it)
    std::memcpy(&low, bytes, sizeof(low));
    std::memcpy(&high, bytes + 4, sizeof(high));
    const int64_t word = static_cast<int64_t>(low) | static_cast<int64_t>(high) << 32;
    const __m256i source = _mm256_broadcastsi128_si256(_mm_cvtsi64_si128(word));
    const __m256i pairs = _mm256_shuffle_epi8(
        source, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 2, 3, 2, 3, 3, 4, 3, 4, 3, 4,
                                 4, 5, 4, 5, 4, 5, 5, 6, 5, 6));
    const __m256i shifts = _mm256_setr_epi16(0, 3, 6, 1, 4, 7, 2, 5, 0, 3, 6, 1, 4, 7, 2, 5);
    const __m256i lanes = _mm256_and_si256(_mm256_srlv_epi16(pairs, shifts), _mm256_set1_epi16(7));
    index = _mm512_cvtepu16_epi32(lanes);
  }
  return index;
}

// 16 indices → their 16 centroids, by a permute of the table (the 2^Bits centroids in its first
// lanes).
template <int Bits>
inline __m512 decode16(const uint8_t* bytes, __m512 table) {
  return _mm512_permutexvar_ps(indices16<Bits>(bytes), table);
}

// One coded vector (16 · V wide) → its centroids in `decoded`; → its norm.
template <int V, int Bits>
inline float decode_vector(const uint8_t* vector, __m512 table, __m512 (&decoded)[V]) {
  float norm;
  std::memcpy(&norm, vector, sizeof(float));
  const uint8_t* payload = vector + kNormBytes;
  for (int i = 0; i < V; ++i) decoded[i] = decode16<Bits>(payload + 2 * Bits * i, table);
  return norm;
}

// Rows a K/V head's pass asks the memory for ahead of the one it decodes, where the rows are
// longer than kPrefetchStride bytes: a head's vectors are a few dozen bytes of every row, a
// stride the hardware prefetchers follow poorly beyond that, and the codes are out of the
// caches again by the time a step's products are done. kv-quant's 8-bit codes in groups of 64
// (408-byte rows on SmolLM2) took 316 µs a layer at 2,048 rows from memory against 88 µs from
// the caches, 113–116 µs with these prefetches; a step at 4,096 tokens 22.8–23.0 → 11.2–11.6 ms.
// Rows of 216 and 240 bytes (turbo-quant's and kv-quant's 4 bits) gained nothing from them.
constexpr int64_t kPrefetchRows = 8;
constexpr int64_t kPrefetchStride = 256;

// Row t's vector at `at` (two cache lines: a vector is up to 68 + 64 bytes long at 128
// coordinates), where t < n and the rows are long.
inline void prefetch_vector(const uint8_t* codes, int64_t t, int64_t n, int64_t row_bytes,
                            int64_t at) {
  if (t >= n || row_bytes <= kPrefetchStride) return;
  const uint8_t* vector = codes + t * row_bytes + at;
  prefetch_line(vector);
  prefetch_line(vector + 64);
}

// One K/V head's `group` query heads (at most kMaxGroup; q: their queries [group, 16 · V] in
// the codes' basis) over n coded rows → m, l [group] and acc [group, 16 · V], in 512-bit lanes:
// decode(vector, decoded) puts a vector's coordinates in 16 · V lanes and gives the factor its
// dot products and weights take (turbo-quant's norm; 1 for kv-quant's).
template <int V, typename Decode>
void attend_head_512(const float* q, int64_t group, const uint8_t* codes, int64_t n,
                     int64_t row_bytes, int64_t key_at, int64_t value_at, const float* shift,
                     float scale, float* m, float* l, float* acc, const Decode& decode) {
  constexpr int64_t width = 16 * V;
  std::vector<float> scores(group * n);
  for (int64_t t = 0; t < n; ++t) {
    prefetch_vector(codes, t + kPrefetchRows, n, row_bytes, key_at);
    __m512 decoded[V];
    const float norm = decode(codes + t * row_bytes + key_at, decoded);
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
    prefetch_vector(codes, t + kPrefetchRows, n, row_bytes, value_at);
    __m512 decoded[V];
    const float norm = decode(codes + t * row_bytes + value_at, decoded);
    for (int64_t j = 0; j < group; ++j) {
      const __m512 w = _mm512_set1_ps(scores[j * n + t] * norm);
      for (int i = 0; i < V; ++i) sums[j][i] = _mm512_fmadd_ps(w, decoded[i], sums[j][i]);
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc + j * width + 16 * i, sums[j][i]);
  }
}

// `attend_coded_head` for width 16 · V: a vector's 16 centroids at a time by a permute of the
// table. The same sums in another order.
template <int V, int Bits>
void attend_coded_head_512(const float* q, int64_t group, const uint8_t* codes, int64_t n,
                           int64_t row_bytes, int64_t key_at, int64_t value_at,
                           const float* centroids, const float* shift, float scale, float* m,
                           float* l, float* acc) {
  float padded[16] = {};
  std::memcpy(padded, centroids, sizeof(float) << Bits);
  const __m512 table = _mm512_loadu_ps(padded);
  const auto decode = [&](const uint8_t* vector, __m512 (&decoded)[V]) {
    return decode_vector<V, Bits>(vector, table, decoded);
  };
  attend_head_512<V>(q, group, codes, n, row_bytes, key_at, value_at, shift, scale, m, l, acc,
                     decode);
}

using CodedHead = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t,
                           int64_t, const float*, const float*, float, float*, float*, float*);

// The 512-bit loop for this width and these bits, or null (the scalar loop runs).
CodedHead coded_head_512(int64_t width, int bits, int64_t group) {
  if (group > kMaxGroup || (width != 64 && width != 128)) return nullptr;
  const bool wide = width == 128;
  switch (bits) {
    case 2: return wide ? attend_coded_head_512<8, 2> : attend_coded_head_512<4, 2>;
    case 3: return wide ? attend_coded_head_512<8, 3> : attend_coded_head_512<4, 3>;
    case 4: return wide ? attend_coded_head_512<8, 4> : attend_coded_head_512<4, 4>;
    default: return nullptr;
  }
}
#else
#define LARQL_CODED_512 0
#endif

}  // namespace

void ExactRows::load(int64_t e, int64_t vector, int64_t vectors, int64_t dim,
                     float* out) const {
  const int64_t at = (e * vectors + vector) * dim;
  switch (kind) {
    case Float32:
      std::memcpy(out, static_cast<const float*>(data) + at, dim * sizeof(float));
      return;
    case Float16: {
      const c10::Half* row = static_cast<const c10::Half*>(data) + at;
      int64_t d = 0;
#if LARQL_AVX2
      for (; d + 8 <= dim; d += 8) {  // the same exact conversions, 8 at a time
        const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
        _mm256_storeu_ps(out + d, _mm256_cvtph_ps(halves));
      }
#endif
      for (; d < dim; ++d) out[d] = static_cast<float>(row[d]);
      return;
    }
    case Int8: {
      const int8_t* row = static_cast<const int8_t*>(data) + at;
      const float s = static_cast<float>(scales[e * vectors + vector]);
      int64_t d = 0;
#if LARQL_AVX2
      const __m256 scale = _mm256_set1_ps(s);
      for (; d + 8 <= dim; d += 8) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
        const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        _mm256_storeu_ps(out + d, _mm256_mul_ps(codes, scale));
      }
#endif
      for (; d < dim; ++d) out[d] = static_cast<float>(row[d]) * s;
      return;
    }
  }
}

namespace {

// One K/V head's exact rows and its query heads' coded state → their outputs: out [group, D]
// (see the header). m, l, acc: the coded rows' state (acc already in the model's basis, μ_V
// included); l = 0 where there are none.
void merge_exact(const float* q, int64_t group, int64_t dim, const std::vector<ExactRows>& rows,
                 int64_t kv_heads, int64_t g, float scale, const float* m, const float* l,
                 const float* acc, float* out) {
  int64_t exact = 0;
  for (const ExactRows& part : rows) exact += part.rows;
  std::vector<float> keys(exact * dim), values(exact * dim), scores(exact);
  int64_t e = 0;
  for (const ExactRows& part : rows) {
    for (int64_t r = 0; r < part.rows; ++r, ++e) {
      part.load(r, g, 2 * kv_heads, dim, keys.data() + e * dim);
      part.load(r, kv_heads + g, 2 * kv_heads, dim, values.data() + e * dim);
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    const float* query = q + j * dim;
    for (int64_t r = 0; r < exact; ++r) scores[r] = scale * dot(query, keys.data() + r * dim, dim);
    const auto [top_exact, sum_exact] = larql::exponentiate(scores.data(), exact);  // e^{s_e − m_e}
    const bool coded_rows = l[j] > 0.0f;
    const float top = coded_rows ? std::max(m[j], top_exact) : top_exact;
    const float coded = coded_rows ? std::exp(m[j] - top) : 0.0f;
    const float fresh = std::exp(top_exact - top);
    float* o = out + j * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = coded * acc[j * dim + d];
    for (int64_t r = 0; r < exact; ++r) {
      add_scaled(o, values.data() + r * dim, fresh * scores[r], dim);
    }
    const float inverse = 1.0f / (coded * l[j] + fresh * sum_exact);
    for (int64_t d = 0; d < dim; ++d) o[d] *= inverse;
  }
}

// A codec's part of the attention: the coded state (m, l, acc̃ [group, width]) of rows
// first.. first + rows − 1 for K/V head g's query heads, from their queries in the codes' basis
// (`queries` [group, width]) and shifts (scale · q·μ_K, or zeros).
using ChunkState = std::function<void(const float* queries, const float* shift, int64_t g,
                                      int64_t first, int64_t rows, float* m, float* l,
                                      float* acc)>;

// Exact row tensors [E, 2, Hkv, D] (float32 or float16) as the attention reads them; `kept`
// holds the contiguous copies they point into.
std::vector<ExactRows> exact_rows(const std::vector<torch::Tensor>& exact, int64_t kv_heads,
                                  int64_t dim, std::vector<torch::Tensor>& kept) {
  std::vector<ExactRows> parts;
  int64_t rows = 0;
  for (const torch::Tensor& tensor : exact) {
    TORCH_CHECK(tensor.dim() == 4 && tensor.size(1) == 2 && tensor.size(2) == kv_heads &&
                    tensor.size(3) == dim,
                "exact rows must be [E, 2, Hkv, D]");
    const bool half = tensor.scalar_type() == torch::kFloat16;
    const torch::Tensor part = half ? tensor.contiguous() : tensor.to(torch::kFloat32).contiguous();
    kept.push_back(part);
    parts.push_back(ExactRows{part.data_ptr(), part.size(0),
                              half ? ExactRows::Float16 : ExactRows::Float32});
    rows += part.size(0);
  }
  TORCH_CHECK(rows > 0, "at least one exact row (the new one) is attended");
  return parts;
}

// The attention both codecs share (the header's formulas): the queries qs [heads, dim] into
// the codes' basis of `width` floats — [q, 0] · R, R [turned, turned] with dim ≤ turned ≤ width
// (the rest zeros), or [q, 0] where r is null — the coded rows in chunks × K/V heads over the
// threads (`state`; the chunks set by `threads`), the chunks combined and rotated back, and the
// exact rows merged → out [heads, dim].
void attend_quantised(const float* qs, int64_t heads, int64_t dim, const float* r, int64_t turned,
                      int64_t width, int64_t n, int64_t kv_heads, const float* mu,
                      const std::vector<ExactRows>& exact, float fscale, int64_t threads,
                      const ChunkState& state, float* out) {
  const int64_t group = heads / kv_heads;
  const bool rotated = r != nullptr;
  const bool centered = mu != nullptr;
  int64_t exact_rows = 0;
  for (const ExactRows& part : exact) exact_rows += part.rows;
  // q̃ per query head, and shift = scale · q·μ_K (the model's basis)
  std::vector<float> queries(heads * width, 0.0f), shift(heads, 0.0f);
  for (int64_t h = 0; h < heads && n > 0; ++h) {
    float* qr = queries.data() + h * width;
    for (int64_t i = 0; i < dim; ++i) {
      const float x = qs[h * dim + i];
      if (!rotated) {
        qr[i] = x;
        continue;
      }
      for (int64_t c = 0; c < turned; ++c) qr[c] += x * r[i * turned + c];
    }
    if (centered) shift[h] = fscale * dot(qs + h * dim, mu + (h / group) * dim, dim);
  }
  // the coded rows in chunks × K/V heads, over the threads: each chunk's (m, l, acc̃)
  const int64_t chunks =
      n == 0 ? 0 : std::max<int64_t>(1, std::min<int64_t>(threads, n / kChunkRows));
  const int64_t per_chunk = chunks ? (n + chunks - 1) / chunks : 0;
  std::vector<float> maxima(chunks * heads), sums(chunks * heads), partial(chunks * heads * width);
  at::parallel_for(0, chunks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t c = unit / kv_heads, g = unit % kv_heads, h = g * group;
      const int64_t first = c * per_chunk, rows = std::min(n, first + per_chunk) - first;
      state(queries.data() + h * width, shift.data() + h, g, first, rows,
            maxima.data() + c * heads + h, sums.data() + c * heads + h,
            partial.data() + (c * heads + h) * width);
    }
  });
  // per query head: the chunks combined, acc̃ back in the model's basis + l · μ_V, then merged
  // with the exact rows (a few µs a head: over the threads only where the exact rows are many,
  // as the 128 or 160 int8 recent rows at 2 and 3 bits are)
  const int64_t merge_grain = exact_rows >= kMergeRows ? 1 : kv_heads;
  at::parallel_for(0, kv_heads, merge_grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc_coded(width), acc(group * dim), m(group), l(group);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < group; ++j) {
        const int64_t h = g * group + j;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) top = std::max(top, maxima[c * heads + h]);
        float total = 0.0f;
        std::fill(acc_coded.begin(), acc_coded.end(), 0.0f);
        for (int64_t c = 0; c < chunks; ++c) {
          const float weight = std::exp(maxima[c * heads + h] - top);
          total += weight * sums[c * heads + h];
          add_scaled(acc_coded.data(), partial.data() + (c * heads + h) * width, weight, width);
        }
        m[j] = top;
        l[j] = total;  // 0 without coded rows
        float* back = acc.data() + j * dim;
        const float* mean_v = centered ? mu + (kv_heads + g) * dim : nullptr;
        for (int64_t d = 0; d < dim; ++d) {
          back[d] = (centered ? total * mean_v[d] : 0.0f) + (rotated ? 0.0f : acc_coded[d]);
        }
        for (int64_t i = 0; i < turned && chunks; ++i) {
          const float x = acc_coded[i];
          for (int64_t d = 0; d < dim; ++d) back[d] += x * r[i * turned + d];
        }
      }
      merge_exact(qs + g * group * dim, group, dim, exact, kv_heads, g, fscale, m.data(), l.data(),
                  acc.data(), out + g * group * dim);
    }
  });
}

// A float8 e4m3 byte's value: its 7 low bits, placed 20 bits up, are a float32 whose exponent
// field carries e4m3's (bias 7, not 127) and whose top mantissa bits carry e4m3's three, so
// that float · 2^120 is the value, subnormals included (e4m3 holds no infinity; its NaN bytes,
// which the codec never writes, read as 480).
constexpr float kE4m3Shift = 1.329227995784916e36f;  // 2^120

inline float e4m3_value(uint8_t byte) {
  const uint32_t bits = static_cast<uint32_t>(byte & 0x7f) << 20 |
                        static_cast<uint32_t>(byte & 0x80) << 24;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value * kE4m3Shift;
}

// One vector of kv-quant's codes → decoded [G · group]. Integer codes ([scales: G float16]
// [zero points: G float16][indices of `bits` bits]): per group, index · scale + zero point.
// fp8 codes ([scales: G float16][G · group e4m3 bytes]): per group, value · scale.
void decode_grouped(const uint8_t* vector, int bits, bool fp8, int64_t group, int64_t groups,
                    float* decoded) {
  const uint8_t* codes = vector + (fp8 ? 2 : 4) * groups;
  for (int64_t j = 0; j < groups; ++j) {
    uint16_t scale_bits, zero_bits = 0;
    std::memcpy(&scale_bits, vector + 2 * j, sizeof(uint16_t));
    if (!fp8) std::memcpy(&zero_bits, vector + 2 * (groups + j), sizeof(uint16_t));
    const float s = c10::detail::fp16_ieee_to_fp32_value(scale_bits);
    const float z = c10::detail::fp16_ieee_to_fp32_value(zero_bits);
    float* out = decoded + j * group;
    int64_t i = 0;
    if (fp8) {
#if LARQL_AVX2
      const __m256 vs = _mm256_set1_ps(s), shift = _mm256_set1_ps(kE4m3Shift);
      for (; i + 8 <= group; i += 8) {
        const __m256i bytes = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j * group + i)));
        const __m256i bits32 = _mm256_or_si256(
            _mm256_slli_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(0x7f)), 20),
            _mm256_slli_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(0x80)), 24));
        const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(bits32), shift);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(value, vs));
      }
#endif
      for (; i < group; ++i) out[i] = e4m3_value(codes[j * group + i]) * s;
      continue;
    }
#if LARQL_CODED_512
    if (group % 16 == 0) {
      const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
      for (; i < group; i += 16) {
        const uint8_t* at = codes + (j * group + i) * bits / 8;
        const __m512i index = bits == 8   ? indices16<8>(at)
                              : bits == 4 ? indices16<4>(at)
                                          : indices16<2>(at);
        _mm512_storeu_ps(out + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(index), vs, vz));
      }
    }
#elif LARQL_AVX2
    if (group % 8 == 0) {
      const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
      for (; i < group; i += 8) {
        const __m256i index = indices8(codes + (j * group + i) * bits / 8, bits);
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(index), vs, vz));
      }
    }
#endif
    for (; i < group; ++i) {
      out[i] = static_cast<float>(index_at(codes, j * group + i, bits)) * s + z;
    }
  }
}

// kv-quant's chunk state: each row's key and value vectors decoded into a buffer, the scores'
// dot products and the weighted values over it.
void attend_grouped_head(const float* q, const float* shift, int64_t group, int64_t width,
                         int bits, bool fp8, int64_t code_group, const uint8_t* codes, int64_t n,
                         int64_t row_bytes, int64_t key_at, int64_t value_at, float scale,
                         float* m, float* l, float* acc) {
  const int64_t groups = width / code_group;
  std::vector<float> scores(group * n), decoded(width);
  for (int64_t t = 0; t < n; ++t) {
    decode_grouped(codes + t * row_bytes + key_at, bits, fp8, code_group, groups, decoded.data());
    for (int64_t j = 0; j < group; ++j) {
      scores[j * n + t] = scale * dot(q + j * width, decoded.data(), width) + shift[j];
    }
  }
  exponentiate(scores.data(), group, n, m, l);
  std::fill(acc, acc + group * width, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    decode_grouped(codes + t * row_bytes + value_at, bits, fp8, code_group, groups,
                   decoded.data());
    for (int64_t j = 0; j < group; ++j) {
      add_scaled(acc + j * width, decoded.data(), scores[j * n + t], width);
    }
  }
}

#if LARQL_CODED_512
// `attend_grouped_head` for width 16 · V and groups of a multiple of 16 coordinates: a group's
// 16 indices at a time widened and scaled in one multiply-add (the same decoded values), the
// dot products and weighted values in 512-bit lanes (their sums in another order).
template <int V, int Bits>
void attend_grouped_head_512(const float* q, const float* shift, int64_t group,
                             int64_t code_group, const uint8_t* codes, int64_t n,
                             int64_t row_bytes, int64_t key_at, int64_t value_at, float scale,
                             float* m, float* l, float* acc) {
  const int64_t groups = 16 * V / code_group, lanes_per_group = code_group / 16;
  const auto decode = [&](const uint8_t* vector, __m512 (&decoded)[V]) {
    uint16_t header[2 * V];  // (16 · V / 16 groups at most: the scales, then the zero points)
    std::memcpy(header, vector, 4 * groups);
    const uint8_t* indices = vector + 4 * groups;
    for (int i = 0; i < V; ++i) {
      const int64_t j = i / lanes_per_group;
      const __m512 lane = _mm512_cvtepi32_ps(indices16<Bits>(indices + 2 * Bits * i));
      decoded[i] = _mm512_fmadd_ps(lane, _mm512_set1_ps(half_to_float(header[j])),
                                   _mm512_set1_ps(half_to_float(header[groups + j])));
    }
    return 1.0f;
  };
  attend_head_512<V>(q, group, codes, n, row_bytes, key_at, value_at, shift, scale, m, l, acc,
                     decode);
}

// `attend_grouped_head` for fp8 codes of width 16 · V and groups of a multiple of 16
// coordinates: 16 e4m3 bytes at a time widened into floats (`e4m3_value`'s bits) and scaled.
template <int V>
void attend_fp8_head_512(const float* q, const float* shift, int64_t group, int64_t code_group,
                         const uint8_t* codes, int64_t n, int64_t row_bytes, int64_t key_at,
                         int64_t value_at, float scale, float* m, float* l, float* acc) {
  const int64_t groups = 16 * V / code_group, lanes_per_group = code_group / 16;
  const auto decode = [&](const uint8_t* vector, __m512 (&decoded)[V]) {
    uint16_t header[V];  // the groups' scales (16 · V / 16 groups at most)
    std::memcpy(header, vector, 2 * groups);
    const uint8_t* bytes = vector + 2 * groups;
    for (int i = 0; i < V; ++i) {
      const __m512i wide = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * i)));
      const __m512i bits = _mm512_or_si512(
          _mm512_slli_epi32(_mm512_and_si512(wide, _mm512_set1_epi32(0x7f)), 20),
          _mm512_slli_epi32(_mm512_and_si512(wide, _mm512_set1_epi32(0x80)), 24));
      const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(kE4m3Shift));
      const float s = half_to_float(header[i / lanes_per_group]);
      decoded[i] = _mm512_mul_ps(value, _mm512_set1_ps(s));
    }
    return 1.0f;
  };
  attend_head_512<V>(q, group, codes, n, row_bytes, key_at, value_at, shift, scale, m, l, acc,
                     decode);
}

using GroupedHead = void (*)(const float*, const float*, int64_t, int64_t, const uint8_t*,
                             int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*);

// The 512-bit loop for these codes, or null (the buffered loop runs).
GroupedHead grouped_head_512(int64_t width, int bits, bool fp8, int64_t code_group,
                             int64_t group) {
  if (group > kMaxGroup || (width != 64 && width != 128) || code_group % 16) return nullptr;
  const bool wide = width == 128;
  if (fp8) return wide ? attend_fp8_head_512<8> : attend_fp8_head_512<4>;
  switch (bits) {
    case 2: return wide ? attend_grouped_head_512<8, 2> : attend_grouped_head_512<4, 2>;
    case 4: return wide ? attend_grouped_head_512<8, 4> : attend_grouped_head_512<4, 4>;
    case 8: return wide ? attend_grouped_head_512<8, 8> : attend_grouped_head_512<4, 8>;
    default: return nullptr;
  }
}
#endif

// mean: float32 [2, Hkv, D] (μ_K, μ_V), contiguous, or an empty tensor (no centering).
torch::Tensor checked_mean(const torch::Tensor& mean, int64_t kv_heads, int64_t dim) {
  if (mean.numel() == 0) return mean;
  TORCH_CHECK(mean.dtype() == torch::kFloat32 && mean.numel() == 2 * kv_heads * dim,
              "mean must be float32 [2, Hkv, D]");
  return mean.contiguous();
}

void check_queries_and_codes(const torch::Tensor& q, const torch::Tensor& codes,
                             int64_t kv_heads) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 2, "q must be float32 [Hq, D]");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(),
              "codes must be contiguous uint8 [n, row_bytes]");
  TORCH_CHECK(kv_heads > 0 && q.size(0) % kv_heads == 0,
              "query heads must be a multiple of K/V heads");
}

}  // namespace

void attend_turbo(const float* q, int64_t heads, int64_t dim, const float* rotation,
                  int64_t width, const uint8_t* codes, int64_t n, int64_t kv_heads,
                  const Codebook& book, const float* mean, const std::vector<ExactRows>& exact,
                  float scale, int64_t threads, float* out) {
  const int bits = book.bits;
  const int64_t vector_bytes = coded_vector_bytes(width, bits);
  const int64_t group = heads / kv_heads, row_bytes = 2 * kv_heads * vector_bytes;
  const ChunkState state = [&](const float* queries, const float* shift, int64_t g,
                               int64_t first, int64_t rows, float* m, float* l, float* acc) {
    const uint8_t* chunk = codes + first * row_bytes;
    const int64_t key_at = g * vector_bytes, value_at = (kv_heads + g) * vector_bytes;
#if LARQL_CODED_512
    if (const CodedHead head = coded_head_512(width, bits, group)) {
      head(queries, group, chunk, rows, row_bytes, key_at, value_at, book.centroids, shift,
           scale, m, l, acc);
      return;
    }
#endif
    attend_coded_head(queries, group, width, bits, chunk, rows, row_bytes, key_at, value_at,
                      book.centroids, shift, scale, m, l, acc);
  };
  attend_quantised(q, heads, dim, rotation, width, width, n, kv_heads, mean, exact, scale, threads,
                   state, out);
}

// q: float32 [Hq, D] in the model's basis; rotation: float32 [D', D'] (D ≤ D'); codes: uint8
// [n, row_bytes] (row_bytes = 2 · Hkv · (4 + D' · bits / 8); n may be 0); centroids: float32
// [2^bits] (their count gives the bits); mean: float32 [2, Hkv, D] (μ_K, μ_V) or an empty tensor
// (no centering); exact: [E_i, 2, Hkv, D] rows (float32 or float16; K then V per token; at least
// one row in all) → out float32 [Hq, D].
torch::Tensor coded_attention(torch::Tensor q, torch::Tensor rotation, torch::Tensor codes,
                              int64_t kv_heads, torch::Tensor centroids, torch::Tensor mean,
                              std::vector<torch::Tensor> exact, double scale) {
  check_queries_and_codes(q, codes, kv_heads);
  q = q.contiguous();
  TORCH_CHECK(rotation.dtype() == torch::kFloat32 && rotation.dim() == 2 &&
                  rotation.size(0) == rotation.size(1) && rotation.size(0) >= q.size(1) &&
                  rotation.is_contiguous(),
              "rotation must be contiguous float32 [D', D'] with D' ≥ D");
  const int64_t width = rotation.size(0);
  const int64_t levels = centroids.numel();
  TORCH_CHECK(centroids.dtype() == torch::kFloat32 && (levels == 4 || levels == 8 || levels == 16),
              "centroids must be float32 [2^bits], bits 2, 3 or 4");
  const int bits = levels == 4 ? 2 : (levels == 8 ? 3 : 4);
  TORCH_CHECK(width % 8 == 0, "the rotated width must be a multiple of 8");
  TORCH_CHECK(codes.size(1) == 2 * kv_heads * coded_vector_bytes(width, bits),
              "codes' rows must hold a key and a value vector per K/V head");
  const torch::Tensor mu = checked_mean(mean, kv_heads, q.size(1));
  std::vector<torch::Tensor> kept;
  const std::vector<ExactRows> parts = exact_rows(exact, kv_heads, q.size(1), kept);
  const torch::Tensor table = centroids.contiguous();
  const Codebook book{table.data_ptr<float>(), nullptr, bits, false};
  torch::Tensor out = torch::empty({q.size(0), q.size(1)}, q.options());
  attend_turbo(q.data_ptr<float>(), q.size(0), q.size(1), rotation.data_ptr<float>(), width,
               codes.data_ptr<uint8_t>(), codes.size(0), kv_heads, book,
               mu.numel() ? mu.data_ptr<float>() : nullptr, parts, static_cast<float>(scale),
               at::get_num_threads(), out.data_ptr<float>());
  return out;
}

void attend_grouped_rows(const float* q, int64_t heads, int64_t dim, const float* rotation,
                         const GroupedCodec& codec, const uint8_t* codes, int64_t n,
                         int64_t kv_heads, const std::vector<ExactRows>& exact, float scale,
                         int64_t threads, float* out) {
  const int64_t vector_bytes = grouped_vector_bytes(codec);
  const int64_t heads_per = heads / kv_heads, row_bytes = 2 * kv_heads * vector_bytes;
  const ChunkState state = [&](const float* queries, const float* shift, int64_t g,
                               int64_t first, int64_t rows, float* m, float* l, float* acc) {
    const uint8_t* chunk = codes + first * row_bytes;
    const int64_t key_at = g * vector_bytes, value_at = (kv_heads + g) * vector_bytes;
#if LARQL_CODED_512
    if (const GroupedHead head = grouped_head_512(codec.width, codec.bits, codec.fp8,
                                                  codec.group, heads_per)) {
      head(queries, shift, heads_per, codec.group, chunk, rows, row_bytes, key_at, value_at,
           scale, m, l, acc);
      return;
    }
#endif
    attend_grouped_head(queries, shift, heads_per, codec.width, codec.bits, codec.fp8,
                        codec.group, chunk, rows, row_bytes, key_at, value_at, scale, m, l, acc);
  };
  attend_quantised(q, heads, dim, rotation, rotation ? codec.turned : 0, codec.width, n,
                   kv_heads, nullptr, exact, scale, threads, state, out);
}

// kv-quant's codes (`IntCodec`, `Fp8Codec`): q: float32 [Hq, D]; rotation: float32 [Rn, Rn]
// (D ≤ Rn, the Walsh–Hadamard rotation the rows were coded after) or an empty tensor; codes:
// uint8 [n, row_bytes], each vector [scales: G float16][zero points: G float16][G · group
// indices of `bits` ∈ {2, 4, 8} bits], or with `fp8` (bits 8) [scales: G float16][G · group
// e4m3 bytes], width = G · group ≥ Rn (or D) → out float32 [Hq, D].
torch::Tensor grouped_attention(torch::Tensor q, torch::Tensor rotation, torch::Tensor codes,
                                int64_t kv_heads, int64_t bits, bool fp8, int64_t group,
                                int64_t width, std::vector<torch::Tensor> exact, double scale) {
  check_queries_and_codes(q, codes, kv_heads);
  q = q.contiguous();
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  TORCH_CHECK(!fp8 || bits == 8, "fp8 codes are 8 bits");
  TORCH_CHECK(group > 0 && width % group == 0 && width * bits % 8 == 0 && width % 8 == 0,
              "width must be whole groups, a multiple of 8");
  const bool rotated = rotation.numel() > 0;
  if (rotated) {
    TORCH_CHECK(rotation.dtype() == torch::kFloat32 && rotation.dim() == 2 &&
                    rotation.size(0) == rotation.size(1) && rotation.size(0) >= q.size(1) &&
                    rotation.size(0) <= width && rotation.is_contiguous(),
                "rotation must be contiguous float32 [Rn, Rn] with D ≤ Rn ≤ width");
  }
  TORCH_CHECK(width >= q.size(1), "width must hold the head");
  const GroupedCodec codec{static_cast<int>(bits), group, width,
                           rotated ? rotation.size(0) : 0, fp8};
  TORCH_CHECK(codes.size(1) == 2 * kv_heads * grouped_vector_bytes(codec),
              "codes' rows must hold a key and a value vector per K/V head");
  std::vector<torch::Tensor> kept;
  const std::vector<ExactRows> parts = exact_rows(exact, kv_heads, q.size(1), kept);
  torch::Tensor out = torch::empty({q.size(0), q.size(1)}, q.options());
  attend_grouped_rows(q.data_ptr<float>(), q.size(0), q.size(1),
                      rotated ? rotation.data_ptr<float>() : nullptr, codec,
                      codes.data_ptr<uint8_t>(), codes.size(0), kv_heads, parts,
                      static_cast<float>(scale), at::get_num_threads(), out.data_ptr<float>());
  return out;
}

}  // namespace larql
