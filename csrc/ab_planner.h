/* ab_planner.h -- the backend registry (capabilities as data) and the planner.
 *
 * Every backend is one row: canonical name, aliases, kind, and per device (CPU, CUDA, MPS, other)
 * what it can serve: dtypes, head dims, masks, causal alignments, window, softcap, dropout,
 * backward, lse, GQA, dense or packed input, compute capability.  The planner takes a described
 * call (ab_call: no tensors, so tests can describe any device) and returns the chosen backend and,
 * for every backend, why it cannot serve the call ("" when it can).
 *
 * Order of candidates: a named backend first, then its chain (e.g. sage -> flash), then the
 * device's priority list (auto's list).  Lossy backends never come from auto; forward-only ones are
 * never chosen when a gradient is needed.
 */
#ifndef AB_PLANNER_H
#define AB_PLANNER_H

#include <stddef.h>
#include <stdint.h>

#include "ab_core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ab_backend_id {
  AB_BK_AUTO = 0,
  AB_BK_FLASH,
  AB_BK_FLASH_VARLEN,
  AB_BK_SAGE,
  AB_BK_MATH,
  AB_BK_EAGER,
  AB_BK_SDPA,
  AB_BK_NATIVE_FLASH,
  AB_BK_NATIVE_EFFICIENT,
  AB_BK_NATIVE_CUDNN,
  AB_BK_NATIVE_MATH,
  AB_BK_FLEX,
  AB_BK_PAGED,
  AB_BK_XFORMERS,
  AB_BK_FLASH_ATTN_PKG,
  AB_BK_SAGE_PKG,
  AB_BK_COUNT
} ab_backend_id;

#define AB_DEV_COUNT 4 /* indexed by ab_device_type: CPU, CUDA, MPS, OTHER */

typedef enum ab_backend_kind {
  AB_KIND_PLANNER = 0,  /* "auto" */
  AB_KIND_BUNDLED = 1,  /* our kernels */
  AB_KIND_TORCH = 2,    /* torch's own (SDPA, FlexAttention), called from Python */
  AB_KIND_EXTERNAL = 3  /* an optional package, used only if installed */
} ab_backend_kind;

/* Feature bits of ab_caps.features. */
enum {
  AB_F_BOOL_MASK = 1u << 0,
  AB_F_FLOAT_MASK = 1u << 1,
  AB_F_MASK_GRAD = 1u << 2,     /* gradient of a float mask */
  AB_F_CAUSAL_TL = 1u << 3,     /* top-left causal */
  AB_F_BR_ALIGNED = 1u << 4,    /* aligns causal and window bottom-right whatever is asked (flash-attn):
                                   serves top-left semantics only when Sq == Sk */
  AB_F_CAUSAL_BR = 1u << 5,     /* bottom-right causal */
  AB_F_WINDOW = 1u << 6,
  AB_F_SOFTCAP = 1u << 7,
  AB_F_DROPOUT = 1u << 8,
  AB_F_BACKWARD = 1u << 9,
  AB_F_DETERMINISTIC = 1u << 10, /* backward bitwise reproducible run after run */
  AB_F_LSE = 1u << 11,
  AB_F_GQA = 1u << 12,
  AB_F_DV = 1u << 13,            /* Dv != D */
  AB_F_DENSE = 1u << 14,         /* serves (B, H, S, D) calls */
  AB_F_VARLEN = 1u << 15,        /* serves packed (total, H, D) calls with cu_seqlens */
  AB_F_KVCACHE = 1u << 16,       /* serves attention_with_kvcache calls (ab_call.varlen == 2) */
  AB_F_SINKS = 1u << 17,         /* attention sinks */
  AB_F_ALIBI = 1u << 18,         /* ALiBi slopes */
  AB_F_SINKS_ALIBI_GRAD = 1u << 19 /* the backward takes sinks and ALiBi too (the sinks' gradient included) */
};

#define AB_DTYPE_BIT(d) (1u << (d))

