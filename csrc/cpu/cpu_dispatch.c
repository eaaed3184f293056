/* cpu_dispatch.c -- picks the instruction-set path of the CPU kernels once, and the flash entry
 * points that check a call before running it on that path.
 *
 * The best vector path the CPU *and* the OS support (ab_cpu_features: CPUID + XGETBV) is chosen on
 * first use; ATTN_BACKENDS_CPU_ISA=generic|avx2|avx512|amx|amx_emu forces one (a request this CPU
 * cannot honour makes every CPU kernel call fail with the reason, ab_cpu_isa_error), and
 * ab_cpu_isa_set switches at run time so tests can cover every path.
 *
 * The AMX paths are never the default.  "amx" (bfloat16 flash and sage on tiles, flash_cpu_amx.c)
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

#include "../ab_planner.h"
#include "ab_cpu.h"
#include "flash_cpu.h"

/* ---- per-thread scratch (ab_cpu.h) ------------------------------------------------------------- */

typedef struct scratch {
  void* ptr;
  size_t bytes;
} scratch;

static pthread_key_t g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;

static void scratch_destroy(void* v) {
  scratch* s = (scratch*)v;
  free(s->ptr);
  free(s);
}

static void scratch_key_init(void) { pthread_key_create(&g_scratch_key, scratch_destroy); }

void* ab_scratch_alloc(size_t bytes) {
  pthread_once(&g_scratch_once, scratch_key_init);
  scratch* s = (scratch*)pthread_getspecific(g_scratch_key);
  if (!s) {
    s = (scratch*)calloc(1, sizeof *s);
    if (!s || pthread_setspecific(g_scratch_key, s) != 0) {
      free(s);
      return NULL;
    }
  }
  const size_t want = (bytes + 63) & ~(size_t)63;
  if (s->ptr && s->bytes >= want) return s->ptr;
  free(s->ptr);
  s->bytes = 0;
  s->ptr = aligned_alloc(64, want ? want : 64);
  if (s->ptr) s->bytes = want;
  return s->ptr;
}

void ab_scratch_free(void* ptr) {
  scratch* s = (scratch*)pthread_getspecific(g_scratch_key);
  if (s && s->ptr == ptr && s->bytes > ((size_t)64 << 20)) {
    free(s->ptr);
    s->ptr = NULL;
    s->bytes = 0;
  }
}

static const ab_flash_cpu_table* const k_tables[AB_ISA_COUNT] = {
    &ab_flash_cpu_generic, &ab_flash_cpu_avx2, &ab_flash_cpu_avx512, &ab_flash_cpu_amx, &ab_flash_cpu_amx_emu};
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
    case AB_ISA_AVX2: return k_tables[1]->fwd && f->avx2 && f->fma && f->f16c;
    case AB_ISA_AVX512:
      return k_tables[2]->fwd && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->fma &&
             f->f16c;
    case AB_ISA_AMX: /* its vector half is the AVX-512 kernel; amx_bf16 implies the tile permission */
      return k_tables[3]->fwd && ab_cpu_isa_supported(AB_ISA_AVX512) && f->amx_tile && f->amx_bf16;
    case AB_ISA_AMX_EMU: return k_tables[4]->fwd != NULL;
    default: return 0;
  }
}

/* Why ATTN_BACKENDS_CPU_ISA cannot be honoured ("" when it can or is unset): every CPU kernel call
 * then fails with it, rather than running another path than the one asked for. */
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
               : !k_tables[3]->fwd       ? "no AMX kernel path is built in this version (the compiler lacked -mamx-*)"
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

typedef struct peak_arg {
  double seconds, rate;
  const ab_flash_cpu_table* table;
} peak_arg;

static void* peak_thread(void* v) {
  peak_arg* a = (peak_arg*)v;
  a->rate = a->table->fma_rate(a->seconds);
  return NULL;
}

double ab_cpu_fma_peak(double seconds, int threads) {
  if (threads < 1) threads = 1;
  if (threads > 256) threads = 256;
  const ab_flash_cpu_table* table = k_tables[ab_cpu_isa_get()];
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

/* The dtypes the flash tables are built for: float32 accumulation of float16, bfloat16, float32. */
static int flash_dtype_ok(ab_dtype dt) { return dt == AB_DTYPE_F32 || dt == AB_DTYPE_F16 || dt == AB_DTYPE_BF16; }

/* The planner's question (ab_planner.h, ab_why_not_fn), answered by the rule the calls are checked with. */
void ab_flash_cpu_why_not(const ab_call* c, char* out, size_t n) {
  out[0] = 0;
  if (!flash_dtype_ok(c->dtype))
    snprintf(out, n, "flash on CPU takes float16, bfloat16 or float32, got %s", ab_dtype_name(c->dtype));
}

static ab_status check_flash(const ab_attn_params* p, int backward, ab_error* err) {
  ab_status st = ab_attn_params_check(p, backward, err);
  if (st != AB_OK) return st;
  if (ab_cpu_isa_error()) return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s", ab_cpu_isa_error());
  if (p->q.device != AB_DEVICE_CPU)
    return ab_error_set(err, AB_ERR_INVALID, "flash CPU kernel called with non-CPU tensors");
  if (!flash_dtype_ok(p->q.dtype))
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "flash on CPU takes float16, bfloat16 or float32, got %s",
                        ab_dtype_name(p->q.dtype));
  return AB_OK;
}

ab_status ab_flash_cpu_fwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  ab_status st = check_flash(p, 0, err);
  if (st != AB_OK || p->B == 0 || p->Hq == 0 || p->Sq == 0) return st;
  return k_tables[ab_cpu_isa_get()]->fwd(p, pool, err);
}

ab_status ab_flash_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  ab_status st = check_flash(p, 1, err);
  if (st != AB_OK) return st;
  if (p->B == 0 || p->Hkv == 0) return p->dsinks.ndim ? ab_sinks_cpu_bwd(p, pool, err) : AB_OK;
  st = k_tables[ab_cpu_isa_get()]->bwd(p, pool, err);
  if (st == AB_OK && p->dsinks.ndim) st = ab_sinks_cpu_bwd(p, pool, err);
  return st;
}
