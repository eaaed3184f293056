// math_common.cuh -- what the math (exact reference) forward and backward on CUDA share: loads and
// stores in the accumulation type (float32, or float64 for float64 inputs), mask reads and the visible
// key range of a query row.
#ifndef AB_MATH_COMMON_CUH
#define AB_MATH_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "ab_cuda_internal.h"

namespace ab_math {

constexpr int kThreads = 128;

template <typename T> __device__ __forceinline__ float load_f(const T* p, int64_t off);
template <> __device__ __forceinline__ float load_f(const float* p, int64_t off) { return p[off]; }
template <> __device__ __forceinline__ float load_f(const __half* p, int64_t off) {
  return __half2float(p[off]);
}
template <> __device__ __forceinline__ float load_f(const __nv_bfloat16* p, int64_t off) {
  return __bfloat162float(p[off]);
}
template <> __device__ __forceinline__ float load_f(const double* p, int64_t off) {
  return (float)p[off];
}

template <typename T, typename Acc> __device__ __forceinline__ Acc load_acc(const T* p, int64_t off) {
  return (Acc)load_f<T>(p, off);
}
template <> __device__ __forceinline__ double load_acc<double, double>(const double* p, int64_t off) {
  return p[off];
}

template <typename T, typename Acc> __device__ __forceinline__ void store_acc(T* p, int64_t off, Acc v);
template <> __device__ __forceinline__ void store_acc<float, float>(float* p, int64_t off, float v) {
  p[off] = v;
}
template <> __device__ __forceinline__ void store_acc<__half, float>(__half* p, int64_t off, float v) {
  p[off] = __float2half_rn(v);
}
template <>
__device__ __forceinline__ void store_acc<__nv_bfloat16, float>(__nv_bfloat16* p, int64_t off,
                                                                float v) {
  p[off] = __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ void store_acc<double, double>(double* p, int64_t off, double v) {
  p[off] = v;
}

// row[d] += sum over t < n of coef[t] * x[base + (c + t) * rs + d * ds], for d < dim split over
// the block's threads (thread tid takes d = tid, tid + kThreads, ...): one chunk of rows c.. of a
// strided operand.  A zero coefficient skips its row of x: masked or dropped rows add nothing, not
// even an inf or NaN of theirs.  The caller syncs before (coef is shared) and after (row and coef
// are reused).
template <typename T, typename Acc>
__device__ __forceinline__ void accum_rows(Acc* row, int64_t dim, const Acc* coef, int64_t n, const T* x,
                                           int64_t base, int64_t c, int64_t rs, int64_t ds, int tid) {
  for (int64_t d = tid; d < dim; d += kThreads) {
    Acc acc = row[d];
    for (int64_t t = 0; t < n; ++t)
      if (coef[t] != 0) acc += coef[t] * load_acc<T, Acc>(x, base + (c + t) * rs + d * ds);
    row[d] = acc;
  }
}

// One element of a mask, lse or dlse of any dtype, as a double.
__device__ __forceinline__ double load_scalar(const void* base, ab_dtype dt, int64_t off) {
  switch (dt) {
    case AB_DTYPE_BOOL: return ((const uint8_t*)base)[off] != 0;
    case AB_DTYPE_F32: return ((const float*)base)[off];
    case AB_DTYPE_F16: return __half2float(((const __half*)base)[off]);
    case AB_DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16*)base)[off]);
    case AB_DTYPE_F64: return ((const double*)base)[off];
    default: return NAN;
  }
}

// Visible keys [lo, hi) of query row i from causal and window (docs/semantics.md), as the CPU's
// ab_row_key_range: i' = i + Sk - Sq for bottom-right causal, else i.
__device__ __forceinline__ void key_range(const ab_attn_params& p, int64_t i, int64_t& lo, int64_t& hi) {
  const int64_t ii = p.causal == AB_CAUSAL_BOTTOM_RIGHT ? i + p.Sk - p.Sq : i;
  lo = 0;
  hi = p.Sk;
  if (p.causal != AB_CAUSAL_NONE && ii + 1 < hi) hi = ii + 1;
  if (p.window_right >= 0 && ii + p.window_right + 1 < hi) hi = ii + p.window_right + 1;
  if (p.window_left >= 0 && ii - p.window_left > lo) lo = ii - p.window_left;
  if (hi < lo) hi = lo;
}

}  // namespace ab_math

#endif  // AB_MATH_COMMON_CUH
