/* ab_registry.c -- every backend the project accepts, as data: names, aliases and what each one
 * serves on each device.  The planner (ab_planner.c) reads only this table.
 *
 * Names cover the ones people type today: flash-attn, HF transformers attn_implementation,
 * diffusers/finetrainers attention_backend, SageAttention function names, nanoGPT-style flags.
 * Lookup is case-insensitive and treats '-' as '_'.
 *
 * When a kernel lands on a device, its row changes here and nowhere else.
 */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "ab_planner.h"
#include "cuda/ab_cuda_limits.h"

#define ALIASES(...) ((const char* const[]){__VA_ARGS__, NULL})
#define NO_ALIASES ((const char* const[]){NULL})

#define DT(d) AB_DTYPE_BIT(AB_DTYPE_##d)
#define ALL_DT (DT(F32) | DT(F16) | DT(BF16) | DT(F64))
#define NO_F64 (DT(F32) | DT(F16) | DT(BF16))
#define HALF_DT (DT(F16) | DT(BF16))

#define MASKS (AB_F_BOOL_MASK | AB_F_FLOAT_MASK)
#define CAUSAL (AB_F_CAUSAL_TL | AB_F_CAUSAL_BR)
/* every feature of the dense semantics (docs/semantics.md) but sinks and ALiBi (SINKS_ALIBI) */
#define FULL                                                                                   \
  (MASKS | AB_F_MASK_GRAD | CAUSAL | AB_F_WINDOW | AB_F_SOFTCAP | AB_F_DROPOUT | AB_F_BACKWARD | \
   AB_F_DETERMINISTIC | AB_F_LSE | AB_F_GQA | AB_F_DV | AB_F_DENSE)
/* attention sinks and ALiBi, forward and backward: the CPU kernels (math, flash, decode) and the eager
 * composite; the CUDA flash forward and backward (CUDA_SINKS_ALIBI: the sinks' gradient included;
 * run on the CUDA emulator only so far, docs/cuda.md) and the CUDA decode kernel */
#define SINKS_ALIBI (AB_F_SINKS | AB_F_ALIBI | AB_F_SINKS_ALIBI_GRAD)
#define CUDA_SINKS_ALIBI (AB_F_SINKS | AB_F_ALIBI | AB_F_SINKS_ALIBI_GRAD)
/* packed sequences (flash-attn's varlen functions): no attn_mask */
#define VARLEN_F                                                                              \
  (CAUSAL | AB_F_WINDOW | AB_F_SOFTCAP | AB_F_DROPOUT | AB_F_BACKWARD | AB_F_DETERMINISTIC |  \
   AB_F_LSE | AB_F_GQA | AB_F_DV | AB_F_VARLEN)
/* sage: the forward of the dense and packed semantics, without dropout */
#define SAGE_F (MASKS | CAUSAL | AB_F_WINDOW | AB_F_SOFTCAP | AB_F_LSE | AB_F_GQA | AB_F_DV | AB_F_DENSE | AB_F_VARLEN)
/* torch SDPA: bottom-right causal and windows are passed as an explicit bool mask */
#define SDPA_F                                                                                \
  (MASKS | AB_F_MASK_GRAD | CAUSAL | AB_F_WINDOW | AB_F_DROPOUT | AB_F_BACKWARD |              \
   AB_F_DETERMINISTIC | AB_F_GQA | AB_F_DV | AB_F_DENSE)

#define SDPA_KV_F (SDPA_F | AB_F_KVCACHE)

/* The forward features our CUDA tensor-core kernels share (flash and sage): the dense and packed
 * semantics without masks or Dv != D; sm_80 and newer.  Their head dims and shared memory are the
 * launchers' (csrc/cuda/ab_cuda_limits.h), asked through ab_cuda_flash_why_not / ab_cuda_sage_why_not. */
#define CUDA_FWD_F (CAUSAL | AB_F_WINDOW | AB_F_SOFTCAP | AB_F_LSE | AB_F_GQA)
/* flash on CUDA (csrc/cuda/flash_fwd*.cu, flash_bwd*.cu): those, plus dropout, forward and
 * backward (deterministic on request: docs/cuda.md).  sage on CUDA (csrc/cuda/sage_fwd*.cu) is
 * CUDA_FWD_F alone: forward only, no dropout. */
#define CUDA_FLASH_F (CUDA_FWD_F | AB_F_DROPOUT | AB_F_BACKWARD | AB_F_DETERMINISTIC)
#define NONE(why) {why, 0, 0, 0, 0, 0, 0, 0, NULL}
#define CAPS(dtypes, features) {NULL, dtypes, features, 0, 0, 0, 0, 0, NULL}
#define CAPS_D(dtypes, features, min_d, max_d, mult, min_cc, lib) \
  {NULL, dtypes, features, min_d, max_d, mult, min_cc, lib, NULL}
