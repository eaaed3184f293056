/* ab_cpu.h -- helpers shared by the C CPU kernels (internal to csrc/cpu).
 *
 * Row loads and stores between any input dtype and the float32/float64 accumulation type, the
 * visible key range of a query row (causal + window), masks, scratch allocation, and the parallel
 * driver that records the first failure of any chunk.
 */
#ifndef AB_CPU_H
#define AB_CPU_H

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../ab_core.h"
#include "../ab_half.h"

/* Element offset of index (a, b, c, d) in a 4-D view; 64-bit so no product can overflow. */
static inline int64_t ab_off4(const ab_tensor* t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return a * t->strides[0] + b * t->strides[1] + c * t->strides[2] + d * t->strides[3];
}

static inline int64_t ab_off3(const ab_tensor* t, int64_t a, int64_t b, int64_t c) {
  return a * t->strides[0] + b * t->strides[1] + c * t->strides[2];
}

/* The keys query row i of a (Sq, Sk) sequence may see through causal and window alone: [*lo, *hi),
 * empty when *lo >= *hi.  Alignment: i' = i + Sk - Sq for bottom-right causal, i' = i otherwise
 * (docs/semantics.md).  The window sides are compared before they are added, so a window up to
 * 2^63 - 1 (a direct op call) cannot overflow. */
static inline void ab_key_range(const ab_attn_params* p, int64_t Sq, int64_t Sk, int64_t i, int64_t* lo,
                                int64_t* hi) {
  const int64_t ii = p->causal == AB_CAUSAL_BOTTOM_RIGHT ? i + Sk - Sq : i;
  int64_t l = 0, h = Sk;
  if (p->causal != AB_CAUSAL_NONE && ii + 1 < h) h = ii + 1;
  if (p->window_right >= 0 && p->window_right < h - ii - 1) h = ii + p->window_right + 1;
  if (p->window_left >= 0 && p->window_left < ii) l = ii - p->window_left;
  if (h < 0) h = 0;
  if (l > Sk) l = Sk;
  *lo = l;
  *hi = h;
}

static inline void ab_row_key_range(const ab_attn_params* p, int64_t i, int64_t* lo, int64_t* hi) {
  ab_key_range(p, p->Sq, p->Sk, i, lo, hi);
}

/* The longest query (key) sequence of a call: Sq (Sk) for dense calls; for packed calls the longest
 * one in cu_seqlens, which max_seqlen only bounds.  Kernels size work and scratch by it, so a loose
 * max_seqlen costs nothing. */
static inline int64_t ab_longest(const int32_t* cu, int64_t B, int64_t bound) {
  if (!cu) return bound;
  int64_t m = 0;
  for (int64_t b = 0; b < B; ++b)
    if ((int64_t)cu[b + 1] - cu[b] > m) m = (int64_t)cu[b + 1] - cu[b];
  return m;
}

static inline int64_t ab_rows_q(const ab_attn_params* p) { return ab_longest(p->cu_seqlens_q, p->B, p->Sq); }
static inline int64_t ab_rows_k(const ab_attn_params* p) { return ab_longest(p->cu_seqlens_k, p->B, p->Sk); }

static inline int ab_mask_is_bool(const ab_attn_params* p) {
  return p->mask.ndim > 0 && p->mask.dtype == AB_DTYPE_BOOL;
}

static inline int ab_mask_is_float(const ab_attn_params* p) {
  return p->mask.ndim > 0 && p->mask.dtype != AB_DTYPE_BOOL;
}

static inline double ab_load_scalar(const void* base, ab_dtype dt, int64_t off) {
  switch (dt) {
    case AB_DTYPE_F32: return ((const float*)base)[off];
    case AB_DTYPE_F16: return ab_f16_to_f32(((const uint16_t*)base)[off]);
    case AB_DTYPE_BF16: return ab_bf16_to_f32(((const uint16_t*)base)[off]);
    case AB_DTYPE_F64: return ((const double*)base)[off];
    case AB_DTYPE_BOOL: case AB_DTYPE_U8: return ((const uint8_t*)base)[off] != 0;
    default: return NAN;
  }
}

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

/* The gradient of the attention sinks (p->dsinks, (Hq,)), from what the forward left and the
 * output's gradient: d s_h = -sum over the rows of head h of P_sink * delta, with P_sink =
 * exp(s_h - lse) the sink's weight and delta = dO . O - dlse.  Dense or packed; one head per work
 * item, summed in float64 in a fixed order, so deterministic.  sinks_cpu.c. */
ab_status ab_sinks_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);

#endif /* AB_CPU_H */
