/* ab_amx.h -- the AMX tile operations the CPU kernels use, real or emulated (internal to csrc/cpu).
 *
 * What it is: one spelling of the tile instructions the AMX kernels need (ldtilecfg and
 * tilerelease, tileloadd, tilestored, tilezero, tdpbf16ps, tdpfp16ps, tdpbssd, tdpbusd), in two
 * builds chosen by AB_AMX_EMULATE:
 *   - real (cpu_amx.c, built with -mamx-tile -mamx-bf16 -mamx-int8): the <immintrin.h>
 *     intrinsics.  tdpfp16ps uses _tile_dpfp16ps where the compiler has -mamx-fp16 (gcc >= 13) and
 *     otherwise the instruction itself through inline assembly (AB_AMX_FP16_ASM: setup.py checks
 *     that the assembler knows it; GNU as 2.40 does, gcc 12 has no flag for it).
 *   - emulated (cpu_amx_emu.c, plain C with the generic flags): the same operations on
 *     eight 1 KiB tiles held per thread, with the instructions' documented semantics, so the
 *     kernels' tiling, packing and indexing run (and are tested) on any CPU.
 *
 * Why the emulation is written to the letter of the instruction reference (Intel SDM, "Intel AMX
 * instructions"): palette 1, 8 tiles of at most 16 rows x 64 bytes; each tile's rows and bytes
 * per row come from the configuration; a load zeroes the bytes and rows past them; a product
 * checks the shapes (C rows = A rows, C bytes per row = B bytes per row, A's 4-byte groups = B's
 * rows) and that the three tiles differ, as the hardware raises #UD otherwise; tdpbf16ps and
 * tdpfp16ps take each 32-bit word of A and B as a pair of 16-bit floats (VNNI-2: B holds rows
 * 2k and 2k+1 of the K x N operand interleaved), accumulate even and odd elements of the pairs
 * in two float32 chains over k, then add their sum to C, with denormal inputs read as zero
 * (bfloat16 and float32; float16 denormals are exact) and denormal results flushed; tdpbssd and
 * tdpbusd take each word as 4 signed (or unsigned) bytes and accumulate in int32 with
 * wraparound.  A misuse the hardware would fault on aborts the process with a message naming it
 * (the emulation's #UD): such a bug must fail loudly in CI, not compute something.
 *
 * What the emulation cannot show: speed, and bitwise agreement with hardware where the reference
 * leaves freedom (a product below float32's normal range is rounded once here before its add,
 * where the hardware's fused multiply-add keeps it exact).  docs/amx.md says more.
 *
 * Tile numbers are compile-time constants (the instructions encode them), so the operations
 * are macros taking a literal 0..7.
 */
#ifndef AB_AMX_H
#define AB_AMX_H

#include <stdint.h>
#include <string.h>

/* The 64-byte operand of ldtilecfg, palette 1 (8 tiles; entries 8..15 stay zero). */
typedef struct ab_tilecfg {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16]; /* bytes per row of tile i */
  uint8_t rows[16];
} ab_tilecfg;

#define AB_TILE_ROWS 16
#define AB_TILE_COLSB 64

/* Every tile 16 rows x 64 bytes: the one shape the kernels use (a 16 x 16 float32 C tile, a
 * 16 x 32 16-bit A tile, a 16-pair x 16 B tile; 64 int8 per row for the integer products). */
static inline void ab_tilecfg_full(ab_tilecfg* c) {
  memset(c, 0, sizeof *c);
  c->palette = 1;
  for (int t = 0; t < 8; ++t) {
    c->colsb[t] = AB_TILE_COLSB;
    c->rows[t] = AB_TILE_ROWS;
  }
}

#if !defined(AB_AMX_EMULATE)

#include <immintrin.h>

/* The intrinsics are asm statements that name no memory: a barrier on each side of the ones that
 * read or write it keeps the compiler from moving ordinary loads and stores across them. */
