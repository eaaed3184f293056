/* ab_core.h -- the C core's one public header.
 *
 * What it is: the plain types every layer below the torch shim speaks (tensor views, the attention
 * parameter struct, status codes) and the entry points of the core (CPU kernels, dropout stream,
 * CPU feature detection, backend names, the lazy CUDA loader).
 *
 * Why it exists: the core never sees a torch or Python type.  csrc/torch_shim.cpp turns torch tensors
 * into ab_tensor views and fills one ab_attn_params; csrc/ab_module.c exposes the non-tensor parts to
 * Python.  Kernels return an ab_status and write a message into an ab_error; they never exit or throw.
 *
 * Shape glossary (used in every comment of the project):
 *   B        batch
 *   Hq, Hkv  query heads, key/value heads (Hq % Hkv == 0; Hq / Hkv query heads share one KV head)
 *   Sq, Sk   query length, key length
 *   D, Dv    head dim of q/k, head dim of v (and of the output)
 *   cu_seqlens  (B + 1,) int32 prefix sums of the packed sequence lengths (varlen)
 * Strides are in elements, never bytes.  Offsets are computed in int64_t throughout.
 */
#ifndef AB_CORE_H
#define AB_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define AB_VERSION "0.1.0"
#define AB_MAX_DIMS 4

#if defined(__GNUC__)
#define AB_EXPORT __attribute__((visibility("default")))
#else
#define AB_EXPORT
#endif

typedef enum ab_status {
  AB_OK = 0,
  AB_ERR_INVALID = 1,     /* bad argument: shapes, dtypes, strides */
  AB_ERR_UNSUPPORTED = 2, /* valid call this kernel does not serve */
  AB_ERR_NOMEM = 3,
  AB_ERR_CUDA = 4,        /* a CUDA runtime call failed */
  AB_ERR_UNAVAILABLE = 5  /* a library or device is missing */
} ab_status;

typedef struct ab_error {
  char msg[512];
} ab_error;

