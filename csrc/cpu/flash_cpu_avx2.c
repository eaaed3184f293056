/* flash_cpu_avx2.c -- the flash kernel for AVX2 + FMA + F16C CPUs (built with -mavx2 -mfma -mf16c).
 * setup.py gives this file its ISA flags by its name; the kernels are flash_cpu_impl.h and
 * sage_cpu_impl.h (which reuses flash's tiles). */
#define AB_ISA_SFX _avx2
#define AB_ISA_NAME "avx2"
#if defined(__x86_64__) || defined(__i386__)
#include "flash_cpu_impl.h"
#include "sage_cpu_impl.h"
#else
#include "flash_cpu.h"
#include "sage_cpu.h"
/* not an x86 build: the table exists so dispatch links; ab_cpu_isa_supported() says no */
const ab_flash_cpu_table ab_flash_cpu_avx2 = {"avx2", 0, 0, 0};
const ab_sage_cpu_table ab_sage_cpu_avx2 = {"avx2", 0, 0};
#endif
