/* dpbf16_rate.c -- how fast this CPU issues vdpbf16ps (AVX512_BF16) and 512-bit FMAs: twelve independent
 * chains of each, nanoseconds per instruction.  The floor under the decode kernel's bfloat16 products
 * (docs/decode.md, "Where bfloat16 GQA stands").  x86-64 with AVX512_BF16 only (the instruction is
 * emitted by inline assembly, so no -mavx512bf16 is needed to build it).
 *
 *   gcc -O2 -mavx512f benchmarks/dpbf16_rate.c -o /tmp/dpbf16_rate && /tmp/dpbf16_rate */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define DP(acc, a, b) __asm__ volatile("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#define FMA(acc, a, b) __asm__ volatile("vfmadd231ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#define TWELVE(OP, x, y)                                                                             \
  OP(a0, x, y); OP(a1, x, y); OP(a2, x, y); OP(a3, x, y); OP(a4, x, y); OP(a5, x, y); OP(a6, x, y); \
  OP(a7, x, y); OP(a8, x, y); OP(a9, x, y); OP(a10, x, y); OP(a11, x, y)

int main(void) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
         a9 = a0, a10 = a0, a11 = a0;
  const __m512i xb = _mm512_set1_epi32(0x3f803f80); /* bfloat16 pairs (1, 1) */
  const __m512 xf = _mm512_set1_ps(1e-9f);
  const long n = 100000000;
  double t = now();
  for (long i = 0; i < n; ++i) {
    TWELVE(DP, xb, xb);
  }
  const double dp = (now() - t) / (12.0 * (double)n);
  t = now();
  for (long i = 0; i < n; ++i) {
    TWELVE(FMA, xf, xf);
  }
  const double fma = (now() - t) / (12.0 * (double)n);
  float out[16];
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)),
                                                    _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)))));
  printf("vdpbf16ps: %.3f ns each, vfmadd231ps (512-bit): %.3f ns each (checksum %g)\n", dp * 1e9, fma * 1e9,
         (double)out[0]);
  return 0;
}
