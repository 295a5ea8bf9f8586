// One-token products with GGUF block-quantised weight rows: out[n] = Σ_k W[n, k] · x[k].
//
// The weights stay in their GGUF blocks of 32 (Q8_0, Q4_0, Q4_1; Q4_K repacked by the loader
// into blocks of 32 with float32 scale and offset, "Q4_K32") and are expanded to float
// in registers; x stays float32, so the result is the float product with the dequantised
// weights up to the order of the float sums. Per block b of row n, with S_b = Σ_i q_i x_i
// over the block's codes and X_b = Σ_i x_i (computed once per call):
//   Q8_0: d · S_b                (weight = d · q)
//   Q4_0: d · S_b − 8 d · X_b    (weight = d · (q − 8))
//   Q4_1: d · S_b + m · X_b      (weight = d · q + m)
//   Q4_K32: the same as Q4_1 with d, m float32 (Q4_K's d · scale_j and −dmin · min_j, exact)
// Q4 blocks hold elements 0–15 in the low nibbles of their 16 bytes, 16–31 in the high ones.
// Rows are split over torch's intra-op threads. With AVX2 + FMA + F16C a block is four 8-wide
// multiply-adds; without them a scalar loop computes the same sums.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LARQL_AVX2 1
#else
#define LARQL_AVX2 0
#endif

namespace larql {

constexpr int64_t kBlock = 32;

// A buffer reused from call to call: it only grows, and what it hands out is not initialised
// (a decode step's products and layers need the same sizes at every step).
template <typename T>
class Scratch {
 public:
  T* take(size_t n) {
    if (n > capacity_) {
      data_.reset(new T[n]);
      capacity_ = n;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<T[]> data_;
  size_t capacity_ = 0;
};

// Every format also comes tiled for the AVX-512 VNNI / AMX products (`tiled_blocks.h`):
// kTiled + the format.
enum class Format : int {
  Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K32 = 3,
  Q8_0_TILED = 16, Q4_0_TILED = 17, Q4_1_TILED = 18, Q4_K32_TILED = 19,
};
constexpr int kTiled = 16;

constexpr bool is_tiled(Format f) { return static_cast<int>(f) >= kTiled; }

constexpr Format base_of(Format f) {
  return is_tiled(f) ? static_cast<Format>(static_cast<int>(f) - kTiled) : f;
}

constexpr int64_t block_bytes(Format f) {
  switch (base_of(f)) {
    case Format::Q8_0: return 34;
    case Format::Q4_0: return 18;
    case Format::Q4_1: return 20;
    case Format::Q4_K32: return 24;  // d f32, m f32, 16 bytes of nibbles
    default: return 0;
  }
}

inline float half_to_float(uint16_t h) {
#if LARQL_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

inline uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float read_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A block's scale d, its offset m (Q4_1, Q4_K32) and where its codes start.
inline float block_scale(Format f, const uint8_t* block) {
  return f == Format::Q4_K32 ? read_f32(block) : half_to_float(read_u16(block));
}

inline float block_offset(Format f, const uint8_t* block) {
  return f == Format::Q4_K32 ? read_f32(block + 4) : half_to_float(read_u16(block + 2));
}

inline const uint8_t* block_codes(Format f, const uint8_t* block) {
  switch (f) {
    case Format::Q8_0: return block + 2;
    case Format::Q4_0: return block + 2;
    case Format::Q4_1: return block + 4;
    case Format::Q4_K32: return block + 8;
  }
  return block;
}

// Σ x over each block of 32: [K/32].
inline void block_sums(const float* x, int64_t k, float* sums) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    float sum = 0.0f;
    for (int i = 0; i < kBlock; ++i) sum += x[b * kBlock + i];
    sums[b] = sum;
  }
}

#if LARQL_AVX2
inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 lanes: 2^n · e^r with n = round(x · log2 e), r = x − n · ln 2 (ln 2 split in two for
// precision) and e^r by its degree-7 series in Horner form (Cephes' expf coefficients, within
// 2 ulp of std::exp over the clamped range).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// Σ_i q_i x_i over one block: q as 32 int8 (Q8_0) or 16 bytes of nibbles (Q4), x float [32].
inline __m256 codes_times_x(__m128i first16, __m128i last16, bool is_signed, const float* x) {
  const __m128i parts[4] = {first16, _mm_srli_si128(first16, 8), last16, _mm_srli_si128(last16, 8)};
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(parts[j]) : _mm256_cvtepu8_epi32(parts[j]);
    sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), _mm256_loadu_ps(x + 8 * j), sum);
  }
  return sum;
}
#endif

