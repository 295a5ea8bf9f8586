// A decode step's layer for one float32 row, in a few calls instead of dozens of torch
// operators (on a 2-core CPU the operators' dispatch costs as much as the block products):
//
//   decode_qkv     h → rms_norm → W_qkv (blocks) (+ bias) → RoPE on the q and k heads
//   residual_gemv  h + W_o (blocks) · attn (+ bias)
//   residual_ffn   h + W_down · (silu(W_gate · x) ⊙ W_up · x),  x = rms_norm(h)
//   decode_layers_batch  whole layers, one after another, for M rows of one or more sessions:
//                  decode_qkv, each row's K/V written into its session's cache storage, each
//                  query's attention over its session's live rows, residual_gemv, residual_ffn
//
// Every piece takes M rows (a batched decode step, or a short prompt for the first three):
// each product reads its weights once for all rows (gemm_with), and a row's arithmetic does not
// depend on the other rows, so one session's results are the same alone or in a batch.
//
// With activation_bits 8 or 16 every product rounds its input to int8 / int16 codes per block
// of 32 first (block_dot.h); otherwise the arithmetic is the torch path's (layer.py) in
// float32, up to the order of the sums: rms_norm(x) = x · rsqrt(mean(x²) + eps) · weight; RoPE
// rotates the split-half pairs of the first `rotary` dims of each head with
// cos = [cos θ, cos θ] and signed sin = [−sin θ, sin θ]:
// x_i' = x_i cos_i + x_{i+half} sin_i, x_{i+half}' = x_{i+half} cos_{i+half} + x_i sin_{i+half}.
// the tensor API alone: torch/extension.h (pybind11, the C++ frontend) is bindings.cpp's,
// and it doubles a file's compile time
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "block_dot.h"
#include "decode_attention.h"
#include "decode_layer.h"

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

// x: [n] → out: [n] = x · rsqrt(mean(x²) + eps) · weight. The squares are summed in double
// (each one exact there), in eight lanes: the sum's order differs from a plain loop only below
// what rounding it to the float scale keeps.
void rms_norm(const float* x, const float* weight, int64_t n, double eps, float* out) {
  double squares = 0.0;
  int64_t i = 0;
#if LARQL_AVX2
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    const __m256d b = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    low = _mm256_fmadd_pd(a, a, low);
    high = _mm256_fmadd_pd(b, b, high);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(low, high));
  squares = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < n; ++i) squares += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(squares / n + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

// fn(m) for every row m < m_rows: over the threads where there are many rows (each row's
// arithmetic is the same either way), on the calling thread for a decode step's few: a norm or
// an activation of 8 rows costs less than a parallel region's start and wait (docs/
// PERFORMANCE.md, the tiled products on Zen 4).
constexpr int64_t kParallelRows = 32;

template <typename Fn>
void each_row(int64_t m_rows, const Fn& fn) {
  if (m_rows < kParallelRows) {
    for (int64_t m = 0; m < m_rows; ++m) fn(m);
    return;
  }
  at::parallel_for(0, m_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) fn(m);
  });
}


