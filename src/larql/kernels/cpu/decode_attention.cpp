// One decode query's attention over a layer's K/V rows, float32, grouped query heads:
//
//   out[h] = Σ_t softmax_t(scale · q[h] · k[g(h), t]) · v[g(h), t],   g(h) = h / (Hq / Hkv)
//
// The rows are split into chunks over torch's intra-op threads (flash-decoding): each chunk
// keeps, per query head, its running maximum m, its sum l = Σ e^{s − m} and its weighted rows
// a = Σ e^{s − m} v; the chunks then combine with weights e^{m_c − M}. Every key and value row
// is read once for all the query heads that share it. The cache rows come as torch hands them
// out ([Hkv, T, D] views of token-major storage), so nothing is copied.
// the tensor API alone: torch/extension.h (pybind11, the C++ frontend) is bindings.cpp's,
// and it doubles a file's compile time
#include <torch/types.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "block_dot.h"
#include "decode_attention.h"

namespace larql {

namespace {

constexpr int64_t kChunkRows = 64;  // fewest rows worth a chunk of their own

#if LARQL_AVX2
// acc[hh][0 : 8V] += Σ_t w[hh][t] · row_t for H heads sharing the value rows row_t (V vectors of
// 8 floats each), the H · V accumulators held in registers over the whole walk: each is the
// same chain of multiply-adds in t order as `add_scaled` per token, without storing and
// reloading the accumulators for every row.
template <int V, int H>
void accumulate_rows(float* const* acc, const float* const* w, const Rows& rows, int64_t head,
                     int64_t first, int64_t n) {
  __m256 sums[H][V];
  for (int hh = 0; hh < H; ++hh) {
    for (int i = 0; i < V; ++i) sums[hh][i] = _mm256_loadu_ps(acc[hh] + 8 * i);
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* row = rows.at(head, first + t);
    for (int hh = 0; hh < H; ++hh) {
      const __m256 weight = _mm256_set1_ps(w[hh][t]);
      for (int i = 0; i < V; ++i) {
        sums[hh][i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(row + 8 * i), sums[hh][i]);
      }
    }
  }
  for (int hh = 0; hh < H; ++hh) {
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(acc[hh] + 8 * i, sums[hh][i]);
  }
}

// out[hh][t] = scale · q[hh] · row_t for H query heads sharing the key rows row_t, the queries
// held in registers: each score is `dot`'s chain of multiply-adds and its horizontal sum.
template <int V, int H>
void score_rows(const float* const* q, const Rows& rows, int64_t head, int64_t first, int64_t n,
                float scale, float* const* out) {
  __m256 queries[H][V];
  for (int hh = 0; hh < H; ++hh) {
    for (int i = 0; i < V; ++i) queries[hh][i] = _mm256_loadu_ps(q[hh] + 8 * i);
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* row = rows.at(head, first + t);
    __m256 acc[H];
    for (int hh = 0; hh < H; ++hh) acc[hh] = _mm256_setzero_ps();
    for (int i = 0; i < V; ++i) {
      const __m256 key = _mm256_loadu_ps(row + 8 * i);
      for (int hh = 0; hh < H; ++hh) acc[hh] = _mm256_fmadd_ps(queries[hh][i], key, acc[hh]);
    }
    for (int hh = 0; hh < H; ++hh) out[hh][t] = scale * horizontal_sum(acc[hh]);
  }
}

// Query heads a pass over a K/V head's rows takes at width 64: three where AVX-512 gives 32
// vector registers (the three heads' 24 query vectors and their sums stay in registers), so a
// group of three (SmolLM2's) reads its rows once, not twice; two with AVX2's 16.
#if defined(__AVX512VL__)
constexpr int64_t kHeadsAPass = 3;
#else
constexpr int64_t kHeadsAPass = 2;
#endif

// The scores of one K/V head's `group` query heads against its rows (widths 64 and 128) →
// false where another width takes `dot`.
bool score_group(const float* qs, float* scores, int64_t per_chunk, const Rows& k, int64_t g,
                 int64_t group, int64_t dim, int64_t first, int64_t n, float scale) {
  if (dim != 64 && dim != 128) return false;
  for (int64_t j = 0; j < group;) {
    const int64_t h = g * group + j;
    // the next heads of the group; where fewer are left, the spare entries repeat the last
    const int64_t last = group - 1 - j;
    const int64_t h1 = h + std::min<int64_t>(1, last), h2 = h + std::min<int64_t>(2, last);
    const float* q[3] = {qs + h * dim, qs + h1 * dim, qs + h2 * dim};
    float* out[3] = {scores + h * per_chunk, scores + h1 * per_chunk, scores + h2 * per_chunk};
    if (dim == 128) {
      score_rows<16, 1>(q, k, g, first, n, scale, out);
      j += 1;
    } else if (kHeadsAPass == 3 && j + 2 < group) {
      score_rows<8, 3>(q, k, g, first, n, scale, out);
      j += 3;
    } else if (j + 1 < group) {
      score_rows<8, 2>(q, k, g, first, n, scale, out);
      j += 2;
    } else {
      score_rows<8, 1>(q, k, g, first, n, scale, out);
      j += 1;
    }
  }
  return true;
}

// The weighted value rows of one K/V head's `group` query heads (head widths 64 and 128; three,
// two or one heads at a time at width 64, as `score_group`) → false where another width takes
// `add_scaled`.
bool accumulate_group(float* acc, const float* scores, int64_t per_chunk, const Rows& v,
                      int64_t g, int64_t group, int64_t dim, int64_t first, int64_t n) {
  if (dim != 64 && dim != 128) return false;
  for (int64_t j = 0; j < group;) {
    const int64_t h = g * group + j;
    const int64_t last = group - 1 - j;  // as in score_group
    const int64_t h1 = h + std::min<int64_t>(1, last), h2 = h + std::min<int64_t>(2, last);
    float* sums[3] = {acc + h * dim, acc + h1 * dim, acc + h2 * dim};
    const float* weights[3] = {scores + h * per_chunk, scores + h1 * per_chunk,
                               scores + h2 * per_chunk};
    if (dim == 128) {
      accumulate_rows<16, 1>(sums, weights, v, g, first, n);
      j += 1;
    } else if (kHeadsAPass == 3 && j + 2 < group) {
      accumulate_rows<8, 3>(sums, weights, v, g, first, n);
      j += 3;
    } else if (j + 1 < group) {
      accumulate_rows<8, 2>(sums, weights, v, g, first, n);
      j += 2;
    } else {
      accumulate_rows<8, 1>(sums, weights, v, g, first, n);
      j += 1;
    }
  }
  return true;
}
#endif

void check_cache(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == 3 && t.stride(2) == 1, name,
              " must be float32 [Hkv, T, D] with unit stride over D");
}

}  // namespace

