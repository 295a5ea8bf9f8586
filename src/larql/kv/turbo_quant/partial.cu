// turbo-quant's partial attention launch in CUDA C++ (4-bit codes, head width 64, bfloat16
// queries; `cuda_partial.py` compiles it with NVRTC at first use and launches it in place of
// the Triton rotation and partial launches). One CTA of W warps per (K/V head, split, session):
//
// - Split CTAs (blockIdx.y < ns) attend over their coded rows. They rotate their group's
//   queries themselves (q·R, float32, from shared memory), then each warp walks its share of
//   the coded rows (whole load groups) with the next GROUP rows' loads in flight:
//   - the scores as S^T = K · Q^T with mma.sync m16n8k16: the key codes are the A operand
//     (16 key rows a product, none of them padding), the queries the B operand in registers;
//   - the weights transposed in registers (movmatrix) into the B operand of O^T = V^T · P^T,
//     whose A operand is the value codes;
//   - the codebook as a 256-entry table of bf16 pairs (one code byte -> its two centroids) in
//     shared memory at byte * 256 + 4 * lane: every lane reads its own bank, and one byte
//     permute forms the address from the code word and the lane. The coordinates a lane feeds
//     the products follow the bytes it loads (the queries take the same order), which leaves
//     every dot product unchanged.
//   The CTA merges its warps' states into one split state: m (natural log, plus centering's
//   shift q·μ_K), l, acc in the rotated basis (plus l·μ_V with centering).
// - The exact-rows CTA (blockIdx.y == ns) attends over the new row, the sinks and the recent
//   ring in the model's basis: a warp per row at a time, a lane per two coordinates.
//
// The states land where the Triton combine launch reads them: state (pair * (ns + 1) + split)
// of SR query rows, pair = session * HKV + head. Session b's store, exact rows and means are
// reached from the base pointers by the offsets in row b of `meta`. A store is laid out by
// plane (`planes.py`): each K/V head's codes, token by token, then every head's norms.
//
// Compile-time: HKV, G (query heads per K/V head, <= 8), SR (query rows a workspace state
// holds, >= G), SINKS, RECENT, RING (the ring's slots), CENTER, LUT_BASE (the dynamic shared memory's address in the shared window, an
// immediate of every table load; the launcher checks it against `base_out`).
#define D 64
#define W 8
#define CH 2             // 16-row chunks a load group
#define GROUP (16 * CH)  // rows a warp loads at once
#define PAY 32           // code bytes a vector (its float32 norm apart)
#define GP 8  // query rows a warp's state holds (the products' 8 columns)
#define META 7
#define AT_CODES 0
#define AT_EXACT 1
#define AT_MEAN_ROTATED 5
#define AT_SLOTS 6
#define LUT_BYTES (256 * 256)
#define EXACT_ROWS (SINKS + (RECENT > 0 ? RING : 0))
// exact rows a warp loads at once: all of its rows, up to 8
#define EXACT_BATCH (EXACT_ROWS > 8 * W ? 8 : EXACT_ROWS > 0 ? (EXACT_ROWS + W - 1) / W : 1)
#define STR2(x) #x
#define STR(x) STR2(x)
#define LUT_BASE_STR STR(LUT_BASE)
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float bf16_low(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_high(u32 x) { return __uint_as_float(x & 0xffff0000u); }

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                    u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 transposed(u32 x) {
  u32 r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

extern __shared__ __align__(16) unsigned char smem[];

// The table word of byte j of w for this lane: address byte * 256 + lane4 (one PRMT).
__device__ __forceinline__ u32 lut_word(u32 w, int j, u32 lane4) {
  const u32 addr = __byte_perm(w, lane4, 0x5504u | (u32)(j << 4));
  u32 r;
  asm("ld.shared.b32 %0, [%1+" LUT_BASE_STR "];" : "=r"(r) : "r"(addr));
  return r;
}

// Shared memory after the table: the rotated queries, centering's shifts, the warps' states
// (the rotation matrix is staged where the warps' values go: it is read before them).
struct Scratch {
  u32* q_raw;    // [GP][D / 2] the queries as loaded (bfloat16 pairs)
  float* q;      // [GP][D]
  float* shift;  // [GP] q·μ_K · scale
  float* m;      // [W][GP] log2 domain
  float* l;      // [W][GP]
  float* acc;    // [W][GP][D]
};

__device__ __forceinline__ Scratch scratch() {
  Scratch s;
  s.q_raw = (u32*)(smem + LUT_BYTES);
  s.q = (float*)(s.q_raw + GP * D / 2);
  s.shift = s.q + GP * D;
  s.m = s.shift + GP;
  s.l = s.m + W * GP;
  s.acc = s.l + W * GP;
  return s;
}

struct Group {   // one warp's loads for GROUP rows (CH chunks of 16), per lane
  u32 kw[CH][4];  // [chunk][row c word t, row c word t+4, row c+8 word t, row c+8 word t+4]
  float kn[CH][2];  // [chunk][rows c, c + 8] key norms (0 past the rows)
  float vn[CH][2];  // value norms, same rows
  u32 vw[CH][4];  // [chunk][rows 2t, 2t+1, 2t+8, 2t+9] word c of the value codes
};

struct Pointers {           // a lane's first bytes of a group, advanced GROUP rows a group
  const unsigned char* kw;  // key codes: row c, word t
  const float* norms;       // row c's key norm (its value norm `value_norms` further)
  const unsigned char* vw;  // value codes: row 2t, word c
  int value_norms;          // HKV * slots
};

// TAIL: rows at or past `left` (rows left from the group's first) read nothing, weigh nothing
template <bool TAIL>
__device__ __forceinline__ void load_group(Group& g, const Pointers& p, int left, int c, int t) {
#pragma unroll
  for (int ch = 0; ch < CH; ++ch) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int rows = 16 * ch + 8 * i;  // from the lane's first row
      const bool present = !TAIL || rows + c < left;
      g.kw[ch][2 * i] = present ? __ldg((const u32*)(p.kw + rows * PAY)) : 0u;
      g.kw[ch][2 * i + 1] = present ? __ldg((const u32*)(p.kw + rows * PAY + 16)) : 0u;
      g.kn[ch][i] = present ? __ldg(p.norms + rows) : 0.f;
      g.vn[ch][i] = present ? __ldg(p.norms + rows + p.value_norms) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rows = 16 * ch + (i & 1) + 8 * (i >> 1);
      const bool present = !TAIL || rows + 2 * t < left;
      g.vw[ch][i] = present ? __ldg((const u32*)(p.vw + rows * PAY)) : 0u;
    }
  }
}

