// Block matrices tiled for int16-input products 16 weight rows at a time, where the CPU has
// AVX-512 with VNNI: on Intel's AMX tiles (`amx_gemm.h`) where it also has AMX-INT8, the
// kernel lets this process use the tile registers and a product has more than 8 input rows,
// else with AVX-512 VNNI's byte dot products (`vnni_gemm.h`), 16 rows in the 16 lanes of a
// vector.
//
// The weights are held tiled (`tile_rows`, once, when a model's blocks are first used): per 16
// rows and block of 32, the rows' code bytes word by word, then their scales — the same bytes as
// the 16 rows' blocks, read in order. Word r of a Q4 block's 16 code bytes carries elements
// 4r..4r+3 in its low nibbles and 16+4r..19+4r in its high ones (a Q8_0 block's 32 bytes are 8
// such words, elements 4r..4r+3 each); the tiled layout keeps word r of the 16 rows together, 64
// bytes, which is both the AMX unit's second operand and one AVX-512 vector of 16 lanes.
//
// The integer sums are the ones the AVX2 path computes, exactly: an int16 code q is split as
// q = 256·hi + lo (hi signed, lo unsigned bytes) and Σ w q = 256·Σ w·hi + Σ w·lo, each a sum of
// byte products (the nibbles are unsigned bytes, Q8_0's signed ones):
//   C_hi[m, o] = Σ_k hi[m, k] · w[o, k],   C_lo[m, o] = Σ_k lo[m, k] · w[o, k]
// int8 inputs ("narrow": llama.cpp's arithmetic, `--weights blocks-int8`) are their codes in the
// high bytes and no low ones: C_hi alone is the block's integer sum, half the byte products.
// Per block the whole integer sum is scaled (not the AVX2 path's 8 partial sums) by the same
// float operations on both units (`scaled_sums`), the same for every input whatever else
// shares the product: a row's result does not depend on its batch or on which unit ran it, and
// a tiled matrix takes this path for one row or many.
#pragma once  // included by block_dot.h, after the definitions it uses

#include <cstdint>
#include <cstdlib>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define LARQL_TILED 1
#else
#define LARQL_TILED 0
#endif

namespace larql {

#if LARQL_TILED
constexpr int kTileOutputs = 16;  // weight rows per tile
constexpr int kTileInputs = 16;   // inputs per group, at most
// Blocks of weights prefetched ahead: far enough that one row's products, which only stream the
// weights, find them in L1 (a one-row step of the default model 3.8–4.0 → 3.2–3.4 ms on the AMX
// Xeon going from 4 to 24 blocks ahead; 12 to 40 measured alike; docs/PERFORMANCE.md).
constexpr int kAhead = 24;

// Below this many input elements a product's rounding runs on the calling thread: waking the
// other threads costs more.
constexpr int64_t kParallelRounding = 1 << 12;

// Up to 16 inputs' int16 codes split into bytes, block-major: [blocks][rows][32] high and low
// bytes, and per block and input its scale, rounded sum d · Σ q, Σ q and Σ hi. `rows`: the
// count rounded up to 1, 2, 4, 8 or 16 (the AMX kernel's instances), the rows past it zero.
// `narrow`: int8 codes, in `high` (Σ hi = Σ q), and no low bytes.
struct TiledInputs {
  int count = 0;
  int rows = 0;
  bool narrow = false;
  const int8_t* high = nullptr;
  const uint8_t* low = nullptr;
  const float* scales = nullptr;
  const float* sums = nullptr;
  const int32_t* code_sums = nullptr;
  const int32_t* high_sums = nullptr;