/* our CPU flash kernel (dense and packed): its dispatcher's own rule */
#define CPU_FLASH(features) {NULL, NO_F64, features, 0, 0, 0, 0, 0, ab_flash_cpu_why_not}
/* our CUDA tensor-core kernels: head dims as their launchers take them (shown in the support matrix;
 * the family's answer checks them with the shared memory) */
#define CUDA_KERNEL(features, why_not)                                                               \
  {NULL, HALF_DT, features, AB_CUDA_HEAD_DIM_MULTIPLE, AB_CUDA_MAX_HEAD_DIM, AB_CUDA_HEAD_DIM_MULTIPLE, 80, 1, \
   why_not}

/* attention_with_kvcache: every backend that serves it takes bottom-right causal, windows, softcap,
 * ALiBi, lse and GQA (the gathered paths pass them as a mask) */
#define KVCACHE_F (AB_F_KVCACHE | AB_F_CAUSAL_BR | AB_F_WINDOW | AB_F_SOFTCAP | AB_F_LSE | AB_F_GQA | SINKS_ALIBI)
/* The CUDA flash kernels and the CUDA math backward pass their tests on a GPU (H200, 2026-11-27) but
 * run slower than torch's own kernels there (docs/benchmarks.md, "GPU"), so they are opt-in:
 * ATTN_BACKENDS_CUDA_FLASH=1 at import (attn_backends/_planner.py) swaps these caps in. */
#define CUDA_FLASH_OFF                                                                                     \
  "the CUDA flash kernel is slower than torch's flash on the GPU measured (H200: 0.78x forward, 0.38x " \
  "backward; set ATTN_BACKENDS_CUDA_FLASH=1 to use it)"
/* The CUDA sage forward likewise (slower than our own CUDA flash there): ATTN_BACKENDS_CUDA_SAGE=1. */
#define CUDA_SAGE_OFF                                                                                      \
  "the CUDA sage kernel is slower than flash on the GPU measured (H200: 0.72-0.9x our CUDA flash; set " \
  "ATTN_BACKENDS_CUDA_SAGE=1 to use it)"
/* The CUDA decode kernel is on by default (verified on an H200, 2026-11-27);
 * ATTN_BACKENDS_CUDA_DECODE=0 at import swaps these caps out, and eager serves the KV-cache calls on CUDA
 * that torch SDPA does not (ab_planner.c torch_first_kv).
 * It takes head dims that are multiples of 8 up to 256. */
#define CUDA_DECODE_OFF \
  "the CUDA decode kernel is switched off (ATTN_BACKENDS_CUDA_DECODE=0; eager serves the KV-cache calls on CUDA " \
  "that torch SDPA does not)"
/* the CUDA decode kernel (csrc/cuda/decode.cu): every KV-cache feature, sinks and ALiBi included */
#define CUDA_DECODE CAPS_D(NO_F64, KVCACHE_F, 8, 256, 8, 80, 1)
/* math on CUDA: the forward by default; the backward (csrc/cuda/math_bwd.cu) when opted in */
#define CUDA_MATH_FWD CAPS_D(ALL_DT, (FULL | AB_F_VARLEN) & ~(AB_F_BACKWARD | AB_F_MASK_GRAD), 0, 0, 0, 80, 1)
#define CUDA_MATH_ALL CAPS_D(ALL_DT, FULL | AB_F_VARLEN, 0, 0, 0, 80, 1)
#define NO_KERNEL "no kernel for this device"
/* eager serves every call: the math kernel on CPU, the aten composite elsewhere (attn_backends/_eager.py) */
#define EAGER_F (FULL | AB_F_VARLEN | AB_F_KVCACHE | SINKS_ALIBI)

