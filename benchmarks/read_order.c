/* read_order.c -- whether this machine overlaps arithmetic with DRAM reads, and at what rate the decode
 * kernel's read order streams K and V when nothing else is in the way (one thread).
 *
 * Every 64-byte line read gets NF independent 512-bit FMAs (in registers, the arithmetic's rate set by the
 * FMA ports, as the kernel's products are).  Modes:
 *   stream  one buffer in order, the hardware prefetchers alone;
 *   plain   two buffers K and V laid out as a dense bfloat16 cache of 8 KV heads at D = 128 ([key][head]
 *           rows of 256 bytes), read as the kernel reads them with step 1 head by head: per chunk of 32 keys,
 *           each head's 32 K rows, then each head's 32 V rows; no software requests;
 *   kernel  the same order with the kernel's requests (csrc/cpu/decode_cpu_impl.h): in step 1 the V row of
 *           each key into L2 and the K row two keys ahead into L1, in step 3 the next chunk's K rows into L2.
 * MiB is each buffer's size: 2-8 keeps them in the L2 / L3 (the arithmetic alone), 128 or more reads
 * them from DRAM.  Options after it: `huge` advises the buffers to transparent huge pages (MADV_HUGEPAGE;
 * /sys/kernel/mm/transparent_hugepage/enabled must say madvise or always); `pages` adds the kernel's page
 * touches (one line of each 4 KiB page of the chunk after next, K and V, at each chunk's start); `hg1` reads
 * plain / kernel one head at a time through the whole buffer (a work item per KV head) instead of all heads
 * per chunk.  Prints the best of 9 passes in GB/s; compare configurations within a minute of each other.
 *
 *   gcc -O2 -mavx512f -mfma benchmarks/read_order.c -o /tmp/read_order
 *   for m in stream plain kernel; do /tmp/read_order $m 16 4; /tmp/read_order $m 16 128; done
 *
 * x86-64 with AVX-512 only.  docs/benchmarks.md, "Where decode's DRAM time goes on one Zen 4 thread". */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { HEADS = 8, ROW = 256, KEY = HEADS * ROW, CHUNK = 32, PASSES = 9 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int nf;
static __m512 a0, a1, a2, a3, a4, a5, a6, a7;

/* One line and its FMAs: eight chains, nf / 8 rounds (nf 0: one add).  Each chain has its own multiplier,
 * so that the compiler cannot fold the eight into one (identical chains from identical starts, it did). */
static inline __attribute__((always_inline)) void line(const char* p) {
  const __m512 x = _mm512_load_ps((const float*)p);
  if (!nf) {
    a0 = _mm512_add_ps(a0, x);
    return;
  }
  for (int r = 0; r < nf; r += 8) {
    a0 = _mm512_fmadd_ps(x, _mm512_set1_ps(0.50f), a0);
    a1 = _mm512_fmadd_ps(x, _mm512_set1_ps(0.51f), a1);
    a2 = _mm512_fmadd_ps(x, _mm512_set1_ps(0.52f), a2);
    a3 = _mm512_fmadd_ps(x, _mm512_set1_ps(0.53f), a3);
    a4 = _mm512_fmadd_ps(x, _mm512_set1_ps(0.54f), a4);
    a5 = _mm512_fmadd_ps(x, _mm512_set1_ps(0.55f), a5);
    a6 = _mm512_fmadd_ps(x, _mm512_set1_ps(0.56f), a6);
    a7 = _mm512_fmadd_ps(x, _mm512_set1_ps(0.57f), a7);
  }
}

static inline __attribute__((always_inline)) void row(const char* p) {
  for (int o = 0; o < ROW; o += 64) line(p + o);
}

static inline __attribute__((always_inline)) void ask(const char* p, int l1) {
  for (int o = 0; o < ROW; o += 64) {
    if (l1)
      _mm_prefetch(p + o, _MM_HINT_T0);
    else
      _mm_prefetch(p + o, _MM_HINT_T1);
  }
}

static char* buffer(size_t bytes, int huge) {
  char* b = aligned_alloc((size_t)2 << 20, bytes);
  if (!b) exit(1);
  if (huge) madvise(b, bytes, MADV_HUGEPAGE);
  memset(b, 1, bytes);
  return b;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s stream|plain|kernel NF MiB [huge]\n", argv[0]);
    return 2;
  }
  const char* mode = argv[1];
  nf = atoi(argv[2]);
  int huge = 0, pages = 0, hg1 = 0;
  for (int i = 4; i < argc; ++i) {
    huge |= !strcmp(argv[i], "huge");
    pages |= !strcmp(argv[i], "pages");
    hg1 |= !strcmp(argv[i], "hg1");
  }
  const size_t bytes = (size_t)atol(argv[3]) << 20, pad = (size_t)4 << 20;
  const int two = strcmp(mode, "stream") != 0, asks = !strcmp(mode, "kernel");
  char *K = buffer(bytes + pad, huge), *V = two ? buffer(bytes + pad, huge) : NULL;
  const size_t chunks = bytes / (KEY * CHUNK);
  double best = 1e30;
  float sink = 0;
  for (int pass = 0; pass < PASSES; ++pass) {
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _mm512_setzero_ps();
    const double t = now();
    if (!two) {
      for (size_t o = 0; o < bytes; o += 64) line(K + o);
    } else if (hg1) {
      for (int h = 0; h < HEADS; ++h)
        for (size_t c = 0; c < chunks; ++c) {
          const char *k = K + c * CHUNK * KEY + h * ROW, *v = V + c * CHUNK * KEY + h * ROW;
          for (int j = 0; j < CHUNK; ++j) {
            if (asks) {
              ask(v + j * KEY, 0);
              if (j + 2 < CHUNK) ask(k + (j + 2) * KEY, 1);
            }
            row(k + j * KEY);
          }
          for (int j = 0; j < CHUNK; ++j) {
            if (asks) ask(k + (CHUNK + j) * KEY, 0);
            row(v + j * KEY);
          }
        }
    } else {
      for (size_t c = 0; c < chunks; ++c) {
        const char *k = K + c * CHUNK * KEY, *kn = k + CHUNK * KEY, *v = V + c * CHUNK * KEY;
        if (pages && c + 2 < chunks)
          for (size_t o = 0; o < CHUNK * KEY; o += 4096) {
            _mm_prefetch(k + 2 * CHUNK * KEY + o, _MM_HINT_T1);
            _mm_prefetch(v + 2 * CHUNK * KEY + o, _MM_HINT_T1);
          }
        for (int h = 0; h < HEADS; ++h) /* step 1 */
          for (int j = 0; j < CHUNK; ++j) {
            if (asks) {
              ask(v + j * KEY + h * ROW, 0);
              if (j + 2 < CHUNK) ask(k + (j + 2) * KEY + h * ROW, 1);
            }
            row(k + j * KEY + h * ROW);
          }
        for (int h = 0; h < HEADS; ++h) /* step 3 */
          for (int j = 0; j < CHUNK; ++j) {
            if (asks) ask(kn + j * KEY + h * ROW, 0);
            row(v + j * KEY + h * ROW);
          }
      }
    }
    const double dt = now() - t;
    if (dt < best) best = dt;
    const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                   _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    sink += _mm512_reduce_add_ps(s);
  }
  const double read = (double)(two ? 2 * chunks * CHUNK * KEY : bytes);
  printf("%-6s NF %2d %5zu MiB%s%s%s: %6.2f GB/s, %.2f ns per line (%g)\n", mode, nf, bytes >> 20,
         huge ? " huge" : "", pages ? " pages" : "", hg1 ? " hg1" : "", read / best / 1e9, best * 1e9 / (read / 64),
         (double)sink);
  return 0;
}
