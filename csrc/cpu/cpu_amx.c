/* cpu_amx.c -- the flash and sage kernels on real AMX tiles (built with the AVX-512 flags and
 * -mamx-tile -mamx-bf16 -mamx-int8, and -mamx-fp16 or AB_AMX_FP16_ASM where the toolchain has it;
 * setup.py gives this file its flags by its name).
 *
 * bfloat16 flash forward and backward, float16 forward (on AMX-FP16 CPUs) and sage run on tiles
 * (flash_amx_{fwd,bwd}_impl.h, sage_amx_impl.h); every other call runs the AVX-512 vector kernels
 * (compiled here once more so the tile kernels can use their pieces); decode is the AVX-512 kernel
 * compiled here once more, with its steps 1 and 3 on tiles for the calls decode_cpu.c's amx_tiles admits
 * and both products on tiles for those amx_rows admits (ab_decode_cpu_amx_vec; decode_cpu_impl.h, "Tiles" and
 * "tiles of many rows"; the avx512 path borrows it for the latter).  Exports ab_cpu_amx (cpu_kernels.h).  The path is
 * selectable only where CPUID, XCR0 and the kernel's tile-data permission all say yes
 * (cpu_isa.c), and it is not the default: on AMX hardware it is correct but not faster than torch SDPA (docs/amx.md).
 * A compiler without AMX support builds an empty table, which dispatch reports as not built.
 */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AMX_INT8__) && defined(__AVX512F__)
#define AB_ISA_SFX _amx_vec
#define AB_ISA_NAME "avx512"
#define AB_AMX_SFX _amx
#define AB_AMX_NAME "amx"
#define AB_AMX_SAGE_NAME "amx_int8"
#define AB_ISA_DECODE 1
#define AB_DECODE_TABLE ab_decode_cpu_amx_vec
#define AB_TABLE ab_cpu_amx
#include "cpu_isa_impl.h"
#else
#include "cpu_kernels.h"
/* no AMX in this build: the table exists so dispatch links; ab_cpu_isa_supported() says no */
const ab_cpu_kernels ab_cpu_amx = {"amx", 0, 0, "amx_int8", 0, 0, 0, 0};
#endif