#define AB_AMX_BARRIER() __asm__ volatile("" ::: "memory")
#define AMX_CONFIG(cfg) \
  do {                  \
    AB_AMX_BARRIER();   \
    _tile_loadconfig(cfg); \
  } while (0)
#define AMX_RELEASE() _tile_release()
#define AMX_LOAD(t, base, stride)   \
  do {                              \
    AB_AMX_BARRIER();               \
    _tile_loadd(t, base, stride);   \
  } while (0)
#define AMX_STORE(t, base, stride)  \
  do {                              \
    _tile_stored(t, base, stride);  \
    AB_AMX_BARRIER();               \
  } while (0)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DPBF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMX_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define AMX_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#if defined(__AMX_FP16__)
#define AB_AMX_HAS_FP16 1
#define AMX_DPFP16(c, a, b) _tile_dpfp16ps(c, a, b)
#elif defined(AB_AMX_FP16_ASM)
#define AB_AMX_HAS_FP16 1
/* the instruction as gcc 13's _tile_dpfp16ps spells it (both assembler dialects) */
#define AB_AMX_DPFP16_INTERNAL(c, a, b) \
  __asm__ volatile("{tdpfp16ps\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c "|tdpfp16ps\t%%tmm" #c ", %%tmm" #a ", %%tmm" #b "}" ::)
#define AMX_DPFP16(c, a, b) AB_AMX_DPFP16_INTERNAL(c, a, b)
#else
#define AB_AMX_HAS_FP16 0
#endif

#else /* AB_AMX_EMULATE */

#include <stdio.h>
#include <stdlib.h>

#define AB_AMX_HAS_FP16 1

typedef struct ab_amx_emu_state {
  ab_tilecfg cfg; /* palette 0: not configured (the state after tilerelease) */
  unsigned char tile[8][AB_TILE_ROWS][AB_TILE_COLSB];
} ab_amx_emu_state;

/* The tile registers of this thread, as the hardware's are per logical CPU. */
static _Thread_local ab_amx_emu_state ab_amx_emu_tls;

static void ab_amx_emu_fault(const char* insn, const char* why) {
  fprintf(stderr, "attn_backends: emulated AMX fault: %s: %s (the real instruction raises #UD or #GP)\n",
          insn, why);
  abort();
}

static inline void ab_amx_emu_config(const ab_tilecfg* c) {
  ab_amx_emu_state* s = &ab_amx_emu_tls;
  if (c->palette == 0) {
    memset(s, 0, sizeof *s);
    return;
  }
  if (c->palette != 1) ab_amx_emu_fault("ldtilecfg", "palette other than 0 or 1");
  for (int i = 0; i < 14; ++i)
    if (c->reserved[i]) ab_amx_emu_fault("ldtilecfg", "reserved bytes not zero");
  if (c->start_row) ab_amx_emu_fault("ldtilecfg", "start_row not zero");
  for (int t = 0; t < 16; ++t) {
    if (t >= 8 && (c->rows[t] || c->colsb[t])) ab_amx_emu_fault("ldtilecfg", "palette 1 has 8 tiles");
    if (c->rows[t] > AB_TILE_ROWS || c->colsb[t] > AB_TILE_COLSB)
      ab_amx_emu_fault("ldtilecfg", "tile larger than 16 rows x 64 bytes");
    if ((c->rows[t] == 0) != (c->colsb[t] == 0)) ab_amx_emu_fault("ldtilecfg", "tile with rows xor bytes zero");
  }
  memset(s, 0, sizeof *s);
  s->cfg = *c;
}

static inline void ab_amx_emu_release(void) { memset(&ab_amx_emu_tls, 0, sizeof ab_amx_emu_tls); }

static inline ab_amx_emu_state* ab_amx_emu_use(int t, const char* insn) {
  ab_amx_emu_state* s = &ab_amx_emu_tls;
  if (s->cfg.palette != 1) ab_amx_emu_fault(insn, "tiles not configured (no ldtilecfg since the last release)");
  if (t < 0 || t > 7 || s->cfg.rows[t] == 0) ab_amx_emu_fault(insn, "tile not configured");
  return s;
}

