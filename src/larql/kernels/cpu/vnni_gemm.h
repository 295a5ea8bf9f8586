// The tiled int16-input block products (`tiled_blocks.h`) with AVX-512 VNNI, where the AMX tiles
// do not run: one vector lane per weight row (a tiled block's word r of its 16 rows is one
// 64-byte vector), each input's 4 bytes of a word broadcast to every lane, VPDPBUSD (unsigned ×
// signed bytes, 4 products summed into each int32 lane) adding them up:
//   Q4:   C_hi += w · hi   (w: a word's nibbles, unsigned; hi signed)
//         C_lo += lo · w   (lo unsigned; the nibbles, 0–15, read as signed bytes)
//   Q8_0: C_hi += (w + 128) · hi, then − 128 · Σ hi   (w signed: made unsigned, exactly)
//         C_lo += lo · w
// The same integer sums as the AMX unit's, scaled by the same float operations
// (`scaled_sums`): a tiled matrix gives the same bits on either unit. int8 inputs (`Narrow`:
// their codes in the high bytes) take the C_hi products alone, 8 VPDPBUSD per block and input;
// they run here on every CPU with tiles, AMX ones too.
//
// Per block and input the 16 rows cost 16 VPDPBUSD (8 for each of hi and lo over the block's
// 32 elements); the weights' nibbles are spread once per block for every input of the call, and
// up to 4 inputs' chains of products are interleaved, so the products' latency is hidden
// without relying on a deep out-of-order window. On the project's Zen 4 cores this is ~1.22
// cycles per block, input and row at 8 inputs (1.28 with one input's chains at a time), against
// ~3.7 for the AVX2 int16 products of the same sums (docs/PERFORMANCE.md).
#pragma once  // included by block_dot.h, after tiled_blocks.h

