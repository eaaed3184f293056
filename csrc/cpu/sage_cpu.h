/* sage_cpu.h -- the CPU sage kernel's per-ISA entry points (internal to csrc/cpu).
 *
 * sage_cpu_impl.h is compiled into each flash_cpu_{generic,avx2,avx512}.c (it reuses the flash
 * kernel's tiles), so each ISA build exports one sage table beside its flash table.
 * The AMX builds (flash_cpu_amx.c, flash_cpu_amx_emu.c) export one more each, from
 * sage_amx_impl.h.  sage_dispatch.c picks the table: the one of the path ab_cpu_isa_get() names,
 * except that the AVX-512 table needs AVX512-VNNI (an AVX-512 CPU without it runs the AVX2 table)
 * and the AMX table AMX-INT8 (else the AVX-512 rule applies).
 */
#ifndef AB_SAGE_CPU_H
#define AB_SAGE_CPU_H

#include <stddef.h>

#include "../ab_core.h"

typedef struct ab_sage_cpu_table {
  const char* isa; /* "generic", "avx2", "avx512_vnni", "amx_int8", "amx_emu" */
  /* bytes of workspace fwd needs for p: quantized K, its scales and means */
  size_t (*workspace_size)(const ab_attn_params* p);
  ab_status (*fwd)(const ab_attn_params* p, void* workspace, size_t workspace_bytes, const ab_cpu_pool* pool,
                   ab_error* err);
} ab_sage_cpu_table;

extern const ab_sage_cpu_table ab_sage_cpu_generic;
extern const ab_sage_cpu_table ab_sage_cpu_avx2;
extern const ab_sage_cpu_table ab_sage_cpu_avx512;
extern const ab_sage_cpu_table ab_sage_cpu_amx;
extern const ab_sage_cpu_table ab_sage_cpu_amx_emu;

#endif /* AB_SAGE_CPU_H */