static inline void ab_amx_emu_zero(int t) {
  ab_amx_emu_state* s = ab_amx_emu_use(t, "tilezero");
  memset(s->tile[t], 0, sizeof s->tile[t]);
}

static inline void ab_amx_emu_load(int t, const void* base, int64_t stride) {
  ab_amx_emu_state* s = ab_amx_emu_use(t, "tileloadd");
  const int rows = s->cfg.rows[t], colsb = s->cfg.colsb[t];
  memset(s->tile[t], 0, sizeof s->tile[t]);
  for (int r = 0; r < rows; ++r) memcpy(s->tile[t][r], (const char*)base + r * stride, (size_t)colsb);
}

static inline void ab_amx_emu_store(int t, void* base, int64_t stride) {
  ab_amx_emu_state* s = ab_amx_emu_use(t, "tilestored");
  const int rows = s->cfg.rows[t], colsb = s->cfg.colsb[t];
  for (int r = 0; r < rows; ++r) memcpy((char*)base + r * stride, s->tile[t][r], (size_t)colsb);
}

/* The shape rules every tile product shares: C (M x N words) += A (M x K words) . B (K x N words). */
static inline ab_amx_emu_state* ab_amx_emu_dp_check(int c, int a, int b, const char* insn, int* M, int* N, int* K) {
  ab_amx_emu_state* s = ab_amx_emu_use(c, insn);
  ab_amx_emu_use(a, insn);
  ab_amx_emu_use(b, insn);
  if (c == a || c == b || a == b) ab_amx_emu_fault(insn, "the three tiles must differ");
  const ab_tilecfg* g = &s->cfg;
  if (g->rows[c] != g->rows[a]) ab_amx_emu_fault(insn, "C and A have different row counts");
  if (g->colsb[c] != g->colsb[b]) ab_amx_emu_fault(insn, "C and B have different bytes per row");
  if (g->colsb[a] % 4 || g->colsb[c] % 4) ab_amx_emu_fault(insn, "bytes per row not a multiple of 4");
  if (g->colsb[a] / 4 != g->rows[b]) ab_amx_emu_fault(insn, "A's 4-byte groups per row differ from B's rows");
  *M = g->rows[c];
  *N = g->colsb[c] / 4;
  *K = g->colsb[a] / 4;
  return s;
}

static inline float ab_amx_emu_f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint32_t ab_amx_emu_u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* Denormals to signed zero: DAZ on the inputs of the float32 adds, FTZ on their results. */
static inline float ab_amx_emu_ftz(float x) {
  const uint32_t u = ab_amx_emu_u(x);
  return (u & 0x7f800000u) ? x : ab_amx_emu_f(u & 0x80000000u);
}

/* A 16-bit float of a pair as float32: bfloat16 with DAZ, float16 exactly (its denormals are
 * normal float32 numbers, and the reference keeps them). */
