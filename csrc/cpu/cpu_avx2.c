/* cpu_avx2.c -- every CPU kernel family for AVX2 + FMA + F16C CPUs (built with -mavx2 -mfma -mf16c);
 * exports ab_cpu_avx2 (cpu_kernels.h).  setup.py gives this file its flags by its name. */
#if defined(__x86_64__) || defined(__i386__)
#define AB_ISA_SFX _avx2
#define AB_ISA_NAME "avx2"
#define AB_ISA_DECODE 1
#define AB_DECODE_TABLE ab_decode_cpu_avx2
#define AB_TABLE ab_cpu_avx2
#include "cpu_isa_impl.h"
#else
#include "cpu_kernels.h"
#include "decode_cpu.h"
/* not an x86 build: the tables exist so dispatch links; ab_cpu_isa_supported() says no */
const ab_decode_cpu_table ab_decode_cpu_avx2 = {"avx2", 0};
const ab_cpu_kernels ab_cpu_avx2 = {"avx2", 0, 0, "avx2", 0, 0, &ab_decode_cpu_avx2, 0};
#endif