inline float row_dot(Format f, const uint8_t* row, int64_t blocks, const float* x, const float* sums) {
  const int64_t stride = block_bytes(f);
  float offset = 0.0f;  // the −8 d · X_b or m · X_b terms
#if LARQL_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * stride;
    const float* xb = x + b * kBlock;
    const float d = block_scale(f, block);
    __m256 dot;
    if (f == Format::Q8_0) {
      const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
      const __m128i last = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
      dot = codes_times_x(first, last, true, xb);
    } else {
      const uint8_t* qs = block_codes(f, block);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i low = _mm_and_si128(packed, mask);
      const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
      dot = codes_times_x(low, high, false, xb);
      offset += f == Format::Q4_0 ? -8.0f * d * sums[b] : block_offset(f, block) * sums[b];
    }
    acc = _mm256_fmadd_ps(dot, _mm256_set1_ps(d), acc);
  }
  return horizontal_sum(acc) + offset;
#else
  float total = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * stride;
    const float* xb = x + b * kBlock;
    const float d = block_scale(f, block);
    float dot = 0.0f;
    if (f == Format::Q8_0) {
      const int8_t* wq = reinterpret_cast<const int8_t*>(block + 2);
      for (int i = 0; i < kBlock; ++i) dot += static_cast<float>(wq[i]) * xb[i];
    } else {
      const uint8_t* qs = block_codes(f, block);
      for (int i = 0; i < 16; ++i) {
        dot += static_cast<float>(qs[i] & 0x0f) * xb[i] + static_cast<float>(qs[i] >> 4) * xb[i + 16];
      }
      offset += f == Format::Q4_0 ? -8.0f * d * sums[b] : block_offset(f, block) * sums[b];
    }
    total += d * dot;
  }
  return total + offset;
#endif
}


// Weight rows are read once per call, from memory: the hardware's prefetch alone left a one-row
// product of SmolLM2's layers 3× slower than with its weights in cache (12.8 against 4.3 ms on
// a 2-core Xeon). Each thread asks for the row kPrefetchRows ahead of the one it computes.
constexpr int64_t kPrefetchRows = 8;

inline void prefetch_row(const uint8_t* rows, int64_t row_bytes, int64_t r, int64_t end) {
#if LARQL_AVX2
  if (r >= end) return;
  const char* row = reinterpret_cast<const char*>(rows + r * row_bytes);
  for (int64_t offset = 0; offset < row_bytes; offset += 64) {
    _mm_prefetch(row + offset, _MM_HINT_T0);
  }
#else
  (void)rows, (void)row_bytes, (void)r, (void)end;
#endif
}

// out[r] = Σ_k W[r, k] · x[k] for the n rows of `rows` (row_bytes each), split over torch's
// intra-op threads; x float32 [k], k a multiple of 32.
inline void gemv(Format f, const uint8_t* rows, int64_t row_bytes, int64_t n, const float* x,
                 int64_t k, float* out) {
  const int64_t blocks = k / kBlock;
  std::vector<float> sums(blocks);
  block_sums(x, k, sums.data());
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      prefetch_row(rows, row_bytes, r + kPrefetchRows, end);
      out[r] = row_dot(f, rows + r * row_bytes, blocks, x, sums.data());
    }
  });
}


// ---- Integer products: x rounded per block of 32 to int8 (as llama.cpp's Q8 activations) or
// int16 codes. With L = 127 or 32767: d_b = max|x| / L over block b, q_i = round(x_i / d_b)
// (to nearest, ties to even); then
//   Q8_0: d · d_b · Σ w_i q_i
//   Q4_0: d · d_b · (Σ w_i q_i − 8 Σ q_i)
//   Q4_1, Q4_K32: d · d_b · Σ w_i q_i + m · X_b   (X_b = d_b · Σ q_i: the rounded block's sum)
// with the integer sums exact: a product is the float product of the dequantised weights with
// the rounded x, whose error is at most d_b / 2 per element. (X_b is the rounded x's sum, as
// llama.cpp's Q8_1 keeps it, not the exact Σ x_i. With the exact sum a row's error would be
// the rounding errors weighted by the unsigned codes, Σ d w_i (d_b q_i − x_i) with d w_i in
// [0, 15 d], instead of by the weights d w_i + m, which straddle 0: on SmolLM2's Q4_1
// matrices about twice the error, four times the KL — docs/FIDELITY.md.)
enum class Activation : int { Float = 0, Int8 = 8, Int16 = 16 };

