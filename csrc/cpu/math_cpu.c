/* math_cpu.c -- the math backend on CPU: the exact reference every other backend is checked
 * against (docs/semantics.md).  Clarity over speed; see math_cpu_impl.h for the algorithm.
 */
#include "ab_cpu.h"
#include "../ab_philox.h"

#define ACC float
#define ACC_EXP expf
#define SFX(name) name##_f32
#include "math_cpu_impl.h"
#undef ACC
#undef ACC_EXP
#undef SFX

#define ACC double
#define ACC_EXP exp
#define SFX(name) name##_f64
#include "math_cpu_impl.h"
#undef ACC
#undef ACC_EXP
#undef SFX

static int serial_parallel_for(int64_t begin, int64_t end, int64_t grain, ab_range_fn fn,
                               void* ctx) {
  (void)grain;
  if (begin < end) fn(begin, end, ctx);
  return 0;
}

const ab_cpu_pool ab_cpu_pool_serial = {serial_parallel_for, 1};

/* float32 and float64 inputs accumulate in double, float16 and bfloat16 in float.  In float (a sequential
 * sum of the row's exponentials, four-lane sums of P V) float32 calls with large logits came out up to
 * 3.5x torch's own float32 error (q, k of standard deviation 2, D = 64, 1000 keys; gradients up to 6x), past
 * DESIGN.md's rule for the reference every backend is checked against; in double they are exact to the
 * output's rounding.  The cost: forward 1.2-2.5x, backward 1.8-2.9x the float path's time (a noisy 2-core
 * Zen 4, 2026-12-05: B=1 H=8 S=1024 and B=4 H=8 S=256, D=64, causal; docs/semantics.md).  For 16-bit
 * inputs the rule's baseline is the 16-bit computation, which float meets with room to spare. */
static int exact_in_double(const ab_attn_params* p) {
  return p->q.dtype == AB_DTYPE_F64 || p->q.dtype == AB_DTYPE_F32;
}

static int empty_call(const ab_attn_params* p) {
  return p->B == 0 || p->Hq == 0 || p->Sq == 0;
}

ab_status ab_math_cpu_fwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  if (p->cu_seqlens_q)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "math takes dense calls (pad packed sequences first)");
  ab_status st = ab_attn_params_check(p, 0, err);
  if (st != AB_OK) return st;
  if (p->q.device != AB_DEVICE_CPU)
    return ab_error_set(err, AB_ERR_INVALID, "math CPU kernel called with non-CPU tensors");
  if (empty_call(p)) return AB_OK;
  return exact_in_double(p) ? math_fwd_f64(p, pool, err) : math_fwd_f32(p, pool, err);
}

ab_status ab_math_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  if (p->cu_seqlens_q)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "math takes dense calls (pad packed sequences first)");
  ab_status st = ab_attn_params_check(p, 1, err);
  if (st != AB_OK) return st;
  if (p->q.device != AB_DEVICE_CPU)
    return ab_error_set(err, AB_ERR_INVALID, "math CPU kernel called with non-CPU tensors");
  if (p->B == 0 || p->Hkv == 0) return p->dsinks.ndim ? ab_sinks_cpu_bwd(p, pool, err) : AB_OK;
  st = exact_in_double(p) ? math_bwd_f64(p, pool, err) : math_bwd_f32(p, pool, err);
  if (st == AB_OK && p->dsinks.ndim) st = ab_sinks_cpu_bwd(p, pool, err);
  return st;
}
