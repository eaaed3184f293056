/* cpu_kernels.h -- one ISA path's CPU kernels as one table, and the choice between the tables
 * (internal to csrc/cpu).
 *
 * Each kernel family is one source for every ISA (flash_fwd_impl.h, flash_bwd_impl.h,
 * sage_cpu_impl.h, decode_cpu_impl.h on the tiles of cpu_tiles_impl.h; the AMX kernels in
 * flash_amx_{fwd,bwd}_impl.h and sage_amx_impl.h on amx_tiles_impl.h).  One file per ISA compiles
 * every family with that ISA's flags (setup.py gives a file its flags by the end of its name) and
 * exports one table, through cpu_isa_impl.h:
 *   cpu_generic.c  baseline flags                                   ab_cpu_generic
 *   cpu_avx2.c     AVX2 + FMA + F16C                                ab_cpu_avx2
 *   cpu_avx512.c   AVX-512 F, BW, VL, DQ                            ab_cpu_avx512
 *   cpu_amx.c      AVX-512 + AMX tiles (empty where the compiler has no -mamx-*)  ab_cpu_amx
 *   cpu_amx_emu.c  baseline flags, tiles emulated (ab_amx.h)        ab_cpu_amx_emu
 * cpu_isa.c picks the table: the best vector path the CPU and the OS support, once, unless
 * ATTN_BACKENDS_CPU_ISA or ab_cpu_isa_set forces one (the AMX tables are only ever chosen that way).
 * A table whose flash_fwd is NULL was not built (not an x86 build, or no AMX in the compiler).
 */
#ifndef AB_CPU_KERNELS_H
#define AB_CPU_KERNELS_H

#include <stddef.h>

#include "../ab_core.h"

struct ab_decode_cpu_table; /* decode_cpu.h */

typedef struct ab_cpu_kernels {
  const char* isa; /* "generic", "avx2", "avx512", "amx", "amx_emu" */
  /* flash, dense and packed (flash_cpu.c checks a call before it gets here) */
  ab_status (*flash_fwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);
  ab_status (*flash_bwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);
  /* sage, forward only (sage_cpu.c): the name of its integer path ("generic", "avx2", "avx512_vnni",
   * "amx_int8", "amx_emu"), the bytes of workspace fwd needs for p (quantized K, its scales and
   * means), the forward */
  const char* sage_isa;
  size_t (*sage_workspace_size)(const ab_attn_params* p);
  ab_status (*sage_fwd)(const ab_attn_params* p, void* workspace, size_t workspace_bytes, const ab_cpu_pool* pool,
                        ab_error* err);
  /* the KV-cache decode kernel this path runs (the AMX paths: their vector one with steps 1 and 3 on
   * tiles where decode_cpu.c's amx_tiles admits a call) */
  const struct ab_decode_cpu_table* decode;
  double (*fma_rate)(double seconds); /* float32 flop/s of one thread on this path */
} ab_cpu_kernels;

extern const ab_cpu_kernels ab_cpu_generic;
extern const ab_cpu_kernels ab_cpu_avx2;
extern const ab_cpu_kernels ab_cpu_avx512;
extern const ab_cpu_kernels ab_cpu_amx;
extern const ab_cpu_kernels ab_cpu_amx_emu;

/* The table of path isa (every path has one; its members are NULL where it was not built). */
const ab_cpu_kernels* ab_cpu_kernels_for(ab_cpu_isa isa);

/* The table of the path ab_cpu_isa_get() names. */
static inline const ab_cpu_kernels* ab_cpu_kernels_get(void) { return ab_cpu_kernels_for(ab_cpu_isa_get()); }

#endif /* AB_CPU_KERNELS_H */