template <typename Code>
struct QuantizedInput {
  std::vector<Code> codes;         // [K]
  std::vector<float> scales;       // [K/32] d_b
  std::vector<int32_t> code_sums;  // [K/32] Σ q_i
  std::vector<float> sums;         // [K/32] X_b = d_b Σ q_i
};

// One block of 32 rounded to integer codes with L levels (127 or 32767): the codes as int32, the
// block's scale d_b, Σ q_i and the rounded block's sum X_b = d_b Σ q_i.
struct BlockCodes {
  alignas(64) int32_t codes[kBlock];
  float scale;
  int32_t code_sum;
  float sum;
};

inline void quantize_block(const float* xb, float levels, BlockCodes& out) {
#if LARQL_AVX2
  // the same codes as the loop below (the conversion rounds half to even, as nearbyint does)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / levels;
  const __m256 inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  __m256i code_sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.codes + 8 * i), q);
    code_sum = _mm256_add_epi32(code_sum, q);
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), code_sum);
  out.scale = d;
  out.code_sum =
      lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
#else
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float d = amax / levels;
  const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
  int32_t code_sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    out.codes[i] = static_cast<int32_t>(std::nearbyint(xb[i] * inverse));
    code_sum += out.codes[i];
  }
  out.scale = d;
  out.code_sum = code_sum;
#endif
  out.sum = d * static_cast<float>(out.code_sum);  // exact Σ q (|Σ q| < 2^24), one rounding
}

template <typename Code>
QuantizedInput<Code> quantize_input(const float* x, int64_t k) {
  constexpr float levels = sizeof(Code) == 1 ? 127.0f : 32767.0f;
  const int64_t blocks = k / kBlock;
  QuantizedInput<Code> in{std::vector<Code>(k), std::vector<float>(blocks),
                          std::vector<int32_t>(blocks), std::vector<float>(blocks)};
  BlockCodes block;
  for (int64_t b = 0; b < blocks; ++b) {
    quantize_block(x + b * kBlock, levels, block);
    for (int i = 0; i < kBlock; ++i) in.codes[b * kBlock + i] = static_cast<Code>(block.codes[i]);
    in.scales[b] = block.scale;
    in.code_sums[b] = block.code_sum;
    in.sums[b] = block.sum;
  }
  return in;
}

#if LARQL_AVX2
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LARQL_VNNI 1
#else
#define LARQL_VNNI 0
#endif

// Σ over 4-byte groups of unsigned w × signed q → 8 int32 lanes.
inline __m256i dot_u8_s8(__m256i w, __m256i q) {
#if LARQL_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, q);
#else  // pairs of products fit int16 here: |w| ≤ 128, |q| ≤ 127
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), _mm256_set1_epi16(1));
#endif
}

// Σ over pairs of int16 w × int16 q, two vectors of 16 each → 8 int32 lanes.
inline __m256i dot_s16(__m256i w0, __m256i q0, __m256i w1, __m256i q1) {
#if LARQL_VNNI
  return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), w0, q0), w1, q1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w0, q0), _mm256_madd_epi16(w1, q1));
#endif
}

// One block's Σ w_i q_i (w: the block's codes, Q4 ones unsigned 0–15) → 8 int32 lanes.
inline __m256i block_codes_dot(Format f, const uint8_t* block, const int8_t* q) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  if (f == Format::Q8_0) {  // signed × signed as |w| × (q with w's sign)
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    return dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  }
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i packed = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(block_codes(f, block)));
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return dot_u8_s8(_mm256_set_m128i(high, low), x);
}

inline __m256i block_codes_dot(Format f, const uint8_t* block, const int16_t* q) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16));
  if (f == Format::Q8_0) {
    const __m128i* w = reinterpret_cast<const __m128i*>(block + 2);
    return dot_s16(_mm256_cvtepi8_epi16(_mm_loadu_si128(w)), x0,
                   _mm256_cvtepi8_epi16(_mm_loadu_si128(w + 1)), x1);
  }
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i packed = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(block_codes(f, block)));
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return dot_s16(_mm256_cvtepu8_epi16(low), x0, _mm256_cvtepu8_epi16(high), x1);
}
#else
template <typename Code>
int32_t block_codes_dot(Format f, const uint8_t* block, const Code* q) {
  int32_t isum = 0;
  if (f == Format::Q8_0) {
    const int8_t* w = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < kBlock; ++i) isum += static_cast<int32_t>(w[i]) * q[i];
  } else {
    const uint8_t* qs = block_codes(f, block);
    for (int i = 0; i < 16; ++i) isum += (qs[i] & 0x0f) * q[i] + (qs[i] >> 4) * q[i + 16];
  }
  return isum;
}
#endif

