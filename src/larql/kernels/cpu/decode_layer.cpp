// A decode step's layer for one float32 row, in a few calls instead of dozens of torch
// operators (on a 2-core CPU the operators' dispatch costs as much as the block products):
//
//   decode_qkv     h → rms_norm → W_qkv (blocks) (+ bias) → RoPE on the q and k heads
//   residual_gemv  h + W_o (blocks) · attn (+ bias)
//   residual_ffn   h + W_down · (silu(W_gate · x) ⊙ W_up · x),  x = rms_norm(h)
//   decode_layer   all of it: decode_qkv, the new K/V row written into the cache's storage,
//                  one query's attention over the live rows, residual_gemv, residual_ffn
//   decode_layer_batch  decode_layer for M rows of M sessions at once (a batched decode step):
//                  every product reads its weights once for all rows (gemm_with), each row
//                  writes its own session's cache and attends over it; a row's arithmetic is
//                  decode_layer's, so its result does not depend on the other rows
//
// With activation_bits 8 or 16 every product rounds its input to int8 / int16 codes per block
// of 32 first (block_dot.h); otherwise the arithmetic is the torch path's (layer.py) in
// float32, up to the order of the sums: rms_norm(x) = x · rsqrt(mean(x²) + eps) · weight; RoPE
// rotates the split-half pairs of the first `rotary` dims of each head with
// cos = [cos θ, cos θ] and signed sin = [−sin θ, sin θ]:
// x_i' = x_i cos_i + x_{i+half} sin_i, x_{i+half}' = x_{i+half} cos_{i+half} + x_i sin_{i+half}.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "block_dot.h"
#include "decode_attention.h"