// out[i] = silu(gate[i]) · up[i] = gate[i] / (1 + e^{−gate[i]}) · up[i], i < n.
void silu_times(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#if LARQL_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

BlockMatrix checked_matrix(const torch::Tensor& rows, int64_t format, int64_t width) {
  const Format f = checked_format(format);
  check_rows(rows, f, width);
  return BlockMatrix{rows.data_ptr<uint8_t>(), rows.size(0), rows.size(1), f};
}

// The M-row products: x [M, width] → out [M, W rows], each weight read once (gemm_with).
void product(Activation a, const BlockMatrix& w, const float* x, int64_t m_rows, int64_t width,
             float* out) {
  gemm_with(a, w.format, w.data, w.row_bytes, w.rows, x, m_rows, width, out);
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

}  // namespace

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

namespace {

// qkv: [M, W_qkv rows] = RoPE(W_qkv · rms_norm(h_m) (+ bias)) per row m, on the first
// rope_heads heads, with row m's cos / sin (cos, sin: [M, rotary]).
void qkv_rows(Activation a, const float* h, int64_t m_rows, const float* norm, double eps,
              int64_t width, const BlockMatrix& w, const float* bias, const float* cos,
              const float* sin, int64_t rotary, int64_t rope_heads, int64_t head_dim, float* qkv) {
  thread_local Scratch<float> normed;
  float* x = normed.take(m_rows * width);
  each_row(m_rows, [&](int64_t m) { rms_norm(h + m * width, norm, width, eps, x + m * width); });
  product(a, w, x, m_rows, width, qkv);
  each_row(m_rows, [&](int64_t m) {
    float* row = qkv + m * w.rows;
    if (bias != nullptr) {
      for (int64_t i = 0; i < w.rows; ++i) row[i] += bias[i];
    }
    rotate_heads(row, cos + m * rotary, sin + m * rotary, rotary, rope_heads, head_dim);
  });
}

// out: [M, W rows] = h + W · x (+ bias), x: [M, width].
void add_product_rows(Activation a, const float* h, int64_t m_rows, const BlockMatrix& w,
                      const float* x, int64_t width, const float* bias, float* out) {
  thread_local Scratch<float> products;
  float* p = products.take(m_rows * w.rows);
  product(a, w, x, m_rows, width, p);
  for (int64_t i = 0; i < m_rows * w.rows; ++i) {
    out[i] = h[i] + (bias ? p[i] + bias[i % w.rows] : p[i]);
  }
}

// Whether the gated product of [gate; up] for `m_rows` inputs takes the SiLU in its tiles'
// pairs (`tiled_gemm_halves`): integer inputs on VNNI-tiled blocks (AMX keeps its paired tiles
// for the int16 products it takes: `products_on_amx`), each half whole tiles. The same
// per-element arithmetic either way (silu_times works 8 lanes at a time from a row's start, and
// a tile's 16 outputs start on a multiple of 8).
bool gated_in_product(Activation a, const BlockMatrix& gate_up, int64_t m_rows) {
#if LARQL_TILED
  const bool on_vnni =
      a == Activation::Int8 || (a == Activation::Int16 && !products_on_amx(m_rows));
  return on_vnni && is_tiled(gate_up.format) && gate_up.rows % (2 * kTileOutputs) == 0;
#else
  (void)a;
  (void)gate_up;
  (void)m_rows;
  return false;
#endif
}

// out: [M, width] = h + W_down · (silu(gate) ⊙ up), [gate; up] = W_gate_up · rms_norm(h), per row.
void ffn_rows(Activation a, const float* h, int64_t m_rows, const float* norm, double eps,
              int64_t width, const BlockMatrix& gate_up, const BlockMatrix& down, float* out) {
  const int64_t hidden = gate_up.rows / 2;
  thread_local Scratch<float> normed, gate_up_rows, gated;
  float* x = normed.take(m_rows * width);
  float* both = gate_up_rows.take(m_rows * 2 * hidden);
  float* inner = gated.take(m_rows * hidden);
  each_row(m_rows, [&](int64_t m) { rms_norm(h + m * width, norm, width, eps, x + m * width); });
  if (gated_in_product(a, gate_up, m_rows)) {  // silu(gate) ⊙ up over the threads, in the product
#if LARQL_TILED
    // W_down's inputs rounded a block at a time by the thread that made the block, inside the
    // product, where they are one group of a tiled product's inputs: not rounded again by
    // every thread of W_down's product from float rows half of which the other thread wrote
    const bool narrow = a == Activation::Int8;
    const bool round_here = is_tiled(down.format) && m_rows <= kTileInputs;
    thread_local TiledInputBuffers down_buffers;
    // (a thread_local named in the workers' lambda would be each worker's own: they write into
    // the calling thread's through this reference)
    TiledInputBuffers& down_inputs = down_buffers;
    if (round_here) down_inputs.reserve(static_cast<int>(m_rows), hidden, narrow);
    const auto gated = [&](int64_t t, const float* pair) {
      for (int64_t m = 0; m < m_rows; ++m) {
        const float* row = pair + m * 2 * kTileOutputs;
        silu_times(row, row + kTileOutputs, kTileOutputs, inner + m * hidden + t * kTileOutputs);
      }
    };
    const auto block_done = [&](int64_t b) {
      if (round_here) down_inputs.round_rows(b, inner, hidden);
    };
    tiled_gemm_halves(base_of(gate_up.format), gate_up.data, gate_up.rows, width / kBlock, x,
                      m_rows, narrow, gated, block_done);
    if (round_here) {
      thread_local Scratch<float> products;
      float* p = products.take(m_rows * down.rows);
      tiled_gemm(base_of(down.format), down.data, down.rows, hidden / kBlock,
                 ProductInputs(down_inputs.inputs()), p);
      for (int64_t i = 0; i < m_rows * down.rows; ++i) out[i] = h[i] + p[i];
      return;
    }
#endif
  } else {
    product(a, gate_up, x, m_rows, width, both);
    each_row(m_rows, [&](int64_t m) {
      const float* row = both + m * 2 * hidden;
      silu_times(row, row + hidden, hidden, inner + m * hidden);
    });
  }
  add_product_rows(a, h, m_rows, down, inner, hidden, nullptr, out);
}

// Rows of a [width] or [M, width] float32 input: (M, width).
std::pair<int64_t, int64_t> rows_of(const torch::Tensor& h) {
  TORCH_CHECK(h.dim() == 1 || h.dim() == 2, "expected [width] or [M, width] rows");
  return h.dim() == 1 ? std::make_pair<int64_t, int64_t>(1, h.size(0))
                      : std::make_pair<int64_t, int64_t>(h.size(0), h.size(1));
}

// cos, sin: [M, rotary] (or [rotary] for one row) → rotary.
int64_t check_rope(const torch::Tensor& cos, const torch::Tensor& sin, int64_t m_rows,
                   int64_t head_dim) {
  check_row(cos, "cos");
  check_row(sin, "sin");
  TORCH_CHECK(cos.numel() % m_rows == 0 && sin.sizes() == cos.sizes(),
              "cos and sin must be [M, rotary] alike, a row per input row");
  const int64_t rotary = cos.numel() / m_rows;
  TORCH_CHECK(rotary % 2 == 0 && rotary <= head_dim, "rotary must be even and at most head_dim");
  return rotary;
}

}  // namespace

std::vector<int64_t> balanced_runs(const std::vector<int64_t>& keys, int64_t parts) {
  constexpr int64_t kRowShare = 16;  // a row's own cost, in keys
  const int64_t rows = static_cast<int64_t>(keys.size());
  int64_t total = 0;
  for (int64_t m = 0; m < rows; ++m) total += keys[m] + kRowShare;
  std::vector<int64_t> bounds(parts + 1, rows);
  bounds[0] = 0;
  int64_t done = 0, part = 1;
  for (int64_t m = 0; m < rows && part < parts; ++m) {
    const int64_t work = keys[m] + kRowShare;
    // row m goes to the run where the middle of its work falls
    while (part < parts && (2 * done + work) * parts >= 2 * part * total) bounds[part++] = m;
    done += work;
  }
  return bounds;
}

void attend_sessions(int64_t m_rows, const std::vector<int64_t>& keys, int64_t threads,
                     const std::function<void(int64_t)>& attend_row) {
  if (m_rows >= threads) {  // whole sessions per thread, in runs of about equal work
    const std::vector<int64_t> bounds = balanced_runs(keys, threads);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t part = begin; part < end; ++part) {
        for (int64_t m = bounds[part]; m < bounds[part + 1]; ++m) attend_row(m);
      }
    });
  } else {
    for (int64_t m = 0; m < m_rows; ++m) attend_row(m);  // each session's rows over the threads
  }
}

