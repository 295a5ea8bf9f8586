// The extension's Python module: the block product and the decode step's layer pieces.
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "decode_layer.h"

namespace larql {
torch::Tensor block_gemv(torch::Tensor x, torch::Tensor rows, int64_t format,
                         int64_t activation_bits);
torch::Tensor block_gemm(torch::Tensor x, torch::Tensor rows, int64_t format,
                         int64_t activation_bits);
std::string simd();
torch::Tensor tile_rows(torch::Tensor rows, int64_t format);
bool tiled();
bool amx();
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                               double scale);
torch::Tensor coded_attention(torch::Tensor q, torch::Tensor rotation, torch::Tensor codes,
                              int64_t kv_heads, torch::Tensor centroids, torch::Tensor mean,
                              std::vector<torch::Tensor> exact, double scale);
torch::Tensor grouped_attention(torch::Tensor q, torch::Tensor rotation, torch::Tensor codes,
                                int64_t kv_heads, int64_t bits, bool fp8, int64_t group,
                                int64_t width, std::vector<torch::Tensor> exact, double scale);
torch::Tensor coded_encode(torch::Tensor rows, torch::Tensor mean, torch::Tensor rotation,
                           torch::Tensor boundaries, torch::Tensor centroids,
                           bool norm_correction);
torch::Tensor grouped_encode(torch::Tensor rows, torch::Tensor mean, torch::Tensor rotation,
                             int64_t bits, int64_t group, int64_t width, bool fp8);
}  // namespace larql

// The compute calls release the GIL: they touch no Python object, and a server's event loop
// (another thread of the same process) must not wait for a whole decode layer to send a token.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("block_gemv", &larql::block_gemv, "one-token product with GGUF block rows", no_gil);
  m.def("block_gemm", &larql::block_gemm, "M-row product with GGUF block rows", no_gil);
  m.def("simd", &larql::simd, "the instruction set this build uses");
  // (the cast picks the tensor call: tiled_blocks.h, which decode_layer.h brings, has another)
  m.def("tile_rows", static_cast<torch::Tensor (*)(torch::Tensor, int64_t)>(&larql::tile_rows),
        "block rows tiled for the AVX-512 VNNI / AMX products");
  m.def("tiled", &larql::tiled, "whether tiled blocks' products run here");
  m.def("amx", &larql::amx, "whether they run on AMX tiles (products of more than 8 rows)");
  m.def("decode_qkv", &larql::decode_qkv, "rms_norm → fused QKV product → RoPE, one row", no_gil);
  m.def("residual_gemv", &larql::residual_gemv, "h + W · x, one row", no_gil);
  m.def("decode_attention", &larql::decode_attention, "one query's attention over K/V rows",
        no_gil);
  m.def("coded_attention", &larql::coded_attention,
        "one query's attention over turbo-quant's 4-bit coded rows (in place) and exact rows",
        no_gil);
  m.def("grouped_attention", &larql::grouped_attention,
        "one query's attention over kv-quant's integer codes (in place) and exact rows", no_gil);
  m.def("coded_encode", &larql::coded_encode, "K/V rows → turbo-quant's 4-bit coded rows",
        no_gil);
  m.def("grouped_encode", &larql::grouped_encode, "K/V rows → kv-quant's integer or fp8 codes",
        no_gil);
  m.def("decode_layers_batch", &larql::decode_layers_batch,
        "whole decode layers for M rows of one or more sessions, each weight read once", no_gil);
  m.def("decode_layers_coded", &larql::decode_layers_coded,
        "turbo-quant's decode layers for M rows of one or more sessions, codes read in place",
        no_gil);
  m.def("rows_kv", &larql::rows_kv,
        "stored pre-layer residuals → their K/V, written into the layers' K/V storage", no_gil);
  m.def("residual_ffn", &larql::residual_ffn, "h + the gated SiLU MLP of rms_norm(h), one row",
        no_gil);
}