template <typename Code>
float row_dot_codes(Format f, const uint8_t* row, int64_t blocks, const QuantizedInput<Code>& in) {
  const int64_t stride = block_bytes(f);
  const Code* codes = in.codes.data();
  float offset = 0.0f;  // the −8 Σ q and m · X_b terms
#if LARQL_AVX2
  __m256 acc = _mm256_setzero_ps();
#else
  float total = 0.0f;
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * stride;
    const float d = block_scale(f, block) * in.scales[b];
    if (f == Format::Q4_0) offset -= 8.0f * d * static_cast<float>(in.code_sums[b]);
    if (f == Format::Q4_1 || f == Format::Q4_K32) offset += block_offset(f, block) * in.sums[b];
#if LARQL_AVX2
    const __m256i isum = block_codes_dot(f, block, codes + b * kBlock);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d), acc);
#else
    total += d * static_cast<float>(block_codes_dot(f, block, codes + b * kBlock));
#endif
  }
#if LARQL_AVX2
  return horizontal_sum(acc) + offset;
#else
  return total + offset;
#endif
}

// ---- Several input rows (a batched decode step): out[m, r] = Σ_k W[r, k] · x[m, k]. Each weight
// row is read from memory once for all M inputs (it stays in L1 between them), and every
// (m, r) is computed with exactly the arithmetic of the one-row product, so a row's result does
// not depend on which others share its step. For int16 inputs (AVX2) a block is also widened
// to int16 once for all of them — and the one-row product is this with M = 1.
#if LARQL_AVX2
// Up to 8 int16 inputs with their per-block numbers interleaved ([blocks][8]: one vector per
// block holds every input's), so a block's scales and offsets for all of them are one vector
// operation; unused lanes are zero.
struct InputTile {
  int count = 0;
  const int16_t* codes[8] = {};
  std::vector<float> scales, sums, code_sums;  // [blocks · 8]
  // the inputs' codes block-major, [blocks][count][32]: a block's inputs at fixed offsets
  std::vector<int16_t> blocked;

  InputTile(const QuantizedInput<int16_t>* ins, int n, int64_t blocks)
      : count(n), scales(blocks * 8), sums(blocks * 8), code_sums(blocks * 8) {
    for (int m = 0; m < n; ++m) {
      codes[m] = ins[m].codes.data();
      for (int64_t b = 0; b < blocks; ++b) {
        scales[b * 8 + m] = ins[m].scales[b];
        sums[b * 8 + m] = ins[m].sums[b];
        code_sums[b * 8 + m] = static_cast<float>(ins[m].code_sums[b]);
      }
    }
    blocked.resize(blocks * n * kBlock);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int m = 0; m < n; ++m) {
        std::memcpy(blocked.data() + (b * n + m) * kBlock, codes[m] + b * kBlock,
                    kBlock * sizeof(int16_t));
      }
    }
  }
};