static ab_backend_info g_backends[AB_BK_COUNT] = {
    [AB_BK_AUTO] = {"auto", NO_ALIASES, AB_KIND_PLANNER, "the planner picks the fastest exact backend", 0, 0,
                    {NONE("the planner, not a backend"), NONE("the planner, not a backend"),
                     NONE("the planner, not a backend"), NONE("the planner, not a backend")}},
    [AB_BK_FLASH] = {"flash",
                     ALIASES("flash_attn", "flash_attn_2", "flash_attn_3", "flash_attention",
                             "flash_attention_2", "flash_attention_3", "fa", "fa2", "fa3", "_flash_3",
                             "flash_hub", "_flash_3_hub", "flash_attn_func", "flash_attn_qkvpacked_func",
                             "flash_attn_kvpacked_func", "flash_attn_with_kvcache",
                             "kernels_community/flash_attn", "kernels_community/flash_attn3",
                             "kernels_community/vllm_flash_attn3"),
                     AB_KIND_BUNDLED, "fused online-softmax kernel (FlashAttention-2 algorithm)", 0, 0,
                     {CPU_FLASH(FULL | AB_F_KVCACHE | SINKS_ALIBI), NONE(CUDA_FLASH_OFF), NONE(NO_KERNEL),
                      NONE(NO_KERNEL)}},
    [AB_BK_FLASH_VARLEN] = {"flash_varlen",
                            ALIASES("varlen", "flash_attn_varlen", "flash_attn_varlen_func",
                                    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
                                    "_flash_varlen_3", "flash_varlen_hub", "_flash_3_varlen_hub"),
                            AB_KIND_BUNDLED, "flash over packed variable-length sequences", 0, 0,
                            {CPU_FLASH(VARLEN_F | SINKS_ALIBI), NONE(CUDA_FLASH_OFF), NONE(NO_KERNEL),
                             NONE(NO_KERNEL)}},
    [AB_BK_SAGE] = {"sage",
                    ALIASES("sage_varlen", "sage_hub", "sageattention", "sage_attention", "sageattn",
                            "sageattn_varlen", "_sage_qk_int8_pv_fp16_cuda",
                            "_sage_qk_int8_pv_fp16_triton", "_sage_qk_int8_pv_fp8_cuda",
                            "_sage_qk_int8_pv_fp8_cuda_sm90", "sageattn_qk_int8_pv_fp16_cuda",
                            "sageattn_qk_int8_pv_fp16_triton", "sageattn_qk_int8_pv_fp8_cuda",
                            "sageattn_qk_int8_pv_fp8_cuda_sm90"),
                    AB_KIND_BUNDLED, "INT8 Q.K^T (SageAttention recipe), inference only, lossy", 1, 0,
                    /* forward only (no AB_F_BACKWARD, no dropout): the planner never routes a call
                     * needing a gradient here; dense and packed calls alike (docs/sage.md) */
                    {CAPS(NO_F64, SAGE_F), NONE(CUDA_SAGE_OFF), NONE(NO_KERNEL), NONE(NO_KERNEL)}},
    [AB_BK_MATH] = {"math", ALIASES("manual", "reference", "math_reference"), AB_KIND_BUNDLED,
                    "exact reference kernel (float32 scores and accumulation)", 0, 0,
                    /* packed (varlen) calls are padded to dense ones in Python */
                    {CAPS(ALL_DT, FULL | AB_F_VARLEN | AB_F_KVCACHE | SINKS_ALIBI), CUDA_MATH_FWD,
                     NONE("no kernel for MPS (eager runs the aten composite there)"),
                     NONE("no kernel for this device (eager runs the aten composite there)")}},
    [AB_BK_EAGER] = {"eager", ALIASES("eager_attention"), AB_KIND_BUNDLED,
                     "universal fallback: the math kernel where we have one, else aten ops", 0, 0,
                     {CAPS(ALL_DT, EAGER_F), CAPS(ALL_DT, EAGER_F), CAPS(NO_F64, EAGER_F), CAPS(ALL_DT, EAGER_F)}},
    [AB_BK_SDPA] = {"sdpa", ALIASES("native", "torch", "torch_sdpa", "scaled_dot_product_attention",
                                    "pytorch", "_native_npu", "_native_xla"),
                    AB_KIND_TORCH, "torch.nn.functional.scaled_dot_product_attention, its choice", 0, 1,
                    /* KV-cache calls too (attn_backends/_kvcache.py run_sdpa: the cache's own view, for the
                     * calls that need no mask but a bottom-right causal one: ab_planner.c); no lse, softcap,
                     * sinks or ALiBi.  On the CPU only from AB_KV_MANY_ROWS query rows per KV head and
                     * AB_KV_MANY_TOKENS tokens: our decode kernel ran 5.6x (float32) to 34x (bfloat16) faster
                     * than torch's SDPA at 4096 keys (bench_kv_routes.py, Zen 4), so a process default of sdpa
                     * does not send decode steps there (ab_planner.c why_not). */
                    {CAPS(ALL_DT, SDPA_KV_F), CAPS(ALL_DT, SDPA_KV_F), CAPS(NO_F64, SDPA_KV_F),
                     CAPS(ALL_DT, SDPA_KV_F)}},
    [AB_BK_NATIVE_FLASH] = {"_native_flash", ALIASES("sdpa_flash", "torch_flash"), AB_KIND_TORCH,
                            "torch SDPA with its flash kernel forced", 0, 1,
                            /* CPU: no dropout either: torch's fused CPU kernel refuses it ("Both fused kernels do
                             * not support non-zero dropout", torch 2.13), and forced it has no math path to go to */
                            {CAPS(ALL_DT, SDPA_F & ~(AB_F_MASK_GRAD | AB_F_GQA | AB_F_DV | AB_F_DROPOUT)),
                             CAPS_D(HALF_DT, AB_F_CAUSAL_TL | AB_F_DROPOUT | AB_F_BACKWARD | AB_F_GQA | AB_F_DENSE,
                                    1, 256, 8, 80, 0),
                             NONE("torch has no flash kernel for MPS"),
                             NONE("torch has no flash kernel for this device")}},
    [AB_BK_NATIVE_EFFICIENT] = {"_native_efficient",
                                ALIASES("sdpa_efficient", "torch_efficient", "mem_efficient",
                                        "memory_efficient"),
                                AB_KIND_TORCH, "torch SDPA with its memory-efficient kernel forced", 0, 1,
                                {NONE("torch has no memory-efficient kernel on CPU"),
                                 CAPS_D(NO_F64, SDPA_F & ~(AB_F_GQA | AB_F_DETERMINISTIC), 1, 0, 8, 50, 0),
                                 NONE("torch has no memory-efficient kernel for MPS"),
                                 NONE("torch has no memory-efficient kernel for this device")}},
    [AB_BK_NATIVE_CUDNN] = {"_native_cudnn", ALIASES("sdpa_cudnn", "torch_cudnn", "cudnn"), AB_KIND_TORCH,
                            "torch SDPA with its cuDNN kernel forced", 0, 1,
                            {NONE("cuDNN attention runs on CUDA only"),
                             CAPS_D(HALF_DT, AB_F_CAUSAL_TL | AB_F_BACKWARD | AB_F_DENSE, 1, 128, 8, 80, 0),
                             NONE("cuDNN attention runs on CUDA only"),
                             NONE("cuDNN attention runs on CUDA only")}},
    [AB_BK_NATIVE_MATH] = {"_native_math", ALIASES("sdpa_math", "torch_math"), AB_KIND_TORCH,
                           "torch SDPA with its math kernel forced", 0, 1,
                           {CAPS(ALL_DT, SDPA_F), CAPS(ALL_DT, SDPA_F), CAPS(NO_F64, SDPA_F),
                            CAPS(ALL_DT, SDPA_F)}},
    [AB_BK_FLEX] = {"flex", ALIASES("flex_attention", "flexattention"), AB_KIND_TORCH,
                    "torch FlexAttention (score_mod with the masks, causal, window, softcap)", 0, 1,
                    /* torch raises "FlexAttention does not support backward on CPU" */
                    {CAPS(NO_F64, MASKS | CAUSAL | AB_F_WINDOW | AB_F_SOFTCAP | AB_F_LSE | AB_F_GQA |
                                      AB_F_DENSE),
                     CAPS(NO_F64, MASKS | CAUSAL | AB_F_WINDOW | AB_F_SOFTCAP | AB_F_BACKWARD |
                                      AB_F_LSE | AB_F_GQA | AB_F_DENSE),
                     NONE("FlexAttention does not run on MPS"),
                     NONE("FlexAttention does not run on this device")}},
    [AB_BK_PAGED] = {"paged_attention", ALIASES("paged", "sdpa_paged", "eager_paged", "flash_paged"),
                     AB_KIND_BUNDLED, "KV-cache decode (attention_with_kvcache), dense or paged cache", 0, 0,
                     /* csrc/cpu/decode_cpu.c, csrc/cuda/decode.cu; attention_with_kvcache calls only,
                      * inference only */
                     {CAPS(NO_F64, KVCACHE_F), NONE(CUDA_DECODE_OFF),
                      NONE(NO_KERNEL), NONE(NO_KERNEL)}},
    [AB_BK_XFORMERS] = {"xformers", ALIASES("xformers_attention", "memory_efficient_attention"),
                        AB_KIND_EXTERNAL, "xformers.ops.memory_efficient_attention, if installed", 0, 1,
                        {NONE("xformers runs on CUDA only"),
                         CAPS_D(NO_F64, MASKS | CAUSAL | AB_F_DROPOUT | AB_F_BACKWARD | AB_F_GQA | AB_F_DV |
                                            AB_F_DENSE, 1, 0, 0, 50, 0),
                         NONE("xformers runs on CUDA only"), NONE("xformers runs on CUDA only")}},
    [AB_BK_FLASH_ATTN_PKG] = {"flash_attn_pkg", ALIASES("flash_attn_package", "dao_flash_attn"),
                              AB_KIND_EXTERNAL, "the flash_attn package (flash_attn_func), if installed", 0, 1,
                              {NONE("the flash_attn package runs on CUDA only"),
                               CAPS_D(HALF_DT, CAUSAL | AB_F_BR_ALIGNED | AB_F_WINDOW | AB_F_SOFTCAP |
                                                   AB_F_DROPOUT | AB_F_BACKWARD | AB_F_LSE | AB_F_GQA |
                                                   AB_F_DENSE, 1, 256, 0, 80, 0),
                               NONE("the flash_attn package runs on CUDA only"),
                               NONE("the flash_attn package runs on CUDA only")}},
    [AB_BK_SAGE_PKG] = {"sageattention_pkg", ALIASES("sageattention_package", "sageattn_pkg"),
                        AB_KIND_EXTERNAL, "the sageattention package (sageattn), if installed; lossy", 1, 1,
                        {NONE("the sageattention package runs on CUDA only"),
                         CAPS_D(HALF_DT, AB_F_CAUSAL_TL | AB_F_DENSE, 64, 128, 32, 80, 0),
                         NONE("the sageattention package runs on CUDA only"),
                         NONE("the sageattention package runs on CUDA only")}},
};

