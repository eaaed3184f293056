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
  return p->q.dtype == AB_DTYPE_F64 ? math_fwd_f64(p, pool, err) : math_fwd_f32(p, pool, err);
}

ab_status ab_math_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  if (p->cu_seqlens_q)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "math takes dense calls (pad packed sequences first)");
  ab_status st = ab_attn_params_check(p, 1, err);
  if (st != AB_OK) return st;
  if (p->q.device != AB_DEVICE_CPU)
    return ab_error_set(err, AB_ERR_INVALID, "math CPU kernel called with non-CPU tensors");
  if (p->B == 0 || p->Hkv == 0) return p->dsinks.ndim ? ab_sinks_cpu_bwd(p, pool, err) : AB_OK;
  st = p->q.dtype == AB_DTYPE_F64 ? math_bwd_f64(p, pool, err) : math_bwd_f32(p, pool, err);
  if (st == AB_OK && p->dsinks.ndim) st = ab_sinks_cpu_bwd(p, pool, err);
  return st;
}