__device__ __forceinline__ void advance(Pointers& p) {
  p.kw += GROUP * PAY;
  p.norms += GROUP;
  p.vw += GROUP * PAY;
}

struct State {      // a warp's softmax state, per lane: queries 2t, 2t + 1 (log2 domain)
  float acc[4][4];  // O^T m-tile jm: [d = c][g = 2t], [c][2t+1], [c+8][2t], [c+8][2t+1]
  float m0, m1, l0, l1;
};

template <bool TAIL>
__device__ __forceinline__ void consume(State& st, const Group& g, int left, u32 lane4, int c,
                                        float scale_log2, const u32 (&qb0)[4],
                                        const u32 (&qb1)[4]) {
  float s[CH][4];  // [chunk][row c: g 2t, 2t+1; row c+8: g 2t, 2t+1]
#pragma unroll
  for (int ch = 0; ch < CH; ++ch) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 a0 = lut_word(g.kw[ch][0], j, lane4);
      const u32 a1 = lut_word(g.kw[ch][2], j, lane4);
      const u32 a2 = lut_word(g.kw[ch][1], j, lane4);
      const u32 a3 = lut_word(g.kw[ch][3], j, lane4);
      mma(d, a0, a1, a2, a3, qb0[j], qb1[j]);
    }
    const float k0 = g.kn[ch][0] * scale_log2, k1 = g.kn[ch][1] * scale_log2;
    const bool p0 = !TAIL || 16 * ch + c < left, p1 = !TAIL || 16 * ch + 8 + c < left;
    s[ch][0] = p0 ? d[0] * k0 : -INFINITY;
    s[ch][1] = p0 ? d[1] * k0 : -INFINITY;
    s[ch][2] = p1 ? d[2] * k1 : -INFINITY;
    s[ch][3] = p1 ? d[3] * k1 : -INFINITY;
  }
  float x0 = fmaxf(s[0][0], s[0][2]), x1 = fmaxf(s[0][1], s[0][3]);