/* Provider availability, set once at import by the Python layer (under the GIL). */
static int g_provider_available[AB_BK_COUNT];
static char g_provider_why[AB_BK_COUNT][AB_REASON_LEN];

void ab_provider_set(int id, int available, const char* why_not) {
  if (id < 0 || id >= AB_BK_COUNT) return;
  g_provider_available[id] = available != 0;
  snprintf(g_provider_why[id], sizeof g_provider_why[id], "%s", why_not ? why_not : "");
}

/* 1 if available; else 0 and *why.  Non-provider backends are always "present". */
int ab_provider_available(int id, const char** why) {
  if (!g_backends[id].provider || g_provider_available[id]) return 1;
  *why = g_provider_why[id][0] ? g_provider_why[id] : "not installed";
  return 0;
}

int ab_backend_count(void) { return AB_BK_COUNT; }

const ab_backend_info* ab_backend_at(int index) {
  return index >= 0 && index < AB_BK_COUNT ? &g_backends[index] : NULL;
}

/* Compares a user-typed name with a table name: ASCII case-insensitive, '-' equal to '_'. */
static int name_equal(const char* typed, const char* table) {
  for (; *typed && *table; ++typed, ++table) {
    char c = (char)tolower((unsigned char)*typed);
    if (c == '-') c = '_';
    if (c != *table) return 0;
  }
  return *typed == 0 && *table == 0;
}

