// The int16-input block products on Intel's AMX tiles, for Q8_0 and the 4-bit formats (Q4_0,
// Q4_1, Q4_K32), where the CPU has AMX-INT8 and the kernel lets this process use the tile registers.
//
// The weights are held tiled (`tile_rows`, once, when a model's blocks are first used): per 16
// rows and block of 32, the rows' code bytes as the tile unit reads them, then their scales —
// the same bytes as the 16 rows' blocks, read in order. The integer sums are the ones the AVX2
// path computes, exactly: an int16 code q is split as q = 256·hi + lo (hi signed, lo unsigned
// bytes) and Σ w q = 256·Σ w·hi + Σ w·lo, each a tile product of bytes (the nibbles are
// unsigned bytes, Q8_0's signed ones):
//   C_hi[m, o] = Σ_k hi[m, k] · w[o, k]   (TDPBSUD: signed × unsigned bytes; Q8_0: TDPBSSD)
//   C_lo[m, o] = Σ_k lo[m, k] · w[o, k]   (TDPBUUD; Q8_0: TDPBUSD)
// The weights' tile (the second operand) holds 4 consecutive k of one row per 32-bit word: word
// r of a Q4 block's 16 code bytes carries elements 4r..4r+3 in its low nibbles and 16+4r..19+4r
// in its high ones (a Q8_0 block's 32 bytes are 8 such words, elements 4r..4r+3 each), so the
// tiled layout keeps word r of the 16 rows together.
//
// Per block the whole integer sum is scaled (not the AVX2 path's 8 partial sums), the same
// arithmetic for every input whatever else shares the tile: a row's result does not depend on
// its batch, and a tiled matrix takes this path for one row or many.
#pragma once  // included by block_dot.h, after the definitions it uses

#include <cstdint>
#include <cstdlib>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LARQL_AMX 1
#else
#define LARQL_AMX 0
#endif

namespace larql {

#if LARQL_AMX
constexpr int kTileOutputs = 16;  // weight rows per tile
constexpr int kTileInputs = 16;   // inputs per tile, at most
constexpr int kAhead = 4;         // blocks of weights prefetched ahead

// Whether this process may use the tile registers: Linux grants them on request, once.
inline bool amx_usable() {
  static const bool usable = [] {
    if (const char* off = std::getenv("LARQL_NO_AMX"); off != nullptr && off[0] == '1') return false;
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 C_hi, C_lo [M × 16 int32] of a first weight tile and 5, 6 of a second; 2, 3 hi,
// lo [M × 32 bytes]; 4, 7 the two weight tiles [8 × 64].
inline void configure_tiles(int inputs) {
  thread_local int configured = 0;
  if (configured == inputs) return;
  TileConfig config;
  for (int t : {0, 1, 5, 6}) config.rows[t] = inputs, config.bytes_per_row[t] = 64;
  for (int t : {2, 3}) config.rows[t] = inputs, config.bytes_per_row[t] = 32;
  for (int t : {4, 7}) config.rows[t] = 8, config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
  configured = inputs;
}

// Below this many input elements a product's rounding runs on the calling thread: waking the
// other threads costs more.
constexpr int64_t kParallelRounding = 1 << 12;

// Up to 16 inputs' int16 codes as the tiles' first operands, block-major: [blocks][rows][32]
// high and low bytes, and per block and input its scale, Σ x and Σ q. `rows`: the count
// rounded up to 1, 2, 4, 8 or 16 (the kernel's instances), the rows past it zero.
struct AmxInputs {
  int count = 0;
  int rows = 0;
  const int8_t* high = nullptr;
  const uint8_t* low = nullptr;
  const float* scales = nullptr;
  const float* sums = nullptr;
  const int32_t* code_sums = nullptr;

  static int rows_for(int n) {
    int rows = 1;
    while (rows < n) rows *= 2;
    return rows;
  }
};

// The storage of one AmxInputs, kept by the thread from product to product.
class AmxInputBuffers {
 public:
  // x: [n, k] float rows (n ≤ 16) → their int16 codes as `quantize_input` rounds them, laid
  // out for the tiles; valid until the next fill.
  AmxInputs fill(const float* x, int n, int64_t k) {
    const int64_t blocks = k / kBlock;
    const int rows = AmxInputs::rows_for(n);
    int8_t* high = high_.take(blocks * rows * kBlock);
    uint8_t* low = low_.take(blocks * rows * kBlock);
    float* scales = scales_.take(blocks * rows);
    float* sums = sums_.take(blocks * rows);
    int32_t* code_sums = code_sums_.take(blocks * rows);
    // blocks begin..end of every row (a thread's blocks share no cache line with another's)
    const auto round_blocks = [&](int64_t begin, int64_t end) {
      BlockCodes block;
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t at = b * rows + m;
          if (m >= n) {  // a padding row: zero codes and scales
            std::memset(high + at * kBlock, 0, kBlock);
            std::memset(low + at * kBlock, 0, kBlock);
            scales[at] = sums[at] = 0.0f;
            code_sums[at] = 0;
            continue;
          }
          quantize_block(x + m * k + b * kBlock, 32767.0f, block);
          // q = 256 · high + low, |q| ≤ 32767; read as the 8-code stores wrote them (a
          // wider load would wait for both stores to reach the cache)
          for (int part = 0; part < 4; ++part) {
            const __m256i q =
                _mm256_load_si256(reinterpret_cast<const __m256i*>(block.codes + 8 * part));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(high + at * kBlock + 8 * part),
                             _mm256_cvtepi32_epi8(_mm256_srai_epi32(q, 8)));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(low + at * kBlock + 8 * part),
                             _mm256_cvtepi32_epi8(q));
          }
          scales[at] = block.scale;
          sums[at] = block.sum;
          code_sums[at] = block.code_sum;
        }
      }
    };
    if (static_cast<int64_t>(n) * k < kParallelRounding) {
      round_blocks(0, blocks);
    } else {
      at::parallel_for(0, blocks, 4, round_blocks);  // (each row's codes alike either way)
    }
    return AmxInputs{n, rows, high, low, scales, sums, code_sums};
  }

 private:
  Scratch<int8_t> high_;
  Scratch<uint8_t> low_;
  Scratch<float> scales_, sums_;
  Scratch<int32_t> code_sums_;
};