#pragma unroll
  for (int ch = 1; ch < CH; ++ch) {
    x0 = fmaxf(x0, fmaxf(s[ch][0], s[ch][2]));
    x1 = fmaxf(x1, fmaxf(s[ch][1], s[ch][3]));
  }
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, o));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, o));
  }
  const float n0 = fmaxf(st.m0, x0), n1 = fmaxf(st.m1, x1);
  const float safe0 = n0 == -INFINITY ? 0.f : n0, safe1 = n1 == -INFINITY ? 0.f : n1;
  const float alpha0 = exp2f(st.m0 - safe0), alpha1 = exp2f(st.m1 - safe1);
  st.m0 = n0;
  st.m1 = n1;
  st.l0 *= alpha0;
  st.l1 *= alpha1;
#pragma unroll
  for (int jm = 0; jm < 4; ++jm) {
    st.acc[jm][0] *= alpha0;
    st.acc[jm][1] *= alpha1;
    st.acc[jm][2] *= alpha0;
    st.acc[jm][3] *= alpha1;
  }
#pragma unroll
  for (int ch = 0; ch < CH; ++ch) {
    const float e0 = exp2f(s[ch][0] - safe0), e1 = exp2f(s[ch][1] - safe1);
    const float e2 = exp2f(s[ch][2] - safe0), e3 = exp2f(s[ch][3] - safe1);
    st.l0 += e0 + e2;
    st.l1 += e1 + e3;
    const float v0 = g.vn[ch][0], v1 = g.vn[ch][1];
    // B = P^T: the weights of rows c (c + 8), queries 2t, 2t+1, transposed to rows 2t, 2t+1
    // (2t + 8, 2t + 9) of query c
    const u32 b0 = transposed(pack_bf16(e0 * v0, e1 * v0));
    const u32 b1 = transposed(pack_bf16(e2 * v1, e3 * v1));
#pragma unroll
    for (int jm = 0; jm < 4; ++jm) {
      const u32 r0 = lut_word(g.vw[ch][0], jm, lane4);
      const u32 r1 = lut_word(g.vw[ch][1], jm, lane4);
      const u32 r2 = lut_word(g.vw[ch][2], jm, lane4);
      const u32 r3 = lut_word(g.vw[ch][3], jm, lane4);
      // A = V^T rows (coordinates) 2(4c + jm) [low nibble], 2(4c + jm) + 1 [high]
      mma(st.acc[jm], __byte_perm(r0, r1, 0x5410u), __byte_perm(r0, r1, 0x7632u),
          __byte_perm(r2, r3, 0x5410u), __byte_perm(r2, r3, 0x7632u), b0, b1);
    }
  }
}

// The CTA's W warp states (in `sc`) merged into state `state_index` (SR rows): m in the
// natural-log domain plus `shift` (null for none), acc plus l·mean with MEAN (`mean_d`: the
// mean's coordinate threadIdx.x % D, which every item of a thread has). Rows >= G are written
// as `pad_m`, `pad_l`, 0.
template <bool MEAN>
__device__ __forceinline__ void merge_warps(const Scratch& sc, int state_index, const float* shift,
                                            float mean_d, float pad_m, float pad_l,
                                            float* m_out, float* l_out, float* acc_out) {
  static_assert((W * 32) % D == 0, "a thread's items share one coordinate");
  for (int idx = threadIdx.x; idx < SR * D; idx += W * 32) {
    const int g = idx / D, d = idx % D;
    float top = -INFINITY, total = 0.f, out = 0.f;
    if (g < G) {
#pragma unroll
      for (int w = 0; w < W; ++w) top = fmaxf(top, sc.m[w * GP + g]);
      if (top != -INFINITY) {
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const float f = exp2f(sc.m[w * GP + g] - top);
          total += f * sc.l[w * GP + g];
          out += f * sc.acc[(w * GP + g) * D + d];
        }
      }
    }
    float m = top * 0.69314718055994530942f;  // natural log
    if (g < G && shift != nullptr) m += shift[g];
    if (MEAN && g < G) out += total * mean_d;
    if (g >= G) {
      m = pad_m;
      total = pad_l;
    }
    const int at = state_index * SR + g;
    if (d == 0) {
      m_out[at] = m;
      l_out[at] = total;
    }
    acc_out[at * D + d] = out;
  }
}