int ab_backend_lookup(const char* name) {
  if (!name) return -1;
  for (int i = 0; i < AB_BK_COUNT; ++i) {
    if (name_equal(name, g_backends[i].name)) return i;
    for (const char* const* a = g_backends[i].aliases; *a; ++a)
      if (name_equal(name, *a)) return i;
  }
  return -1;
}

void ab_registry_enable_cuda_flash(int on) {
  static const ab_caps dense = CUDA_KERNEL(CUDA_FLASH_F | AB_F_DENSE | CUDA_SINKS_ALIBI, ab_cuda_flash_why_not);
  static const ab_caps packed = CUDA_KERNEL(CUDA_FLASH_F | AB_F_VARLEN | CUDA_SINKS_ALIBI, ab_cuda_flash_why_not);
  static const ab_caps off = NONE(CUDA_FLASH_OFF);
  static const ab_caps math_fwd = CUDA_MATH_FWD, math_all = CUDA_MATH_ALL;
  g_backends[AB_BK_FLASH].caps[AB_DEVICE_CUDA] = on ? dense : off;
  g_backends[AB_BK_FLASH_VARLEN].caps[AB_DEVICE_CUDA] = on ? packed : off;
  g_backends[AB_BK_MATH].caps[AB_DEVICE_CUDA] = on ? math_all : math_fwd;
}

void ab_registry_enable_cuda_sage(int on) {
  static const ab_caps caps = CUDA_KERNEL(CUDA_FWD_F | AB_F_DENSE | AB_F_VARLEN, ab_cuda_sage_why_not);
  static const ab_caps off = NONE(CUDA_SAGE_OFF);
  g_backends[AB_BK_SAGE].caps[AB_DEVICE_CUDA] = on ? caps : off;
}

void ab_registry_enable_cuda_decode(int on) {
  static const ab_caps caps = CUDA_DECODE, off = NONE(CUDA_DECODE_OFF);
  g_backends[AB_BK_PAGED].caps[AB_DEVICE_CUDA] = on ? caps : off;
}

static int g_cuda_emulation;

void ab_registry_set_cuda_emulation(int on) { g_cuda_emulation = on != 0; }

/* What the emulated device serves: the CUDA kernels' capabilities with the opt-ins on (their
 * families' answers weigh the emulated device's shared memory). */
