/* cpu_generic.c -- every CPU kernel family for any CPU (the compiler's baseline flags: SSE2 on
 * x86-64, NEON on Arm); exports ab_cpu_generic (cpu_kernels.h).  setup.py gives this file its
 * flags by its name. */
#define AB_ISA_SFX _generic
#define AB_ISA_NAME "generic"
#define AB_ISA_DECODE 1
#define AB_DECODE_TABLE ab_decode_cpu_generic
#define AB_TABLE ab_cpu_generic
#include "cpu_isa_impl.h"