__device__ void split_state(const u16* q, const float* rotation, const unsigned char* codes,
                            const float* centroids, const float* mean_rotated, int head, int split,
                            int rpw, int lo, int hi, int slots, float scale, float scale_log2,
                            int state_index, float* m_out, float* l_out, float* acc_out) {
  const Scratch sc = scratch();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = lane >> 2, t = lane & 3;
  const int first = lo + (split * W + warp) * rpw;
  const int last = min(first + rpw, hi);
  Pointers p;
  // the store by plane: head h's key codes [slots][PAY] from byte h * slots * PAY, its value
  // codes HKV planes further, then every plane's norms (float32 [2 * HKV][slots])
  const size_t key_row = (size_t)head * slots + max(first, 0);  // the warp's first row's
  const size_t value_row = key_row + (size_t)HKV * slots;
  p.kw = codes + (key_row + c) * PAY + 4 * t;
  p.vw = codes + (value_row + 2 * t) * PAY + 4 * c;
  p.norms = (const float*)(codes + (size_t)2 * HKV * slots * PAY) + key_row + c;
  p.value_norms = HKV * slots;
  const int full = max(last - first, 0) / GROUP;
  Group ga, gb;
  if (full > 0) load_group<false>(ga, p, 0, c, t);
  // Every other load of the set-up is issued before any is waited for, so their latencies
  // overlap (the set-up is ~30% of a split CTA at depth 32,000 on an H200; this took ~900
  // cycles off it).
  static_assert(W * 32 == 256, "the table's 2,048 parts of 16 bytes, 8 a thread");
  static_assert(D * D % (4 * W * 32) == 0 && G * D / 2 <= W * 32, "the loads' shares");
  constexpr int ROT = D * D / (4 * W * 32);  // float4s of the rotation a thread
  float4 rot[ROT];
#pragma unroll
  for (int i = 0; i < ROT; ++i) rot[i] = __ldg((const float4*)rotation + tid + i * W * 32);
  const u32 q_word = tid < G * D / 2 ? __ldg((const u32*)q + tid) : 0u;
  // the table's entries this thread writes (below): bytes tid / 8 + 32 j, j < 8, whose low
  // nibble is the same for all j
  const float c_lo = __ldg(centroids + ((tid >> 3) & 15));
  float c_hi[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) c_hi[j] = __ldg(centroids + (tid >> 7) + 2 * j);
  float mean_k0 = 0.f, mean_k1 = 0.f, mean_v = 0.f;
  if (CENTER) {
    mean_k0 = __ldg(mean_rotated + head * D + lane);
    mean_k1 = __ldg(mean_rotated + head * D + lane + 32);
    mean_v = __ldg(mean_rotated + (HKV + head) * D + tid % D);
  }
  // The table in order, 16 bytes a thread at a time: part u of the 2,048 is byte u / 8's
  // (u % 8)-th 16 bytes, so a warp's stores cover whole rows of banks. (A thread writing all
  // of one byte's 256 bytes had 32-way bank conflicts: a warp's stores were 256 bytes apart;
  // this took ~0.9 µs off a launch of 16 µs.) Then the rotation, staged where the warps' values
  // go later, and the queries.
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int u = tid + W * 32 * j;
    const u32 v = pack_bf16(c_lo, c_hi[j]);
    *(uint4*)(smem + (u >> 3) * 256 + 16 * (u & 7)) = make_uint4(v, v, v, v);
  }
#pragma unroll
  for (int i = 0; i < ROT; ++i) ((float4*)sc.acc)[tid + i * W * 32] = rot[i];
  if (tid < G * D / 2) sc.q_raw[tid] = q_word;
  __syncthreads();
  for (int idx = tid; idx < GP * D; idx += W * 32) {  // q·R, float32
    const int g = idx / D, d = idx % D;
    float r = 0.f;
    if (g < G) {
#pragma unroll 16
      for (int k = 0; k < D; k += 2) {
        const u32 pair = sc.q_raw[(g * D + k) / 2];
        r += bf16_low(pair) * sc.acc[k * D + d];
        r += bf16_high(pair) * sc.acc[(k + 1) * D + d];
      }
    }
    sc.q[idx] = r;
  }
  __syncthreads();
  if (CENTER && warp < G) {  // q·μ_K, a constant over the coded rows' scores
    float s = sc.q[warp * D + lane] * mean_k0 + sc.q[warp * D + lane + 32] * mean_k1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sc.shift[warp] = s * scale;
  }
  // B = Q^T: b0 = q[g = c][coordinates of byte 4t + j], b1 = q[c][byte 16 + 4t + j]
  u32 qb0[4], qb1[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int d0 = 2 * (4 * t + j), d1 = 2 * (16 + 4 * t + j);
    qb0[j] = pack_bf16(sc.q[c * D + d0], sc.q[c * D + d0 + 1]);
    qb1[j] = pack_bf16(sc.q[c * D + d1], sc.q[c * D + d1 + 1]);
  }
  const u32 lane4 = 4u * lane;
  State st;