const ab_caps* ab_registry_emulated_caps(int id) {
  static const ab_caps flash = CUDA_KERNEL(CUDA_FLASH_F | AB_F_DENSE | CUDA_SINKS_ALIBI, ab_cuda_flash_why_not);
  static const ab_caps packed = CUDA_KERNEL(CUDA_FLASH_F | AB_F_VARLEN | CUDA_SINKS_ALIBI, ab_cuda_flash_why_not);
  static const ab_caps sage = CUDA_KERNEL(CUDA_FWD_F | AB_F_DENSE | AB_F_VARLEN, ab_cuda_sage_why_not);
  static const ab_caps math = CUDA_MATH_ALL, decode = CUDA_DECODE;
  if (!g_cuda_emulation) return NULL;
  switch (id) {
    case AB_BK_FLASH: return &flash;
    case AB_BK_FLASH_VARLEN: return &packed;
    case AB_BK_SAGE: return &sage;
    case AB_BK_MATH: return &math;
    case AB_BK_PAGED: return &decode;
    /* eager runs the math kernel on the CPU, so the emulated one too */
    case AB_BK_EAGER: return &g_backends[AB_BK_EAGER].caps[AB_DEVICE_CUDA];
    default: return NULL;
  }
}


/* ---- CPU matrix units: what torch computes each dtype on, and what our CPU paths do ------------- */

const char* ab_unit_name(int bit) {
  static const char* const names[AB_UNIT_COUNT] = {"AMX-BF16", "AMX-FP16", "AMX-INT8"};
  return bit >= 0 && bit < AB_UNIT_COUNT ? names[bit] : "unknown";
}

const char* ab_mask_kind_name(int kind) {
  static const char* const names[3] = {"none", "bool", "float"};
  return kind >= 0 && kind < 3 ? names[kind] : "unknown";
}

const char* ab_cpu_vendor_name(int vendor) {
  static const char* const names[AB_VENDOR_COUNT] = {"other", "Intel", "AMD"};
  return vendor >= 0 && vendor < AB_VENDOR_COUNT ? names[vendor] : "unknown";
}

uint32_t ab_cpu_units_detect(void) {
  const ab_cpu_features* f = ab_cpu_features_get();
  return (f->amx_bf16 ? AB_UNIT_AMX_BF16 : 0u) | (f->amx_fp16 ? AB_UNIT_AMX_FP16 : 0u) |
         (f->amx_int8 ? AB_UNIT_AMX_INT8 : 0u);
}

/* torch's CPU SDPA (its flash kernel: oneDNN brgemm for the two products) runs bfloat16 on AMX-BF16
 * tiles and float16 on AMX-FP16 tiles when the CPU has them: measured 2.0-3.8x our AVX-512 kernel in
 * bfloat16 on a Xeon with AMX (B=2 H=16 S=2048, forward; 2x forward+backward).  Dropout sends torch
 * to its unfused math path (its fused CPU kernel has none), and windows reach it as a dense bool
 * mask (every score computed, where ours skips the blocks outside): there the tiles' advantage is
 * not established, so those calls keep our kernel. */
uint32_t ab_torch_cpu_units(int dtype, uint32_t* unless_features) {
  if (unless_features) *unless_features = AB_F_DROPOUT | AB_F_WINDOW;
  switch (dtype) {
    case AB_DTYPE_BF16: return AB_UNIT_AMX_BF16;
    case AB_DTYPE_F16: return AB_UNIT_AMX_FP16;
    default: return 0;
  }
}

/* Which units our ISA paths compute each dtype on, for the planner to weigh against torch's.  The
 * generic, AVX2 and AVX-512 paths convert every dtype to float32 and use FMA.  The "amx" path
 * (csrc/cpu/cpu_amx.c) computes bfloat16 (and float16 on AMX-FP16) on tiles, and "amx_emu"
 * runs the same kernel on an emulation, but neither counts here yet: the real path has not run on
 * AMX hardware.  What must be measured before AB_UNIT_AMX_BF16 (resp. AMX_FP16) is returned for
 * isa == AB_ISA_AMX and that dtype: on an AMX CPU, `python benchmarks/bench_cpu.py --isa amx`,
 * bfloat16 (float16) forward and forward+backward at D = 64 and 128, S = 512..4096, causal and
 * not, ours >= torch SDPA (ratio >= 1, side by side in the same rounds) in every row; until then
 * auto keeps routing those calls to torch SDPA. */
uint32_t ab_our_cpu_units(int isa, int dtype) {
  (void)isa;
  (void)dtype;
  return 0;
}

