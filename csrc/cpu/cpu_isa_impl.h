/* cpu_isa_impl.h -- one ISA's build of every CPU kernel family, and its table (cpu_kernels.h).
 *
 * Included once by each cpu_<isa>.c, which setup.py compiles with that ISA's flags, after it sets
 *   AB_ISA_SFX, AB_ISA_NAME   the suffix of the vector kernels' symbols and the vector path's name;
 *   AB_ISA_DECODE             (vector paths) also build the decode kernel, decode_cpu_impl.h;
 *   AB_DECODE_TABLE           the decode table the path runs;
 *   AB_AMX_SFX, AB_AMX_NAME, AB_AMX_SAGE_NAME  (the AMX paths) also build the tile kernels, which
 *                             serve what they can and hand the rest to the vector kernels;
 *   AB_TABLE                  the table's name (ab_cpu_<isa>).
 * Families, by idea: cpu_tiles_impl.h (micro-kernel, geometry, masking), flash_fwd_impl.h,
 * flash_bwd_impl.h, sage_cpu_impl.h; on tiles amx_tiles_impl.h, flash_amx_fwd_impl.h,
 * flash_amx_bwd_impl.h, sage_amx_impl.h.
 */
#include <time.h>

#include "cpu_kernels.h"
#include "decode_cpu.h"
#include "cpu_tiles_impl.h"
#include "flash_fwd_impl.h"
#include "flash_bwd_impl.h"
#include "sage_cpu_impl.h"
#ifdef AB_ISA_DECODE
#include "decode_cpu_impl.h"
#endif
#ifdef AB_AMX_SFX
#include "amx_tiles_impl.h"
#include "flash_amx_fwd_impl.h"
#include "flash_amx_bwd_impl.h"
#include "sage_amx_impl.h"
#endif

/* ---- the FMA peak of this ISA path (benchmarks report kernels as a fraction of it) -------------- */

/* Float32 FMAs per second on the calling thread: 12 independent vector chains (enough to cover
 * the FMA latency on every x86 core), timed for about `seconds`. */
#if defined(__x86_64__) || defined(__i386__)
#define AB_KEEP(x) __asm__ volatile("" : "+x"(x)) /* the chain stays a register, unoptimised */
#elif defined(__aarch64__)
#define AB_KEEP(x) __asm__ volatile("" : "+w"(x))
#else
#define AB_KEEP(x) ((void)0)
#endif
#define AB_FMA12(op) op(c0) op(c1) op(c2) op(c3) op(c4) op(c5) op(c6) op(c7) op(c8) op(c9) op(c10) op(c11)
#define AB_STEP(x) x = x * a + b; AB_KEEP(x);

static double SYM(fma_rate)(double seconds) {
  const vf a = vset1(0.99999f), b = vset1(1e-6f);
  vf c0 = a, c1 = b, c2 = a, c3 = b, c4 = a, c5 = b, c6 = a, c7 = b, c8 = a, c9 = b, c10 = a, c11 = b;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  double elapsed = 0.0;
  int64_t iters = 0;
  while (elapsed < seconds) {
    for (int it = 0; it < 100000; ++it) {
      AB_FMA12(AB_STEP)
    }
    iters += 100000;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    elapsed = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  }
  const float sink = c0[0] + c1[0] + c2[0] + c3[0] + c4[0] + c5[0] + c6[0] + c7[0] + c8[0] + c9[0] + c10[0] + c11[0];
  return sink == 12345.0f ? 0.0 : 2.0 * 12 * VLEN * (double)iters / elapsed;
}
#undef AB_STEP
#undef AB_FMA12
#undef AB_KEEP

extern const ab_decode_cpu_table AB_DECODE_TABLE;

#ifdef AB_AMX_SFX
const ab_cpu_kernels AB_TABLE = {AB_AMX_NAME,         AMXS(flash_fwd),  AMXS(flash_bwd), AB_AMX_SAGE_NAME,
                                 AMXS(sage_workspace_size), AMXS(sage_fwd), &AB_DECODE_TABLE, SYM(fma_rate)};
#else
const ab_cpu_kernels AB_TABLE = {AB_ISA_NAME,         SYM(flash_fwd),  SYM(flash_bwd), SG_ISA_NAME,
                                 SYM(sage_workspace_size), SYM(sage_fwd), &AB_DECODE_TABLE, SYM(fma_rate)};
#endif
