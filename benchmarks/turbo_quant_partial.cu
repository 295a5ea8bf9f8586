// A prototype of turbo-quant's split partial launch in CUDA C++ (4-bit codes, head width 64,
// bfloat16 products): one program (CTA) of W warps per (K/V head, split), each warp walking RPW
// coded rows and the CTA merging its warps' softmax states into one split state (m in the
// natural-log domain, l, acc in the rotated basis, as the Triton launch stores them).
// Timed against the Triton launch by benchmarks/turbo_quant_cuda_partial.py; not yet wired into
// the engine (docs/PERFORMANCE.md).
//
// - Scores as S^T = K · Q^T with mma.sync m16n8k16: the key codes are the A operand (16 rows a
//   product, none of it padding), the group's queries the B operand (kept in registers).
// - The weights are transposed in registers (movmatrix) into the B operand of
//   O^T = V^T · P^T, whose A operand is the value codes.
// - The codebook is a 256-entry table of bf16 pairs (one code byte -> its two centroids) in
//   shared memory at byte byte * 256 + 4 * lane: every lane reads its own bank, and one byte
//   permute (PRMT) forms the address from the code word and the lane. The coordinates a lane
//   feeds the products are permuted to the bytes it loads (the queries take the same order),
//   which leaves every dot product unchanged.
// - SPLIT = 1 reads a layout with the norms apart: codes [slot][2][Hkv][32 B], norms float
//   [2][Hkv][slots]; SPLIT = 0 the store as the engine keeps it, [slot][2][Hkv][norm, 32 B].
#ifndef HKV
#define HKV 8
#endif
#ifndef G
#define G 4
#endif
#ifndef W
#define W 8
#endif
#ifndef RPW
#define RPW 128
#endif
#ifndef MINB
#define MINB 2
#endif
#ifndef CH
#define CH 2
#endif
#define GROUP (16 * CH)
#define BPV 36
#ifndef SPLIT
#define SPLIT 0
#endif
// SPLIT: the codes [slot][2][Hkv][32 B] (each vector one aligned sector), the norms apart as
// float [2][Hkv][slots] (a head's norms contiguous: one load covers 32 rows)
#if SPLIT
#define ROW_BYTES (2 * HKV * 32)
#else
#define ROW_BYTES (2 * HKV * BPV)
#endif
#define LUT_BYTES (256 * 256)
// the dynamic shared memory's address in the shared window, an immediate of every table load
// (checked by the caller against what the kernel reports)
#ifndef LUT_BASE
#define LUT_BASE 1024
#endif
#define STR2(x) #x
#define STR(x) STR2(x)
#define LUT_BASE_STR STR(LUT_BASE)
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned int u32;

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

struct Group {     // one warp's loads for GROUP rows (CH chunks of 16), per lane
  u32 kw[CH][4];    // [chunk][row c word t, row c word t+4, row c+8 word t, row c+8 word t+4]
#if SPLIT
  float knl[(CH + 1) / 2];  // the key norm of row 32h + lane of the group (0 past the rows)
  float vnl[(CH + 1) / 2];
#else
  float kn[CH][2];  // [chunk][rows c, c + 8] key norms (0 past the rows)
  float vn[CH][2];  // value norms, same rows
#endif
  u32 vw[CH][4];    // [chunk][rows 2t, 2t+1, 2t+8, 2t+9] word c of the value codes
};

struct Pointers {               // a lane's first bytes of a group, advanced 32 rows a group
  const unsigned char* kw;      // key codes: row c, word t
#if SPLIT
  const float* norms;           // the key norm of row `lane` (values' HKV * slots further)
  int slots;
#else
  const unsigned char* norms;   // row c's key norm (its value norm HKV * BPV further)
#endif
  const unsigned char* vw;      // value codes: row 2t, word c
};

