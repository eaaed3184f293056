/* flash_cpu.h -- the CPU flash kernel's per-ISA entry points and the dispatch between them
 * (internal to csrc/cpu).
 *
 * flash_cpu_impl.h is compiled three times (flash_cpu_generic.c, _avx2.c, _avx512.c) with that
 * ISA's compiler flags; each copy exports one table.  The AMX tile kernel (flash_amx_impl.h) is
 * compiled twice more: flash_cpu_amx.c on real tiles, flash_cpu_amx_emu.c on emulated ones.
 * cpu_dispatch.c picks the best vector table the CPU and the OS support, once, unless
 * ATTN_BACKENDS_CPU_ISA forces one (the AMX tables are only ever chosen that way).
 */
#ifndef AB_FLASH_CPU_H
#define AB_FLASH_CPU_H

#include "../ab_core.h"

typedef struct ab_flash_cpu_table {
  const char* isa;
  ab_status (*fwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);
  ab_status (*bwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);
  double (*fma_rate)(double seconds); /* float32 flop/s of one thread on this path */
} ab_flash_cpu_table;

extern const ab_flash_cpu_table ab_flash_cpu_generic;
extern const ab_flash_cpu_table ab_flash_cpu_avx2;
extern const ab_flash_cpu_table ab_flash_cpu_avx512;
extern const ab_flash_cpu_table ab_flash_cpu_amx;     /* fwd NULL: built without AMX support */
extern const ab_flash_cpu_table ab_flash_cpu_amx_emu;

#endif /* AB_FLASH_CPU_H */
