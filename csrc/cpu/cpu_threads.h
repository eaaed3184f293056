/* cpu_threads.h -- how the CPU kernels use threads and memory (internal to csrc/cpu): per-thread
 * scratch (cpu_threads.c) and the parallel driver that runs work items on the caller's pool and
 * records the first failure of any of them.
 */
#ifndef AB_CPU_THREADS_H
#define AB_CPU_THREADS_H

#include <stdatomic.h>
#include <stddef.h>

#include "../ab_core.h"

/* 64-byte aligned scratch, so rows start on a cache line: the calling thread's own buffer,
 * kept between calls (small calls would otherwise pay malloc, free and page faults every time)
 * and freed when the thread exits.  One buffer per thread: a kernel must not call a kernel while
 * holding it.  ab_scratch_free releases it only when it grew past 64 MiB (a one-off huge call). */
void* ab_scratch_alloc(size_t bytes);
void ab_scratch_free(void* ptr);

/* Gap, in floats, that the flash backward leaves after each buffer it carves from its scratch
 * block.  Its buffers are whole multiples of 4 KiB (S x 128 floats, ...), so without the gap they
 * would all start at the same address modulo 4096: the same rows of K, dK, V, dV, Q and dO then
 * share cache sets, and loads alias earlier stores to other buffers (4K aliasing); which of the
 * two costs more was not isolated.  Measured
 * side by side on one core, float32 D=128: the backward at S=512 5-8% faster, S=1024 3%, S=2048
 * unchanged; a harness that isolates its five products moved from 77 to 115 GFLOP/s at S=1024.
 * The forward's tiles showed no change and carry no gap.  320 bytes: a whole number of cache
 * lines, so alignment is kept. */
#define AB_STAGGER 80

/* Shared state of one parallel kernel call: the first failing chunk's status wins. */
typedef struct ab_par_status {
  atomic_int status;
  ab_error* err;
} ab_par_status;

static inline void ab_par_fail(ab_par_status* st, ab_status code, const char* what) {
  int expected = AB_OK;
  if (atomic_compare_exchange_strong(&st->status, &expected, (int)code))
    ab_error_set(st->err, code, "%s", what);
}

/* Below this many multiply-adds a call runs on the calling thread: waking the pool costs more
 * than it saves. */
#define AB_PAR_MIN_WORK (1 << 18)

/* Runs fn over [0, n) on the pool (serially when pool is NULL or the work, in multiply-adds, is
 * small); returns the first failing chunk's status. */
static inline ab_status ab_par_run(const ab_cpu_pool* pool, int64_t n, int64_t grain, double work,
                                   ab_range_fn fn, void* ctx, ab_par_status* st) {
  if (n <= 0) return AB_OK;
  if (!pool || work < (double)AB_PAR_MIN_WORK) pool = &ab_cpu_pool_serial;
  if (pool->parallel_for(0, n, grain < 1 ? 1 : grain, fn, ctx) != 0)
    return ab_error_set(st->err, AB_ERR_INVALID, "the thread pool failed to run the kernel");
  return (ab_status)atomic_load(&st->status);
}

#endif /* AB_CPU_THREADS_H */
