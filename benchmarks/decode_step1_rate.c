/* decode_step1_rate.c -- step 1 of the CPU decode kernel at G = 4 in isolation: what its loop, its score
 * reductions and its prefetch requests cost per key and KV head, with the rows in L1/L2.
 *
 * A copy of the shape of DC(dot4xk) for a bfloat16 cache (decode_cpu_impl.h): 8 KV heads of a key row side by
 * side (2 KiB), 4 query rows per head, 4 keys at a time, D = 128, 16 float32 chains; the bfloat16 key elements
 * widened and shifted to float32.  Modes:
 *   0  the loop, then one _mm512_reduce_add_ps per score (a costly reduction, for scale)
 *   1  the loop alone (the sixteen chains summed into one store)
 *   2  as 1 with float32 key rows (no conversion, twice the bytes)
 *   3  as 1 with the kernel's prefetch requests as SYM(pf_lines) issued them before 2026-12-07: a loop per row,
 *      one line a turn, the key row two keys ahead into L1 and the value row into L2 (DC(pf_head))
 *   4  as 3 without the value rows
 *   5  as 3 with the four lines of each row asked for unrolled (SYM(pf_lines) since)
 * Prints the best of 50 timings of 100 passes over 256 keys, ns per key and KV head.
 *
 *   gcc -std=c11 -D_GNU_SOURCE -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -ffp-contract=fast \
 *       benchmarks/decode_step1_rate.c -o /tmp/step1 && for m in 1 3 5; do /tmp/step1 $m; done
 * x86-64 with AVX-512 only. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { HG = 8, G = 4, D = 128, SK = 256, CH = 32 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline __m512 ldbf(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static uint16_t *K, *V;
static float *Q, *S;

static inline void pf_loop(const char* row, int locality3) {
  for (uintptr_t x = (uintptr_t)row & ~(uintptr_t)63; x < (uintptr_t)row + 256; x += 64) {
    if (locality3)
      __builtin_prefetch((const void*)x, 0, 3);
    else
      __builtin_prefetch((const void*)x, 0, 2);
  }
}

__attribute__((noinline)) static void step1(int mode) {
  for (int j = 0; j < SK; j += 4)
    for (int h = 0; h < HG; ++h) {
      for (int k = 0; k < 4 && mode >= 3; ++k) {
        const char* kr = (const char*)(K + ((size_t)((j + k + 2) % SK) * HG + h) * D);
        const char* vr = (const char*)(V + ((size_t)(j + k) * HG + h) * D);
        if (mode == 5) {
          _mm_prefetch(kr, _MM_HINT_T0), _mm_prefetch(kr + 64, _MM_HINT_T0);
          _mm_prefetch(kr + 128, _MM_HINT_T0), _mm_prefetch(kr + 192, _MM_HINT_T0);
          _mm_prefetch(vr, _MM_HINT_T1), _mm_prefetch(vr + 64, _MM_HINT_T1);
          _mm_prefetch(vr + 128, _MM_HINT_T1), _mm_prefetch(vr + 192, _MM_HINT_T1);
        } else {
          pf_loop(kr, 1);
          if (mode == 3) pf_loop(vr, 0);
        }
      }
      __m512 a[4][4];
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 4; ++i) a[k][i] = _mm512_setzero_ps();
      const float* q = Q + h * G * D;
      for (int d = 0; d < D; d += 16) {
        __m512 qv[4];
        for (int i = 0; i < 4; ++i) qv[i] = _mm512_loadu_ps(q + i * D + d);
        for (int k = 0; k < 4; ++k) {
          const size_t row = ((size_t)(j + k) * HG + h) * D;
          const __m512 kv = mode == 2 ? _mm512_loadu_ps((const float*)K + row + d) : ldbf(K + row + d);
          for (int i = 0; i < 4; ++i) a[k][i] = _mm512_fmadd_ps(qv[i], kv, a[k][i]);
        }
      }
      if (mode == 0) {
        for (int k = 0; k < 4; ++k)
          for (int i = 0; i < 4; ++i) S[(h * G + i) * CH + (j + k) % CH] = _mm512_reduce_add_ps(a[k][i]);
      } else {
        __m512 t = a[0][0];
        for (int k = 0; k < 4; ++k)
          for (int i = 0; i < 4; ++i) t = _mm512_add_ps(t, a[k][i]);
        _mm512_storeu_ps(S + h * G * CH, t);
      }
    }
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 1;
  const size_t n = (size_t)SK * HG * D;
  K = aligned_alloc(64, n * 4); /* room for float32 rows (mode 2) */
  V = aligned_alloc(64, n * 2);
  Q = aligned_alloc(64, HG * G * D * 4);
  S = aligned_alloc(64, HG * G * CH * 4);
  if (!K || !V || !Q || !S) return 1;
  for (size_t i = 0; i < 2 * n; ++i) K[i] = (uint16_t)(0x3f80 + i % 7);
  memset(V, 0, n * 2);
  for (int i = 0; i < HG * G * D; ++i) Q[i] = 0.001f * (float)(i % 13);
  double best = 1e9;
  for (int r = 0; r < 50; ++r) {
    const double t0 = now();
    for (int it = 0; it < 100; ++it) step1(mode);
    const double t = (now() - t0) / 100;
    best = t < best ? t : best;
  }
  printf("mode %d: %.2f ns per key and KV head (checksum %g)\n", mode, best * 1e9 / (SK * HG), S[3]);
  return 0;
}
