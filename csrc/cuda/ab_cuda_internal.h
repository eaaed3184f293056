// ab_cuda_internal.h -- declarations shared by the .cu files of the CUDA library (not installed).
#ifndef AB_CUDA_INTERNAL_H
#define AB_CUDA_INTERNAL_H

#include <cuda_runtime.h>

#include "ab_cuda.h"

// Turns a CUDA error into an ab_status with the runtime's message.
static inline ab_status ab_cuda_check(cudaError_t e, const char* what, ab_error* err) {
  if (e == cudaSuccess) return AB_OK;
  return ab_error_set(err, AB_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(e),
                      cudaGetErrorName(e));
}

// AB_LAUNCH(grid, block, smem, stream, kernel)(args) is kernel<<<grid, block, smem, stream>>>(args),
// spelled so that the emulated build (csrc/cuda/emu, compiled by g++) runs the same launcher source:
// its cuda_runtime.h defines AB_LAUNCH first.  The kernel comes last: a template-id's commas.
#ifndef AB_LAUNCH
#define AB_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#endif

#if defined(__CUDACC__) || defined(AB_CUDA_EMULATE)
// The dropout pair of a call: from device memory when the shim passed it there (drawn on the GPU,
// e.g. under CUDA graph capture, so each replay reads the value its own draw wrote), else the
// host values carried in the params.  P is ab_attn_params or a kernel's copy of those fields
// (ab_flash::FwdParams): rng_dev, seed, offset.
template <typename P>
__device__ __forceinline__ void ab_cuda_rng(const P& p, uint64_t& seed, uint64_t& offset) {
  if (p.rng_dev != nullptr) {
    seed = (uint64_t)p.rng_dev[0];
    offset = (uint64_t)p.rng_dev[1];
  } else {
    seed = p.seed;
    offset = p.offset;
  }
}
#endif

extern "C" ab_status ab_cuda_math_fwd(const ab_attn_params* p, void* stream, ab_error* err);
extern "C" ab_status ab_cuda_flash_fwd(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                                       const int32_t* cu_seqlens_k_dev, void* stream, ab_error* err);
extern "C" ab_status ab_cuda_sage_fwd(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                                      const int32_t* cu_seqlens_k_dev, void* workspace, size_t* workspace_bytes,
                                      void* stream, ab_error* err);

extern "C" size_t ab_cuda_math_bwd_workspace(const ab_attn_params* p);
extern "C" size_t ab_cuda_flash_bwd_workspace(const ab_attn_params* p);
extern "C" ab_status ab_cuda_math_bwd(const ab_attn_params* p, void* workspace, size_t workspace_bytes,
                                      void* stream, ab_error* err);
extern "C" ab_status ab_cuda_flash_bwd(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                                       const int32_t* cu_seqlens_k_dev, void* workspace,
                                       size_t workspace_bytes, void* stream, ab_error* err);
extern "C" ab_status ab_cuda_dropout_mask(uint64_t seed, uint64_t offset, const int64_t* rng_dev, double p,
                                          int64_t B, int64_t H, int64_t Sq, int64_t Sk, uint8_t* keep,
                                          void* stream, ab_error* err);

extern "C" size_t ab_cuda_kvcache_workspace(const struct ab_kvcache_params* p);
extern "C" ab_status ab_cuda_kvcache_fwd(const struct ab_kvcache_params* p, void* workspace, size_t workspace_bytes,
                                         void* stream, ab_error* err);

#endif  // AB_CUDA_INTERNAL_H