/* Formats msg (printf style) into err and returns code; err may be NULL. */
ab_status ab_error_set(ab_error* err, ab_status code, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

typedef enum ab_dtype {
  AB_DTYPE_F32 = 0,
  AB_DTYPE_F16 = 1,
  AB_DTYPE_BF16 = 2,
  AB_DTYPE_F64 = 3,
  AB_DTYPE_BOOL = 4,
  AB_DTYPE_I32 = 5,
  AB_DTYPE_I64 = 6,
  AB_DTYPE_U8 = 7,
  AB_DTYPE_OTHER = 8
} ab_dtype;

const char* ab_dtype_name(ab_dtype dtype);
size_t ab_dtype_size(ab_dtype dtype);
int ab_dtype_is_floating(ab_dtype dtype);

typedef enum ab_device_type {
  AB_DEVICE_CPU = 0,
  AB_DEVICE_CUDA = 1,
  AB_DEVICE_MPS = 2,
  AB_DEVICE_OTHER = 3
} ab_device_type;

/* A strided view of someone else's memory.  ndim == 0 means "absent" (optional operand); data may be
 * NULL for a present operand with no elements. */
typedef struct ab_tensor {
  void* data;
  ab_dtype dtype;
  ab_device_type device;
  int32_t device_index;
  int32_t ndim;
  int64_t sizes[AB_MAX_DIMS];
  int64_t strides[AB_MAX_DIMS];
} ab_tensor;

typedef enum ab_causal {
  AB_CAUSAL_NONE = 0,
  AB_CAUSAL_TOP_LEFT = 1,     /* query i sees keys j <= i */
  AB_CAUSAL_BOTTOM_RIGHT = 2  /* query i sees keys j <= i + Sk - Sq (KV-cache convention) */
} ab_causal;

/* Names of the enums above ("cpu", "cuda", "mps", "other"; "none", "top_left", "bottom_right"): the
 * Python side takes its names and ids from these (attn_backends._C.enum_names). */
const char* ab_device_name(ab_device_type device);
const char* ab_causal_name(ab_causal causal);

/* Everything a kernel needs for one attention call, filled in one place (the shim).
 * Forward reads q, k, v, mask and writes out, lse.  Backward also reads dout, dlse (optional), out,
 * lse and writes dq, dk, dv and dmask (optional: the gradient of a float mask, (B, Hq, Sq, Sk)).
 *
 * Packed (varlen) calls set cu_seqlens_q/k: then q, out, dout, dq are (total_q, Hq, D|Dv), k, v,
 * dk, dv are (total_k, Hkv, D|Dv), lse is (Hq, total_q), sequence b is rows cu[b] .. cu[b+1],
 * Sq and Sk hold max_seqlen_q and max_seqlen_k, and there is no mask. */
typedef struct ab_attn_params {
  int64_t B, Hq, Hkv, Sq, Sk, D, Dv;
  const int32_t* cu_seqlens_q; /* (B + 1,) on the host; NULL for dense calls */
  const int32_t* cu_seqlens_k;

  ab_tensor q;     /* (B, Hq, Sq, D) */
  ab_tensor k;     /* (B, Hkv, Sk, D) */
  ab_tensor v;     /* (B, Hkv, Sk, Dv) */
  ab_tensor mask;  /* (B, Hq, Sq, Sk) after broadcasting (zero strides); bool or floating; optional */
  ab_tensor out;   /* (B, Hq, Sq, Dv) */
  ab_tensor lse;   /* (B, Hq, Sq) float32 (float64 for float64 inputs) */

  ab_tensor dout;  /* (B, Hq, Sq, Dv) */
  ab_tensor dlse;  /* (B, Hq, Sq) optional */
  ab_tensor dq;    /* (B, Hq, Sq, D) */
  ab_tensor dk;    /* (B, Hkv, Sk, D) */
  ab_tensor dv;    /* (B, Hkv, Sk, Dv) */
  ab_tensor dmask; /* (B, Hq, Sq, Sk) float32, optional */
  /* (2, B, Hq, Sq) (packed: (2, Hq, Tq)) like lse, optional: each row's max score m and the log of its
   * sum of exp(x - m), lse = m + log sum kept in two parts.  The CPU flash forward writes it and its
   * backward takes p = exp((x - m) - log sum) from it, free of lse's float32 rounding, which grows
   * with |lse|; without it the backward uses lse (m = lse, log sum = 0). */
  ab_tensor stats;

  double scale;    /* multiplies q.k */
  double softcap;  /* > 0: score = softcap * tanh(score / softcap) */
  double dropout_p;
  ab_causal causal;
  int64_t window_left, window_right; /* -1 = unbounded on that side */
  uint64_t seed, offset;             /* dropout stream (ab_philox.h) */
  /* CUDA only: [seed, offset] as two int64 in device memory, read by the kernels instead of
   * seed/offset above; NULL otherwise.  Set when the pair was drawn on the GPU (CUDA graph
   * capture), where a host value would be frozen into the graph. */
  const int64_t* rng_dev;
  int32_t deterministic;             /* backward: bitwise identical results run after run */

  /* Attention sinks, optional: (Hq,) floating, one logit s_h per query head that joins every row's
   * softmax denominator and contributes no value (FA3's and vLLM's s_aux, GPT-OSS): p_j =
   * exp(x_j) / (exp(s_h) + sum exp(x)), lse = log(exp(s_h) + sum exp(x)).  A row that sees no key
   * then outputs 0 with lse = s_h. */
  ab_tensor sinks;
  /* ALiBi slopes, optional: (Hq,) or (B, Hq) float32; score (after softcap) += -slope * |i' - j|
   * with i' = i + Sk - Sq (per sequence for packed calls), flash-attn's definition, whatever the
   * causal alignment.  No gradient. */
  ab_tensor alibi;
  /* Backward, optional: the gradient of sinks, (Hq,) float32 (float64 for float64 inputs). */
  ab_tensor dsinks;
} ab_attn_params;

/* Checks shapes, dtypes and strides of the operands the forward (backward = 0) or the backward
 * (backward = 1) reads and writes; names the offending argument in err. */
ab_status ab_attn_params_check(const ab_attn_params* p, int backward, ab_error* err);

/* The softmax's extra logit of query head h (0 ... Hq - 1), or -inf without sinks; ALiBi's slope of
 * (batch b, query head h), or 0 without ALiBi.  For kernels that read them one head at a time. */
double ab_attn_sink(const ab_attn_params* p, int64_t h);
double ab_attn_alibi_slope(const ab_attn_params* p, int64_t b, int64_t h);

/* ---- CPU execution: the caller lends its thread pool (torch's, through the shim) ---------------- */

typedef void (*ab_range_fn)(int64_t begin, int64_t end, void* ctx);

typedef struct ab_cpu_pool {
  /* Runs fn over [begin, end) split into chunks of at least grain; returns 0 on success. */
  int (*parallel_for)(int64_t begin, int64_t end, int64_t grain, ab_range_fn fn, void* ctx);
  int num_threads;
} ab_cpu_pool;

/* Runs fn serially; the pool used by the core's own tests and when no pool is given. */
extern const ab_cpu_pool ab_cpu_pool_serial;

/* math: the exact reference kernel.  Scores, softmax and accumulation in float32 (float64 for
 * float64 inputs); any strides; every feature of ab_attn_params. */
ab_status ab_math_cpu_fwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);
ab_status ab_math_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);

