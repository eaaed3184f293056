/* cpu_amx_emu.c -- the AMX flash and sage kernels against an emulation of the tile
 * instructions (ab_amx.h), built with the generic flags, so their tiling, packing and indexing run
 * and are tested on any CPU.  Selected only by ATTN_BACKENDS_CPU_ISA=amx_emu or
 * _C.set_cpu_isa("amx_emu") (the tests): it computes what the real path computes, slowly.
 * Calls the tiles do not serve (float32 flash, float16 backward) run the generic vector kernels;
 * decode is the generic kernel compiled here once more, with its steps 1 and 3 on the emulated tiles
 * for the calls decode_cpu.c's amx_tiles admits.  Exports ab_cpu_amx_emu (cpu_kernels.h).
 */
#define AB_AMX_EMULATE 1
#define AB_ISA_SFX _amx_emu_vec
#define AB_ISA_NAME "generic"
#define AB_AMX_SFX _amx_emu
#define AB_AMX_NAME "amx_emu"
#define AB_AMX_SAGE_NAME "amx_emu"
#define AB_ISA_DECODE 1
#define AB_DECODE_TABLE ab_decode_cpu_amx_emu_vec
#define AB_TABLE ab_cpu_amx_emu
#include "cpu_isa_impl.h"

/* One emulated tile product, for the tests of the emulation itself (tests/test_amx.py): tile 0 = C,
 * 1 = A, 2 = B, configured with the given shapes (which may be wrong on purpose: the emulation
 * then faults as the instruction would). */
void ab_amx_emu_dot(int op, const void* a, const void* b, void* c, const int shape[6]) {
  ab_tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 3; ++t) {
    cfg.rows[t] = (uint8_t)shape[2 * t];
    cfg.colsb[t] = (uint16_t)shape[2 * t + 1];
  }
  AMX_CONFIG(&cfg);
  AMX_LOAD(0, c, shape[1]);
  AMX_LOAD(1, a, shape[3]);
  AMX_LOAD(2, b, shape[5]);
  switch (op) {
    case 0: AMX_DPBF16(0, 1, 2); break;
    case 1: AMX_DPFP16(0, 1, 2); break;
    case 2: AMX_DPBSSD(0, 1, 2); break;
    default: AMX_DPBUSD(0, 1, 2); break;
  }
  AMX_STORE(0, c, shape[1]);
  AMX_RELEASE();
}
