/* ab_cpu.h -- helpers shared by the C CPU kernels (internal to csrc/cpu).
 *
 * Row loads and stores between any input dtype and the float32/float64 accumulation type, the
 * visible key range of a query row (causal + window), masks; scratch and the parallel driver come
 * from cpu_threads.h.
 */
#ifndef AB_CPU_H
#define AB_CPU_H

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../ab_core.h"
#include "../ab_half.h"
#include "cpu_threads.h"

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

/* The gradient of the attention sinks (p->dsinks, (Hq,)), from what the forward left and the
 * output's gradient: d s_h = -sum over the rows of head h of P_sink * delta, with P_sink =
 * exp(s_h - lse) the sink's weight and delta = dO . O - dlse.  Dense or packed; one head per work
 * item, summed in float64 in a fixed order, so deterministic.  sinks_cpu.c. */
ab_status ab_sinks_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);

#endif /* AB_CPU_H */
