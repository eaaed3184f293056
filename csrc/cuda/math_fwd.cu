// math_fwd.cu -- the math (exact reference) forward on CUDA.
//
// One thread block per query row (grid-stride over B * Hq * Sq rows).  Two passes over the visible
// keys: the first finds the row max and softmax denominator with the online rescale, the second
// recomputes each probability and accumulates P.V.  Scores and accumulation are float32 (float64
// for float64 inputs); any strides; bool or float masks with broadcast (zero) strides; causal in
// both alignments, window, softcap, GQA, dropout from the shared Philox stream (ab_philox.h), so
// the same seed keeps the same elements as the CPU kernels.  Clarity over speed: flash is the fast
// path.  Semantics: docs/semantics.md; the CPU twin is csrc/cpu/math_cpu_impl.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "ab_cuda_internal.h"
#include "math_common.cuh"
#include "../ab_philox.h"

namespace {

using namespace ab_math;

// Kernel arguments: the params struct by value (it lives in the launch's parameter space).
struct MathArgs {
  ab_attn_params p;
  int64_t rows;  // B * Hq * Sq
};

template <typename Acc>
__device__ __forceinline__ void online_merge(Acc& m, Acc& l, Acc m2, Acc l2) {
  // Merges two (max, sum of exp(x - max)) pairs; -inf maxima contribute nothing.
  if (m2 == (Acc)-INFINITY) return;
  if (m == (Acc)-INFINITY) {
    m = m2;
    l = l2;
    return;
  }
  Acc mn = m > m2 ? m : m2;
  l = l * (Acc)exp((double)(m - mn)) + l2 * (Acc)exp((double)(m2 - mn));
  m = mn;
}

// minBlocksPerSM = 1: without it ptxas for sm_90a held these kernels to 32 registers and spilled.
template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads, 1) math_fwd_kernel(const MathArgs args) {
  const ab_attn_params& p = args.p;
  extern __shared__ unsigned char smem_raw[];
  Acc* qrow = reinterpret_cast<Acc*>(smem_raw);  // (D)
  Acc* pchunk = qrow + p.D;                       // (kThreads)
  Acc* orow = pchunk + kThreads;                  // (Dv)
  Acc* red_m = orow + p.Dv;                       // (kThreads / 32)
  Acc* red_l = red_m + kThreads / 32;
  __shared__ int any_nan;

  const T* qd = static_cast<const T*>(p.q.data);
  const T* kd = static_cast<const T*>(p.k.data);
  const T* vd = static_cast<const T*>(p.v.data);
  T* od = static_cast<T*>(p.out.data);
  const int has_mask = p.mask.ndim > 0;
  const int bool_mask = has_mask && p.mask.dtype == AB_DTYPE_BOOL;
  const int64_t group = p.Hq / p.Hkv;
  const uint32_t threshold = ab_dropout_threshold(p.dropout_p);
  uint64_t seed, offset;
  ab_cuda_rng(p, seed, offset);
  const Acc rdrop = (Acc)(1.0 / (1.0 - p.dropout_p));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  for (int64_t row = blockIdx.x; row < args.rows; row += gridDim.x) {
    const int64_t i = row % p.Sq, bh = row / p.Sq, h = bh % p.Hq, b = bh / p.Hq, hk = h / group;
    int64_t lo, hi;
    key_range(p, i, lo, hi);

    const int64_t qoff = b * p.q.strides[0] + h * p.q.strides[1] + i * p.q.strides[2];
    for (int64_t d = tid; d < p.D; d += kThreads) qrow[d] = load_acc<T, Acc>(qd, qoff + d * p.q.strides[3]);
    for (int64_t d = tid; d < p.Dv; d += kThreads) orow[d] = 0;
    if (tid == 0) any_nan = 0;
    __syncthreads();

    const int64_t kbase = b * p.k.strides[0] + hk * p.k.strides[1];
    const int64_t vbase = b * p.v.strides[0] + hk * p.v.strides[1];
    const int64_t mbase = has_mask ? b * p.mask.strides[0] + h * p.mask.strides[1] + i * p.mask.strides[2] : 0;
    // Score of key j, or -inf when the bool mask hides it.
    auto score = [&](int64_t j) -> Acc {
      if (bool_mask && load_scalar(p.mask.data, p.mask.dtype, mbase + j * p.mask.strides[3]) == 0)
        return (Acc)-INFINITY;
      Acc x = 0;
      const int64_t ko = kbase + j * p.k.strides[2];
      for (int64_t d = 0; d < p.D; ++d) x += qrow[d] * load_acc<T, Acc>(kd, ko + d * p.k.strides[3]);
      x *= (Acc)p.scale;
      if (p.softcap > 0) x = (Acc)(p.softcap * tanh((double)x / p.softcap));
      if (has_mask && !bool_mask) x += (Acc)load_scalar(p.mask.data, p.mask.dtype, mbase + j * p.mask.strides[3]);
      return x;
    };

    // Pass 1: row max and denominator, merged across threads.
    Acc m = (Acc)-INFINITY, l = 0;
    for (int64_t j = lo + tid; j < hi; j += kThreads) {
      Acc x = score(j);
      if (x != x) any_nan = 1;
      online_merge<Acc>(m, l, x, (Acc)1);
    }
    for (int o = 16; o > 0; o >>= 1) {
      Acc m2 = __shfl_xor_sync(0xffffffffu, m, o);
      Acc l2 = __shfl_xor_sync(0xffffffffu, l, o);
      online_merge<Acc>(m, l, m2, l2);
    }
    if (lane == 0) {
      red_m[warp] = m;
      red_l[warp] = l;
    }
    __syncthreads();
    m = (Acc)-INFINITY;
    l = 0;
    for (int w = 0; w < kThreads / 32; ++w) online_merge<Acc>(m, l, red_m[w], red_l[w]);
    const bool nan_row = any_nan != 0;
    const bool empty_row = !nan_row && m == (Acc)-INFINITY;
    const Acc inv = empty_row || nan_row ? (Acc)0 : (Acc)1 / l;

    // Pass 2: recompute probabilities a chunk at a time and accumulate P.V per output column.
    if (!empty_row && !nan_row) {
      for (int64_t c = lo; c < hi; c += kThreads) {
        const int64_t j = c + tid;
        Acc pj = 0;
        if (j < hi) {
          Acc x = score(j);
          pj = x == (Acc)-INFINITY ? (Acc)0 : (Acc)exp((double)(x - m)) * inv;
          if (p.dropout_p > 0) {
            const bool keep = ab_dropout_keep(seed, offset, (uint64_t)row, (uint64_t)j, threshold);
            pj = keep ? pj * rdrop : (Acc)0;
          }
        }
        pchunk[tid] = pj;
        __syncthreads();
        const int64_t n = hi - c < kThreads ? hi - c : kThreads;
        accum_rows<T, Acc>(orow, p.Dv, pchunk, n, vd, vbase, c, p.v.strides[2], p.v.strides[3], tid);
        __syncthreads();
      }
    }

    const int64_t ooff = b * p.out.strides[0] + h * p.out.strides[1] + i * p.out.strides[2];
    for (int64_t d = tid; d < p.Dv; d += kThreads)
      store_acc<T, Acc>(od, ooff + d * p.out.strides[3], nan_row ? (Acc)NAN : orow[d]);
    if (tid == 0) {
      const Acc lse = nan_row ? (Acc)NAN : empty_row ? (Acc)-INFINITY : m + (Acc)log((double)l);
      const int64_t loff = b * p.lse.strides[0] + h * p.lse.strides[1] + i * p.lse.strides[2];
      if (p.lse.dtype == AB_DTYPE_F64)
        static_cast<double*>(p.lse.data)[loff] = (double)lse;
      else
        static_cast<float*>(p.lse.data)[loff] = (float)lse;
    }
    __syncthreads();  // qrow/orow are reused by the next row
  }
}

