// The tiled int16-input block products (`tiled_blocks.h`) for M inputs: on the AMX tiles where
// they run (`amx_gemm.h`), else with AVX-512 VNNI (`vnni_gemm.h`); the same bits either way.
#pragma once  // included by block_dot.h, after the kernels

namespace larql {

#if LARQL_TILED
// Whether this process may multiply tiled blocks on the AMX tiles.
inline bool tiles_on_amx() {
#if LARQL_AMX
  return amx_usable();
#else
  return false;
#endif
}

// Whether a product of `m_rows` int16 input rows runs on the AMX tiles (else with VNNI): where
// the tiles run, for more rows than one VNNI pass keeps in registers. Up to that VNNI is the
// faster unit — a one-row decode step of the default model 3.7 ms against 5.4 on the AMX tiles
// of a 2-core Xeon, eight rows level — and past it the tiles are (16 rows: 13.6 ms against
// 16.2; docs/PERFORMANCE.md). Both give the same bits, so the choice never changes a result.
inline bool products_on_amx(int64_t m_rows) { return m_rows > kVnniInputs && tiles_on_amx(); }

// Inputs up to which each thread of a product rounds them all itself, into its own buffers: a
// decode step's few rows cost a thread less to round than a parallel region of their own costs
// both threads to wait on (docs/PERFORMANCE.md, the tiled products on Zen 4); a prompt's many
// rows are rounded once, over the threads.
constexpr int64_t kOwnRounding = 1 << 15;

// The inputs x [M, k] rounded into `buffers` (`narrow`: to int8 codes), a group of up to
// kTileInputs rows each.
inline std::vector<TiledInputs> tiled_inputs(std::vector<TiledInputBuffers>& buffers,
                                             const float* x, int64_t m_rows, int64_t k,
                                             bool parallel, bool narrow) {
  const size_t group_count = static_cast<size_t>((m_rows + kTileInputs - 1) / kTileInputs);
  if (buffers.size() < group_count) buffers.resize(group_count);
  std::vector<TiledInputs> groups(group_count);
  for (size_t g = 0; g < group_count; ++g) {
    const int64_t m0 = static_cast<int64_t>(g) * kTileInputs;
    const int count = static_cast<int>(std::min<int64_t>(kTileInputs, m_rows - m0));
    groups[g] = buffers[g].fill(x + m0 * k, count, k, parallel, narrow);
  }
  return groups;
}

// A product's inputs x [M, k], rounded where its threads take them: by each thread for itself
// up to kOwnRounding, else once, over the threads, before the product.
class ProductInputs {
 public:
  ProductInputs(const float* x, int64_t m_rows, int64_t k, bool narrow)
      : x_(x), m_rows_(m_rows), k_(k), own_(m_rows * k <= kOwnRounding), narrow_(narrow) {
    thread_local std::vector<TiledInputBuffers> shared_buffers;
    if (!own_) shared_ = tiled_inputs(shared_buffers, x, m_rows, k, true, narrow);
  }

  // Inputs already rounded (one group of up to kTileInputs rows), by whoever made them.
  explicit ProductInputs(const TiledInputs& rounded)
      : x_(nullptr), m_rows_(rounded.count), k_(0), own_(false), narrow_(rounded.narrow),
        shared_{rounded} {}

  int64_t rows() const { return m_rows_; }
  bool narrow() const { return narrow_; }

  // The groups the calling thread multiplies (inside the product's parallel region).
  std::vector<TiledInputs> groups() const {
    if (!own_) return shared_;
    thread_local std::vector<TiledInputBuffers> own_buffers;
    return tiled_inputs(own_buffers, x_, m_rows_, k_, false, narrow_);
  }

