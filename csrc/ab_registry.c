/* ab_registry.c -- every backend name the project accepts, as data.
 *
 * One row per canonical backend with the aliases people already type (flash-attn, HF transformers
 * attn_implementation, diffusers/finetrainers attention_backend, SageAttention function names).
 * Lookup is case-insensitive and treats '-' as '_', so "Flash-Attn" and "flash_attn" agree.
 */
#include <ctype.h>
#include <string.h>

#include "ab_core.h"

#define ALIASES(...) ((const char* const[]){__VA_ARGS__, NULL})
#define NO_ALIASES ((const char* const[]){NULL})

static const ab_backend_info g_backends[] = {
    {"auto", NO_ALIASES, AB_KIND_PLANNER, "the planner picks the fastest exact backend"},
    {"flash",
     ALIASES("flash_attn", "flash_attn_2", "flash_attention_2", "flash_attention_3", "fa2", "fa3"),
     AB_KIND_BUNDLED, "fused online-softmax kernel (FlashAttention-2 algorithm)"},
    {"flash_varlen", ALIASES("varlen"), AB_KIND_BUNDLED, "flash over packed variable-length sequences"},
    {"sage",
     ALIASES("sage_varlen", "sageattention", "_sage_qk_int8_pv_fp16_cuda",
             "_sage_qk_int8_pv_fp16_triton", "_sage_qk_int8_pv_fp8_cuda",
             "_sage_qk_int8_pv_fp8_cuda_sm90"),
     AB_KIND_BUNDLED, "INT8 Q.K^T (SageAttention recipe), inference only, lossy"},
    {"math", ALIASES("manual", "reference"), AB_KIND_BUNDLED, "exact reference kernel"},
    {"eager", NO_ALIASES, AB_KIND_BUNDLED,
     "universal fallback: math where we have a kernel, else aten ops through the dispatcher"},
    {"sdpa", ALIASES("native", "torch"), AB_KIND_TORCH, "torch's scaled_dot_product_attention, its choice"},
    {"_native_flash", NO_ALIASES, AB_KIND_TORCH, "torch SDPA with its flash backend forced"},
    {"_native_efficient", NO_ALIASES, AB_KIND_TORCH, "torch SDPA with its memory-efficient backend forced"},
    {"_native_cudnn", NO_ALIASES, AB_KIND_TORCH, "torch SDPA with its cuDNN backend forced"},
    {"_native_math", NO_ALIASES, AB_KIND_TORCH, "torch SDPA with its math backend forced"},
    {"flex", ALIASES("flex_attention"), AB_KIND_TORCH, "torch FlexAttention"},
    {"paged_attention", NO_ALIASES, AB_KIND_BUNDLED, "KV-cache decode over a paged cache"},
    {"xformers", NO_ALIASES, AB_KIND_EXTERNAL, "the xformers package, if installed"},
    {"flash_attn_pkg", NO_ALIASES, AB_KIND_EXTERNAL, "the flash_attn package, if installed"},
    {"sageattention_pkg", NO_ALIASES, AB_KIND_EXTERNAL, "the sageattention package, if installed"},
};

#define N_BACKENDS ((int)(sizeof g_backends / sizeof g_backends[0]))

int ab_backend_count(void) { return N_BACKENDS; }

const ab_backend_info* ab_backend_at(int index) {
  return index >= 0 && index < N_BACKENDS ? &g_backends[index] : NULL;
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
  for (int i = 0; i < N_BACKENDS; ++i) {
    if (name_equal(name, g_backends[i].name)) return i;
    for (const char* const* a = g_backends[i].aliases; *a; ++a)
      if (name_equal(name, *a)) return i;
  }
  return -1;
}