struct ab_call;
/* A kernel family's own answer for a call, from its launcher's constants (and, on CUDA, the device's
 * shared memory): why it cannot serve it, written into out ("" when it can).  It lives beside the
 * family's launcher (ab_flash_cpu_why_not in csrc/cpu/flash_cpu.c; ab_cuda_flash_why_not and
 * ab_cuda_sage_why_not in csrc/ab_cuda_loader.c, from csrc/cuda/ab_cuda_limits.h); the planner asks
 * it after the registry's own checks. */
typedef void (*ab_why_not_fn)(const struct ab_call* c, char* out, size_t n);

/* What one backend serves on one device. */
typedef struct ab_caps {
  const char* unavailable; /* NULL when implemented on this device, else why not */
  uint32_t dtypes;         /* AB_DTYPE_BIT(...) */
  uint32_t features;       /* AB_F_* */
  int32_t min_d, max_d, d_multiple; /* head dim constraints (0 = none) */
  int32_t min_cc;          /* CUDA: lowest compute capability, x10 (80 = 8.0) */
  int32_t needs_cuda_lib;  /* our CUDA library must hold code for the device */
  ab_why_not_fn why_not;   /* the kernel family's own limits (NULL: none beyond the above) */
} ab_caps;

typedef struct ab_backend_info {
  const char* name;            /* canonical */
  const char* const* aliases;  /* NULL-terminated */
  ab_backend_kind kind;
  const char* summary;
  int32_t lossy;               /* approximate (sage): never chosen by auto */
  int32_t provider;            /* availability decided at import (a torch feature or a package) */
  ab_caps caps[AB_DEV_COUNT];
} ab_backend_info;

int ab_backend_count(void);
const ab_backend_info* ab_backend_at(int index);
/* Canonical index for any accepted name (ASCII case-insensitive, '-' == '_'), or -1. */
int ab_backend_lookup(const char* name);

/* CPU matrix units (ab_call.cpu_units): hardware that computes a dtype faster than float32 FMA. */
enum {
  AB_UNIT_AMX_BF16 = 1u << 0, /* AMX tiles, bfloat16 dot products (TDPBF16PS) */
  AB_UNIT_AMX_FP16 = 1u << 1, /* AMX tiles, float16 dot products (TDPFP16PS) */
  AB_UNIT_AMX_INT8 = 1u << 2  /* AMX tiles, int8 dot products (TDPBSSD and friends) */
};
#define AB_UNIT_COUNT 3
/* "AMX-BF16", "AMX-FP16", "AMX-INT8": the name of unit bit i */
const char* ab_unit_name(int bit);
/* "none", "bool", "float": ab_call.mask */
const char* ab_mask_kind_name(int kind);
/* The units this CPU has and this process may use (CPUID, XCR0 and the OS's permission). */
uint32_t ab_cpu_units_detect(void);
/* "other", "Intel", "AMD": the name of an ab_cpu_vendor (ab_call.cpu_vendor) */
const char* ab_cpu_vendor_name(int vendor);
/* The units torch's own CPU SDPA computes `dtype` on where the CPU has them (oneDNN brgemm), and
 * the features of a call that send torch off its fast path (so the advantage does not hold). */
uint32_t ab_torch_cpu_units(int dtype, uint32_t* unless_features);
/* The units our CPU kernels' ISA path `isa` computes `dtype` on at least as fast as torch does,
 * measured (docs/benchmarks.md); a unit listed by ab_torch_cpu_units and not here means torch SDPA
 * is faster for that dtype on a CPU that has it. */
uint32_t ab_our_cpu_units(int isa, int dtype);
/* The units our CPU decode kernel computes a KV-cache call of many query rows per KV head (chunked prefill) in
 * `dtype` on, on ISA path `isa` where the CPU has them (csrc/cpu/decode_cpu.c amx_rows). */
uint32_t ab_our_kv_cpu_units(int isa, int dtype);

/* Serves our CUDA kernels that have not run on a GPU yet (on = 1) or not (0): flash and
 * flash_varlen (forward and backward) and math's backward.  Opt-in until verified.  Called under
 * the GIL, before planning (plans are cached). */
