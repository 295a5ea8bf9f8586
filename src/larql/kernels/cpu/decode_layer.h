// The decode step's layer pieces for float32 rows and GGUF block matrices (decode_layer.cpp).
#pragma once

// the tensor API alone: torch/extension.h (pybind11, the C++ frontend) is bindings.cpp's,
// and it doubles a file's compile time
#include <torch/types.h>

#include <functional>
#include <vector>

#include "block_dot.h"

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
                                  double scale, int64_t activation_bits,
                                  c10::optional<torch::Tensor> layer_inputs);
void rows_kv(torch::Tensor rows, Tensors norms, double eps, Tensors qkv,
             std::vector<int64_t> formats, OptionalTensors qkv_bias, Tensors cos, Tensors sin,
             std::vector<int64_t> counts, Tensors k_stores, Tensors v_stores,
             std::vector<int64_t> slots, int64_t heads, int64_t activation_bits);
torch::Tensor decode_layers_coded(torch::Tensor h, Tensors norms, double eps, Tensors qkv,
                                  Tensors wo, Tensors gate_up, Tensors down, PerLayerInts formats,
                                  OptionalTensors qkv_bias, OptionalTensors o_bias, Tensors cos,
                                  Tensors sin, PerLayerTensors codes, PerLayerTensors recent,
                                  PerLayerTensors recent_scales, PerLayerTensors sinks,
                                  PerLayerTensors means, std::vector<int64_t> places,
                                  int64_t heads, double scale, int64_t activation_bits,
                                  int64_t bits, int64_t group, int64_t width,
                                  torch::Tensor rotation, torch::Tensor centroids,
                                  torch::Tensor boundaries, bool norm_correction, bool fp8);

// ---- for the decode layers of other K/V stores (coded_layers.cpp)

// A block matrix as the products take it.
struct BlockMatrix {
  const uint8_t* data;
  int64_t rows;
  int64_t row_bytes;
  Format format;
};

// A plain layer's four block matrices, their shapes checked against the layer's widths.
struct LayerMatrices {
  BlockMatrix qkv, o, gate_up, down;
};

LayerMatrices checked_layer(const torch::Tensor& qkv, const torch::Tensor& wo,
                            const torch::Tensor& gate_up, const torch::Tensor& down,
                            const std::vector<int64_t>& formats, int64_t width, int64_t q_dim,
                            int64_t kv_dim);

// A layer's attention for its M rows: projected [M, q_dim + 2 · kv_dim] (each row's q and k
// rotated, then v) → attn [M, q_dim], each row's K/V stored in its session's store.
using AttendRows = std::function<void(const float* projected, float* attn)>;

// h [M, H] → h after the layer: rms_norm → QKV + RoPE → `attend` → + W_o · attn → + the gated
// MLP of rms_norm (norms: [attn_norm; ffn_norm] float32 [2, H]).
torch::Tensor layer_around(const torch::Tensor& h, const torch::Tensor& norms, double eps,
                           const LayerMatrices& w, const c10::optional<torch::Tensor>& qkv_bias,
                           const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& cos,
                           const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t activation_bits, const AttendRows& attend);

// Rows 0..M split into `parts` contiguous runs of about equal attention work (the keys a row's
// query reads, plus a fixed share for the row itself) → the runs' bounds [parts + 1]: a batch's
// sessions differ in length, and a new prompt's short rows follow the decode rows, so equal
// row counts would leave one thread most of the work.
std::vector<int64_t> balanced_runs(const std::vector<int64_t>& keys, int64_t parts);

// attend_row(m) for the M rows of a step, rows reading keys[m] keys: whole sessions per
// thread in balanced runs where there are at least `threads` rows, else one after another
// (each then spreading its own keys over the threads). A row's result is the same either way
// where attend_row chunks its keys by `threads`, not by the thread it runs on.
void attend_sessions(int64_t m_rows, const std::vector<int64_t>& keys, int64_t threads,
                     const std::function<void(int64_t)>& attend_row);

}  // namespace larql