/* AMX-BF16 for bfloat16 on the avx512 path, which borrows the amx path's decode kernel for such calls where the
 * CPU's tiles are usable, and on the amx path: there the decode kernel takes both products of calls of several
 * tokens and 16 query rows per KV head or more on tiles, and ran 1.02-3.0x torch SDPA's speed in chunked prefill
 * over its best layout (an Intel Xeon with AMX, 2 threads, B=1 Hq=32 D=128 over 2048-4096 keys, 16 to 2048 tokens,
 * 1 to 16 query heads per KV head, 2026-12-07; docs/decode.md, "Chunked prefill on an AMX CPU").  Not amx_emu:
 * its tiles are emulated. */
uint32_t ab_our_kv_cpu_units(int isa, int dtype) {
  return dtype == AB_DTYPE_BF16 && (isa == AB_ISA_AVX512 || isa == AB_ISA_AMX) ? AB_UNIT_AMX_BF16 : 0u;
}

/* Classes of CPU calls where torch's fused kernel, on the CPUs named (the same FMA units as ours but
 * in the AMD row), measured faster than our flash, side by side (docs/benchmarks.md, "auto against
 * torch, per dtype"), per ISA path of our kernels.  Each holds only for a call torch serves as it is,
 * on its fast path: no causal mask (ours skips the masked blocks and measured 1.03-1.68x torch in every
 * causal row), no attn_mask (but where a row says so), no GQA, no window, softcap, dropout, lse or
 * packing; and only for long queries, where they were measured: a forward of few_queries (Dv = D)
 * goes to the decode kernel, which took 0.58x torch's time in float32 MHA decode at D=128 (B=1 H=32
 * Sk=4096, Zen 4, 2026-11-27: 3.3 against 5.7 ms) where this rule used to send it to torch.  Rows,
 * with their figures (torch / ours):
 *   - every path, float32 forward, D >= 128: 0.85-0.97 on two AVX-512 CPUs without AMX (2026-11-21 and
 *     2026-11-24, B=2..4, S=1024..4096), torch's kernel at 61-73% of the FMA peak; 0.79-0.90 on the
 *     avx2 path (AMD EPYC, Zen 3, 2026-11-26).  D <= 96 and the backward stay ours there (forward +
 *     backward 0.99-1.34 on AVX-512).
 *   - avx2 path, bfloat16 forward, D >= 64 (measured at 64 and 128): 0.74-0.89 (AMD EPYC, Zen 3, 2026-11-26), 0.80-1.24 after the
 *     8-wide bfloat16 conversion and 32-row chunks (a noisy machine: parity, not an advantage).  Its
 *     backward stays ours (forward+backward 4.9-8.4x).
 *     With a float attn_mask too (HF's additive one): 0.80-0.88 at D=128, 0.93 at D=64, after the AVX2 mask
 *     changes of 2026-12-07 (AMD EPYC, Zen 3, S=1024; docs/benchmarks.md "Masked calls on an AVX2 CPU"); with a
 *     bool mask ours measured 0.95-1.13 there (parity: stays ours).
 *   - avx2 path, float32 forward with a float attn_mask, D >= 128: 0.85-0.91 (same runs); with a bool mask
 *     0.96-1.00 (stays ours), at D=64 0.96 (stays ours).
 *   - avx2 path, float32 forward+backward, D >= 128: 0.67-0.91 (same run; D=64 1.03-1.24 stays ours).
 *   - avx512 path on an AMD CPU (Zen 4: AVX512_BF16, no AMX), bfloat16 forward+backward, D >= 128:
 *     0.86-0.92 at S=2048 in three runs, 0.92-1.08 at S=1024 (2026-11-27); torch's bfloat16 backward
 *     there is faster than its float32 one, so it computes on the bfloat16 dot products.  On the
 *     Intel AVX-512 CPU with AVX512_BF16 ours measured 1.76-1.79x torch in the same rows, hence the
 *     vendor.  D=64 (0.95-1.13) and the forward (1.06-1.81) stay ours there.  With an attn_mask (HF's
 *     padded causal one, bool or float, no gradient for it) too: 0.72-0.85 at S=2048 D=128 and
 *     0.77-0.81 at S=1024 D=256, 0.95-0.98 at S=512 D=128 (2026-11-27, after the mask's per-dtype
 *     loops).  The other rows were measured without a mask and hold without one only.
 *   - the same path and CPU, bfloat16 forward, D >= 128, with a float attn_mask (HF's additive one):
 *     0.91-0.95 at S=1024..2048 (2026-11-27, after the mask's gathered loads; 0.79-0.81 before them),
 *     where a bool mask measured 1.00-1.07 and no mask 1.04-1.05 (those stay ours).
 * float16 stays ours everywhere (1.2-1.8x on the avx2 path, parity on AVX-512).
 * On a Zen 5 (AMD family 26, 2 threads, 2026-12-04, docs/benchmarks.md "auto against torch on a Zen 5"),
 * whose AVX-512 units are full width, our avx512 path measured 1.3-2.0x torch in every one of those rows
 * (float32 forward D >= 128 1.91-2.02; bfloat16 forward+backward D >= 128 1.45-1.55, with a bool mask 1.31;
 * bfloat16 forward with a float mask 1.71-1.80), and its avx2 path at parity with torch (1.00-1.15): so the
 * avx512 rows hold on AMD CPUs below family 26 only (amd_family_below), the others on every family. */