  static int rows_for(int n) {
    int rows = 1;
    while (rows < n) rows *= 2;
    return rows;
  }
};

// One input's block xb [32] → its int16 codes split into bytes at `at` (q = 256 · high + low,
// |q| ≤ 32767) — `Narrow`: its int8 codes (|q| ≤ 127) in `high`, no low bytes — its scale,
// rounded sum d · Σ q, Σ q and Σ high: the codes, scale and sum that `quantize_block` gives
// (the same max, the same scale and rounding), in 512-bit vectors.
template <bool Narrow>
inline void round_block(const float* xb, int64_t at, int8_t* high, uint8_t* low, float* scales,
                        float* sums, int32_t* code_sums, int32_t* high_sums) {
  const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = top / (Narrow ? 127.0f : 32767.0f);
  const __m512 inverse = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
  const __m512i hi0 = Narrow ? q0 : _mm512_srai_epi32(q0, 8);
  const __m512i hi1 = Narrow ? q1 : _mm512_srai_epi32(q1, 8);
  __m128i* high_out = reinterpret_cast<__m128i*>(high + at * kBlock);
  _mm_storeu_si128(high_out, _mm512_cvtepi32_epi8(hi0));
  _mm_storeu_si128(high_out + 1, _mm512_cvtepi32_epi8(hi1));
  if constexpr (!Narrow) {
    __m128i* low_out = reinterpret_cast<__m128i*>(low + at * kBlock);
    _mm_storeu_si128(low_out, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(low_out + 1, _mm512_cvtepi32_epi8(q1));
  }
  const int32_t code_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  scales[at] = d;
  sums[at] = d * static_cast<float>(code_sum);
  code_sums[at] = code_sum;
  high_sums[at] = _mm512_reduce_add_epi32(_mm512_add_epi32(hi0, hi1));
}

// The storage of one TiledInputs, kept by the thread from product to product.
class TiledInputBuffers {
 public:
  // x: [n, k] float rows (n ≤ 16) → their int16 codes as `quantize_input` rounds them, split
  // into bytes (`narrow`: their int8 codes), over the threads where `parallel` and they are
  // many; valid until the next fill.
  TiledInputs fill(const float* x, int n, int64_t k, bool parallel, bool narrow) {
    reserve(n, k, narrow);
    const int64_t blocks = k / kBlock;
    // blocks begin..end of every row (a thread's blocks share no cache line with another's)
    const auto round_blocks = [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) round_rows(b, x, k);
    };
    if (!parallel || static_cast<int64_t>(n) * k < kParallelRounding) {
      round_blocks(0, blocks);
    } else {
      at::parallel_for(0, blocks, 4, round_blocks);  // (each row's codes alike either way)
    }
    return inputs();
  }

  // Room for n rows (n ≤ 16) of k inputs, each of whose blocks `round_rows` then rounds — on
  // whichever thread made that block's inputs, each block once — before `inputs()` is read.
  void reserve(int n, int64_t k, bool narrow) {
    const int64_t blocks = k / kBlock;
    count_ = n;
    rows_ = TiledInputs::rows_for(n);
    narrow_ = narrow;
    high_ptr_ = high_.take(blocks * rows_ * kBlock);
    low_ptr_ = narrow ? nullptr : low_.take(blocks * rows_ * kBlock);
    scales_ptr_ = scales_.take(blocks * rows_);
    sums_ptr_ = sums_.take(blocks * rows_);
    code_sums_ptr_ = code_sums_.take(blocks * rows_);
    high_sums_ptr_ = high_sums_.take(blocks * rows_);
  }

  // Block b of every reserved row of x [n, k] rounded (the padding rows' zeroed).
  void round_rows(int64_t b, const float* x, int64_t k) const {
    for (int64_t m = 0; m < rows_; ++m) {
      const int64_t at = b * rows_ + m;
      if (m >= count_) {  // a padding row: zero codes and scales
        std::memset(high_ptr_ + at * kBlock, 0, kBlock);
        if (!narrow_) std::memset(low_ptr_ + at * kBlock, 0, kBlock);
        scales_ptr_[at] = sums_ptr_[at] = 0.0f;
        code_sums_ptr_[at] = high_sums_ptr_[at] = 0;
        continue;
      }
      const float* xb = x + m * k + b * kBlock;
      if (narrow_) {
        round_block<true>(xb, at, high_ptr_, low_ptr_, scales_ptr_, sums_ptr_, code_sums_ptr_,
                          high_sums_ptr_);
      } else {
        round_block<false>(xb, at, high_ptr_, low_ptr_, scales_ptr_, sums_ptr_, code_sums_ptr_,
                           high_sums_ptr_);
      }
    }
  }

  TiledInputs inputs() const {
    return TiledInputs{count_,      rows_,         narrow_,        high_ptr_,     low_ptr_,
                       scales_ptr_, sums_ptr_,     code_sums_ptr_, high_sums_ptr_};
  }

 private:
  Scratch<int8_t> high_;
  Scratch<uint8_t> low_;
  Scratch<float> scales_, sums_;
  Scratch<int32_t> code_sums_, high_sums_;
  int count_ = 0, rows_ = 0;
  bool narrow_ = false;
  int8_t* high_ptr_ = nullptr;
  uint8_t* low_ptr_ = nullptr;
  float *scales_ptr_ = nullptr, *sums_ptr_ = nullptr;
  int32_t *code_sums_ptr_ = nullptr, *high_sums_ptr_ = nullptr;
};

// The bytes of one tile (16 rows) and block in the tiled layout: the 16 rows' code words
// first — 64 bytes per word, word r (bytes 4r..4r+3) of each row's code bytes, rows in order —
// then the rows' scales d and offsets m, fp16 (Q8_0, Q4_0: d alone; Q4_1) or float32
// (Q4_K32): 16 × block_bytes.
constexpr int64_t tile_block_bytes(Format base) { return kTileOutputs * block_bytes(base); }

// The code words of a block: 8 for Q8_0 (32 bytes), 4 for the 4-bit formats (16 bytes); the
// tiled block holds them first, 64 bytes per word (16 rows).
constexpr int code_words(Format base) { return base == Format::Q8_0 ? 8 : 4; }

// rows [n, row_bytes] in GGUF blocks → the same matrix tiled into out (n a multiple of 16):
// tile-major, then block-major.
inline void tile_rows(Format base, const uint8_t* rows, int64_t row_bytes, int64_t n,
                      uint8_t* out) {
  const int64_t stride = block_bytes(base);
  const int64_t blocks = row_bytes / stride;
  const int64_t per = tile_block_bytes(base);
  const int scale_bytes = base == Format::Q4_K32 ? 4 : 2;
  const int scales = base == Format::Q4_0 || base == Format::Q8_0 ? 1 : 2;
  const int words = code_words(base);
  for (int64_t t = 0; t < n / kTileOutputs; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* target = out + (t * blocks + b) * per;
      for (int o = 0; o < kTileOutputs; ++o) {
        const uint8_t* block = rows + (t * kTileOutputs + o) * row_bytes + b * stride;
        const uint8_t* codes = block_codes(base, block);
        for (int r = 0; r < words; ++r) std::memcpy(target + 64 * r + 4 * o, codes + 4 * r, 4);
        for (int s = 0; s < scales; ++s) {
          std::memcpy(target + 64 * words + (s * kTileOutputs + o) * scale_bytes,
                      block + s * scale_bytes, scale_bytes);
        }
      }
    }
  }
}