// TAIL: rows at or past `left` (rows left from the group's first) read nothing, weigh nothing
template <bool TAIL>
__device__ __forceinline__ void load_group(Group& g, const Pointers& p, int left, int c, int t,
                                           int lane) {
#pragma unroll
  for (int ch = 0; ch < CH; ++ch) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int rows = 16 * ch + 8 * i;  // from the lane's first row
      const bool present = !TAIL || rows + c < left;
#if SPLIT
      const uint2 two = present ? __ldg((const uint2*)(p.kw + rows * ROW_BYTES)) : make_uint2(0u, 0u);
      g.kw[ch][2 * i] = two.x;
      g.kw[ch][2 * i + 1] = two.y;
#else
      g.kw[ch][2 * i] = present ? __ldg((const u32*)(p.kw + rows * ROW_BYTES)) : 0u;
      g.kw[ch][2 * i + 1] = present ? __ldg((const u32*)(p.kw + rows * ROW_BYTES + 16)) : 0u;
      g.kn[ch][i] = present ? __ldg((const float*)(p.norms + rows * ROW_BYTES)) : 0.f;
      g.vn[ch][i] =
          present ? __ldg((const float*)(p.norms + rows * ROW_BYTES + HKV * BPV)) : 0.f;
#endif
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rows = 16 * ch + (i & 1) + 8 * (i >> 1);
      const bool present = !TAIL || rows + 2 * t < left;
      g.vw[ch][i] = present ? __ldg((const u32*)(p.vw + rows * ROW_BYTES)) : 0u;
    }
  }
#if SPLIT
#pragma unroll
  for (int h = 0; h < (CH + 1) / 2; ++h) {
    const bool present = !TAIL || 32 * h + lane < left;
    g.knl[h] = present ? __ldg(p.norms + 32 * h) : 0.f;
    g.vnl[h] = present ? __ldg(p.norms + 32 * h + HKV * p.slots) : 0.f;
  }
#endif
}

__device__ __forceinline__ void advance(Pointers& p) {
  p.kw += GROUP * ROW_BYTES;
#if SPLIT
  p.norms += GROUP;
#else
  p.norms += GROUP * ROW_BYTES;
#endif
  p.vw += GROUP * ROW_BYTES;
}

struct State {      // a warp's softmax state, per lane: queries 2t, 2t + 1
  float acc[4][4];  // O^T m-tile jm: [d = c][g = 2t], [c][2t+1], [c+8][2t], [c+8][2t+1]
  float m0, m1, l0, l1;
};