torch::Tensor layer_around(const torch::Tensor& h, const torch::Tensor& norms, double eps,
                           const LayerMatrices& w, const c10::optional<torch::Tensor>& qkv_bias,
                           const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& cos,
                           const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t activation_bits, const AttendRows& attend) {
  check_row(h, "h");
  check_row(norms, "norms");
  const auto [m_rows, width] = rows_of(h);
  TORCH_CHECK(norms.numel() == 2 * width, "norms must be [2, H]: the attention and FFN norms");
  const int64_t rotary = check_rope(cos, sin, m_rows, head_dim);
  const int64_t q_dim = heads * head_dim;
  const Activation a = checked_activation(activation_bits);
  const float* norm = norms.data_ptr<float>();

  thread_local Scratch<float> projected_rows, attn_rows, mid_rows;
  float* projected = projected_rows.take(m_rows * w.qkv.rows);
  float* attn = attn_rows.take(m_rows * q_dim);
  float* mid = mid_rows.take(m_rows * width);
  qkv_rows(a, h.data_ptr<float>(), m_rows, norm, eps, width, w.qkv,
           optional_data(qkv_bias, "qkv bias"), cos.data_ptr<float>(), sin.data_ptr<float>(),
           rotary, heads + kv_heads, head_dim, projected);
  attend(projected, attn);
  add_product_rows(a, h.data_ptr<float>(), m_rows, w.o, attn, q_dim,
                   optional_data(o_bias, "o bias"), mid);
  torch::Tensor out = torch::empty_like(h);
  ffn_rows(a, mid, m_rows, norm + width, eps, width, w.gate_up, w.down,
           out.data_ptr<float>());
  return out;
}

