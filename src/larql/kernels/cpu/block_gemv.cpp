// The one-token product with GGUF block rows, as a torch operator (the arithmetic is in
// block_dot.h).
// the tensor API alone: torch/extension.h (pybind11, the C++ frontend) is bindings.cpp's,
// and it doubles a file's compile time
#include <torch/types.h>

#include <cstdlib>
#include <string>

#include "block_dot.h"

namespace larql {

Format checked_format(int64_t format) {
  TORCH_CHECK((format >= 0 && format <= 3) || (format >= kTiled && format <= kTiled + 3),
              "format must be 0 (Q8_0), 1 (Q4_0), 2 (Q4_1) or 3 (Q4_K in blocks of 32), or 16 + "
              "one of them tiled (AVX-512 VNNI / AMX products)");
  return static_cast<Format>(format);
}

Activation checked_activation(int64_t bits) {
  TORCH_CHECK(bits == 0 || bits == 8 || bits == 16,
              "activation_bits must be 0 (float32 input), 8 (int8 codes) or 16 (int16 codes)");
  return static_cast<Activation>(bits);
}

void check_rows(const torch::Tensor& rows, Format f, int64_t width) {
  TORCH_CHECK(rows.dtype() == torch::kUInt8 && rows.dim() == 2 && rows.is_contiguous(),
              "rows must be contiguous uint8 [N, row_bytes]");
  TORCH_CHECK(width % kBlock == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(rows.size(1) == width / kBlock * block_bytes(f), "row bytes do not match the width");
}

// x: float32 [K] contiguous; rows: uint8 [N, K/32 · block bytes]; format 0 Q8_0, 1 Q4_0,
// 2 Q4_1, 3 Q4_K32; activation_bits: 0 keeps x float32, 8 / 16 round it to int8 / int16 codes per
// block of 32 first (block_dot.h) → float32 [N].
torch::Tensor block_gemv(torch::Tensor x, torch::Tensor rows, int64_t format,
                         int64_t activation_bits) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 1 && x.is_contiguous(),
              "x must be a contiguous float32 vector");
  const Format f = checked_format(format);
  check_rows(rows, f, x.size(0));
  torch::Tensor out = torch::empty({rows.size(0)}, x.options());
  gemv_with(checked_activation(activation_bits), f, rows.data_ptr<uint8_t>(), rows.size(1),
            rows.size(0),             x.data_ptr<float>(), x.size(0),
       out.data_ptr<float>());
  return out;
}

// x: float32 [M, K] contiguous → float32 [M, N]: `block_gemv` for M rows at once, each weight
// row read once for all of them (row m's result is block_gemv's for x[m]).
torch::Tensor block_gemm(torch::Tensor x, torch::Tensor rows, int64_t format,
                         int64_t activation_bits) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous float32 [M, K]");
  const Format f = checked_format(format);
  check_rows(rows, f, x.size(1));
  torch::Tensor out = torch::empty({x.size(0), rows.size(0)}, x.options());
  gemm_with(checked_activation(activation_bits), f, rows.data_ptr<uint8_t>(), rows.size(1),
            rows.size(0), x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<float>());
  return out;
}

// rows: uint8 [N, row_bytes] of blocks (N a multiple of 16) → the same bytes tiled for
// the tiled products (tiled_blocks.h), to be used with format + 16.
torch::Tensor tile_rows(torch::Tensor rows, int64_t format) {
  const Format f = checked_format(format);
  TORCH_CHECK(!is_tiled(f), "these blocks are tiled already");
  TORCH_CHECK(rows.dtype() == torch::kUInt8 && rows.dim() == 2 && rows.is_contiguous(),
              "rows must be contiguous uint8 [N, row_bytes]");
  TORCH_CHECK(rows.size(0) % 16 == 0, "tiles hold 16 rows: N must be a multiple of 16");
  torch::Tensor out = torch::empty_like(rows);
#if LARQL_TILED
  larql::tile_rows(f, rows.data_ptr<uint8_t>(), rows.size(1), rows.size(0), out.data_ptr<uint8_t>());
#else
  TORCH_CHECK(false, "this build has no tiled products (they need AVX-512 VNNI)");
#endif
  return out;
}

// Whether matrices are to be tiled for the tiled products here: a build with AVX-512 VNNI,
// unless LARQL_NO_TILES=1 keeps the untiled products (for A/B measurements).
bool tiled() {
  const char* off = std::getenv("LARQL_NO_TILES");
  return LARQL_TILED && !(off != nullptr && off[0] == '1');
}

// Whether they run on AMX tiles: an AMX build in a process allowed the tiles (the int16
// products of more than 8 input rows; fewer run with VNNI, which is faster there).
bool amx() {
#if LARQL_TILED
  return tiles_on_amx();
#else
  return false;
#endif
}

// "avx2", "avx2+vnni" or "scalar": the instructions of the untiled products; then, in a build
// that has them, what the tiled ones run on. (The untiled products stay 8 wide: 16-wide AVX-512
// measured slower there on the project's Zen 4 cores, which split it in two: 12.2 against 9.4 ms
// for SmolLM2's layers. The tiled ones are 16 wide: 16 weight rows in a vector's lanes.)
std::string simd() {
#if LARQL_AVX2 && LARQL_VNNI
  std::string untiled = "avx2+vnni";
#else
  std::string untiled = LARQL_AVX2 ? "avx2" : "scalar";
#endif
  if (!LARQL_TILED) return untiled;
  return untiled + (LARQL_AMX ? ", tiles on amx or avx512-vnni" : ", tiles on avx512-vnni");
}

}  // namespace larql