// Prefetches the lines of the tiled block kAhead blocks after `block`.
template <Format F>
inline void prefetch_ahead(const uint8_t* block) {
  constexpr int64_t per = tile_block_bytes(F);
  for (int64_t line = 0; line < per; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(block + kAhead * per + line), _MM_HINT_T0);
  }
}

// The 16 weight rows' scales d and offsets m of one tiled block (`scales`: after its codes).
struct TileScales {
  __m512 d;
  __m512 offset;
};

template <Format F>
inline TileScales tile_scales(const uint8_t* scales) {
  TileScales s{_mm512_setzero_ps(), _mm512_setzero_ps()};
  if constexpr (F == Format::Q4_K32) {
    s.d = _mm512_loadu_ps(scales);
    s.offset = _mm512_loadu_ps(scales + 64);
  } else {
    s.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    if constexpr (F == Format::Q4_1) {
      s.offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
    }
  }
  return s;
}

// acc + input `at`'s block sums C_hi, C_lo (16 weight rows; `Narrow`: C_hi alone) scaled by
// the rows' scales and the input's; + m · X for the formats with offsets. Both units' products
// end here.
template <Format F, bool Narrow = false>
inline __m512 scaled_sums(__m512 acc, __m512i c_high, __m512i c_low, const TileScales& s,
                          const TiledInputs& in, int64_t at) {
  __m512i sum = Narrow ? c_high : _mm512_add_epi32(_mm512_slli_epi32(c_high, 8), c_low);
  if constexpr (F == Format::Q4_0) {  // weight = d · (q − 8)
    sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * in.code_sums[at]));
  }
  const __m512 scale = _mm512_mul_ps(s.d, _mm512_set1_ps(in.scales[at]));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc);
  if constexpr (F == Format::Q4_1 || F == Format::Q4_K32) {  // + m · X (X = d_x · Σ q)
    acc = _mm512_fmadd_ps(s.offset, _mm512_set1_ps(in.sums[at]), acc);
  }
  return acc;
}
#endif

}  // namespace larql