// The bytes of one tile (16 rows) and block in the tiled layout: the 16 rows' code words
// first — 4 chunks of 64 bytes, chunk r holding word r (bytes 4r..4r+3) of each row's 16 code
// bytes, rows in order — then the rows' scales d and offsets m, fp16 (Q8_0, Q4_0: d alone;
// Q4_1) or float32 (Q4_K32): 16 × block_bytes.
inline int64_t tile_block_bytes(Format base) { return kTileOutputs * block_bytes(base); }

// The code words of a block: 8 for Q8_0 (32 bytes), 4 for the 4-bit formats (16 bytes); the
// tiled block holds them first, 64 bytes per word (16 rows).
inline int code_words(Format base) { return base == Format::Q8_0 ? 8 : 4; }

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

// The tile intrinsics take their registers' numbers as literals (they are pasted into the
// instruction): `SECOND` picks the second weight tile's registers (5, 6 and 7) over the
// first's (0, 1 and 4).

// One weight tile's block into its tile register (`staging`: 512 bytes for the 4-bit
// formats' nibbles spread to bytes).
template <Format F, bool SECOND>
inline void load_weights(const uint8_t* block, uint8_t* staging) {
  if constexpr (F == Format::Q8_0) {  // signed bytes, already as the unit reads them
    if constexpr (SECOND) _tile_loadd(7, block, 64); else _tile_loadd(4, block, 64);
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int r = 0; r < 4; ++r) {  // word r: elements 4r..4r+3 (low nibbles), 16+4r.. (high)
      const __m512i words = _mm512_loadu_si512(block + 64 * r);
      _mm512_store_si512(staging + 64 * r, _mm512_and_si512(words, nibble));
      _mm512_store_si512(staging + 64 * (r + 4),
                         _mm512_and_si512(_mm512_srli_epi16(words, 4), nibble));
    }
    if constexpr (SECOND) _tile_loadd(7, staging, 64); else _tile_loadd(4, staging, 64);
  }
}