template <bool TAIL>
__device__ __forceinline__ void consume(State& st, const Group& g, int left,
                                        u32 lane4, int c, float scale_log2, const u32 (&qb0)[4],
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
#if SPLIT
      const float k0 = __shfl_sync(0xffffffffu, g.knl[ch >> 1], 16 * (ch & 1) + c) * scale_log2;
      const float k1 = __shfl_sync(0xffffffffu, g.knl[ch >> 1], 16 * (ch & 1) + 8 + c) * scale_log2;
#else
      const float k0 = g.kn[ch][0] * scale_log2, k1 = g.kn[ch][1] * scale_log2;
#endif
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
#if SPLIT
      const float v0 = __shfl_sync(0xffffffffu, g.vnl[ch >> 1], 16 * (ch & 1) + c);
      const float v1 = __shfl_sync(0xffffffffu, g.vnl[ch >> 1], 16 * (ch & 1) + 8 + c);
#else
      const float v0 = g.vn[ch][0], v1 = g.vn[ch][1];
#endif
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

extern "C" __global__ void __launch_bounds__(W * 32, MINB)
tq_partial(const unsigned char* __restrict__ codes, const float* __restrict__ q_rot,
           const float* __restrict__ centroids, int n_rows, float scale_log2,
           float* __restrict__ m_out, float* __restrict__ l_out, float* __restrict__ acc_out,
           int ns, unsigned int* __restrict__ base_out, const float* __restrict__ norms, int slots) {
  // dynamic shared memory: the table (64 KB), then the warps' states for the merge
  float* sm_m = (float*)(smem + LUT_BYTES);  // [W][8]
  float* sm_l = sm_m + W * 8;                // [W][8]
  float* sm_acc = sm_l + W * 8;              // [W][8][64]
  const int head = blockIdx.x, split = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = lane >> 2, t = lane & 3;
  // B = Q^T: b0 = q[g = c][coordinates of byte 4t + j], b1 = q[c][byte 16 + 4t + j]
  u32 qb0[4], qb1[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    qb0[j] = 0u;
    qb1[j] = 0u;
    if (c < G) {
      const float* q = q_rot + (head * G + c) * 64;
#if SPLIT
      const int d0 = 2 * (8 * t + j), d1 = 2 * (8 * t + 4 + j);  // words 2t, 2t + 1
#else
      const int d0 = 2 * (4 * t + j), d1 = 2 * (16 + 4 * t + j);
#endif
      qb0[j] = pack_bf16(q[d0], q[d0 + 1]);
      qb1[j] = pack_bf16(q[d1], q[d1 + 1]);
    }
  }
  const u32 lut_base = (u32)__cvta_generic_to_shared(smem);
  const u32 lane4 = 4u * lane;
  if (tid == 0 && head == 0 && split == 0) *base_out = lut_base;

  State st;
#pragma unroll
  for (int jm = 0; jm < 4; ++jm) st.acc[jm][0] = st.acc[jm][1] = st.acc[jm][2] = st.acc[jm][3] = 0.f;
  st.m0 = st.m1 = -INFINITY;
  st.l0 = st.l1 = 0.f;
  const int first = (split * W + warp) * RPW;
  const int last = min(first + RPW, n_rows);
  Pointers p;
#if SPLIT
  const unsigned char* hk = codes + head * 32;
  const unsigned char* hv = codes + (HKV + head) * 32;
  p.kw = hk + ((size_t)first + c) * ROW_BYTES + 8 * t;
  p.norms = norms + (size_t)head * slots + first + lane;
  p.slots = slots;
  p.vw = hv + ((size_t)first + 2 * t) * ROW_BYTES + 4 * c;
#else
  const unsigned char* hk = codes + head * BPV;
  const unsigned char* hv = codes + (HKV + head) * BPV;
  p.kw = hk + ((size_t)first + c) * ROW_BYTES + 4 + 4 * t;
  p.norms = hk + ((size_t)first + c) * ROW_BYTES;
  p.vw = hv + ((size_t)first + 2 * t) * ROW_BYTES + 4 + 4 * c;
#endif
  // full groups alternate between two sets of registers (no copies); then the tail
  const int full = max(last - first, 0) / GROUP;
  Group ga, gb;
  if (full > 0) load_group<false>(ga, p, 0, c, t, lane);
  for (int byte = tid; byte < 256; byte += W * 32) {
    const u32 v = pack_bf16(centroids[byte & 15], centroids[byte >> 4]);
    const uint4 four = make_uint4(v, v, v, v);
#pragma unroll
    for (int l4 = 0; l4 < 8; ++l4) *(uint4*)(smem + byte * 256 + 16 * l4) = four;
  }
  __syncthreads();
  int i = 0;
  for (; i + 2 <= full; i += 2) {
    advance(p);
    load_group<false>(gb, p, 0, c, t, lane);
    consume<false>(st, ga, 0, lane4, c, scale_log2, qb0, qb1);
    advance(p);
    if (i + 2 < full) load_group<false>(ga, p, 0, c, t, lane);
    consume<false>(st, gb, 0, lane4, c, scale_log2, qb0, qb1);
  }
  if (i < full) {
    consume<false>(st, ga, 0, lane4, c, scale_log2, qb0, qb1);
    advance(p);
  }
  const int left = last - (first + GROUP * full);
  if (left > 0) {
    load_group<true>(gb, p, left, c, t, lane);
    consume<true>(st, gb, left, lane4, c, scale_log2, qb0, qb1);
  }
  float m0 = st.m0, m1 = st.m1, l0 = st.l0, l1 = st.l1;
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  const int g0 = 2 * t, g1 = 2 * t + 1;
  if (c == 0) {
    sm_m[warp * 8 + g0] = m0;
    sm_m[warp * 8 + g1] = m1;
    sm_l[warp * 8 + g0] = l0;
    sm_l[warp * 8 + g1] = l1;
  }
#pragma unroll
  for (int jm = 0; jm < 4; ++jm) {
    const int dim = 2 * (4 * c + jm);
    sm_acc[(warp * 8 + g0) * 64 + dim] = st.acc[jm][0];
    sm_acc[(warp * 8 + g1) * 64 + dim] = st.acc[jm][1];
    sm_acc[(warp * 8 + g0) * 64 + dim + 1] = st.acc[jm][2];
    sm_acc[(warp * 8 + g1) * 64 + dim + 1] = st.acc[jm][3];
  }
  __syncthreads();
  for (int idx = tid; idx < G * 64; idx += W * 32) {
    const int g = idx >> 6, d = idx & 63;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) top = fmaxf(top, sm_m[w * 8 + g]);
    float total = 0.f, out = 0.f;
    if (top != -INFINITY) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float f = exp2f(sm_m[w * 8 + g] - top);
        total += f * sm_l[w * 8 + g];
        out += f * sm_acc[(w * 8 + g) * 64 + d];
      }
    }
    const int state = (head * ns + split) * G + g;
    if (d == 0) {
      m_out[state] = top * 0.69314718055994530942f;  // natural log domain
      l_out[state] = total;
    }
    acc_out[state * 64 + d] = out;
  }
}