#pragma unroll
  for (int jm = 0; jm < 4; ++jm) st.acc[jm][0] = st.acc[jm][1] = st.acc[jm][2] = st.acc[jm][3] = 0.f;
  st.m0 = st.m1 = -INFINITY;
  st.l0 = st.l1 = 0.f;
  // full groups alternate between two sets of registers (no copies); then the tail
  int i = 0;
  for (; i + 2 <= full; i += 2) {
    advance(p);
    load_group<false>(gb, p, 0, c, t);
    consume<false>(st, ga, 0, lane4, c, scale_log2, qb0, qb1);
    advance(p);
    if (i + 2 < full) load_group<false>(ga, p, 0, c, t);
    consume<false>(st, gb, 0, lane4, c, scale_log2, qb0, qb1);
  }
  if (i < full) {
    consume<false>(st, ga, 0, lane4, c, scale_log2, qb0, qb1);
    advance(p);
  }
  const int left = last - (first + GROUP * full);
  if (left > 0) {
    load_group<true>(gb, p, left, c, t);
    consume<true>(st, gb, left, lane4, c, scale_log2, qb0, qb1);
  }
  float l0 = st.l0, l1 = st.l1;
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  __syncthreads();  // every warp is done with the staged rotation
  const int g0 = 2 * t, g1 = 2 * t + 1;
  if (c == 0) {
    sc.m[warp * GP + g0] = st.m0;
    sc.m[warp * GP + g1] = st.m1;
    sc.l[warp * GP + g0] = l0;
    sc.l[warp * GP + g1] = l1;
  }
#pragma unroll
  for (int jm = 0; jm < 4; ++jm) {
    const int dim = 2 * (4 * c + jm);
    sc.acc[(warp * GP + g0) * D + dim] = st.acc[jm][0];
    sc.acc[(warp * GP + g1) * D + dim] = st.acc[jm][1];
    sc.acc[(warp * GP + g0) * D + dim + 1] = st.acc[jm][2];
    sc.acc[(warp * GP + g1) * D + dim + 1] = st.acc[jm][3];
  }
  __syncthreads();
  merge_warps<CENTER>(sc, state_index, CENTER ? sc.shift : nullptr, mean_v, -INFINITY, 0.f,
                      m_out, l_out, acc_out);
}

// One exact row (key word kw, value word vw: this lane's two coordinates) into a warp's state.
__device__ __forceinline__ void exact_row(u32 kw, u32 vw, const float (&q0)[G],
                                          const float (&q1)[G], float scale_log2, float (&m)[G],
                                          float (&l)[G], float (&a0)[G], float (&a1)[G]) {
  const float k0 = bf16_low(kw), k1 = bf16_high(kw), v0 = bf16_low(vw), v1 = bf16_high(vw);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float s = q0[g] * k0 + q1[g] * k1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    s *= scale_log2;
    const float n = fmaxf(m[g], s);
    const float alpha = exp2f(m[g] - n), e = exp2f(s - n);
    l[g] = l[g] * alpha + e;
    a0[g] = a0[g] * alpha + e * v0;
    a1[g] = a1[g] * alpha + e * v1;
    m[g] = n;
  }
}

