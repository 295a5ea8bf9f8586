// The tiled int16-input block products (`tiled_blocks.h`) on Intel's AMX tiles, where the CPU
// has AMX-INT8 and the kernel lets this process use the tile registers. Each product is a tile
// product of bytes:
//   C_hi[m, o] = Σ_k hi[m, k] · w[o, k]   (TDPBSUD: signed × unsigned bytes; Q8_0: TDPBSSD)
//   C_lo[m, o] = Σ_k lo[m, k] · w[o, k]   (TDPBUUD; Q8_0: TDPBUSD)
// the weights' tile (the second operand) holding 4 consecutive k of one row per 32-bit word, as
// the tiled layout keeps them.
#pragma once  // included by block_dot.h, after tiled_blocks.h

#include <sys/syscall.h>
#include <unistd.h>

#if LARQL_TILED && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define LARQL_AMX 1
#else
#define LARQL_AMX 0
#endif

namespace larql {

#if LARQL_AMX
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

// The input rows the calling thread's tile configuration was loaded for (0: none loaded).
inline int& configured_inputs() {
  thread_local int configured = 0;
  return configured;
}

// Tiles: 0, 1 C_hi, C_lo [M × 16 int32] of a first weight tile and 5, 6 of a second; 2, 3 hi,
// lo [M × 32 bytes]; 4, 7 the two weight tiles [8 × 64].
inline void configure_tiles(int inputs) {
  int& configured = configured_inputs();
  if (configured == inputs) return;
  TileConfig config;
  for (int t : {0, 1, 5, 6}) config.rows[t] = inputs, config.bytes_per_row[t] = 64;
  for (int t : {2, 3}) config.rows[t] = inputs, config.bytes_per_row[t] = 32;
  for (int t : {4, 7}) config.rows[t] = 8, config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
  configured = inputs;
}

// The tile registers for one thread's share of a product (`active`: it runs on them): the
// configuration loaded afresh at its first tile group, and the tiles released at its end. Other
// code on the same thread — torch's oneDNN kernels, which run on AMX too — releases the tiles
// after its own products, and a tile instruction with no configuration loaded is an illegal
// instruction; released, this thread's tile state is back to its initial one.
class TileSession {
 public:
  explicit TileSession(bool active) : active_(active) {
    if (active_) configured_inputs() = 0;
  }
  ~TileSession() {
    if (!active_) return;
    _tile_release();
    configured_inputs() = 0;
  }
  TileSession(const TileSession&) = delete;
  TileSession& operator=(const TileSession&) = delete;

 private:
  bool active_;
};

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

// acc[m] += the block's integer sums (c_high, c_low: [M × 16], as the tiles stored them),
// scaled (`scaled_sums`).
template <Format F, int M>
inline void scale_block(const uint8_t* scales, const int32_t* c_high, const int32_t* c_low,
                        const TiledInputs& in, int64_t at, __m512* acc) {
  const TileScales s = tile_scales<F>(scales);
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    if (m >= in.count) break;  // (rows past the count are padding)
    acc[m] = scaled_sums<F>(acc[m], _mm512_load_si512(c_high + 16 * m),
                            _mm512_load_si512(c_low + 16 * m), s, in, at + m);
  }
}

// T (1 or 2) consecutive tiles of 16 weight rows × M inputs over every block (`tile`: the
// first tile's first block, `tile_bytes` apart) → out[m · out_stride + o]. Two tiles share
// the inputs' tiles and give the unit two independent chains of products: while one tile's
// sums are stored and scaled, the other's products run.
template <Format F, int M, int T>
inline void amx_tiles(const uint8_t* tile, int64_t tile_bytes, int64_t blocks,
                      const TiledInputs& in, float* out, int64_t out_stride) {
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
    prefetch_ahead<F>(first);
    if constexpr (T == 2) prefetch_ahead<F>(second);
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
                         const TiledInputs& in, float* out, int64_t out_stride) {
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
                          const TiledInputs& in, float* out, int64_t out_stride) {
  if (pair) return amx_tiles_of<F, 2>(tile, tile_bytes, blocks, in, out, out_stride);
  amx_tiles_of<F, 1>(tile, tile_bytes, blocks, in, out, out_stride);
}

// One group of inputs over tile t (and t + 1 where `pair`) of a tiled matrix of format
// `base` → out[m · out_stride + o] (out: the tile's first output).
inline void amx_tile_group(Format base, const uint8_t* tile, int64_t tile_bytes, int64_t blocks,
                           bool pair, const TiledInputs& in, float* out, int64_t out_stride) {
  configure_tiles(in.rows);
  switch (base) {
    case Format::Q8_0: return amx_tile_pair<Format::Q8_0>(tile, tile_bytes, blocks, pair, in, out, out_stride);
    case Format::Q4_0: return amx_tile_pair<Format::Q4_0>(tile, tile_bytes, blocks, pair, in, out, out_stride);
    case Format::Q4_1: return amx_tile_pair<Format::Q4_1>(tile, tile_bytes, blocks, pair, in, out, out_stride);
    default: return amx_tile_pair<Format::Q4_K32>(tile, tile_bytes, blocks, pair, in, out, out_stride);
  }
}
#endif

}  // namespace larql
