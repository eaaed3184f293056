/* read_segments.c -- what a scattered paged cache costs a plain stream, without the decode kernel.
 *
 * Two threads sum a 512 MiB buffer read in segments of SEG KiB (a paged cache's blocks: 16 keys of
 * 8 KV heads x 128 bfloat16 are 32 KiB of K), in order or in a shuffled order (a shuffled
 * block_table), optionally touching one line of each 4 KiB page of the segment AHEAD segments on
 * before reading the current one (the decode kernel's pages_ahead, csrc/cpu/decode_cpu.c).  It
 * prints the best of 7 passes in GB/s.  Compare configurations in the same minute: a shared machine
 * moves the absolute figure between runs.
 *
 *   gcc -std=c11 -D_GNU_SOURCE -O2 -mavx512f benchmarks/read_segments.c -o /tmp/read_segments -lpthread
 *   for a in 0 1 2 4; do /tmp/read_segments 32 1 $a; /tmp/read_segments 32 0 $a; done
 *
 * Arguments: SEG (KiB), SHUFFLED (0/1), AHEAD (segments; 0: no touches), and optionally OFFSET (bytes
 * the segments start past a 2 MiB boundary; default 64, where torch's allocator puts large tensors).
 * x86-64 with AVX-512 only. */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { THREADS = 2, PASSES = 7 };
static const size_t TOTAL = (size_t)512 << 20;

static size_t seg_bytes, nseg, offset, ahead;
static const char* buf;
static size_t* order;

typedef struct part {
  size_t first, last;
  float sum;
} part;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static const char* segment(size_t i) { return buf + offset + order[i] * seg_bytes; }

static void* read_part(void* arg) {
  part* pt = arg;
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = pt->first; i < pt->last; ++i) {
    if (ahead && i + ahead < pt->last) {
      const char* next = segment(i + ahead);
      for (size_t o = 0; o < seg_bytes; o += 4096) __builtin_prefetch(next + o, 0, 2);
    }
    const char* p = segment(i);
    for (size_t o = 0; o < seg_bytes; o += 256) {
      s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + o));
      s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + o + 64));
      s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + o + 128));
      s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + o + 192));
    }
  }
  pt->sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  return NULL;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s SEG_KiB SHUFFLED AHEAD [OFFSET]\n", argv[0]);
    return 2;
  }
  seg_bytes = (size_t)atol(argv[1]) * 1024;
  const int shuffled = atoi(argv[2]);
  ahead = (size_t)atol(argv[3]);
  offset = argc > 4 ? (size_t)atol(argv[4]) : 64;
  if (seg_bytes == 0 || seg_bytes % 256 || offset % 64) {
    fprintf(stderr, "SEG must be a positive number of KiB and OFFSET a multiple of 64\n");
    return 2;
  }
  nseg = TOTAL / seg_bytes;
  char* mem = aligned_alloc((size_t)2 << 20, TOTAL + ((size_t)4 << 20));
  order = malloc(nseg * sizeof *order);
  if (!mem || !order) return 1;
  memset(mem, 1, TOTAL + ((size_t)4 << 20));
  buf = mem;
  for (size_t i = 0; i < nseg; ++i) order[i] = i;
  srand(1);
  for (size_t i = nseg - 1; shuffled && i > 0; --i) {
    const size_t j = (size_t)rand() % (i + 1), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  double best = 0.0;
  float check = 0.0f;
  for (int r = 0; r < PASSES; ++r) {
    pthread_t th[THREADS];
    part parts[THREADS];
    const double t0 = now();
    for (int i = 0; i < THREADS; ++i) {
      parts[i] = (part){nseg * (size_t)i / THREADS, nseg * (size_t)(i + 1) / THREADS, 0.0f};
      pthread_create(&th[i], NULL, read_part, &parts[i]);
    }
    for (int i = 0; i < THREADS; ++i) {
      pthread_join(th[i], NULL);
      check += parts[i].sum;
    }
    const double gbs = (double)(nseg * seg_bytes) / (now() - t0) / 1e9;
    best = gbs > best ? gbs : best;
  }
  printf("segments of %zu KiB, %s, pages touched %zu ahead, offset %zu: %.1f GB/s (sum %g)\n", seg_bytes / 1024,
         shuffled ? "shuffled" : "in order", ahead, offset, best, (double)check);
  free(mem);
  free(order);
  return 0;
}