// One weight row against a tile's Count inputs (accumulators in registers), the format fixed at
// compile time, each block's codes widened once for all of them; per block and input:
// d = d_w · d_x, acc += d · Σ w q (8 lanes), offset −= 8 d Σ q (Q4_0) or += m · X (Q4_1, Q4_K32)
// → out[m · out_stride]. The inputs' codes are read block-major from one pointer at fixed
// offsets: with the format a template argument and no per-input pointers to reload, the
// compiler keeps the accumulators in registers (the run-time format and pointer array spilled
// them): SmolLM2's products ~15% faster at 8 rows and at one, the same arithmetic.
template <Format F, int Count>
inline void rows_dot_int16(const uint8_t* row, int64_t blocks, const InputTile& in, float* out,
                           int64_t out_stride) {
  const int64_t stride = block_bytes(F);
  __m256 acc[Count];
  for (int m = 0; m < Count; ++m) acc[m] = _mm256_setzero_ps();
  __m256 offset = _mm256_setzero_ps();
  alignas(32) float d[8];
  const int16_t* codes = in.blocked.data();
  const __m128i mask = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * stride;
    __m256i w0, w1;
    if constexpr (F == Format::Q8_0) {
      const __m128i* wp = reinterpret_cast<const __m128i*>(block + 2);
      w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wp));
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wp + 1));
    } else {
      const __m128i packed = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(block_codes(F, block)));
      w0 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, mask));
      w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
    }
    const __m256 dv = _mm256_mul_ps(_mm256_set1_ps(block_scale(F, block)),
                                    _mm256_loadu_ps(in.scales.data() + b * 8));
    if constexpr (F == Format::Q4_0) {
      const __m256 eight_d = _mm256_mul_ps(_mm256_set1_ps(8.0f), dv);
      offset = _mm256_sub_ps(offset, _mm256_mul_ps(eight_d, _mm256_loadu_ps(in.code_sums.data() + b * 8)));
    } else if constexpr (F != Format::Q8_0) {
      offset = _mm256_fmadd_ps(_mm256_set1_ps(block_offset(F, block)),
                               _mm256_loadu_ps(in.sums.data() + b * 8), offset);
    }
    _mm256_store_ps(d, dv);
    const __m256i* q = reinterpret_cast<const __m256i*>(codes + b * Count * kBlock);
#pragma GCC unroll 8
    for (int m = 0; m < Count; ++m) {
      const __m256i isum = dot_s16(w0, _mm256_loadu_si256(q + 2 * m), w1, _mm256_loadu_si256(q + 2 * m + 1));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcast_ss(d + m), acc[m]);
    }
  }
  alignas(32) float offsets[8];
  _mm256_store_ps(offsets, offset);
  for (int m = 0; m < Count; ++m) out[m * out_stride] = horizontal_sum(acc[m]) + offsets[m];
}

template <Format F>
inline void rows_dot_int16_tile_of(const uint8_t* row, int64_t blocks, const InputTile& in,
                                   float* out, int64_t out_stride) {
  switch (in.count) {
    case 1: return rows_dot_int16<F, 1>(row, blocks, in, out, out_stride);
    case 2: return rows_dot_int16<F, 2>(row, blocks, in, out, out_stride);
    case 3: return rows_dot_int16<F, 3>(row, blocks, in, out, out_stride);
    case 4: return rows_dot_int16<F, 4>(row, blocks, in, out, out_stride);
    case 5: return rows_dot_int16<F, 5>(row, blocks, in, out, out_stride);
    case 6: return rows_dot_int16<F, 6>(row, blocks, in, out, out_stride);
    case 7: return rows_dot_int16<F, 7>(row, blocks, in, out, out_stride);
    default: return rows_dot_int16<F, 8>(row, blocks, in, out, out_stride);
  }
}

inline void rows_dot_int16_tile(Format f, const uint8_t* row, int64_t blocks, const InputTile& in,
                                float* out, int64_t out_stride) {
  switch (f) {
    case Format::Q8_0: return rows_dot_int16_tile_of<Format::Q8_0>(row, blocks, in, out, out_stride);
    case Format::Q4_0: return rows_dot_int16_tile_of<Format::Q4_0>(row, blocks, in, out, out_stride);
    case Format::Q4_1: return rows_dot_int16_tile_of<Format::Q4_1>(row, blocks, in, out, out_stride);
    case Format::Q4_K32: return rows_dot_int16_tile_of<Format::Q4_K32>(row, blocks, in, out, out_stride);
  }
}
#endif

}  // namespace larql

#include "tiled_blocks.h"  // tiled matrices' layout and inputs (uses the definitions above)
#include "amx_gemm.h"      // their products on AMX tiles
#include "vnni_gemm.h"     // … or with AVX-512 VNNI
#include "tiled_gemm.h"    // … whichever runs here

