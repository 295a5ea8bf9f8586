// Whether AVX-512 VNNI byte products and float multiply-adds share the CPU's pipes: time 8
// independent 512-bit VPDPBUSD chains, 8 VFMADD231PS chains, and both together (8 + 4). If the
// mixed loop takes the sum of the two loops' shares, they take turns on the same pipes.
//
//   gcc -O2 -march=native -o /tmp/cpu_pipes benchmarks/cpu_pipes.c && /tmp/cpu_pipes
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define DP(c) c = _mm512_dpbusd_epi32(c, a, b)
#define FMA(f) f = _mm512_fmadd_ps(x, y, f)

__attribute__((noinline)) static void products(__m512i* o, __m512i a, __m512i b, long n) {
  __m512i c0 = o[0], c1 = o[1], c2 = o[2], c3 = o[3], c4 = o[4], c5 = o[5], c6 = o[6], c7 = o[7];
  for (long i = 0; i < n; i++) {
    DP(c0); DP(c1); DP(c2); DP(c3); DP(c4); DP(c5); DP(c6); DP(c7);
  }
  o[0] = c0; o[1] = c1; o[2] = c2; o[3] = c3; o[4] = c4; o[5] = c5; o[6] = c6; o[7] = c7;
}

__attribute__((noinline)) static void multiply_adds(__m512* p, __m512 x, __m512 y, long n) {
  __m512 f0 = p[0], f1 = p[1], f2 = p[2], f3 = p[3], f4 = p[4], f5 = p[5], f6 = p[6], f7 = p[7];
  for (long i = 0; i < n; i++) {
    FMA(f0); FMA(f1); FMA(f2); FMA(f3); FMA(f4); FMA(f5); FMA(f6); FMA(f7);
  }
  p[0] = f0; p[1] = f1; p[2] = f2; p[3] = f3; p[4] = f4; p[5] = f5; p[6] = f6; p[7] = f7;
}

__attribute__((noinline)) static void both(__m512i* o, __m512* p, __m512i a, __m512i b, __m512 x,
                                           __m512 y, long n) {
  __m512i c0 = o[0], c1 = o[1], c2 = o[2], c3 = o[3], c4 = o[4], c5 = o[5], c6 = o[6], c7 = o[7];
  __m512 f0 = p[0], f1 = p[1], f2 = p[2], f3 = p[3];
  for (long i = 0; i < n; i++) {
    DP(c0); DP(c1); DP(c2); DP(c3); DP(c4); DP(c5); DP(c6); DP(c7);
    FMA(f0); FMA(f1); FMA(f2); FMA(f3);
  }
  o[0] = c0; o[1] = c1; o[2] = c2; o[3] = c3; o[4] = c4; o[5] = c5; o[6] = c6; o[7] = c7;
  p[0] = f0; p[1] = f1; p[2] = f2; p[3] = f3;
}

int main(void) {
  __m512i o[8] = {0};
  __m512 p[8] = {0};
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  const long n = 25000000;
  for (int round = 0; round < 2; round++) {
    double t = now();
    products(o, a, b, n);
    const double t_products = (now() - t) / n * 1e9;
    t = now();
    multiply_adds(p, x, y, n);
    const double t_fmas = (now() - t) / n * 1e9;
    t = now();
    both(o, p, a, b, x, y, n);
    const double t_both = (now() - t) / n * 1e9;
    printf("ns an iteration: 8 vpdpbusd %.3f, 8 fma %.3f, 8 vpdpbusd + 4 fma %.3f\n", t_products,
           t_fmas, t_both);
  }
  // (the results, so the loops are not optimised away)
  return (_mm512_reduce_add_epi32(o[0]) + (int)_mm512_reduce_add_ps(p[0])) == 42;
}
