// turbo-quant's decode attention over its coded rows in place and its encoding of a token's
// K/V, for callers inside the extension (coded_attention.cpp, coded_encode.cpp; their Python
// entry points and the decode layers of coded_layers.cpp).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace larql {

// Exact rows of a layer as the attention reads them: [E, 2, Hkv, D] (a token's K heads, then
// its V heads), in float32, float16, or int8 with a float16 scale per head vector [E, 2, Hkv].
struct ExactRows {
  enum Kind { Float32, Float16, Int8 };
  const void* data;
  int64_t rows;
  Kind kind;
  const c10::Half* scales = nullptr;  // Int8's

  // Head vector `vector` (< 2 · Hkv: K heads, then V heads) of row e → out [dim] float32.
  void load(int64_t e, int64_t vector, int64_t vectors, int64_t dim, float* out) const;
};

// turbo-quant's codebook: 2^bits centroids and the 2^bits − 1 cell boundaries between them.
struct Codebook {
  const float* centroids;
  const float* boundaries;
  int bits;
  bool norm_correction;
};

// Bytes of one coded vector: a float32 norm and `width` indices of `bits` bits.
inline int64_t coded_vector_bytes(int64_t width, int bits) { return 4 + width * bits / 8; }

// One decode query q [Hq, D] over n coded rows `codes` (each 2 · Hkv vectors of
// coded_vector_bytes(width, bits)) and the exact rows → out [Hq, D] (the formulas are in
// coded_attention.cpp). rotation: [width, width] float32; mean: [2, Hkv, D] or null. The
// coded rows are split into chunks by `threads`, whichever thread runs them.
void attend_turbo(const float* q, int64_t heads, int64_t dim, const float* rotation,
                  int64_t width, const uint8_t* codes, int64_t n, int64_t kv_heads,
                  const Codebook& book, const float* mean, const std::vector<ExactRows>& exact,
                  float scale, int64_t threads, float* out);

// kv-quant's codes: per vector, G = width / group groups, each a float16 scale and a float16
// zero point, then width indices of `bits` (2, 4 or 8) bits; a coordinate decodes to index ·
// scale + zero point. With `fp8`, each group has a float16 scale alone, and the coordinates
// are float8 e4m3 bytes: a coordinate decodes to its e4m3 value · scale. `turned`: the
// Walsh–Hadamard rotation's width (0: none).
struct GroupedCodec {
  int bits;
  int64_t group;
  int64_t width;
  int64_t turned;
  bool fp8 = false;
};

inline int64_t grouped_vector_bytes(const GroupedCodec& c) {
  const int64_t groups = c.width / c.group;
  return c.fp8 ? 2 * groups + c.width : 4 * groups + c.width * c.bits / 8;
}

// attend_turbo for kv-quant's codes (rotation [turned, turned] or null).
void attend_grouped_rows(const float* q, int64_t heads, int64_t dim, const float* rotation,
                         const GroupedCodec& codec, const uint8_t* codes, int64_t n,
                         int64_t kv_heads, const std::vector<ExactRows>& exact, float scale,
                         int64_t threads, float* out);

// One head vector x [dim] float32 → its kv-quant code (coded_encode.cpp has the formulas).
void encode_grouped_vector(const float* x, int64_t dim, const float* rotation,
                           const GroupedCodec& codec, uint8_t* out);

// One token's K/V kv [2, Hkv, D] float32 minus mean ([2, Hkv, D] or null) → its code row at
// out (2 · Hkv vectors of coded_vector_bytes(width, bits)).
void encode_token(const float* kv, int64_t kv_heads, int64_t dim, const float* mean,
                  const float* rotation, int64_t width, const Codebook& book, uint8_t* out);

}  // namespace larql
