// The decode step's layer pieces for float32 rows and GGUF block matrices (decode_layer.cpp).
#pragma once

// the tensor API alone: torch/extension.h (pybind11, the C++ frontend) is bindings.cpp's,
// and it doubles a file's compile time
#include <torch/types.h>

#include <vector>

namespace larql {

// Per-layer arguments of decode_layers_batch: entry l is layer l's.
using Tensors = std::vector<torch::Tensor>;
using OptionalTensors = std::vector<c10::optional<torch::Tensor>>;
using PerLayerTensors = std::vector<Tensors>;  // layer l's: a tensor per row
using PerLayerInts = std::vector<std::vector<int64_t>>;

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
torch::Tensor decode_layers_batch(torch::Tensor h, Tensors norms, double eps, Tensors qkv,
                                  Tensors wo, Tensors gate_up, Tensors down, PerLayerInts formats,
                                  OptionalTensors qkv_bias, OptionalTensors o_bias, Tensors cos,
                                  Tensors sin, PerLayerTensors k_stores, PerLayerTensors v_stores,
                                  PerLayerInts firsts, PerLayerInts slots, int64_t heads,
                                  double scale, int64_t activation_bits);

}  // namespace larql