 private:
  const float* x_;
  int64_t m_rows_, k_;
  bool own_, narrow_;
  std::vector<TiledInputs> shared_;
};

// The product of a matrix stacked from two halves of n / 2 rows each (a gated MLP's [gate; up])
// taken a pair of tiles at a time, with VNNI: tile t of the first half and tile t of the second;
// for every input their 32 outputs side by side, [M, 32] (tile t's 16 then its partner's), go to
// `epilogue(t, outputs)` on the thread that computed them — so what combines the halves runs
// inside the product, over the threads, not after it on one. The threads take the pairs two at
// a time, and after pairs 2b and 2b + 1 (outputs 32b .. 32b + 31 of each half: one block of 32
// of what the epilogue makes) the same thread calls `block_done(b)`. Each tile's outputs are
// `tiled_gemm`'s. Needs n a multiple of 32. `narrow`: int8 inputs.
template <typename Epilogue, typename BlockDone>
inline void tiled_gemm_halves(Format base, const uint8_t* tiled, int64_t n, int64_t blocks,
                              const float* x, int64_t m_rows, bool narrow,
                              const Epilogue& epilogue, const BlockDone& block_done) {
  const ProductInputs inputs(x, m_rows, blocks * kBlock, narrow);
  const int64_t tile_bytes = blocks * tile_block_bytes(base);
  const int64_t pairs = n / (2 * kTileOutputs);
  constexpr int64_t kPair = 2 * kTileOutputs;  // outputs of a pair, per input
  at::parallel_for(0, (pairs + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch<float> pair_outputs;
    const std::vector<TiledInputs> groups = inputs.groups();
    float* outputs = pair_outputs.take(m_rows * kPair);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t last = std::min(2 * b + 2, pairs);
      for (int64_t t = 2 * b; t < last; ++t) {
        for (size_t g = 0; g < groups.size(); ++g) {
          float* target = outputs + g * kTileInputs * kPair;
          vnni_tile_group(base, tiled + t * tile_bytes, blocks, groups[g], target, kPair);
          vnni_tile_group(base, tiled + (t + pairs) * tile_bytes, blocks, groups[g],
                          target + kTileOutputs, kPair);
        }
        epilogue(t, static_cast<const float*>(outputs));
      }
      if (last == 2 * b + 2) block_done(b);
    }
  });
}

// out: [M, n] for the inputs `inputs` (int16 codes, or int8 where narrow) and n weight rows
// held tiled (`tile_rows`), the tiles over torch's threads: on AMX two tiles at a time (the unit
// works on one while the other's sums are scaled), with VNNI one (int8 inputs and few rows
// always: `products_on_amx`).
inline void tiled_gemm(Format base, const uint8_t* tiled, int64_t n, int64_t blocks,
                       const ProductInputs& inputs, float* out) {
  const int64_t tile_bytes = blocks * tile_block_bytes(base);
  const int64_t tiles = n / kTileOutputs;
  const bool amx = !inputs.narrow() && products_on_amx(inputs.rows());
  const int64_t step = amx ? 2 : 1;  // tiles a task takes
  at::parallel_for(0, (tiles + step - 1) / step, 2, [&](int64_t begin, int64_t end) {
#if LARQL_AMX
    const TileSession session(amx);
#endif
    const std::vector<TiledInputs> groups = inputs.groups();
    for (int64_t p = begin; p < end; ++p) {
      const int64_t t = step * p;
      const uint8_t* tile = tiled + t * tile_bytes;
      for (size_t g = 0; g < groups.size(); ++g) {
        float* target = out + g * kTileInputs * n + t * kTileOutputs;
#if LARQL_AMX
        if (amx) {
          amx_tile_group(base, tile, tile_bytes, blocks, t + 1 < tiles, groups[g], target, n);
          continue;
        }
#endif
        vnni_tile_group(base, tile, blocks, groups[g], target, n);
      }
    }
  });
}

// The same for float32 inputs x [M, blocks · 32], rounded to int16 codes (`narrow`: int8).
inline void tiled_gemm(Format base, const uint8_t* tiled, int64_t n, int64_t blocks,
                       const float* x, int64_t m_rows, bool narrow, float* out) {
  tiled_gemm(base, tiled, n, blocks, ProductInputs(x, m_rows, blocks * kBlock, narrow), out);
}
#endif

}  // namespace larql
