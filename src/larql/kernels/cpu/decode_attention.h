// One decode query's attention over K/V rows in place (decode_attention.cpp).
#pragma once

#include <cstdint>
#include <utility>

#include "block_dot.h"

namespace larql {

// Asks for the cache line holding p ahead of its use, as an instruction of its own: GCC 12 at
// -O1 and above left _mm_prefetch calls in the attention's row loops out of the object code.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

// a · b over n floats (8 lanes at a time where AVX2 runs and n is a multiple of 8)
inline float dot(const float* a, const float* b, int64_t n) {
#if LARQL_AVX2
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    }
    return horizontal_sum(acc);
  }
#endif
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// acc[0:n] += w · row[0:n]
inline void add_scaled(float* acc, const float* row, float w, int64_t n) {
#if LARQL_AVX2
  if (n % 8 == 0) {
    const __m256 weight = _mm256_set1_ps(w);
    for (int64_t i = 0; i < n; i += 8) {
      _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(weight, _mm256_loadu_ps(row + i),
                                                _mm256_loadu_ps(acc + i)));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) acc[i] += w * row[i];
}

// Rows of one K/V head h and token t at data + h · head_stride + t · row_stride (D floats each).
struct Rows {
  const float* data;
  int64_t head_stride;
  int64_t row_stride;
  const float* at(int64_t head, int64_t row) const {
    return data + head * head_stride + row * row_stride;
  }
};

// s[0:n] ← e^{s − m} with m = max s → (m, Σ e^{s − m}); vectorised where AVX2 runs.
std::pair<float, float> exponentiate(float* s, int64_t n);

// q: [heads · dim]; `rows` key and value rows of kv_heads heads (heads a multiple of them)
// → out: [heads · dim] = softmax(scale · q·k) · v per query head. The rows are split into
// chunks for `threads` threads (≤ 0: torch's intra-op count); the chunking, not the thread that
// runs a chunk, fixes the result, so a call inside a parallel region that passes the outer
// count computes exactly what the outer call would.
void attend_one_query(const float* q, int64_t heads, int64_t dim, const Rows& k, const Rows& v,
                      int64_t kv_heads, int64_t rows, float scale, float* out,
                      int64_t threads = 0);

}  // namespace larql