namespace larql {

Format checked_format(int64_t format);
Activation checked_activation(int64_t bits);
void check_rows(const torch::Tensor& rows, Format f, int64_t width);

namespace {

void check_row(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(), name,
              " must be contiguous float32");
}

const float* optional_data(const c10::optional<torch::Tensor>& t, const char* name) {
  if (!t.has_value()) return nullptr;
  check_row(*t, name);
  return t->data_ptr<float>();
}

// x: [n] → out: [n] = x · rsqrt(mean(x²) + eps) · weight.
void rms_norm(const float* x, const float* weight, int64_t n, double eps, float* out) {
  double squares = 0.0;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(squares / n + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

// A block matrix as the products take it.
struct BlockMatrix {
  const uint8_t* data;
  int64_t rows;
  int64_t row_bytes;
  Format format;
};

BlockMatrix checked_matrix(const torch::Tensor& rows, int64_t format, int64_t width) {
  const Format f = checked_format(format);
  check_rows(rows, f, width);
  return BlockMatrix{rows.data_ptr<uint8_t>(), rows.size(0), rows.size(1), f};
}

void product(Activation a, const BlockMatrix& w, const float* x, int64_t width, float* out) {
  gemv_with(a, w.format, w.data, w.row_bytes, w.rows, x, width, out);
}

// RoPE on the first `n_heads` heads of width head_dim in x, cos / signed sin [rotary].
void rotate_heads(float* x, const float* cos, const float* sin, int64_t rotary, int64_t n_heads,
                  int64_t head_dim) {
  const int64_t half = rotary / 2;
  for (int64_t head = 0; head < n_heads; ++head) {
    float* v = x + head * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float first = v[i], second = v[i + half];
      v[i] = first * cos[i] + second * sin[i];
      v[i + half] = second * cos[i + half] + first * sin[i + half];
    }
  }
}

// A plain layer's four block matrices, their shapes checked against the layer's widths.
struct LayerMatrices {
  BlockMatrix qkv, o, gate_up, down;
};

LayerMatrices checked_layer(const torch::Tensor& qkv, const torch::Tensor& wo,
                            const torch::Tensor& gate_up, const torch::Tensor& down,
                            const std::vector<int64_t>& formats, int64_t width, int64_t q_dim,
                            int64_t kv_dim) {
  TORCH_CHECK(formats.size() == 4, "formats must be [qkv, o, gate_up, down]");
  const BlockMatrix w_qkv = checked_matrix(qkv, formats[0], width);
  TORCH_CHECK(w_qkv.rows == q_dim + 2 * kv_dim, "W_qkv's rows are not q_dim + 2 · kv_dim");
  const BlockMatrix w_o = checked_matrix(wo, formats[1], q_dim);
  TORCH_CHECK(w_o.rows == width, "W_o's rows are not the residual's width");
  const BlockMatrix w_gate_up = checked_matrix(gate_up, formats[2], width);
  const BlockMatrix w_down = checked_matrix(down, formats[3], w_gate_up.rows / 2);
  TORCH_CHECK(w_down.rows == width, "W_down's rows are not the residual's width");
  return LayerMatrices{w_qkv, w_o, w_gate_up, w_down};
}

// qkv: [rows of W_qkv] = RoPE(W_qkv · rms_norm(h) (+ bias)) on the first rope_heads heads.
void qkv_row(Activation a, const float* h, const float* norm, double eps, int64_t width,
             const BlockMatrix& w, const float* bias, const float* cos, const float* sin,
             int64_t rotary, int64_t rope_heads, int64_t head_dim, float* qkv) {
  std::vector<float> x(width);
  rms_norm(h, norm, width, eps, x.data());
  product(a, w, x.data(), width, qkv);
  if (bias != nullptr) {
    for (int64_t i = 0; i < w.rows; ++i) qkv[i] += bias[i];
  }
  rotate_heads(qkv, cos, sin, rotary, rope_heads, head_dim);
}

// out: [W rows] = h + W · x (+ bias).
void add_product_row(Activation a, const float* h, const BlockMatrix& w, const float* x,
                     int64_t width, const float* bias, float* out) {
  std::vector<float> p(w.rows);
  product(a, w, x, width, p.data());
  for (int64_t i = 0; i < w.rows; ++i) out[i] = h[i] + (bias ? p[i] + bias[i] : p[i]);
}

// out: [width] = h + W_down · (silu(gate) ⊙ up), [gate; up] = W_gate_up · rms_norm(h).
void ffn_row(Activation a, const float* h, const float* norm, double eps, int64_t width,
             const BlockMatrix& gate_up, const BlockMatrix& down, float* out) {
  const int64_t hidden = gate_up.rows / 2;
  std::vector<float> x(width), both(2 * hidden);
  rms_norm(h, norm, width, eps, x.data());
  product(a, gate_up, x.data(), width, both.data());
  for (int64_t i = 0; i < hidden; ++i) {
    const float gate = both[i];
    both[i] = gate / (1.0f + std::exp(-gate)) * both[hidden + i];
  }
  add_product_row(a, h, down, both.data(), hidden, nullptr, out);
}

void check_rope(const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim) {
  check_row(cos, "cos");
  check_row(sin, "sin");
  const int64_t rotary = cos.numel();
  TORCH_CHECK(sin.numel() == rotary && rotary % 2 == 0 && rotary <= head_dim,
              "cos and sin must be [rotary], rotary even and at most head_dim");
}

}  // namespace

// h: float32 [1, H]; rows: the fused [q; k; v] matrix in blocks, [q_dim + 2·kv_dim] rows;
// cos, sin: float32 [rotary] at the row's position; the first `rope_heads` heads of width
// `head_dim` (the q heads, then the k heads) are rotated → float32 [q_dim + 2·kv_dim].
torch::Tensor decode_qkv(torch::Tensor h, torch::Tensor norm_weight, double eps,
                         torch::Tensor rows, int64_t format, c10::optional<torch::Tensor> bias,
                         torch::Tensor cos, torch::Tensor sin, int64_t rope_heads,
                         int64_t head_dim, int64_t activation_bits) {
  check_row(h, "h");
  check_row(norm_weight, "norm weight");
  check_rope(cos, sin, head_dim);
  const int64_t width = h.numel();
  TORCH_CHECK(norm_weight.numel() == width, "the norm weight's width is not the row's");
  const BlockMatrix w = checked_matrix(rows, format, width);
  TORCH_CHECK(rope_heads * head_dim <= w.rows, "more rotated heads than rows");
  torch::Tensor out = torch::empty({w.rows}, h.options());
  qkv_row(checked_activation(activation_bits), h.data_ptr<float>(), norm_weight.data_ptr<float>(),
          eps, width, w, optional_data(bias, "bias"), cos.data_ptr<float>(),
          sin.data_ptr<float>(), cos.numel(), rope_heads, head_dim, out.data_ptr<float>());
  return out;
}

// h: float32 [1, H]; attn: float32 [1, in]; rows: W_o in blocks [H rows] → h + W_o · attn.
torch::Tensor residual_gemv(torch::Tensor h, torch::Tensor attn, torch::Tensor rows,
                            int64_t format, c10::optional<torch::Tensor> bias,
                            int64_t activation_bits) {
  check_row(h, "h");
  check_row(attn, "attn");
  const BlockMatrix w = checked_matrix(rows, format, attn.numel());
  TORCH_CHECK(h.numel() == w.rows, "the residual and the matrix's rows differ in width");
  torch::Tensor out = torch::empty_like(h);
  add_product_row(checked_activation(activation_bits), h.data_ptr<float>(), w,
                  attn.data_ptr<float>(), attn.numel(), optional_data(bias, "bias"),
                  out.data_ptr<float>());
  return out;
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
  const BlockMatrix gu = checked_matrix(gate_up, gate_up_format, width);
  const BlockMatrix dn = checked_matrix(down, down_format, gu.rows / 2);
  TORCH_CHECK(dn.rows == width, "W_down's rows are not the residual's width");
  torch::Tensor out = torch::empty_like(h);
  ffn_row(checked_activation(activation_bits), h.data_ptr<float>(), norm_weight.data_ptr<float>(),
          eps, width, gu, dn, out.data_ptr<float>());
  return out;
}

// One whole decode layer for the row h: float32 [1, H] at the position cos/sin are taken at.
// k_store, v_store: float32 [capacity, Hkv, D], contiguous, the layer's cache storage; the new
// row's K (rotated) and V are written at row `slot`, and the query attends rows first..slot.
// norms: [attn_norm; ffn_norm] float32 [2, H]; formats: [qkv, o, gate_up, down] → h after
// attention and FFN, [1, H].
torch::Tensor decode_layer(torch::Tensor h, torch::Tensor norms, double eps, torch::Tensor qkv,
                           torch::Tensor wo, torch::Tensor gate_up, torch::Tensor down,
                           std::vector<int64_t> formats, c10::optional<torch::Tensor> qkv_bias,
                           c10::optional<torch::Tensor> o_bias, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor k_store, torch::Tensor v_store,
                           int64_t first, int64_t slot, int64_t heads, double scale,
                           int64_t activation_bits) {
  check_row(h, "h");
  check_row(norms, "norms");
  check_row(k_store, "k_store");
  check_row(v_store, "v_store");
  const int64_t width = h.numel();
  TORCH_CHECK(norms.numel() == 2 * width, "norms must be [2, H]: the attention and FFN norms");
  TORCH_CHECK(k_store.dim() == 3 && v_store.sizes() == k_store.sizes(),
              "k_store and v_store must be [capacity, Hkv, D] alike");
  const int64_t kv_heads = k_store.size(1), head_dim = k_store.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of K/V heads");
  TORCH_CHECK(0 <= first && first <= slot && slot < k_store.size(0),
              "need 0 ≤ first ≤ slot < the storage's capacity");
  check_rope(cos, sin, head_dim);
  const int64_t q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
  const LayerMatrices w = checked_layer(qkv, wo, gate_up, down, formats, width, q_dim, kv_dim);
  const BlockMatrix &w_qkv = w.qkv, &w_o = w.o, &w_gate_up = w.gate_up, &w_down = w.down;
  const Activation a = checked_activation(activation_bits);
  const float* norm = norms.data_ptr<float>();

  std::vector<float> projected(w_qkv.rows), attn(q_dim), mid(width);
  qkv_row(a, h.data_ptr<float>(), norm, eps, width, w_qkv, optional_data(qkv_bias, "qkv bias"),
          cos.data_ptr<float>(), sin.data_ptr<float>(), cos.numel(), heads + kv_heads, head_dim,
          projected.data());
  float* keys = k_store.data_ptr<float>();
  float* values = v_store.data_ptr<float>();
  std::memcpy(keys + slot * kv_dim, projected.data() + q_dim, kv_dim * sizeof(float));
  std::memcpy(values + slot * kv_dim, projected.data() + q_dim + kv_dim, kv_dim * sizeof(float));
  attend_one_query(projected.data(), heads, head_dim, Rows{keys + first * kv_dim, head_dim, kv_dim},
                   Rows{values + first * kv_dim, head_dim, kv_dim}, kv_heads, slot - first + 1,
                   static_cast<float>(scale), attn.data());
  add_product_row(a, h.data_ptr<float>(), w_o, attn.data(), q_dim, optional_data(o_bias, "o bias"),
                  mid.data());
  torch::Tensor out = torch::empty_like(h);
  ffn_row(a, mid.data(), norm + width, eps, width, w_gate_up, w_down, out.data_ptr<float>());
  return out;
}

// decode_layer for M rows at once, row m of session m. h: float32 [M, H]; cos, sin: [M, rotary]
// at each row's position; k_stores[m], v_stores[m]: session m's cache storage [capacity, Hkv, D]
// (its new row written at slots[m], attending rows firsts[m]..slots[m]) → [M, H].
torch::Tensor decode_layer_batch(torch::Tensor h, torch::Tensor norms, double eps,
                                 torch::Tensor qkv, torch::Tensor wo, torch::Tensor gate_up,
                                 torch::Tensor down, std::vector<int64_t> formats,
                                 c10::optional<torch::Tensor> qkv_bias,
                                 c10::optional<torch::Tensor> o_bias, torch::Tensor cos,
                                 torch::Tensor sin, std::vector<torch::Tensor> k_stores,
                                 std::vector<torch::Tensor> v_stores, std::vector<int64_t> firsts,
                                 std::vector<int64_t> slots, int64_t heads, double scale,
                                 int64_t activation_bits) {
  check_row(h, "h");
  check_row(norms, "norms");
  check_row(cos, "cos");
  check_row(sin, "sin");
  TORCH_CHECK(h.dim() == 2, "h must be [M, H]");
  const int64_t m_rows = h.size(0), width = h.size(1);
  TORCH_CHECK(norms.numel() == 2 * width, "norms must be [2, H]: the attention and FFN norms");
  TORCH_CHECK(static_cast<int64_t>(k_stores.size()) == m_rows &&
                  static_cast<int64_t>(v_stores.size()) == m_rows &&
                  static_cast<int64_t>(firsts.size()) == m_rows &&
                  static_cast<int64_t>(slots.size()) == m_rows,
              "one K/V store, first row and slot per row of h");
  TORCH_CHECK(m_rows > 0, "h has no rows");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == m_rows && sin.sizes() == cos.sizes(),
              "cos and sin must be [M, rotary]");
  const int64_t rotary = cos.size(1);
  const int64_t kv_heads = k_stores[0].size(1), head_dim = k_stores[0].size(2);
  TORCH_CHECK(rotary % 2 == 0 && rotary <= head_dim, "rotary must be even and at most head_dim");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of K/V heads");
  for (int64_t m = 0; m < m_rows; ++m) {
    check_row(k_stores[m], "k_store");
    check_row(v_stores[m], "v_store");
    TORCH_CHECK(k_stores[m].dim() == 3 && k_stores[m].size(1) == kv_heads &&
                    k_stores[m].size(2) == head_dim && v_stores[m].sizes() == k_stores[m].sizes(),
                "every K/V store must be [capacity, Hkv, D] with the same Hkv and D");
    TORCH_CHECK(0 <= firsts[m] && firsts[m] <= slots[m] && slots[m] < k_stores[m].size(0),
                "need 0 ≤ first ≤ slot < the storage's capacity");
  }
  const int64_t q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
  const LayerMatrices w = checked_layer(qkv, wo, gate_up, down, formats, width, q_dim, kv_dim);
  const BlockMatrix &w_qkv = w.qkv, &w_o = w.o, &w_gate_up = w.gate_up, &w_down = w.down;
  const int64_t hidden = w_gate_up.rows / 2;
  const Activation a = checked_activation(activation_bits);
  const float* norm = norms.data_ptr<float>();
  const float* bqkv = optional_data(qkv_bias, "qkv bias");
  const float* bo = optional_data(o_bias, "o bias");
  const float* rows_in = h.data_ptr<float>();

