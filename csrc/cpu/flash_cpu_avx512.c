/* flash_cpu_avx512.c -- the flash kernel for AVX-512 (F, BW, VL, DQ) CPUs (built with -mavx512f -mavx512bw -mavx512vl -mavx512dq).
 * setup.py gives this file its ISA flags by its name; the kernels are flash_cpu_impl.h and
 * sage_cpu_impl.h (which reuses flash's tiles). */
#define AB_ISA_SFX _avx512
#define AB_ISA_NAME "avx512"
#if defined(__x86_64__) || defined(__i386__)
#include "flash_cpu_impl.h"
#include "sage_cpu_impl.h"
#else
#include "flash_cpu.h"
#include "sage_cpu.h"
/* not an x86 build: the table exists so dispatch links; ab_cpu_isa_supported() says no */
const ab_flash_cpu_table ab_flash_cpu_avx512 = {"avx512", 0, 0, 0};
const ab_sage_cpu_table ab_sage_cpu_avx512 = {"avx512_vnni", 0, 0};
#endif