typedef struct torch_faster_row {
  uint32_t isas; /* bit (1 << ab_cpu_isa) per path the row was measured on */
  ab_dtype dtype;
  int need_grad; /* 0: forward only, 1: forward+backward */
  int64_t min_D;
  int32_t vendor;   /* ab_cpu_vendor the row was measured on; AB_VENDOR_OTHER: any */
  int masks;        /* the attn_mask kinds (ab_call.mask: bit 0 none, 1 bool, 2 float) it holds for; a mask
                       that needs a gradient never */
  int32_t amd_family_below; /* on an AMD CPU the row holds below this CPUID family only; 0: every family */
  const char* what;         /* for the plan's note */
} torch_faster_row;

#define ISA_BIT(i) (1u << (i))
static const torch_faster_row k_torch_faster[] = {
    {~ISA_BIT(AB_ISA_AVX512), AB_DTYPE_F32, 0, 128, AB_VENDOR_OTHER, 1, 0, "a float32 forward at D >= 128"},
    {ISA_BIT(AB_ISA_AVX512), AB_DTYPE_F32, 0, 128, AB_VENDOR_OTHER, 1, AB_AMD_FAMILY_ZEN5,
     "a float32 forward at D >= 128"},
    {ISA_BIT(AB_ISA_AVX2), AB_DTYPE_BF16, 0, 64, AB_VENDOR_OTHER, 5, 0,
     "a bfloat16 forward at D >= 64 on the avx2 path"},
    {ISA_BIT(AB_ISA_AVX2), AB_DTYPE_F32, 0, 128, AB_VENDOR_OTHER, 4, 0,
     "a float32 forward at D >= 128 with a float attn_mask on the avx2 path"},
    {ISA_BIT(AB_ISA_AVX2), AB_DTYPE_F32, 1, 128, AB_VENDOR_OTHER, 1, 0,
     "a float32 forward+backward at D >= 128 on the avx2 path"},
    {ISA_BIT(AB_ISA_AVX512), AB_DTYPE_BF16, 1, 128, AB_VENDOR_AMD, 7, AB_AMD_FAMILY_ZEN5,
     "a bfloat16 forward+backward at D >= 128 on the avx512 path of an AMD CPU"},
    {ISA_BIT(AB_ISA_AVX512), AB_DTYPE_BF16, 0, 128, AB_VENDOR_AMD, 4, AB_AMD_FAMILY_ZEN5,
     "a bfloat16 forward at D >= 128 with a float attn_mask on the avx512 path of an AMD CPU"},
};
#undef ISA_BIT

int ab_call_decode_route(const ab_call* c) {
  const int top_left = c->causal == AB_CAUSAL_TOP_LEFT || (c->window && c->causal != AB_CAUSAL_BOTTOM_RIGHT);
  return c->few_queries && !c->need_grad && !c->dropout && c->Dv == c->D && (!top_left || c->square);
}

const char* ab_torch_cpu_faster(const ab_call* c) {
  const int decode = ab_call_decode_route(c); /* flash's route to the decode kernel */
  /* Dv != D: torch's fused CPU kernel takes one head dim for q, k and v, and sends such a call to its unfused
   * math path (2.8x our flash's time, float32 D=128 Dv=64 S=1024 H=8, an AMD EPYC, avx512 path): not a call
   * the rows were measured on */
  if (c->device != AB_DEVICE_CPU || c->causal != AB_CAUSAL_NONE || c->mask_grad || c->gqa || c->window ||
      c->softcap || c->dropout || c->want_lse || c->varlen != 0 || decode || c->Dv != c->D || c->cpu_isa < 0 ||
      c->cpu_isa >= 32)
    return NULL;
  for (size_t i = 0; i < sizeof k_torch_faster / sizeof k_torch_faster[0]; ++i) {
    const torch_faster_row* r = &k_torch_faster[i];
    if ((r->isas >> c->cpu_isa & 1u) && r->dtype == c->dtype && r->need_grad == !!c->need_grad && c->D >= r->min_D &&
        (r->vendor == AB_VENDOR_OTHER || r->vendor == c->cpu_vendor) && (r->masks >> c->mask & 1) &&
        !(r->amd_family_below && c->cpu_vendor == AB_VENDOR_AMD && c->cpu_family >= r->amd_family_below))
      return r->what;
  }
  return NULL;
}