/* flash: the fused online-softmax kernel (FlashAttention-2 algorithm), tiled so extra memory is
 * O(tile) in the forward; float16, bfloat16 and float32 (float32 scores and accumulation), every
 * feature of ab_attn_params, dense or packed (varlen).  Runs the ISA path ab_cpu_isa_get() names. */
ab_status ab_flash_cpu_fwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);
/* The query tokens per sequence of the flash call p when the decode kernel serves it instead, else 0
 * (csrc/cpu/flash_cpu.c, "short queries"): ab_flash_cpu_fwd runs such a call there when it has no row
 * statistics (stats absent).  Reads the shapes, strides, dtype, mask, dropout, causal, window and, for
 * packed calls, the host cu_seqlens of p; not its data. */
int64_t ab_flash_cpu_decode_route(const ab_attn_params* p);
ab_status ab_flash_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err);

/* sage: SageAttention's recipe, forward only and lossy (docs/sage.md): K smoothed by its mean over
 * the sequence, Q and K quantized to int8 per row, S = Q K^T in int32, softmax and P V in float32.
 * float16, bfloat16 and float32; masks, causal, window, softcap, GQA, lse, dense or packed; no
 * dropout.  The caller provides workspace_bytes >= ab_sage_cpu_workspace_size(p) of workspace
 * (quantized K and its scales; the shim allocates it through torch).  Same ISA path as flash,
 * except that AVX-512 needs VNNI (else the AVX2 path runs) and AMX needs AMX-INT8 (else the
 * AVX-512 rule applies). */
size_t ab_sage_cpu_workspace_size(const ab_attn_params* p);
ab_status ab_sage_cpu_fwd(const ab_attn_params* p, void* workspace, size_t workspace_bytes,
                          const ab_cpu_pool* pool, ab_error* err);
/* "generic", "avx2", "avx512_vnni", "amx_int8" or "amx_emu": the path sage runs now. */
const char* ab_sage_cpu_isa_name(void);

/* Instruction-set paths of the CPU kernels; a generic C path always exists.  AB_ISA_AMX runs
 * bfloat16 flash, float16 forward (AMX-FP16) and sage on AMX tiles and everything else on AVX-512;
 * AB_ISA_AMX_EMU runs the same tile kernels against a C emulation of the tile instructions (any
 * CPU; for tests).  Neither is ever chosen by default (docs/amx.md). */
typedef enum ab_cpu_isa {
  AB_ISA_GENERIC = 0,
  AB_ISA_AVX2 = 1,
  AB_ISA_AVX512 = 2,
  AB_ISA_AMX = 3,
  AB_ISA_AMX_EMU = 4
} ab_cpu_isa;
#define AB_ISA_COUNT 5

/* The path in use: the best this CPU and OS support among generic, avx2 and avx512, or
 * ATTN_BACKENDS_CPU_ISA=generic|avx2|avx512|amx|amx_emu. */
ab_cpu_isa ab_cpu_isa_get(void);
/* Why ATTN_BACKENDS_CPU_ISA cannot be honoured (an unknown name, a path this CPU or OS cannot run,
 * "amx" without AMX), or NULL.  While set, the flash and sage CPU kernels fail with it. */