template <typename T, typename Acc>
ab_status launch(const ab_attn_params* p, cudaStream_t stream, ab_error* err) {
  MathArgs args;
  args.p = *p;
  args.rows = p->B * p->Hq * p->Sq;
  const size_t smem = sizeof(Acc) * (size_t)(p->D + kThreads + p->Dv + 2 * (kThreads / 32));
  if (smem > 48 * 1024)
    return ab_error_set(err, AB_ERR_UNSUPPORTED,
                        "math on CUDA supports D + Dv up to about %d, got D=%lld Dv=%lld",
                        (int)(48 * 1024 / sizeof(Acc)) - kThreads - 8, (long long)p->D,
                        (long long)p->Dv);
  const int64_t max_grid = 1 << 20;  // grid-stride beyond this
  const unsigned grid = (unsigned)(args.rows < max_grid ? args.rows : max_grid);
  AB_LAUNCH(grid, kThreads, smem, stream, math_fwd_kernel<T, Acc>)(args);
  return ab_cuda_check(cudaGetLastError(), "math_fwd launch", err);
}

}  // namespace

extern "C" ab_status ab_cuda_math_fwd(const ab_attn_params* p, void* stream, ab_error* err) {
  if (p->cu_seqlens_q)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "math takes dense calls (pad packed sequences first)");
  ab_status st = ab_attn_params_check(p, 0, err);
  if (st != AB_OK) return st;
  if (p->B == 0 || p->Hq == 0 || p->Sq == 0) return AB_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->q.dtype) {
    case AB_DTYPE_F32: return launch<float, float>(p, s, err);
    case AB_DTYPE_F16: return launch<__half, float>(p, s, err);
    case AB_DTYPE_BF16: return launch<__nv_bfloat16, float>(p, s, err);
    case AB_DTYPE_F64: return launch<double, double>(p, s, err);
    default: return ab_error_set(err, AB_ERR_INVALID, "math on CUDA: unsupported dtype");
  }
}