// C_hi and C_lo of one weight tile and the inputs' bytes (tiles 2, 3).
template <Format F, bool SECOND>
inline void tile_products() {
  if constexpr (SECOND) {
    _tile_zero(5);
    _tile_zero(6);
    if constexpr (F == Format::Q8_0) {
      _tile_dpbssd(5, 2, 7);
      _tile_dpbusd(6, 3, 7);
    } else {
      _tile_dpbsud(5, 2, 7);
      _tile_dpbuud(6, 3, 7);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (F == Format::Q8_0) {
      _tile_dpbssd(0, 2, 4);  // signed high bytes × signed weights
      _tile_dpbusd(1, 3, 4);  // unsigned low bytes × signed weights
    } else {
      _tile_dpbsud(0, 2, 4);
      _tile_dpbuud(1, 3, 4);
    }
  }
}

// The sums of tile_products<F, SECOND> into memory ([M × 16] int32 each).
template <bool SECOND>
inline void store_sums(int32_t* c_high, int32_t* c_low) {
  if constexpr (SECOND) {
    _tile_stored(5, c_high, 64);
    _tile_stored(6, c_low, 64);
  } else {
    _tile_stored(0, c_high, 64);
    _tile_stored(1, c_low, 64);
  }
}

// acc[m] += the block's integer sums (c_high, c_low: [M × 16]) scaled by the weight rows'
// scales (`scales`, the tiled block's) and input m's; + m · X for the formats with offsets.
template <Format F, int M>
inline void scale_block(const uint8_t* scales, const int32_t* c_high, const int32_t* c_low,
                        const AmxInputs& in, int64_t at, __m512* acc) {
  __m512 d, offset = _mm512_setzero_ps();
  if constexpr (F == Format::Q4_K32) {
    d = _mm512_loadu_ps(scales);
    offset = _mm512_loadu_ps(scales + 64);
  } else {
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    if constexpr (F == Format::Q4_1) {
      offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    if (m >= in.count) break;  // (rows past the count are padding)
    __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c_high + 16 * m), 8),
                                   _mm512_load_si512(c_low + 16 * m));
    if constexpr (F == Format::Q4_0) {  // weight = d · (q − 8)
      sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * in.code_sums[at + m]));
    }
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(in.scales[at + m]));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[m]);
    if constexpr (F == Format::Q4_1 || F == Format::Q4_K32) {  // + m · X
      acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(in.sums[at + m]), acc[m]);
    }
  }
}

// T (1 or 2) consecutive tiles of 16 weight rows × M inputs over every block (`tile`: the
// first tile's first block, `tile_bytes` apart) → out[m · out_stride + o]. Two tiles share
// the inputs' tiles and give the unit two independent chains of products: while one tile's
// sums are stored and scaled, the other's products run.
template <Format F, int M, int T>
inline void amx_tiles(const uint8_t* tile, int64_t tile_bytes, int64_t blocks,
                      const AmxInputs& in, float* out, int64_t out_stride) {
  static_assert(T == 1 || T == 2);
  const int64_t per = tile_block_bytes(F);
  alignas(64) uint8_t weights[T][8 * 64];
  alignas(64) int32_t c_high[T][kTileInputs * 16], c_low[T][kTileInputs * 16];
  __m512 acc[T][M];
#pragma GCC unroll 2
  for (int t = 0; t < T; ++t) {
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[t][m] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* first = tile + b * per;
    const uint8_t* second = first + (T - 1) * tile_bytes;
    for (int64_t line = 0; line < per; line += 64) {  // kAhead blocks ahead
      _mm_prefetch(reinterpret_cast<const char*>(first + kAhead * per + line), _MM_HINT_T0);
      if constexpr (T == 2) {
        _mm_prefetch(reinterpret_cast<const char*>(second + kAhead * per + line), _MM_HINT_T0);
      }
    }
    load_weights<F, false>(first, weights[0]);
    if constexpr (T == 2) load_weights<F, true>(second, weights[T - 1]);
    _tile_loadd(2, in.high + b * M * kBlock, kBlock);
    _tile_loadd(3, in.low + b * M * kBlock, kBlock);
    tile_products<F, false>();
    if constexpr (T == 2) tile_products<F, true>();
    store_sums<false>(c_high[0], c_low[0]);
    scale_block<F, M>(first + 64 * code_words(F), c_high[0], c_low[0], in, b * M, acc[0]);
    if constexpr (T == 2) {
      store_sums<true>(c_high[T - 1], c_low[T - 1]);
      scale_block<F, M>(second + 64 * code_words(F), c_high[T - 1], c_low[T - 1], in, b * M,
                        acc[T - 1]);
    }
  }
  // (constant indices only, so the accumulators stay in registers)
#pragma GCC unroll 2
  for (int t = 0; t < T; ++t) {
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      if (m < in.count) _mm512_storeu_ps(out + m * out_stride + t * kTileOutputs, acc[t][m]);
    }
  }
}

