/* cpu_tiles.c -- the CPU flash forward's two matrix products alone, in their real tile shapes.
 *
 * One query chunk (64 rows, D = 128, float32) sweeps the 2048 keys of one head in blocks of 64:
 * S^T = K Q^T (KC head dims per pass of the micro-kernel) then O += P V (PK keys per pass), the
 * calls fwd_range makes, with K and V as large as a real head's so they stream from beyond L2 as
 * they do in a call.  Every configuration sweeps in turn, round after round, and the table is
 * GFLOP/s on one thread; compare with `_C.fma_peak(0.3, 1)` in the same minute.  The last column
 * reuses one K/V block throughout, so the operands stay in cache: the products' ceiling in these
 * shapes.  It answers "how close to peak do the products run where they sit, and what does
 * streaming K and V cost" without the softmax, masks and packing.
 *
 *   gcc -std=c11 -D_POSIX_C_SOURCE=200809L -O3 -ffp-contract=fast -mavx512f -mavx512bw -mavx512vl \
 *       -mavx512dq -mavx2 -mfma -mf16c -Icsrc/cpu -Icsrc benchmarks/cpu_tiles.c -o /tmp/cpu_tiles -lm
 *   /tmp/cpu_tiles
 *
 * (x86-64 with AVX-512 only; it includes the kernels' tiles, cpu_tiles_impl.h, so the four stubs
 * below stand in for the library functions the rest of that file refers to.) */
#define AB_ISA_SFX _avx512
#define AB_ISA_NAME "avx512"
#include "cpu_tiles_impl.h"

#include <stdio.h>

const ab_cpu_pool ab_cpu_pool_serial;
ab_status ab_error_set(ab_error* e, ab_status s, const char* fmt, ...) { return s; }
void* ab_scratch_alloc(size_t n) { return malloc(n); }
void ab_scratch_free(void* x) { free(x); }

enum { SK = 2048, D = 128, RC = 64, BLK = 64 };

static float qt[D * RC] __attribute__((aligned(64))); /* Q^T of the chunk */
static float st[BLK * RC] __attribute__((aligned(64))); /* S^T, then P^T */
static float on[RC * D] __attribute__((aligned(64)));  /* O rows */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* hot: every block reads keys 0..BLK-1 again, so K and V stay in L1/L2 (the ceiling of the tiles) */
static void sweep(const float* k, const float* v, int kc, int pk, int hot) {
  for (int j0 = 0; j0 < SK; j0 += BLK) {
    const float* kb = k + (hot ? 0 : (int64_t)j0 * D);
    const float* vb = v + (hot ? 0 : (int64_t)j0 * D);
    for (int d0 = 0; d0 < D; d0 += kc) gemm_nv_avx512(BLK, RC / 16, kc, kb + d0, D, 1, qt + d0 * RC, RC, st, RC, d0 > 0);
    for (int k0 = 0; k0 < BLK; k0 += pk) gemm_avx512(RC, D / 16, pk, st + k0 * RC, 1, RC, vb + k0 * D, D, on, D, 1);
  }
}

int main(void) {
  float* k = aligned_alloc(64, sizeof(float) * SK * D);
  float* v = aligned_alloc(64, sizeof(float) * SK * D);
  if (!k || !v) return 1;
  /* small values: no overflow, no subnormals, however long it runs */
  for (int i = 0; i < SK * D; ++i) {
    k[i] = 1e-3f * (float)(i % 5);
    v[i] = 2e-3f * (float)(i % 3);
  }
  for (int i = 0; i < D * RC; ++i) qt[i] = 1e-3f * (float)(i % 7);
  static const int cfg[][3] = {{64, 64, 0}, {128, 64, 0}, {32, 64, 0}, {64, 32, 0}, {128, 32, 0}, {128, 16, 0}, {64, 64, 1}};
  enum { NC = sizeof cfg / sizeof cfg[0], PER_ROUND = 100 };
  double t[NC] = {0};
  for (int c = 0; c < NC; ++c) printf("  KC%-3d PK%-2d%s", cfg[c][0], cfg[c][1], cfg[c][2] ? " hot" : "    ");
  printf("   (GFLOP/s; the kernel uses KC64 PK64; hot: K/V kept in cache)\n");
  for (int round = 1; round <= 5; ++round) {
    for (int it = 0; it < PER_ROUND; ++it)
      for (int c = 0; c < NC; ++c) {
        const double t0 = now();
        sweep(k, v, cfg[c][0], cfg[c][1], cfg[c][2]);
        t[c] += now() - t0;
      }
    const double fl = 4.0 * RC * SK * D * PER_ROUND * round;
    for (int c = 0; c < NC; ++c) printf("  %13.0f", fl / t[c] / 1e9);
    printf("   (check %g)\n", (double)on[5]);
  }
  free(k);
  free(v);
  return 0;
}