__device__ void exact_state(const u16* q, const u16* k_new, const u16* v_new, const u16* exact,
                            int head, int pos, int keep, float scale_log2, int state_index,
                            float* m_out, float* l_out, float* acc_out) {
  const Scratch sc = scratch();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float q0[G], q1[G], m[G], l[G], a0[G], a1[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const u32 word = *(const u32*)(q + g * D + 2 * lane);
    q0[g] = bf16_low(word);
    q1[g] = bf16_high(word);
    m[g] = -INFINITY;
    l[g] = a0[g] = a1[g] = 0.f;
  }
  if (warp == 0) {  // the new row, always seen
    exact_row(*(const u32*)(k_new + head * D + 2 * lane), *(const u32*)(v_new + head * D + 2 * lane),
              q0, q1, scale_log2, m, l, a0, a1);
  }
  // a warp's rows loaded EXACT_BATCH at a time before any is attended: each row's load would
  // otherwise wait a memory latency after the previous row's softmax
  const int stride = 2 * HKV * D;  // elements a token in the exact rows
  for (int first = warp; first < EXACT_ROWS; first += EXACT_BATCH * W) {
    u32 kw[EXACT_BATCH], vw[EXACT_BATCH];
    bool present[EXACT_BATCH];
#pragma unroll
    for (int i = 0; i < EXACT_BATCH; ++i) {
      const int e = first + i * W;
      if (e >= EXACT_ROWS) {
        present[i] = false;
      } else if (e < SINKS) {
        present[i] = e < pos;
      } else {  // ring slot r holds tokens r, r + RING, …: its latest before the position
        const int r = e - SINKS;
        const int latest = r <= pos - 1 ? r + RING * ((pos - 1 - r) / RING) : -1;
        present[i] =
            r <= pos - 1 && latest >= pos - RECENT && latest >= SINKS && latest >= pos - keep;
      }
      const u16* row = exact + (present[i] ? e : 0) * stride + head * D + 2 * lane;
      kw[i] = present[i] ? *(const u32*)row : 0u;
      vw[i] = present[i] ? *(const u32*)(row + HKV * D) : 0u;
    }
#pragma unroll
    for (int i = 0; i < EXACT_BATCH; ++i) {
      if (present[i]) exact_row(kw[i], vw[i], q0, q1, scale_log2, m, l, a0, a1);
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sc.m[warp * GP + g] = m[g];
      sc.l[warp * GP + g] = l[g];
    }
    sc.acc[(warp * GP + g) * D + 2 * lane] = a0[g];
    sc.acc[(warp * GP + g) * D + 2 * lane + 1] = a1[g];
  }
  __syncthreads();
  // rows past the group: a finite state of weight 1 and no value (as a zero query would give)
  merge_warps<false>(sc, state_index, nullptr, 0.f, 0.f, 1.f, m_out, l_out, acc_out);
}

extern "C" __global__ void __launch_bounds__(W * 32, 2)
turbo_quant_partial(const u16* __restrict__ q,  // [B, HKV * G, D] bfloat16
                    const float* __restrict__ rotation,  // [D, D] float32
                    const u16* __restrict__ k_new,  // [B, HKV, D] bfloat16: the new row
                    const u16* __restrict__ v_new,
                    const unsigned char* __restrict__ codes_base,  // the stores' base
                    const u16* __restrict__ exact_base,  // the exact rows' base (bfloat16)
                    const float* __restrict__ centroids,  // [16] float32
                    const float* __restrict__ mean_rotated_base,  // the rotated means' base
                    const long long* __restrict__ meta,  // [B, META]: offsets, slots
                    const long long* __restrict__ positions,  // [B]: the new tokens'
                    float* __restrict__ m_out,  // [B * HKV, ns + 1, SR]
                    float* __restrict__ l_out,
                    float* __restrict__ acc_out,  // [B * HKV, ns + 1, SR, D]
                    int ns, int keep, double scale, unsigned int* __restrict__ base_out) {
  if (ns < 0) {  // the launcher's check: where the table sits in the shared window
    if (threadIdx.x == 0) *base_out = (u32)__cvta_generic_to_shared(smem);
    return;
  }
  const int head = blockIdx.x, split = blockIdx.y, seq = blockIdx.z;
  const long long* row = meta + seq * META;
  const int pos = (int)positions[seq];
  const int state_index = (seq * HKV + head) * (ns + 1) + split;
  const float scale_log2 = (float)(scale * 1.4426950408889634);
  const u16* q_session = q + ((size_t)seq * HKV + head) * G * D;
  if (split == ns) {
    exact_state(q_session, k_new + (size_t)seq * HKV * D, v_new + (size_t)seq * HKV * D,
                exact_base + row[AT_EXACT], head, pos, keep, scale_log2, state_index, m_out, l_out,
                acc_out);
    return;
  }
  // the coded tokens [max(pos − keep, SINKS), pos − RECENT), token t in slot t (no ring)
  const int slots = (int)row[AT_SLOTS];
  const int lo = max(pos - keep, SINKS);
  const int hi = max(min(max(pos - RECENT, 0), slots), lo);
  // the rows shared out evenly: whole load groups a warp, whatever the store's capacity
  const int rpw = (hi - lo + ns * W * GROUP - 1) / (ns * W * GROUP) * GROUP;
  split_state(q_session, rotation, codes_base + row[AT_CODES], centroids,
              mean_rotated_base + row[AT_MEAN_ROTATED], head, split, rpw, lo, hi, slots,
              (float)scale, scale_log2, state_index, m_out, l_out, acc_out);
}
