/* tile_wait.c -- whether an AMX tile load waits for the memory requests issued before it.  Each step asks for
 * the next eight lines of a 1 GiB buffer (prefetcht0, or plain loads whose values are not used; TILE_WAIT_RANDOM=1:
 * eight random lines) and then does a
 * little work on data in L1: a vector load and add (A), or a tile load of 16 rows of 64 bytes and a tile
 * product (B); (C) is the requests alone.  Nanoseconds per step: if B takes much longer than A and C, the tile
 * load or product waited for the requests (the decode kernel's tiles from DRAM, docs/decode.md "Tiles").
 * x86-64 Linux with AMX-BF16.
 *
 *   gcc -O2 -mavx512f -mamx-tile -mamx-bf16 benchmarks/tile_wait.c -o /tmp/tile_wait && /tmp/tile_wait */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

typedef struct {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tilecfg;

#define LINES ((size_t)1 << 24) /* 1 GiB of 64-byte lines */
#define STEPS 2000000L

static uint64_t rng = 88172645463325252ull;
static inline uint64_t next(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) {
    printf("no AMX tile data permission\n");
    return 1;
  }
  char* big = aligned_alloc(4096, LINES * 64);
  memset(big, 1, LINES * 64);
  uint32_t* idx = malloc(sizeof(uint32_t) * 8 * STEPS);
  const int seq = getenv("TILE_WAIT_RANDOM") == NULL; /* lines in order (a stream), else at random */
  for (long i = 0; i < 8 * STEPS; ++i) idx[i] = seq ? (uint32_t)(i % LINES) : (uint32_t)(next() % LINES);
  static float small[16 * 16] __attribute__((aligned(64)));
  static uint16_t bt[16 * 32] __attribute__((aligned(64)));
  tilecfg c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 3; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
  _tile_zero(0);
  _tile_loadd(2, bt, 64);
  const char* kinds[] = {"requests alone (C)", "requests + vector load and add (A)", "requests + tile load and product (B)"};
  for (int loads = 0; loads < 2; ++loads)
    for (int k = 0; k < 3; ++k) {
      __m512 acc = _mm512_setzero_ps();
      uint64_t sink = 0;
      const double t0 = now();
      for (long s = 0; s < STEPS; ++s) {
        const uint32_t* x = idx + 8 * s;
        for (int j = 0; j < 8; ++j) {
          if (loads)
            sink += *(volatile char*)(big + (size_t)x[j] * 64);
          else
            _mm_prefetch(big + (size_t)x[j] * 64, _MM_HINT_T0);
        }
        if (k == 1) acc = _mm512_add_ps(acc, _mm512_load_ps(small + (s & 15) * 16));
        if (k == 2) {
          _tile_loadd(1, small, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
      }
      const double t = now() - t0;
      _mm512_store_ps(small, _mm512_add_ps(_mm512_load_ps(small), acc));
      printf("%s lines, %s, %s: %.1f ns a step (sink %llu)\n", seq ? "streamed" : "random", loads ? "8 loads" : "8 prefetcht0",
             kinds[k], t / STEPS * 1e9,
             (unsigned long long)(sink & 1));
    }
  _tile_release();
  return 0;
}