// h: float32 [M, H] (or [H]); rows: the fused [q; k; v] matrix in blocks, [q_dim + 2·kv_dim]
// rows; cos, sin: float32 [M, rotary] at each row's position; the first `rope_heads` heads of
// width `head_dim` (the q heads, then the k heads) are rotated → float32 [M, q_dim + 2·kv_dim].
torch::Tensor decode_qkv(torch::Tensor h, torch::Tensor norm_weight, double eps,
                         torch::Tensor rows, int64_t format, c10::optional<torch::Tensor> bias,
                         torch::Tensor cos, torch::Tensor sin, int64_t rope_heads,
                         int64_t head_dim, int64_t activation_bits) {
  check_row(h, "h");
  check_row(norm_weight, "norm weight");
  const auto [m_rows, width] = rows_of(h);
  const int64_t rotary = check_rope(cos, sin, m_rows, head_dim);
  TORCH_CHECK(norm_weight.numel() == width, "the norm weight's width is not the row's");
  const BlockMatrix w = checked_matrix(rows, format, width);
  TORCH_CHECK(rope_heads * head_dim <= w.rows, "more rotated heads than rows");
  torch::Tensor out = torch::empty({m_rows, w.rows}, h.options());
  qkv_rows(checked_activation(activation_bits), h.data_ptr<float>(), m_rows,
           norm_weight.data_ptr<float>(), eps, width, w, optional_data(bias, "bias"),
           cos.data_ptr<float>(), sin.data_ptr<float>(), rotary, rope_heads, head_dim,
           out.data_ptr<float>());
  return out;
}

// h: float32 [M, H]; attn: float32 [M, in]; rows: W_o in blocks [H rows] → h + W_o · attn.
torch::Tensor residual_gemv(torch::Tensor h, torch::Tensor attn, torch::Tensor rows,
                            int64_t format, c10::optional<torch::Tensor> bias,
                            int64_t activation_bits) {
  check_row(h, "h");
  check_row(attn, "attn");
  const auto [m_rows, width] = rows_of(h);
  TORCH_CHECK(attn.numel() % m_rows == 0, "attn must have a row per row of h");
  const int64_t in = attn.numel() / m_rows;
  const BlockMatrix w = checked_matrix(rows, format, in);
  TORCH_CHECK(width == w.rows, "the residual and the matrix's rows differ in width");
  torch::Tensor out = torch::empty_like(h);
  add_product_rows(checked_activation(activation_bits), h.data_ptr<float>(), m_rows, w,
                   attn.data_ptr<float>(), in, optional_data(bias, "bias"), out.data_ptr<float>());
  return out;
}

// h: float32 [M, H] → h + W_down · (silu(gate) ⊙ up), [gate; up] = W_gate_up · rms_norm(h), per
// row; gate_up: [2F rows], down: [H rows] of width F.
torch::Tensor residual_ffn(torch::Tensor h, torch::Tensor norm_weight, double eps,
                           torch::Tensor gate_up, int64_t gate_up_format, torch::Tensor down,
                           int64_t down_format, int64_t activation_bits) {
  check_row(h, "h");
  check_row(norm_weight, "norm weight");
  const auto [m_rows, width] = rows_of(h);
  TORCH_CHECK(norm_weight.numel() == width, "the norm weight's width is not the row's");
  const BlockMatrix gu = checked_matrix(gate_up, gate_up_format, width);
  const BlockMatrix dn = checked_matrix(down, down_format, gu.rows / 2);
  TORCH_CHECK(dn.rows == width, "W_down's rows are not the residual's width");
  torch::Tensor out = torch::empty_like(h);
  ffn_rows(checked_activation(activation_bits), h.data_ptr<float>(), m_rows,
           norm_weight.data_ptr<float>(), eps, width, gu, dn, out.data_ptr<float>());
  return out;
}

