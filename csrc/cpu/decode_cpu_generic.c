/* decode_cpu_generic.c -- the KV-cache attention kernel for any CPU (the compiler's baseline flags).
 * setup.py gives this file its ISA flags by its name; the kernel is decode_cpu_impl.h. */
#define AB_ISA_SFX _generic
#define AB_ISA_NAME "generic"
#include "decode_cpu_impl.h"