namespace larql {

#if LARQL_TILED
constexpr int kVnniInputs = 8;  // inputs a pass over a tile keeps in registers

// Inputs m0 .. m0 + M − 1 of `in` over one tile of 16 weight rows, every block (`tile`: its
// first block) → out[m · out_stride + o] for those inputs (out: input m0's first output).
template <Format F, int M, bool Narrow>
inline void vnni_tile(const uint8_t* tile, int64_t blocks, const TiledInputs& in, int m0,
                      float* out, int64_t out_stride) {
  constexpr int words = code_words(F);
  constexpr int64_t per = tile_block_bytes(F);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i sign_bit = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * per;
    prefetch_ahead<F>(block);
    // w[j]: the rows' bytes for elements 4j..4j+3 (lane o: row o), 8 words of a block
    __m512i w[8], w_unsigned[8];
    if constexpr (F == Format::Q8_0) {
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        w[r] = _mm512_loadu_si512(block + 64 * r);
        w_unsigned[r] = _mm512_xor_si512(w[r], sign_bit);  // w + 128
      }
    } else {
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {  // word r: elements 4r.. (low nibbles), 16 + 4r.. (high)
        const __m512i word = _mm512_loadu_si512(block + 64 * r);
        w[r] = _mm512_and_si512(word, nibble);
        w[r + 4] = _mm512_and_si512(_mm512_srli_epi16(word, 4), nibble);
      }
    }
    const TileScales s = tile_scales<F>(block + 64 * words);
    const int64_t first = b * in.rows + m0;  // this block's first input
    // the inputs K at a time, their chains of byte products interleaved (2K independent
    // accumulators: the dot products' latency hidden without a deep out-of-order window)
    constexpr int K = M % 4 == 0 ? 4 : (M % 2 == 0 ? 2 : 1);
#pragma GCC unroll 8
    for (int m0 = 0; m0 < M; m0 += K) {
      __m512i c_high[K], c_low[K];
#pragma GCC unroll 4
      for (int i = 0; i < K; ++i) c_high[i] = c_low[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {  // elements 4j..4j+3
#pragma GCC unroll 4
        for (int i = 0; i < K; ++i) {
          const int64_t row = (first + m0 + i) * kBlock;
          const int32_t* high = reinterpret_cast<const int32_t*>(in.high + row);
          const __m512i hi = _mm512_set1_epi32(high[j]);
          if constexpr (F == Format::Q8_0) {
            c_high[i] = _mm512_dpbusd_epi32(c_high[i], w_unsigned[j], hi);
          } else {
            c_high[i] = _mm512_dpbusd_epi32(c_high[i], w[j], hi);
          }
          if constexpr (!Narrow) {
            const int32_t* low = reinterpret_cast<const int32_t*>(in.low + row);
            c_low[i] = _mm512_dpbusd_epi32(c_low[i], _mm512_set1_epi32(low[j]), w[j]);
          }
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < K; ++i) {
        const int m = m0 + i;
        if constexpr (F == Format::Q8_0) {
          const __m512i correction = _mm512_set1_epi32(128 * in.high_sums[first + m]);
          c_high[i] = _mm512_sub_epi32(c_high[i], correction);
        }
        acc[m] = scaled_sums<F, Narrow>(acc[m], c_high[i], c_low[i], s, in, first + m);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * out_stride, acc[m]);
}

template <Format F, bool Narrow>
inline void vnni_tile_counted(const uint8_t* tile, int64_t blocks, const TiledInputs& in, int m0,
                              int count, float* out, int64_t out_stride) {
  switch (count) {
    case 1: return vnni_tile<F, 1, Narrow>(tile, blocks, in, m0, out, out_stride);
    case 2: return vnni_tile<F, 2, Narrow>(tile, blocks, in, m0, out, out_stride);
    case 3: return vnni_tile<F, 3, Narrow>(tile, blocks, in, m0, out, out_stride);
    case 4: return vnni_tile<F, 4, Narrow>(tile, blocks, in, m0, out, out_stride);
    case 5: return vnni_tile<F, 5, Narrow>(tile, blocks, in, m0, out, out_stride);
    case 6: return vnni_tile<F, 6, Narrow>(tile, blocks, in, m0, out, out_stride);
    case 7: return vnni_tile<F, 7, Narrow>(tile, blocks, in, m0, out, out_stride);
    default: return vnni_tile<F, 8, Narrow>(tile, blocks, in, m0, out, out_stride);
  }
}

template <Format F>
inline void vnni_tile_inputs(const uint8_t* tile, int64_t blocks, const TiledInputs& in, int m0,
                             int count, float* out, int64_t out_stride) {
  if (in.narrow) return vnni_tile_counted<F, true>(tile, blocks, in, m0, count, out, out_stride);
  vnni_tile_counted<F, false>(tile, blocks, in, m0, count, out, out_stride);
}

// One group of inputs over one tile of a tiled matrix of format `base`, kVnniInputs at a time
// → out[m · out_stride + o] (out: the tile's first output).
inline void vnni_tile_group(Format base, const uint8_t* tile, int64_t blocks,
                            const TiledInputs& in, float* out, int64_t out_stride) {
  for (int m0 = 0; m0 < in.count; m0 += kVnniInputs) {
    const int count = std::min(kVnniInputs, in.count - m0);
    float* target = out + m0 * out_stride;
    switch (base) {
      case Format::Q8_0:
        vnni_tile_inputs<Format::Q8_0>(tile, blocks, in, m0, count, target, out_stride);
        break;
      case Format::Q4_0:
        vnni_tile_inputs<Format::Q4_0>(tile, blocks, in, m0, count, target, out_stride);
        break;
      case Format::Q4_1:
        vnni_tile_inputs<Format::Q4_1>(tile, blocks, in, m0, count, target, out_stride);
        break;
      default:
        vnni_tile_inputs<Format::Q4_K32>(tile, blocks, in, m0, count, target, out_stride);
    }
  }
}
#endif

}  // namespace larql
