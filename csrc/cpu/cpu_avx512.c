/* cpu_avx512.c -- every CPU kernel family for AVX-512 (F, BW, VL, DQ) CPUs (built with -mavx512f
 * -mavx512bw -mavx512vl -mavx512dq; sage's vpdpbusd with a function attribute, chosen only where
 * the CPU has AVX512-VNNI); exports ab_cpu_avx512 (cpu_kernels.h).  setup.py gives this file its
 * flags by its name. */
#if defined(__x86_64__) || defined(__i386__)
#define AB_ISA_SFX _avx512
#define AB_ISA_NAME "avx512"
#define AB_ISA_DECODE 1
#define AB_DECODE_TABLE ab_decode_cpu_avx512
#define AB_TABLE ab_cpu_avx512
#include "cpu_isa_impl.h"
#else
#include "cpu_kernels.h"
#include "decode_cpu.h"
/* not an x86 build: the tables exist so dispatch links; ab_cpu_isa_supported() says no */
const ab_decode_cpu_table ab_decode_cpu_avx512 = {"avx512", 0};
const ab_cpu_kernels ab_cpu_avx512 = {"avx512", 0, 0, "avx512_vnni", 0, 0, &ab_decode_cpu_avx512, 0};
#endif
