// A decode step's layer pieces for one float32 row, each one call instead of a dozen torch
// operators (on a 2-core CPU the operators' dispatch costs as much as the block products):
//
//   decode_qkv     h → rms_norm → W_qkv (blocks) (+ bias) → RoPE on the q and k heads
//   residual_gemv  h + W_o (blocks) · attn (+ bias)
//   residual_ffn   h + W_down · (silu(W_gate · x) ⊙ W_up · x),  x = rms_norm(h)
//
// With activation_bits 8 or 16 every product rounds its input to int8 / int16 codes per block
// of 32 first (block_dot.h);
// otherwise the arithmetic is the torch path's (layer.py) in float32, up to the order of the sums:
// rms_norm(x) = x · rsqrt(mean(x²) + eps) · weight; RoPE rotates the split-half pairs of the
// first `rotary` dims of each head with cos = [cos θ, cos θ] and signed sin = [−sin θ, sin θ]:
// x_i' = x_i cos_i + x_{i+half} sin_i, x_{i+half}' = x_{i+half} cos_{i+half} + x_i sin_{i+half}.
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "block_dot.h"

namespace larql {

Format checked_format(int64_t format);
Activation checked_activation(int64_t bits);
void check_rows(const torch::Tensor& rows, Format f, int64_t width);

namespace {

void check_row(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(), name,
              " must be contiguous float32");
}

// x: [n] → out: [n] = x · rsqrt(mean(x²) + eps) · weight.
void rms_norm(const float* x, const float* weight, int64_t n, double eps, float* out) {
  double squares = 0.0;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(squares / n + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

// out = h + W · x (+ bias), W in blocks.
torch::Tensor add_product(const torch::Tensor& h, const torch::Tensor& rows, Format f,
                          const float* x, int64_t width, const c10::optional<torch::Tensor>& bias,
                          int64_t activation_bits) {
  const int64_t n = rows.size(0);
  TORCH_CHECK(h.numel() == n, "the residual and the matrix's rows differ in width");
  std::vector<float> product(n);
  gemv_with(checked_activation(activation_bits), f, rows.data_ptr<uint8_t>(), rows.size(1), n, x,
            width, product.data());
  torch::Tensor out = torch::empty_like(h);
  const float* hs = h.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  for (int64_t i = 0; i < n; ++i) dst[i] = hs[i] + (b ? product[i] + b[i] : product[i]);
  return out;
}

}  // namespace

// h: float32 [1, H]; rows: the fused [q; k; v] matrix in blocks, [q_dim + 2·kv_dim] rows;
// cos, sin: float32 [rotary] at the row's position; the first `rope_heads` heads of width
// `head_dim` (the q heads, then the k heads) are rotated → float32 [q_dim + 2·kv_dim].
torch::Tensor decode_qkv(torch::Tensor h, torch::Tensor norm_weight, double eps,
                         torch::Tensor rows, int64_t format, c10::optional<torch::Tensor> bias,
                         torch::Tensor cos, torch::Tensor sin, int64_t rope_heads,
                         int64_t head_dim, int64_t activation_bits) {
  for (const auto* t : {&h, &norm_weight, &cos, &sin}) check_row(*t, "h, norm weight, cos, sin");
  const int64_t width = h.numel();
  const Format f = checked_format(format);
  check_rows(rows, f, width);
  const int64_t rotary = cos.numel();
  TORCH_CHECK(norm_weight.numel() == width, "the norm weight's width is not the row's");
  TORCH_CHECK(sin.numel() == rotary && rotary % 2 == 0 && rotary <= head_dim,
              "cos and sin must be [rotary], rotary even and at most head_dim");
  TORCH_CHECK(rope_heads * head_dim <= rows.size(0), "more rotated heads than rows");
  std::vector<float> x(width);
  rms_norm(h.data_ptr<float>(), norm_weight.data_ptr<float>(), width, eps, x.data());
  torch::Tensor out = torch::empty({rows.size(0)}, h.options());
  float* qkv = out.data_ptr<float>();
  gemv_with(checked_activation(activation_bits), f, rows.data_ptr<uint8_t>(), rows.size(1),
            rows.size(0), x.data(), width, qkv);
  if (bias.has_value()) {
    check_row(*bias, "bias");
    const float* b = bias->data_ptr<float>();
    for (int64_t i = 0; i < rows.size(0); ++i) qkv[i] += b[i];
  }
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t half = rotary / 2;
  for (int64_t head = 0; head < rope_heads; ++head) {
    float* v = qkv + head * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float first = v[i], second = v[i + half];
      v[i] = first * c[i] + second * s[i];
      v[i + half] = second * c[i + half] + first * s[i + half];
    }
  }
  return out;
}

// h: float32 [1, H]; attn: float32 [1, in]; rows: W_o in blocks [H rows] → h + W_o · attn.
torch::Tensor residual_gemv(torch::Tensor h, torch::Tensor attn, torch::Tensor rows,
                            int64_t format, c10::optional<torch::Tensor> bias,
                            int64_t activation_bits) {
  check_row(h, "h");
  check_row(attn, "attn");
  if (bias.has_value()) check_row(*bias, "bias");
  const Format f = checked_format(format);
  check_rows(rows, f, attn.numel());
  return add_product(h, rows, f, attn.data_ptr<float>(), attn.numel(), bias, activation_bits);
}

// h: float32 [1, H] → h + W_down · (silu(gate) ⊙ up), [gate; up] = W_gate_up · rms_norm(h);
// gate_up: [2F rows], down: [H rows] of width F.
torch::Tensor residual_ffn(torch::Tensor h, torch::Tensor norm_weight, double eps,
                           torch::Tensor gate_up, int64_t gate_up_format, torch::Tensor down,
                           int64_t down_format, int64_t activation_bits) {
  check_row(h, "h");
  check_row(norm_weight, "norm weight");
  const int64_t width = h.numel();
  TORCH_CHECK(norm_weight.numel() == width, "the norm weight's width is not the row's");
  const Format gu = checked_format(gate_up_format), dn = checked_format(down_format);
  check_rows(gate_up, gu, width);
  const int64_t hidden = gate_up.size(0) / 2;
  check_rows(down, dn, hidden);
  std::vector<float> x(width), both(2 * hidden);
  rms_norm(h.data_ptr<float>(), norm_weight.data_ptr<float>(), width, eps, x.data());
  gemv_with(checked_activation(activation_bits), gu, gate_up.data_ptr<uint8_t>(), gate_up.size(1),
            2 * hidden, x.data(), width, both.data());
  for (int64_t i = 0; i < hidden; ++i) {
    const float gate = both[i];
    both[i] = gate / (1.0f + std::exp(-gate)) * both[hidden + i];
  }
  return add_product(h, down, dn, both.data(), hidden, c10::nullopt, activation_bits);
}

}  // namespace larql