template <Format F, int T>
inline void amx_tiles_of(const uint8_t* tile, int64_t tile_bytes, int64_t blocks,
                         const AmxInputs& in, float* out, int64_t out_stride) {
  switch (in.rows) {
    case 1: return amx_tiles<F, 1, T>(tile, tile_bytes, blocks, in, out, out_stride);
    case 2: return amx_tiles<F, 2, T>(tile, tile_bytes, blocks, in, out, out_stride);
    case 4: return amx_tiles<F, 4, T>(tile, tile_bytes, blocks, in, out, out_stride);
    case 8: return amx_tiles<F, 8, T>(tile, tile_bytes, blocks, in, out, out_stride);
    default: return amx_tiles<F, 16, T>(tile, tile_bytes, blocks, in, out, out_stride);
  }
}

template <Format F>
inline void amx_tile_pair(const uint8_t* tile, int64_t tile_bytes, int64_t blocks, bool pair,
                          const AmxInputs& in, float* out, int64_t out_stride) {
  if (pair) return amx_tiles_of<F, 2>(tile, tile_bytes, blocks, in, out, out_stride);
  amx_tiles_of<F, 1>(tile, tile_bytes, blocks, in, out, out_stride);
}

// out: [M, n] for float32 inputs x [M, blocks · 32], rounded to int16 codes, and n weight rows
// held tiled (`tile_rows`), the tiles over torch's threads.
inline void amx_gemm(Format base, const uint8_t* tiled, int64_t n, int64_t blocks,
                     const float* x, int64_t m_rows, float* out) {
  thread_local std::vector<AmxInputBuffers> buffers;
  const int64_t k = blocks * kBlock;
  const size_t group_count = static_cast<size_t>((m_rows + kTileInputs - 1) / kTileInputs);
  if (buffers.size() < group_count) buffers.resize(group_count);
  std::vector<AmxInputs> groups(group_count);
  for (size_t g = 0; g < group_count; ++g) {
    const int64_t m0 = static_cast<int64_t>(g) * kTileInputs;
    groups[g] = buffers[g].fill(x + m0 * k, static_cast<int>(std::min<int64_t>(kTileInputs, m_rows - m0)), k);
  }
  const int64_t tile_bytes = blocks * tile_block_bytes(base);
  const int64_t tiles = n / kTileOutputs;
  at::parallel_for(0, (tiles + 1) / 2, 2, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {  // tiles 2p and 2p + 1 together
      const int64_t t = 2 * p;
      const uint8_t* tile = tiled + t * tile_bytes;
      const bool pair = t + 1 < tiles;
      for (size_t g = 0; g < groups.size(); ++g) {
        configure_tiles(groups[g].rows);
        float* target = out + g * kTileInputs * n + t * kTileOutputs;
        if (base == Format::Q8_0) {
          amx_tile_pair<Format::Q8_0>(tile, tile_bytes, blocks, pair, groups[g], target, n);
        } else if (base == Format::Q4_0) {
          amx_tile_pair<Format::Q4_0>(tile, tile_bytes, blocks, pair, groups[g], target, n);
        } else if (base == Format::Q4_1) {
          amx_tile_pair<Format::Q4_1>(tile, tile_bytes, blocks, pair, groups[g], target, n);
        } else {
          amx_tile_pair<Format::Q4_K32>(tile, tile_bytes, blocks, pair, groups[g], target, n);
        }
      }
    }
  });
}
#endif

}  // namespace larql
