/* sage_cpu.c -- the sage entry points: check a call, pick the ISA table (cpu_kernels.h), run it.
 *
 * The table is the one of the path the flash kernel uses (ab_cpu_isa_get: CPUID + XGETBV,
 * ATTN_BACKENDS_CPU_ISA, _C.set_cpu_isa), except that the AVX-512 table's Q.K^T is vpdpbusd: an
 * AVX-512 CPU without AVX512-VNNI (Skylake-SP) runs the AVX2 table instead; and the AMX table's is
 * tdpbssd: without AMX-INT8 the AVX-512 rule applies (no such CPU is known; the check is cheap).
 */
#include "ab_cpu.h"
#include "cpu_kernels.h"

static const ab_cpu_kernels* sage_table(void) {
  const ab_cpu_features* f = ab_cpu_features_get();
  switch (ab_cpu_isa_get()) {
    case AB_ISA_AMX_EMU: return &ab_cpu_amx_emu;
    case AB_ISA_AMX:
      if (ab_cpu_amx.sage_fwd && f->amx_int8) return &ab_cpu_amx;
      /* fall through */
    case AB_ISA_AVX512: return ab_cpu_avx512.sage_fwd && f->avx512_vnni ? &ab_cpu_avx512 : &ab_cpu_avx2;
    case AB_ISA_AVX2: return &ab_cpu_avx2;
    default: return &ab_cpu_generic;
  }
}

const char* ab_sage_cpu_isa_name(void) { return sage_table()->sage_isa; }

size_t ab_sage_cpu_workspace_size(const ab_attn_params* p) {
  /* an invalid call needs none: ab_sage_cpu_fwd then reports what is wrong with it */
  ab_error ignored;
  if (ab_attn_params_check(p, 0, &ignored) != AB_OK || p->B <= 0 || p->Hkv <= 0 || p->D <= 0) return 0;
  return sage_table()->sage_workspace_size(p);
}

ab_status ab_sage_cpu_fwd(const ab_attn_params* p, void* workspace, size_t workspace_bytes,
                          const ab_cpu_pool* pool, ab_error* err) {
  ab_status st = ab_attn_params_check(p, 0, err);
  if (st != AB_OK) return st;
  if (p->q.device != AB_DEVICE_CPU)
    return ab_error_set(err, AB_ERR_INVALID, "sage CPU kernel called with non-CPU tensors");
  if (p->q.dtype != AB_DTYPE_F32 && p->q.dtype != AB_DTYPE_F16 && p->q.dtype != AB_DTYPE_BF16)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "sage on CPU takes float16, bfloat16 or float32, got %s",
                        ab_dtype_name(p->q.dtype));
  if (p->dropout_p > 0)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "sage is inference only: no dropout");
  if (p->sinks.ndim || p->alibi.ndim)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "sage takes no %s", p->sinks.ndim ? "sinks" : "alibi_slopes");
  if (ab_cpu_isa_error()) return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s", ab_cpu_isa_error());
  if (p->B == 0 || p->Hq == 0 || p->Sq == 0) return AB_OK;
  return sage_table()->sage_fwd(p, workspace, workspace_bytes, pool, err);
}