void ab_registry_enable_cuda_flash(int on);
/* The same for sage on CUDA (forward only; its kernel is just as unverified). */
void ab_registry_enable_cuda_sage(int on);
/* The CUDA decode kernel (csrc/cuda/decode.cu) likewise, for paged_attention: ATTN_BACKENDS_CUDA_DECODE. */
void ab_registry_enable_cuda_decode(int on);
/* The CUDA emulation (docs/cuda.md) on (1) or off: while on, CPU calls of flash, flash_varlen, sage,
 * math (and eager, which runs math) and paged_attention are planned with those backends' CUDA capabilities (the emulator
 * runs the CUDA kernels), and ab_registry_emulated_caps returns them (NULL for other backends, or
 * when off). */
void ab_registry_set_cuda_emulation(int on);
const ab_caps* ab_registry_emulated_caps(int id);
/* Records whether a provider backend (torch feature, optional package) exists in this process. */
void ab_provider_set(int id, int available, const char* why_not);
/* 1 if backend id is present in this process (always, for non-providers); else 0 and *why_not. */
int ab_provider_available(int id, const char** why_not);

/* A call, described without tensors: the call descriptor.  AB_CALL_FIELDS is its one definition,
 * X(type, name, doc) per field in order: the struct below, its Python mirror (attn_backends._C.Call,
 * a struct sequence with these names and docs, which the planner, the report and explain read by
 * name) and the conversions between them (ab_module.c) all expand it.  The direct path
 * (ab_direct.c) fills the same struct from the tensors. */
#define AB_CALL_FIELDS(X)                                                                              \
  X(ab_device_type, device, "0 cpu, 1 cuda, 2 mps, 3 other (ab_device_type)")                         \
  X(int32_t, cuda_cc, "CUDA compute capability x10, 0 when not CUDA")                                 \
  X(int32_t, cuda_lib_ok, "our CUDA library is present and holds code for cuda_cc")                  \
  X(ab_dtype, dtype, "0 float32, 1 float16, 2 bfloat16, 3 float64 (ab_dtype)")                         \
  X(int64_t, D, "head dim of q and k")                                                                 \
  X(int64_t, Dv, "head dim of v")                                                                      \
  X(int32_t, gqa, "Hq != Hkv")                                                                         \
  X(int32_t, square, "Sq == Sk")                                                                       \
  X(int32_t, mask, "attn_mask: 0 none, 1 bool, 2 float; a KV-cache call: what attending to the cache as a "   \
                   "dense call needs: 0 nothing, 2 only a bottom-right causal mask of host-known sizes, 1 a "  \
                   "mask or the index values (ab_planner.c, torch_first_kv)")                                 \
  X(int32_t, mask_grad, "the float mask needs a gradient")                                             \
  X(ab_causal, causal, "0 none, 1 top-left, 2 bottom-right (ab_causal)")                               \
  X(int32_t, window, "a sliding window is given")                                                      \
  X(int32_t, softcap, "softcap > 0")                                                                   \
  X(int32_t, dropout, "dropout_p > 0")                                                                 \
  X(int32_t, need_grad, "a gradient will be asked for")                                                \
  X(int32_t, deterministic, "the backward must be bitwise reproducible")                               \
  X(int32_t, want_lse, "lse is returned")                                                              \
  X(int32_t, varlen, "layout: 0 dense, 1 packed (cu_seqlens), 2 a KV-cache call")                      \
  X(int32_t, mps_fix, "MPS: avoid torch SDPA with a mask in evaluation (it gives NaN)")                \
  X(int32_t, requested, "the backend asked for (ab_backend_id; 0 = auto)")                             \
  X(int32_t, cpu_isa, "ab_cpu_isa the CPU kernels run with")                                           \
  X(uint32_t, cpu_units, "AB_UNIT_* matrix units this CPU has and the process may use")                \
  X(int32_t, cuda_smem, "CUDA: shared memory a block may opt in to, bytes; 0 = not known")             \
  X(int32_t, sinks, "attention sinks are given")                                                       \
  X(int32_t, alibi, "ALiBi slopes are given")                                                          \
  X(int32_t, cpu_vendor, "0 other, 1 Intel, 2 AMD (ab_cpu_vendor): who made the CPU")                   \
  X(int32_t, few_queries, "a dense call of Sq <= AB_FEW_QUERIES query tokens (decode); 0 when packed") \
  X(int32_t, cpu_family, "CPUID's display family of the CPU (AMD Zen 4: 25, Zen 5: 26); 0 off x86")        \
  X(int32_t, many_rows, "a KV-cache call of at least AB_KV_MANY_ROWS query rows per KV head and AB_KV_MANY_TOKENS "  \
                       "query tokens (chunked prefill)")

