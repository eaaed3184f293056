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

extern "C" ab_status ab_cuda_math_fwd(const ab_attn_params* p, void* stream, ab_error* err);
extern "C" ab_status ab_cuda_flash_fwd(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                                       const int32_t* cu_seqlens_k_dev, void* stream, ab_error* err);
extern "C" ab_status ab_cuda_sage_fwd(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                                      const int32_t* cu_seqlens_k_dev, void* workspace, size_t* workspace_bytes,
                                      void* stream, ab_error* err);

#endif  // AB_CUDA_INTERNAL_H
