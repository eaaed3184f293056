/* flash_cpu.c -- the CPU flash entry points: check a call, run it on the ISA path's table
 * (cpu_kernels.h); and the flash family's answer to the planner (ab_flash_cpu_why_not).
 */
#include <stdio.h>

#include "../ab_planner.h"
#include "ab_cpu.h"
#include "cpu_kernels.h"

/* The dtypes the flash tables are built for: float32 accumulation of float16, bfloat16, float32. */
static int flash_dtype_ok(ab_dtype dt) { return dt == AB_DTYPE_F32 || dt == AB_DTYPE_F16 || dt == AB_DTYPE_BF16; }

/* The planner's question (ab_planner.h, ab_why_not_fn), answered by the rule the calls are checked with. */
void ab_flash_cpu_why_not(const ab_call* c, char* out, size_t n) {
  out[0] = 0;
  if (!flash_dtype_ok(c->dtype))
    snprintf(out, n, "flash on CPU takes float16, bfloat16 or float32, got %s", ab_dtype_name(c->dtype));
}

static ab_status check_flash(const ab_attn_params* p, int backward, ab_error* err) {
  ab_status st = ab_attn_params_check(p, backward, err);
  if (st != AB_OK) return st;
  if (ab_cpu_isa_error()) return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s", ab_cpu_isa_error());
  if (p->q.device != AB_DEVICE_CPU)
    return ab_error_set(err, AB_ERR_INVALID, "flash CPU kernel called with non-CPU tensors");
  if (!flash_dtype_ok(p->q.dtype))
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "flash on CPU takes float16, bfloat16 or float32, got %s",
                        ab_dtype_name(p->q.dtype));
  return AB_OK;
}

ab_status ab_flash_cpu_fwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  ab_status st = check_flash(p, 0, err);
  if (st != AB_OK || p->B == 0 || p->Hq == 0 || p->Sq == 0) return st;
  return ab_cpu_kernels_get()->flash_fwd(p, pool, err);
}

ab_status ab_flash_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  ab_status st = check_flash(p, 1, err);
  if (st != AB_OK) return st;
  if (p->B == 0 || p->Hkv == 0) return p->dsinks.ndim ? ab_sinks_cpu_bwd(p, pool, err) : AB_OK;
  st = ab_cpu_kernels_get()->flash_bwd(p, pool, err);
  if (st == AB_OK && p->dsinks.ndim) st = ab_sinks_cpu_bwd(p, pool, err);
  return st;
}
