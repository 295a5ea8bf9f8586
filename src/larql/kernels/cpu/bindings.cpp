// The extension's Python module: the block product and the decode step's layer pieces.
#include <torch/extension.h>

#include <string>

namespace larql {
torch::Tensor block_gemv(torch::Tensor x, torch::Tensor rows, int64_t format,
                         int64_t activation_bits);
torch::Tensor block_gemm(torch::Tensor x, torch::Tensor rows, int64_t format,
                         int64_t activation_bits);
std::string simd();
torch::Tensor tile_rows(torch::Tensor rows, int64_t format);
bool amx();
torch::Tensor decode_qkv(torch::Tensor h, torch::Tensor norm_weight, double eps,
                         torch::Tensor rows, int64_t format, c10::optional<torch::Tensor> bias,
                         torch::Tensor cos, torch::Tensor sin, int64_t rope_heads,
                         int64_t head_dim, int64_t activation_bits);
torch::Tensor residual_gemv(torch::Tensor h, torch::Tensor attn, torch::Tensor rows,
                            int64_t format, c10::optional<torch::Tensor> bias,
                            int64_t activation_bits);
torch::Tensor residual_ffn(torch::Tensor h, torch::Tensor norm_weight, double eps,
                           torch::Tensor gate_up, int64_t gate_up_format, torch::Tensor down,
                           int64_t down_format, int64_t activation_bits);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                               double scale);
torch::Tensor decode_layer(torch::Tensor h, torch::Tensor norms, double eps, torch::Tensor qkv,
                           torch::Tensor wo, torch::Tensor gate_up, torch::Tensor down,
                           std::vector<int64_t> formats, c10::optional<torch::Tensor> qkv_bias,
                           c10::optional<torch::Tensor> o_bias, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor k_store, torch::Tensor v_store,
                           int64_t first, int64_t slot, int64_t heads, double scale,
                           int64_t activation_bits);
torch::Tensor decode_layer_batch(torch::Tensor h, torch::Tensor norms, double eps,
                                 torch::Tensor qkv, torch::Tensor wo, torch::Tensor gate_up,
                                 torch::Tensor down, std::vector<int64_t> formats,
                                 c10::optional<torch::Tensor> qkv_bias,
                                 c10::optional<torch::Tensor> o_bias, torch::Tensor cos,
                                 torch::Tensor sin, std::vector<torch::Tensor> k_stores,
                                 std::vector<torch::Tensor> v_stores, std::vector<int64_t> firsts,
                                 std::vector<int64_t> slots, int64_t heads, double scale,
                                 int64_t activation_bits);
}  // namespace larql

// The compute calls release the GIL: they touch no Python object, and a server's event loop
// (another thread of the same process) must not wait for a whole decode layer to send a token.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("block_gemv", &larql::block_gemv, "one-token product with GGUF block rows", no_gil);
  m.def("block_gemm", &larql::block_gemm, "M-row product with GGUF block rows", no_gil);
  m.def("simd", &larql::simd, "the instruction set this build uses");
  m.def("tile_rows", &larql::tile_rows, "4-bit block rows tiled for the AMX products");
  m.def("amx", &larql::amx, "whether tiled blocks' products run here");
  m.def("decode_qkv", &larql::decode_qkv, "rms_norm → fused QKV product → RoPE, one row", no_gil);
  m.def("residual_gemv", &larql::residual_gemv, "h + W · x, one row", no_gil);
  m.def("decode_attention", &larql::decode_attention, "one query's attention over K/V rows",
        no_gil);
  m.def("decode_layer", &larql::decode_layer,
        "one whole decode layer: QKV + RoPE, K/V into the cache, attention, W_o, MLP", no_gil);
  m.def("decode_layer_batch", &larql::decode_layer_batch,
        "decode_layer for M rows of M sessions, each weight read once", no_gil);
  m.def("residual_ffn", &larql::residual_ffn, "h + the gated SiLU MLP of rms_norm(h), one row",
        no_gil);
}