static inline float ab_amx_emu_half(uint16_t h, int fp16) {
  if (!fp16) return ab_amx_emu_ftz(ab_amx_emu_f((uint32_t)h << 16));
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    const float f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
    return sign ? -f : f;
  }
  if (exp == 31) return ab_amx_emu_f(sign | 0x7f800000u | (mant << 13));
  return ab_amx_emu_f(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* tdpbf16ps / tdpfp16ps: per row m of C, two float32 chains (even and odd halves of the pairs)
 * start at 0 and take the products of k = 0, 1, ... in order; then C[m][n] += even + odd. */
static inline void ab_amx_emu_dp_half(int c, int a, int b, int fp16) {
  int M, N, K;
  ab_amx_emu_state* s = ab_amx_emu_dp_check(c, a, b, fp16 ? "tdpfp16ps" : "tdpbf16ps", &M, &N, &K);
  float bf[AB_TILE_ROWS][32];
  for (int k = 0; k < K; ++k)
    for (int n = 0; n < 2 * N; ++n) {
      uint16_t h;
      memcpy(&h, &s->tile[b][k][2 * n], 2);
      bf[k][n] = ab_amx_emu_half(h, fp16);
    }
  for (int m = 0; m < M; ++m) {
    float acc[32] = {0};
    for (int k = 0; k < K; ++k) {
      uint16_t h0, h1;
      memcpy(&h0, &s->tile[a][m][4 * k], 2);
      memcpy(&h1, &s->tile[a][m][4 * k + 2], 2);
      const float a0 = ab_amx_emu_half(h0, fp16), a1 = ab_amx_emu_half(h1, fp16);
      for (int n = 0; n < N; ++n) {
        acc[2 * n] = ab_amx_emu_ftz(acc[2 * n] + a0 * bf[k][2 * n]);
        acc[2 * n + 1] = ab_amx_emu_ftz(acc[2 * n + 1] + a1 * bf[k][2 * n + 1]);
      }
    }
    float row[16];
    memcpy(row, s->tile[c][m], sizeof row);
    for (int n = 0; n < N; ++n)
      row[n] = ab_amx_emu_ftz(ab_amx_emu_ftz(row[n]) + ab_amx_emu_ftz(acc[2 * n] + acc[2 * n + 1]));
    memset(s->tile[c][m], 0, AB_TILE_COLSB);
    memcpy(s->tile[c][m], row, (size_t)N * 4);
  }
  for (int m = M; m < AB_TILE_ROWS; ++m) memset(s->tile[c][m], 0, AB_TILE_COLSB);
}

/* tdpbssd / tdpbusd: each word is 4 bytes, A's signed or unsigned, B's signed; int32 sums with
 * wraparound (done in uint32, where C defines it). */
static inline void ab_amx_emu_dp_int8(int c, int a, int b, int a_unsigned) {
  int M, N, K;
  ab_amx_emu_state* s = ab_amx_emu_dp_check(c, a, b, a_unsigned ? "tdpbusd" : "tdpbssd", &M, &N, &K);
  for (int m = 0; m < M; ++m) {
    uint32_t row[16];
    memcpy(row, s->tile[c][m], sizeof row);
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) {
        int32_t dot = 0;
        for (int i = 0; i < 4; ++i) {
          const int32_t av = a_unsigned ? (int32_t)s->tile[a][m][4 * k + i] : (int32_t)(int8_t)s->tile[a][m][4 * k + i];
          dot += av * (int32_t)(int8_t)s->tile[b][k][4 * n + i];
        }
        row[n] += (uint32_t)dot;
      }
    memset(s->tile[c][m], 0, AB_TILE_COLSB);
    memcpy(s->tile[c][m], row, (size_t)N * 4);
  }
  for (int m = M; m < AB_TILE_ROWS; ++m) memset(s->tile[c][m], 0, AB_TILE_COLSB);
}

#define AMX_CONFIG(cfg) ab_amx_emu_config(cfg)
#define AMX_RELEASE() ab_amx_emu_release()
#define AMX_LOAD(t, base, stride) ab_amx_emu_load(t, base, stride)
#define AMX_STORE(t, base, stride) ab_amx_emu_store(t, base, stride)
#define AMX_ZERO(t) ab_amx_emu_zero(t)
#define AMX_DPBF16(c, a, b) ab_amx_emu_dp_half(c, a, b, 0)
#define AMX_DPFP16(c, a, b) ab_amx_emu_dp_half(c, a, b, 1)
#define AMX_DPBSSD(c, a, b) ab_amx_emu_dp_int8(c, a, b, 0)
#define AMX_DPBUSD(c, a, b) ab_amx_emu_dp_int8(c, a, b, 1)

#endif /* AB_AMX_EMULATE */

#endif /* AB_AMX_H */
