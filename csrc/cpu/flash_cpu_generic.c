/* flash_cpu_generic.c -- the flash kernel for any CPU (the compiler's baseline flags).
 * setup.py gives this file its ISA flags by its name; the kernels are flash_cpu_impl.h and
 * sage_cpu_impl.h (which reuses flash's tiles). */
#define AB_ISA_SFX _generic
#define AB_ISA_NAME "generic"
#include "flash_cpu_impl.h"
#include "sage_cpu_impl.h"