// A whole decode layer for M rows of M sessions, row m at the position cos/sin row m is taken
// at. k_stores[m], v_stores[m]: session m's cache storage, float32 [capacity, Hkv, D]
// contiguous; row m's K (rotated) and V are written at slots[m], and its query attends rows
// firsts[m]..slots[m] (one session per thread, each chunked as a call of its own would be).
// norms: [attn_norm; ffn_norm] float32 [2, H]; formats: [qkv, o, gate_up, down] → [M, H].
static torch::Tensor decode_layer_batch(torch::Tensor h, torch::Tensor norms, double eps,
                                 torch::Tensor qkv, torch::Tensor wo, torch::Tensor gate_up,
                                 torch::Tensor down, std::vector<int64_t> formats,
                                 c10::optional<torch::Tensor> qkv_bias,
                                 c10::optional<torch::Tensor> o_bias, torch::Tensor cos,
                                 torch::Tensor sin, std::vector<torch::Tensor> k_stores,
                                 std::vector<torch::Tensor> v_stores, std::vector<int64_t> firsts,
                                 std::vector<int64_t> slots, int64_t heads, double scale,
                                 int64_t activation_bits) {
  check_row(h, "h");
  const auto [m_rows, width] = rows_of(h);
  TORCH_CHECK(static_cast<int64_t>(k_stores.size()) == m_rows &&
                  static_cast<int64_t>(v_stores.size()) == m_rows &&
                  static_cast<int64_t>(firsts.size()) == m_rows &&
                  static_cast<int64_t>(slots.size()) == m_rows,
              "one K/V store, first row and slot per row of h");
  TORCH_CHECK(k_stores[0].dim() == 3, "K/V stores must be [capacity, Hkv, D]");
  const int64_t kv_heads = k_stores[0].size(1), head_dim = k_stores[0].size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of K/V heads");
  std::vector<int64_t> keys(m_rows);
  for (int64_t m = 0; m < m_rows; ++m) {
    check_row(k_stores[m], "k_store");
    check_row(v_stores[m], "v_store");
    TORCH_CHECK(k_stores[m].dim() == 3 && k_stores[m].size(1) == kv_heads &&
                    k_stores[m].size(2) == head_dim && v_stores[m].sizes() == k_stores[m].sizes(),
                "every K/V store must be [capacity, Hkv, D] with the same Hkv and D");
    TORCH_CHECK(0 <= firsts[m] && firsts[m] <= slots[m] && slots[m] < k_stores[m].size(0),
                "need 0 ≤ first ≤ slot < the storage's capacity");
    keys[m] = slots[m] - firsts[m] + 1;
  }
  const int64_t q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
  const LayerMatrices w = checked_layer(qkv, wo, gate_up, down, formats, width, q_dim, kv_dim);
  const int64_t threads = at::get_num_threads();
  const auto attend = [&](const float* projected, float* attn) {
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* row = projected + m * w.qkv.rows;
      std::memcpy(k_stores[m].data_ptr<float>() + slots[m] * kv_dim, row + q_dim,
                  kv_dim * sizeof(float));
      std::memcpy(v_stores[m].data_ptr<float>() + slots[m] * kv_dim, row + q_dim + kv_dim,
                  kv_dim * sizeof(float));
    }
    attend_sessions(m_rows, keys, threads, [&](int64_t m) {
      const float* k = k_stores[m].data_ptr<float>() + firsts[m] * kv_dim;
      const float* v = v_stores[m].data_ptr<float>() + firsts[m] * kv_dim;
      attend_one_query(projected + m * w.qkv.rows, heads, head_dim, Rows{k, head_dim, kv_dim},
                       Rows{v, head_dim, kv_dim}, kv_heads, keys[m], static_cast<float>(scale),
                       attn + m * q_dim, threads);
    });
  };
  return layer_around(h, norms, eps, w, qkv_bias, o_bias, cos, sin, heads, kv_heads, head_dim,
                      activation_bits, attend);
}

