/* ab_cuda.h -- the launcher table of libattn_backends_cuda.so.
 *
 * The CUDA library is a separate shared object (static cudart) that the core dlopen()s the first
 * time a CUDA tensor arrives, so `import attn_backends` never touches CUDA.  Its one exported
 * symbol, ab_cuda_api_get, returns this table.  Launchers take raw pointers, strides and a
 * cudaStream_t (as void*) inside ab_attn_params; outputs and workspaces are allocated by the caller
 * (torch's caching allocator).  A launcher returns a status and fills err; it never throws.
 */
#ifndef AB_CUDA_H
#define AB_CUDA_H

#include "../ab_core.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ab_kvcache_params; /* csrc/cpu/decode_cpu.h: a KV-cache call (attention_with_kvcache) */

/* Bumped whenever the table's layout or a launcher's contract changes; the loader refuses a
 * library with another version (a stale build beside a fresh module). */
#define AB_CUDA_API_VERSION 6

typedef struct ab_cuda_api {
  int api_version;
  const char* archs; /* the -gencode targets the library was built for, e.g. "sm_80 sm_90a" */
  /* Compute capability of device `device` (e.g. 90 for 9.0), or an error if there is none. */
  ab_status (*device_capability)(int device, int* cc, ab_error* err);
  /* 1 if the library holds code for compute capability cc (cubin or PTX that can JIT). */
  int (*supports_cc)(int cc);
  /* math forward: exact reference, every feature, float16/bfloat16/float32/float64. */
  ab_status (*math_fwd)(const ab_attn_params* p, void* stream, ab_error* err);
  /* flash forward (FlashAttention-2): float16/bfloat16, D and Dv multiples of 8 up to 256 (D == Dv is
   * the usual case; both are padded to the next instantiated head dim), both causal alignments,
   * window, softcap, dropout, GQA/MQA, lse; no mask.  Dense when p->cu_seqlens_q is NULL.
   * Packed (varlen): q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), out (Tq, Hq, Dv), lse (Hq, Tq);
   * p->cu_seqlens_q/k are the host copies (B + 1 entries; p->Sq/p->Sk are max_seqlen_q/k), and
   * cu_seqlens_q_dev/k_dev the same values in device memory, read by the kernel. */
  ab_status (*flash_fwd)(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                         const int32_t* cu_seqlens_k_dev, void* stream, ab_error* err);
  /* sage forward (INT8 Q.K^T, SageAttention recipe; docs/sage.md): the operands, features and
   * packed-call convention of flash_fwd.  It needs a workspace (K smoothed and quantized, scales,
   * means): called with workspace == NULL it only writes the bytes needed to *workspace_bytes (0 when
   * there is nothing to compute) and launches nothing; then call it again with that many bytes,
   * 256-byte aligned, on the device (the shim takes them from torch's allocator). */
  ab_status (*sage_fwd)(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                        const int32_t* cu_seqlens_k_dev, void* workspace, size_t* workspace_bytes,
                        void* stream, ab_error* err);
  /* Every launcher that serves dropout (math_fwd, flash_fwd, math_bwd, flash_bwd) reads the dropout
   * pair from p->rng_dev (device memory) when it is set, else from p->seed / p->offset; the mapping
   * to keep/drop is ab_philox.h's, as on the CPU.  sage_fwd takes no dropout. */

  /* Bytes of workspace math_bwd / flash_bwd need for this call (0 is possible); the caller
   * allocates it (torch's allocator) on the call's device and passes it in. */
  size_t (*math_bwd_workspace)(const ab_attn_params* p);
  size_t (*flash_bwd_workspace)(const ab_attn_params* p);
  /* math backward: every feature (masks and the float mask's gradient, dlse, dropout), every
   * dtype; deterministic always (no atomics). */
  ab_status (*math_bwd)(const ab_attn_params* p, void* workspace, size_t workspace_bytes, void* stream,
                        ab_error* err);
  /* flash backward (FlashAttention-2): what flash_fwd serves, plus dropout; dense or packed (the
   * cu_seqlens arguments as in flash_fwd).  p->deterministic picks the dQ path: a separate dQ kernel
   * (bitwise reproducible) or float32 atomics (faster). */
  ab_status (*flash_bwd)(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                         const int32_t* cu_seqlens_k_dev, void* workspace, size_t workspace_bytes,
                         void* stream, ab_error* err);
  /* The keep-mask (1 = kept) the kernels draw, (B, H, Sq, Sk) contiguous uint8 in device memory;
   * rng_dev as in ab_attn_params (NULL: seed and offset). */
  ab_status (*dropout_mask)(uint64_t seed, uint64_t offset, const int64_t* rng_dev, double p, int64_t B,
                            int64_t H, int64_t Sq, int64_t Sk, uint8_t* keep, void* stream, ab_error* err);
  /* KV-cache attention (flash_attn_with_kvcache, docs/decode.md): the new k/v written into the
   * cache in place (rotated when asked), then q attends; float16/bfloat16/float32, D a multiple of 8
   * up to 256, 16-byte aligned cache rows; every tensor on the device.  The index values must have
   * been checked by the caller (attn_backends/_kvcache.py host_rows): the kernels only keep a bad
   * value from reaching memory outside the caches.  kvcache_workspace gives the bytes the call
   * needs on the current device (split-KV partials; 0 when unsplit); the caller allocates them. */
  size_t (*kvcache_workspace)(const struct ab_kvcache_params* p);
  ab_status (*kvcache_fwd)(const struct ab_kvcache_params* p, void* workspace, size_t workspace_bytes, void* stream,
                           ab_error* err);
  /* Bytes of shared memory a block of device `device` may opt in to (the device's answer,
   * cudaDevAttrMaxSharedMemoryPerBlockOptin): what the planner weighs the kernels' configs
   * against (ab_cuda_limits.h), as the launchers do before a launch. */
  ab_status (*device_smem_optin)(int device, int* bytes, ab_error* err);
} ab_cuda_api;

AB_EXPORT const ab_cuda_api* ab_cuda_api_get(void);

#ifdef __cplusplus
}
#endif

#endif /* AB_CUDA_H */