/* The query tokens up to which a dense call counts as decode (ab_call.few_queries): flash's CPU forward
 * hands a forward of so few tokens to the decode kernel (csrc/cpu/flash_cpu.c; for MHA always, with
 * the same head dim for values and keys with a contiguous last dimension), so the classes of calls
 * where torch's kernel measured faster, all measured on long queries and without GQA, do not describe
 * such a forward (ab_torch_cpu_faster; a call that needs a gradient keeps flash's own forward). */
#define AB_FEW_QUERIES 4

/* The query rows per KV head (Sq x Hq / Hkv) from which a KV-cache call counts as chunked prefill
 * (ab_call.many_rows): on a CPU where torch computes the dtype on a matrix unit our kernels do not use,
 * torch SDPA serves such a call faster than the decode kernel (ab_planner.c, torch_first_kv). */
#define AB_KV_MANY_ROWS 256
#define AB_KV_MANY_TOKENS 32 /* and at least this many query tokens */

typedef struct ab_call {
#define AB_CALL_MEMBER(type, name, doc) type name;
  AB_CALL_FIELDS(AB_CALL_MEMBER)
#undef AB_CALL_MEMBER
} ab_call;

/* Number of fields of ab_call. */
#define AB_CALL_NFIELDS_ONE(type, name, doc) +1
enum { AB_CALL_NFIELDS = 0 AB_CALL_FIELDS(AB_CALL_NFIELDS_ONE) };

/* The kernel families' answers (ab_why_not_fn). */
void ab_flash_cpu_why_not(const ab_call* c, char* out, size_t n);
void ab_cuda_flash_why_not(const ab_call* c, char* out, size_t n);
void ab_cuda_sage_why_not(const ab_call* c, char* out, size_t n);


#define AB_REASON_LEN 192

typedef struct ab_plan {
  int32_t chosen;                          /* ab_backend_id, -1 when nothing can serve */
  int32_t order[AB_BK_COUNT];              /* candidates in the order they were tried */
  int32_t norder;
  char reason[AB_BK_COUNT][AB_REASON_LEN]; /* why each backend cannot serve ("" = it can) */
  char path[32];                           /* how the chosen one runs: "cpu avx512", "cuda sm90", "torch" */
  char note[AB_REASON_LEN];                /* why auto's order changed for this call ("" = it did not) */
} ab_plan;

void ab_plan_build(const ab_call* call, ab_plan* plan);
/* For a CPU call torch's own fused kernel was measured to serve faster than ours on the same FMA
 * units, with the ISA path the call's kernels would run on: what the call is, for the plan's note
 * ("a float32 forward at D >= 128"); NULL otherwise (ab_registry.c lists the classes and the
 * figures). */
const char* ab_torch_cpu_faster(const ab_call* call);
/* Whether flash's CPU forward hands the call to the decode kernel (csrc/cpu/flash_cpu.c, "short queries";
 * ab_flash_cpu_decode_route): a dense forward of few query tokens (few_queries) with no gradient, no dropout,
 * Dv = D, and causal or a window aligned bottom-right (or Sq = Sk, where both alignments agree).  The route also
 * wants keys and values with a contiguous last dimension, which the descriptor does not hold: a call without one
 * runs flash's own kernel. */
int ab_call_decode_route(const ab_call* c);

#ifdef __cplusplus
}
#endif

#endif /* AB_PLANNER_H */