// decode_layer_batch through every layer in one call: argument i of each list is layer i's
// (its weights, its cos / sin rows, and each row's K/V store, first row and slot in it) → the
// residuals after the last layer [M, H]; layer_inputs (float32 [layers, M, H], or None) gets
// each layer's input rows (what an engine that stores pre-layer residuals keeps). The same
// arithmetic as a call per layer; the GIL stays released for the whole step, so a server's
// event loop runs beside it without the step waiting for the GIL at each layer, and the step
// pays Python's per-layer work once.
torch::Tensor decode_layers_batch(torch::Tensor h, Tensors norms, double eps, Tensors qkv,
                                  Tensors wo, Tensors gate_up, Tensors down, PerLayerInts formats,
                                  OptionalTensors qkv_bias, OptionalTensors o_bias, Tensors cos,
                                  Tensors sin, PerLayerTensors k_stores, PerLayerTensors v_stores,
                                  PerLayerInts firsts, PerLayerInts slots, int64_t heads,
                                  double scale, int64_t activation_bits,
                                  c10::optional<torch::Tensor> layer_inputs) {
  const size_t layers = norms.size();
  for (const size_t n : {qkv.size(), wo.size(), gate_up.size(), down.size(), formats.size(),
                         qkv_bias.size(), o_bias.size(), cos.size(), sin.size(), k_stores.size(),
                         v_stores.size(), firsts.size(), slots.size()}) {
    TORCH_CHECK(n == layers, "every per-layer argument needs one entry per layer");
  }
  float* inputs = nullptr;  // each layer's input rows, where the caller keeps them
  if (layer_inputs.has_value()) {
    check_row(h, "h");
    check_row(*layer_inputs, "layer_inputs");
    TORCH_CHECK(layer_inputs->numel() == static_cast<int64_t>(layers) * h.numel(),
                "layer_inputs must be float32 [layers, M, H]");
    inputs = layer_inputs->data_ptr<float>();
  }
  for (size_t l = 0; l < layers; ++l) {
    if (inputs != nullptr) {  // (each layer's output: contiguous float32 like its input)
      std::memcpy(inputs + l * h.numel(), h.data_ptr<float>(), h.numel() * sizeof(float));
    }
    h = decode_layer_batch(h, norms[l], eps, qkv[l], wo[l], gate_up[l], down[l], formats[l],
                           qkv_bias[l], o_bias[l], cos[l], sin[l], k_stores[l], v_stores[l],
                           firsts[l], slots[l], heads, scale, activation_bits);
  }
  return h;
}