namespace larql {

// out: [M, n] for x: [M, k] (rows contiguous), x rounded to integer codes per block first.
template <typename Code>
void gemm_codes(Format f, const uint8_t* rows, int64_t row_bytes, int64_t n, const float* x,
                int64_t m_rows, int64_t k, float* out) {
  const int64_t blocks = k / kBlock;
  if (is_tiled(f)) {  // (gemm_with allows it for integer inputs on a tiled build only)
#if LARQL_TILED
    const bool narrow = sizeof(Code) == 1;
    return tiled_gemm(base_of(f), rows, n, blocks, x, m_rows, narrow, out);
#endif
    return;
  }
  std::vector<QuantizedInput<Code>> ins(m_rows);
  const auto quantize_rows = [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) ins[m] = quantize_input<Code>(x + m * k, k);
  };
  if (m_rows < 2) {
    quantize_rows(0, m_rows);
  } else {
    at::parallel_for(0, m_rows, 1, quantize_rows);  // (each row's codes alike either way)
  }
  const int64_t grain = std::max<int64_t>(8, 64 / m_rows);
#if LARQL_AVX2
  if constexpr (sizeof(Code) == 2) {
    std::vector<InputTile> tiles;
    for (int64_t m0 = 0; m0 < m_rows; m0 += 8) {
      tiles.emplace_back(ins.data() + m0, static_cast<int>(std::min<int64_t>(8, m_rows - m0)), blocks);
    }
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        prefetch_row(rows, row_bytes, r + kPrefetchRows, end);
        for (size_t t = 0; t < tiles.size(); ++t) {
          rows_dot_int16_tile(f, rows + r * row_bytes, blocks, tiles[t], out + t * 8 * n + r, n);
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      prefetch_row(rows, row_bytes, r + kPrefetchRows, end);
      const uint8_t* row = rows + r * row_bytes;
      for (int64_t m = 0; m < m_rows; ++m) {
        out[m * n + r] = row_dot_codes<Code>(f, row, blocks, ins[m]);
      }
    }
  });
}

// `gemv` with x rounded to integer codes per block first (`quantize_input`).
template <typename Code>
void gemv_codes(Format f, const uint8_t* rows, int64_t row_bytes, int64_t n, const float* x,
                int64_t k, float* out) {
  gemm_codes<Code>(f, rows, row_bytes, n, x, 1, k, out);
}

inline void gemm_float(Format f, const uint8_t* rows, int64_t row_bytes, int64_t n,
                       const float* x, int64_t m_rows, int64_t k, float* out) {
  const int64_t blocks = k / kBlock;
  std::vector<float> sums(m_rows * blocks);
  for (int64_t m = 0; m < m_rows; ++m) block_sums(x + m * k, k, sums.data() + m * blocks);
  const int64_t grain = std::max<int64_t>(8, 64 / m_rows);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      prefetch_row(rows, row_bytes, r + kPrefetchRows, end);
      for (int64_t m = 0; m < m_rows; ++m) {
        out[m * n + r] = row_dot(f, rows + r * row_bytes, blocks, x + m * k, sums.data() + m * blocks);
      }
    }
  });
}

// Whether these weights can be multiplied with these inputs: tiled ones only with int16 or int8
// inputs, where this build has the tiled products (AVX-512 VNNI, and AMX where it runs).
inline bool product_supported(Activation a, Format f) {
  if (!is_tiled(f)) return true;
#if LARQL_TILED
  return a != Activation::Float;
#else
  (void)a;
  return false;
#endif
}

// The M-row product with float32, int8 or int16 inputs: x [M, k] → out [M, n].
inline void gemm_with(Activation a, Format f, const uint8_t* rows, int64_t row_bytes, int64_t n,
                      const float* x, int64_t m_rows, int64_t k, float* out) {
  if (!product_supported(a, f)) {
    throw std::invalid_argument(
        "tiled blocks take int8 or int16 inputs on a CPU with AVX-512 VNNI only");
  }
  switch (a) {
    case Activation::Int8: return gemm_codes<int8_t>(f, rows, row_bytes, n, x, m_rows, k, out);
    case Activation::Int16: return gemm_codes<int16_t>(f, rows, row_bytes, n, x, m_rows, k, out);
    case Activation::Float: return gemm_float(f, rows, row_bytes, n, x, m_rows, k, out);
  }
}

// The one-row product with a float32, int8 or int16 input.
inline void gemv_with(Activation a, Format f, const uint8_t* rows, int64_t row_bytes, int64_t n,
                      const float* x, int64_t k, float* out) {
  if (!product_supported(a, f)) {
    throw std::invalid_argument(
        "tiled blocks take int8 or int16 inputs on a CPU with AVX-512 VNNI only");
  }
  switch (a) {
    case Activation::Int8: return gemv_codes<int8_t>(f, rows, row_bytes, n, x, k, out);
    case Activation::Int16: return gemv_codes<int16_t>(f, rows, row_bytes, n, x, k, out);
    case Activation::Float: return gemv(f, rows, row_bytes, n, x, k, out);
  }
}

}  // namespace larql