  // attention: norm → QKV for every row at once → per row: bias, RoPE, cache write, attention
  std::vector<float> x(m_rows * width), projected(m_rows * w_qkv.rows), attn(m_rows * q_dim);
  for (int64_t m = 0; m < m_rows; ++m) {
    rms_norm(rows_in + m * width, norm, width, eps, x.data() + m * width);
  }
  gemm_with(a, w_qkv.format, w_qkv.data, w_qkv.row_bytes, w_qkv.rows, x.data(), m_rows, width,
            projected.data());
  for (int64_t m = 0; m < m_rows; ++m) {
    float* row = projected.data() + m * w_qkv.rows;
    if (bqkv != nullptr) {
      for (int64_t i = 0; i < w_qkv.rows; ++i) row[i] += bqkv[i];
    }
    const float* c = cos.data_ptr<float>() + m * rotary;
    const float* s = sin.data_ptr<float>() + m * rotary;
    rotate_heads(row, c, s, rotary, heads + kv_heads, head_dim);
    std::memcpy(k_stores[m].data_ptr<float>() + slots[m] * kv_dim, row + q_dim,
                kv_dim * sizeof(float));
    std::memcpy(v_stores[m].data_ptr<float>() + slots[m] * kv_dim, row + q_dim + kv_dim,
                kv_dim * sizeof(float));
  }
  // one session per thread, each chunked as a call of its own would be (the same result)
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, m_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* keys = k_stores[m].data_ptr<float>() + firsts[m] * kv_dim;
      const float* values = v_stores[m].data_ptr<float>() + firsts[m] * kv_dim;
      attend_one_query(projected.data() + m * w_qkv.rows, heads, head_dim,
                       Rows{keys, head_dim, kv_dim}, Rows{values, head_dim, kv_dim}, kv_heads,
                       slots[m] - firsts[m] + 1, static_cast<float>(scale),
                       attn.data() + m * q_dim, threads);
    }
  });

  // h + W_o · attn (+ bias), every row at once
  std::vector<float> mid(m_rows * width), p(m_rows * width);
  gemm_with(a, w_o.format, w_o.data, w_o.row_bytes, w_o.rows, attn.data(), m_rows, q_dim, p.data());
  for (int64_t i = 0; i < m_rows * width; ++i) {
    mid[i] = rows_in[i] + (bo ? p[i] + bo[i % width] : p[i]);
  }

  // the MLP: norm → [gate; up] → silu(gate) ⊙ up → W_down, + the residual
  std::vector<float> both(m_rows * 2 * hidden), inner(m_rows * hidden);
  for (int64_t m = 0; m < m_rows; ++m) {
    rms_norm(mid.data() + m * width, norm + width, width, eps, x.data() + m * width);
  }
  gemm_with(a, w_gate_up.format, w_gate_up.data, w_gate_up.row_bytes, w_gate_up.rows, x.data(),
            m_rows, width, both.data());
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* row = both.data() + m * 2 * hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      const float gate = row[i];
      inner[m * hidden + i] = gate / (1.0f + std::exp(-gate)) * row[hidden + i];
    }
  }
  gemm_with(a, w_down.format, w_down.data, w_down.row_bytes, w_down.rows, inner.data(), m_rows,
            hidden, p.data());
  torch::Tensor out = torch::empty_like(h);
  float* result = out.data_ptr<float>();
  for (int64_t i = 0; i < m_rows * width; ++i) result[i] = mid[i] + p[i];
  return out;
}

}  // namespace larql