// For each entry l: rows[l] float32 [N_l, H], pre-layer residuals of one layer, at the
// positions cos[l] / sin[l] ([N_l, rotary]) give → their K (rotated) and V by that layer's
// rms_norm → W_qkv (blocks) (+ bias) → RoPE, written into k_stores[l] / v_stores[l] (float32
// [capacity, Hkv, D]) at slots[l]..: a decode step's arithmetic for those rows (the q part is
// computed and dropped). What an engine that keeps residuals runs to give rows it stored
// lossily the K/V of their stored values.
void rows_kv(torch::Tensor rows, Tensors norms, double eps, Tensors qkv,
             std::vector<int64_t> formats, OptionalTensors qkv_bias, Tensors cos, Tensors sin,
             std::vector<int64_t> counts, Tensors k_stores, Tensors v_stores,
             std::vector<int64_t> slots, int64_t heads, int64_t activation_bits) {
  check_row(rows, "rows");
  TORCH_CHECK(rows.dim() == 3, "rows must be [N, layers, width]");
  const int64_t n_rows = rows.size(0), layers = rows.size(1), width = rows.size(2);
  for (const size_t size : {norms.size(), qkv.size(), formats.size(), qkv_bias.size(),
                            cos.size(), sin.size()}) {
    TORCH_CHECK(static_cast<int64_t>(size) == layers, "every layer argument needs one entry "
                "per layer of the rows");
  }
  const int64_t segments = static_cast<int64_t>(counts.size());
  for (const size_t size : {k_stores.size(), v_stores.size(), slots.size()}) {
    TORCH_CHECK(static_cast<int64_t>(size) == segments * layers,
                "every store argument needs one entry per segment and layer");
  }
  int64_t counted = 0;
  for (const int64_t count : counts) {
    TORCH_CHECK(count >= 0, "a segment's rows cannot be negative");
    counted += count;
  }
  TORCH_CHECK(counted == n_rows, "the segments' rows must add up to the rows given");
  const Activation a = checked_activation(activation_bits);
  if (n_rows == 0) return;
  thread_local Scratch<float> layer_rows, projected_rows;
  float* h = layer_rows.take(n_rows * width);
  for (int64_t l = 0; l < layers; ++l) {
    check_row(norms[l], "norm");
    TORCH_CHECK(norms[l].numel() == width, "the norm weight's width is not the row's");
    const torch::Tensor& first = k_stores[l];  // segment 0's: every segment's must match it
    TORCH_CHECK(first.dim() == 3, "K/V stores must be [capacity, Hkv, D]");
    const int64_t kv_heads = first.size(1), head_dim = first.size(2);
    const int64_t q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
    for (int64_t g = 0; g < segments; ++g) {
      const torch::Tensor& keys = k_stores[g * layers + l];
      const torch::Tensor& values = v_stores[g * layers + l];
      check_row(keys, "k_store");
      check_row(values, "v_store");
      TORCH_CHECK(keys.dim() == 3 && keys.size(1) == kv_heads && keys.size(2) == head_dim &&
                      values.sizes() == keys.sizes(),
                  "a layer's K/V stores must be [capacity, Hkv, D] alike");
      const int64_t slot = slots[g * layers + l];
      TORCH_CHECK(0 <= slot && slot + counts[g] <= keys.size(0),
                  "a segment's slots must lie in its storage");
    }
    const BlockMatrix w = checked_matrix(qkv[l], formats[l], width);
    TORCH_CHECK(w.rows == q_dim + 2 * kv_dim, "W_qkv's rows are not q_dim + 2 · kv_dim");
    const int64_t rotary = check_rope(cos[l], sin[l], n_rows, head_dim);
    const float* source = rows.data_ptr<float>() + l * width;
    for (int64_t m = 0; m < n_rows; ++m) {  // the layer's rows: [N, width]
      std::memcpy(h + m * width, source + m * layers * width, width * sizeof(float));
    }
    // Only W_qkv's K and V rows where they start a tile (each output row's products are
    // its own: the same values as in the whole product), else the whole matrix.
    constexpr int64_t kRowsPerTile = 16;  // a tiled matrix's rows, tile by tile
    const int64_t skip = !is_tiled(w.format) || q_dim % kRowsPerTile == 0 ? q_dim : 0;
    const BlockMatrix kv{w.data + skip * w.row_bytes, w.rows - skip, w.row_bytes, w.format};
    const float* bias = optional_data(qkv_bias[l], "qkv bias");
    float* projected = projected_rows.take(n_rows * kv.rows);
    qkv_rows(a, h, n_rows, norms[l].data_ptr<float>(), eps, width, kv,
             bias != nullptr ? bias + skip : nullptr, cos[l].data_ptr<float>(),
             sin[l].data_ptr<float>(), rotary, skip == 0 ? heads + kv_heads : kv_heads,
             head_dim, projected);
    for (int64_t g = 0, m = 0; g < segments; ++g) {
      float* keys = k_stores[g * layers + l].data_ptr<float>();
      float* values = v_stores[g * layers + l].data_ptr<float>();
      for (int64_t r = 0; r < counts[g]; ++r, ++m) {
        const float* row = projected + m * kv.rows + (q_dim - skip);  // [K | V]
        const int64_t slot = slots[g * layers + l] + r;
        std::memcpy(keys + slot * kv_dim, row, kv_dim * sizeof(float));
        std::memcpy(values + slot * kv_dim, row + kv_dim, kv_dim * sizeof(float));
      }
    }
  }
}

}  // namespace larql
