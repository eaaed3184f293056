/* cpu_isa.c -- picks the instruction-set path of the CPU kernels once: which table of
 * cpu_kernels.h every CPU kernel call runs; and the FMA peak of that path.
 *
 * The best vector path the CPU *and* the OS support (ab_cpu_features: CPUID + XGETBV) is chosen on
 * first use; ATTN_BACKENDS_CPU_ISA=generic|avx2|avx512|amx|amx_emu forces one (a request this CPU
 * cannot honour makes every call of the kernels with per-path code, flash, sage and decode, fail
 * with the reason, ab_cpu_isa_error), and
 * ab_cpu_isa_set switches at run time so tests can cover every path.
 *
 * The AMX paths are never the default.  "amx" (bfloat16 flash and sage on tiles, cpu_amx.c)
 * has been compiled and its logic tested through the emulation, but it has not run on AMX
 * hardware: its correctness there and its speed are unverified (docs/amx.md), so it is chosen only
 * when asked for, and only where CPUID, XCR0 and the kernel's tile-data permission all allow it
 * (ab_cpu_features: never SIGILL).  "amx_emu" runs the same tile kernels on an emulation of the
 * instructions (any CPU, slowly): it exists for the tests.  When a real AMX path is measured
 * faster than torch, the planner's tables (ab_our_cpu_units, ab_registry.c) say so, not this file.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ab_cpu.h"
#include "cpu_kernels.h"

static const ab_cpu_kernels* const k_tables[AB_ISA_COUNT] = {&ab_cpu_generic, &ab_cpu_avx2, &ab_cpu_avx512,
                                                            &ab_cpu_amx, &ab_cpu_amx_emu};
static const char* const k_names[AB_ISA_COUNT] = {"generic", "avx2", "avx512", "amx", "amx_emu"};

static atomic_int g_isa = -1;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

const char* ab_cpu_isa_name(ab_cpu_isa isa) {
  return isa >= AB_ISA_GENERIC && isa < AB_ISA_COUNT ? k_names[isa] : "unknown";
}

int ab_cpu_isa_supported(ab_cpu_isa isa) {
  const ab_cpu_features* f = ab_cpu_features_get();
  switch (isa) {
    case AB_ISA_GENERIC: return 1;
    case AB_ISA_AVX2: return k_tables[1]->flash_fwd && f->avx2 && f->fma && f->f16c;
    case AB_ISA_AVX512:
      return k_tables[2]->flash_fwd && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->fma &&
             f->f16c;
    case AB_ISA_AMX: /* its vector half is the AVX-512 kernel; amx_bf16 implies the tile permission */
      return k_tables[3]->flash_fwd && ab_cpu_isa_supported(AB_ISA_AVX512) && f->amx_tile && f->amx_bf16;
    case AB_ISA_AMX_EMU: return k_tables[4]->flash_fwd != NULL;
    default: return 0;
  }
}

/* Why ATTN_BACKENDS_CPU_ISA cannot be honoured ("" when it can or is unset): every flash, sage and
 * decode call then fails with it, rather than running another path than the one asked for. */
static char g_isa_error[256];

static void init_isa(void) {
  int best = ab_cpu_isa_supported(AB_ISA_AVX512) ? AB_ISA_AVX512
             : ab_cpu_isa_supported(AB_ISA_AVX2) ? AB_ISA_AVX2
                                                  : AB_ISA_GENERIC;
  const char* env = getenv("ATTN_BACKENDS_CPU_ISA");
  if (env && *env) {
    int asked = -1;
    for (int i = 0; i < AB_ISA_COUNT; ++i)
      if (strcmp(env, k_names[i]) == 0) asked = i;
    const ab_cpu_features* f = ab_cpu_features_get();
    if (asked >= 0 && ab_cpu_isa_supported((ab_cpu_isa)asked))
      best = asked;
    else if (asked == AB_ISA_AMX)
      snprintf(g_isa_error, sizeof g_isa_error, "ATTN_BACKENDS_CPU_ISA=amx: %s%s",
               !f->amx_tile ? "AMX is " : "",
               !f->amx_tile              ? f->amx_state
               : !k_tables[3]->flash_fwd ? "no AMX kernel path is built in this version (the compiler lacked -mamx-*)"
               : !f->amx_bf16            ? "this CPU has AMX tiles but no AMX-BF16"
                                         : "the AMX path needs AVX-512 (F, BW, VL, DQ), which this CPU or OS lacks");
    else if (asked >= 0)
      snprintf(g_isa_error, sizeof g_isa_error,
               "ATTN_BACKENDS_CPU_ISA=%s: this CPU or OS cannot run that path (best here: %s)", env,
               k_names[best]);
    else
      snprintf(g_isa_error, sizeof g_isa_error,
               "ATTN_BACKENDS_CPU_ISA=%.40s: unknown path (expected generic, avx2, avx512, amx or amx_emu)", env);
  }
  atomic_store(&g_isa, best);
}

const char* ab_cpu_isa_error(void) {
  pthread_once(&g_once, init_isa);
  return g_isa_error[0] ? g_isa_error : NULL;
}

ab_cpu_isa ab_cpu_isa_get(void) {
  pthread_once(&g_once, init_isa);
  return (ab_cpu_isa)atomic_load(&g_isa);
}

int ab_cpu_isa_set(ab_cpu_isa isa) {
  pthread_once(&g_once, init_isa);
  if (!ab_cpu_isa_supported(isa)) return 0;
  atomic_store(&g_isa, (int)isa);
  g_isa_error[0] = 0; /* an explicit switch replaces what the environment asked for */
  return 1;
}
const ab_cpu_kernels* ab_cpu_kernels_for(ab_cpu_isa isa) {
  return k_tables[isa >= AB_ISA_GENERIC && isa < AB_ISA_COUNT ? isa : AB_ISA_GENERIC];
}

typedef struct peak_arg {
  double seconds, rate;
  const ab_cpu_kernels* table;
} peak_arg;

static void* peak_thread(void* v) {
  peak_arg* a = (peak_arg*)v;
  a->rate = a->table->fma_rate(a->seconds);
  return NULL;
}

double ab_cpu_fma_peak(double seconds, int threads) {
  if (threads < 1) threads = 1;
  if (threads > 256) threads = 256;
  const ab_cpu_kernels* table = ab_cpu_kernels_get();
  peak_arg args[256];
  pthread_t tids[256];
  int started = 0;
  for (int i = 0; i < threads; ++i) {
    args[i] = (peak_arg){seconds, 0.0, table};
    if (pthread_create(&tids[i], NULL, peak_thread, &args[i]) != 0) break;
    ++started;
  }
  double total = 0.0;
  for (int i = 0; i < started; ++i) {
    pthread_join(tids[i], NULL);
    total += args[i].rate;
  }
  return total;
}

