/* decode_cpu_avx2.c -- the KV-cache attention kernel for AVX2 + FMA + F16C CPUs (built with -mavx2
 * -mfma -mf16c).  setup.py gives this file its ISA flags by its name; the kernel is decode_cpu_impl.h. */
#define AB_ISA_SFX _avx2
#define AB_ISA_NAME "avx2"
#if defined(__x86_64__) || defined(__i386__)
#include "decode_cpu_impl.h"
#else
#include "decode_cpu.h"
/* not an x86 build: the table exists so dispatch links; ab_cpu_isa_supported() says no */
const ab_decode_cpu_table ab_decode_cpu_avx2 = {"avx2", 0};
#endif