// s[0:n] ← e^{s − m} with m = max s → (m, Σ e^{s − m}): 8 scores at a time where AVX2 runs
// (`exp8`, within 2 ulp of std::exp; a long context's softmax spent as long in scalar std::exp
// as in reading its rows), std::exp for the rest.
std::pair<float, float> exponentiate(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if LARQL_AVX2
  __m256 top = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  m = *std::max_element(lanes, lanes + 8);
#endif
  for (; t < n; ++t) m = std::max(m, s[t]);
  float l = 0.0f;
  t = 0;
#if LARQL_AVX2
  const __m256 shift = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  l = horizontal_sum(total);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    l += s[t];
  }
  return {m, l};
}

void attend_one_query(const float* qs, int64_t heads, int64_t dim, const Rows& k, const Rows& v,
                      int64_t kv_heads, int64_t rows, float softmax_scale, float* o,
                      int64_t threads) {
  const int64_t group = heads / kv_heads;
  if (threads <= 0) threads = at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, rows / kChunkRows));
  const int64_t per_chunk = (rows + chunks - 1) / chunks;
  std::vector<float> maxima(chunks * heads), sums(chunks * heads), partial(chunks * heads * dim);

  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * per_chunk);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * per_chunk, last = std::min(rows, first + per_chunk);
      const int64_t n = last - first;
      bool scored = false;
#if LARQL_AVX2
      scored = true;
      for (int64_t g = 0; g < kv_heads && scored; ++g) {
        scored = score_group(qs, scores.data(), per_chunk, k, g, group, dim, first, n,
                             softmax_scale);
      }
#endif
      for (int64_t t = 0; t < n && !scored; ++t) {  // rows outer: storage streams in order
        for (int64_t g = 0; g < kv_heads; ++g) {
          const float* key = k.at(g, first + t);
          for (int64_t j = 0; j < group; ++j) {
            const int64_t h = g * group + j;
            scores[h * per_chunk + t] = softmax_scale * dot(qs + h * dim, key, dim);
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        const auto [m, l] = exponentiate(scores.data() + h * per_chunk, n);
        maxima[c * heads + h] = m;
        sums[c * heads + h] = l;
      }
      float* acc = partial.data() + c * heads * dim;
      std::fill(acc, acc + heads * dim, 0.0f);
#if LARQL_AVX2
      bool done = true;
      for (int64_t g = 0; g < kv_heads && done; ++g) {
        done = accumulate_group(acc, scores.data(), per_chunk, v, g, group, dim, first, n);
      }
      if (done) continue;
#endif
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t g = 0; g < kv_heads; ++g) {
          const float* value = v.at(g, first + t);
          for (int64_t j = 0; j < group; ++j) {
            const int64_t h = g * group + j;
            add_scaled(acc + h * dim, value, scores[h * per_chunk + t], dim);
          }
        }
      }
    }
  });

  std::fill(o, o + heads * dim, 0.0f);
  for (int64_t h = 0; h < heads; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, maxima[c * heads + h]);
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float weight = std::exp(maxima[c * heads + h] - top);
      total += weight * sums[c * heads + h];
      add_scaled(o + h * dim, partial.data() + (c * heads + h) * dim, weight, dim);
    }
    const float inverse = 1.0f / total;
    for (int64_t i = 0; i < dim; ++i) o[h * dim + i] *= inverse;
  }
}

// q: float32 [Hq, 1, D] (contiguous); keys, values: float32 [Hkv, T, D], any head and row
// strides → float32 [1, Hq · D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                               double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3 && q.size(1) == 1 && q.is_contiguous(),
              "q must be contiguous float32 [Hq, 1, D]");
  check_cache(keys, "keys");
  check_cache(values, "values");
  const int64_t heads = q.size(0), dim = q.size(2);
  const int64_t kv_heads = keys.size(0), rows = keys.size(1);
  TORCH_CHECK(values.sizes() == keys.sizes(), "keys and values differ in shape");
  TORCH_CHECK(keys.size(2) == dim, "keys' width is not the query's");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of K/V heads");
  TORCH_CHECK(rows > 0, "no rows to attend to");
  torch::Tensor out = torch::empty({1, heads * dim}, q.options());
  attend_one_query(q.data_ptr<float>(), heads, dim,
                   Rows{keys.data_ptr<float>(), keys.stride(0), keys.stride(1)},
                   Rows{values.data_ptr<float>(), values.stride(0), values.stride(1)}, kv_heads,
                   rows, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

}  // namespace larql