const char* ab_cpu_isa_error(void);
int ab_cpu_isa_supported(ab_cpu_isa isa);
/* Switches the path for the whole process (tests run every supported path); 0 if unsupported. */
int ab_cpu_isa_set(ab_cpu_isa isa);
const char* ab_cpu_isa_name(ab_cpu_isa isa);
/* Float32 flop/s of independent FMA chains on `threads` threads of the current path: the ceiling
 * the CPU benchmarks are measured against. */
double ab_cpu_fma_peak(double seconds, int threads);
/* One tile product on the emulated tiles (csrc/cpu/ab_amx.h), for tests of the emulation: op 0
 * tdpbf16ps, 1 tdpfp16ps, 2 tdpbssd, 3 tdpbusd; shape = rows and bytes per row of C, A, B; c is
 * read and written (rows x bytes per row each, packed).  A shape the instruction rejects aborts
 * the process, as the emulation's #UD. */
void ab_amx_emu_dot(int op, const void* a, const void* b, void* c, const int shape[6]);

/* Writes the dropout keep-mask (1 = kept) the kernels use for (B, H, Sq, Sk), contiguous uint8. */
ab_status ab_dropout_mask_cpu(uint64_t seed, uint64_t offset, double p, int64_t B, int64_t H,
                              int64_t Sq, int64_t Sk, uint8_t* keep, const ab_cpu_pool* pool,
                              ab_error* err);

/* ---- CPU features (CPUID and XGETBV: an ISA counts only if the OS saves its registers) ---------- */

typedef struct ab_cpu_features {
  int sse42, avx, avx2, fma, f16c;
  int avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni, avx512_bf16, avx512_fp16;
  int avx_vnni;
  /* AMX: set only when CPUID reports it, XCR0 enables tile state AND the kernel granted this
   * process tile data (requested once, at detection); amx_state says which step failed. */
  int amx_tile, amx_bf16, amx_int8, amx_fp16;
  char amx_state[112];
  char vendor[13];
  char brand[49];
  int family, model; /* CPUID leaf 1's display family and model (AMD Zen 4: 25, Zen 5: 26); 0 off x86 */
  int64_t l3_bytes; /* the L3 a core sees (CPUID's cache parameters), bytes; 0 when CPUID does not say */
} ab_cpu_features;

const ab_cpu_features* ab_cpu_features_get(void);

/* AMD's CPUID family of Zen 5: from it on, rules measured on Zen 4 (family 25) are not assumed to hold
 * (the torch-faster rows' amd_family_below, csrc/ab_registry.c; decode's scores_by_head, decode_cpu.c). */
#define AB_AMD_FAMILY_ZEN5 26

/* Who made the CPU, from CPUID's vendor string: two makers' cores on the same ISA path can rank our
 * kernels and torch's differently (the planner's ab_call.cpu_vendor, ab_torch_cpu_faster), and can
 * want different prefetches (the decode kernel, csrc/cpu/decode_cpu.c). */
typedef enum ab_cpu_vendor {
  AB_VENDOR_OTHER = 0,
  AB_VENDOR_INTEL = 1,
  AB_VENDOR_AMD = 2,
  AB_VENDOR_COUNT
} ab_cpu_vendor;
ab_cpu_vendor ab_cpu_vendor_detect(void);

/* ---- The CUDA library, loaded on first use --------------------------------------------------- */

struct ab_cuda_api;
/* Loads libattn_backends_cuda.so from beside this module once; NULL (and err) when absent. */
const struct ab_cuda_api* ab_cuda_load(ab_error* err);
/* Path the loader looks at; for the report. */
const char* ab_cuda_library_path(void);
/* The CUDA emulator (csrc/cuda/emu, docs/cuda.md): on = 1 loads libattn_backends_cuda_emu.so from
 * beside this module (AB_ERR_UNAVAILABLE when it is not there) and makes ab_cuda_emulation return
 * its launcher table, which the shim then uses for CPU tensors of flash, flash_varlen, sage and math;
 * on = 0 turns that off (NULL). */
ab_status ab_cuda_set_emulation(int on, ab_error* err);
const struct ab_cuda_api* ab_cuda_emulation(void);
const char* ab_cuda_emu_library_path(void);

#ifdef __cplusplus
}
#endif

#endif /* AB_CORE_H */
