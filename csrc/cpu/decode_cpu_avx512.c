/* decode_cpu_avx512.c -- the KV-cache attention kernel for AVX-512 (F, BW, VL, DQ) CPUs.  setup.py
 * gives this file its ISA flags by its name; the kernel is decode_cpu_impl.h. */
#define AB_ISA_SFX _avx512
#define AB_ISA_NAME "avx512"
#if defined(__x86_64__) || defined(__i386__)
#include "decode_cpu_impl.h"
#else
#include "decode_cpu.h"
/* not an x86 build: the table exists so dispatch links; ab_cpu_isa_supported() says no */
const ab_decode_cpu_table ab_decode_cpu_avx512 = {"avx512", 0};
#endif
