// flash_bwd.cu -- the flash backward on CUDA (FlashAttention-2 algorithm): the launcher, and the
// two small kernels around the main ones.
//
// UNVERIFIED: compiled for sm_80 and sm_90a with nvcc 13.0, never run (written without a GPU).
// Opt-in with ATTN_BACKENDS_CUDA_FLASH=1, like the forward; tests/test_cuda.py checks it against the
// float64 reference on the first GPU run.
//
// One call, in stream order:
//   1. (fast path) zero the float32 dQ accumulator in the workspace (cudaMemsetAsync).
//   2. delta_i for every query row: with the forward's stats (p->stats given: the call's keys are its
//      rows' whole, as for autograd's calls) bwd_delta_kernel (flash_bwd_kernel.cuh) sums
//      P'_ij dP_ij / Z_i - dlse_i from S and dP recomputed, since out is rounded to 16 bits; without
//      them (the ring of attn_backends/_ring.py passes a block of keys and the whole row's out and
//      lse) preprocess_kernel takes dout_i . out_i - dlse_i, so the call is exactly the block's share.
//   3. bwd_dkv_kernel (flash_bwd_kernel.cuh): dK, dV, and on the fast path dQ by float32 atomics.
//   4. fast path: convert_kernel writes dq = scale * accumulator in q's dtype;
//      deterministic path (p->deterministic): bwd_dq_kernel computes dQ with no atomics instead.
//   5. with attention sinks and a gradient for them: sinks_grad_kernel, one block per query head,
//      d sinks[h] = -sum over the head's rows of exp(sinks[h] - lse_i) delta_i.  Its sum runs in a
//      fixed order (no atomics) on both dQ paths, so it is bitwise reproducible either way.
// Served: what the forward serves (flash_fwd.cu), dropout, attention sinks and ALiBi included, with
// dout, dq, dk and dv under the same layout rule as q, k, v (the Python layer copies a gradient that
// breaks it) and dsinks (Hq,) float32.  Head dims are padded to 64, 128, 192 or 256 (flash_bwd.cuh).
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "ab_cuda_internal.h"
#include "ab_cuda_limits.h"
#include "flash_bwd.cuh"

namespace {

// ab_cuda_limits.h states this tile table (flash_bwd.cuh) for the planner: the build fails when the two
// differ.
constexpr ab_cuda_config kBwdConfigs[] = {AB_CUDA_FLASH_BWD_CONFIGS};
template <int I> constexpr bool bwd_config_matches() {
  return kBwdConfigs[I].head_dim == ab_flash::kBwdHeadDims[I] &&
         kBwdConfigs[I].smem == (int)ab_flash::bwd_smem_bytes(ab_flash::kBwdHeadDims[I]);
}
static_assert(sizeof kBwdConfigs / sizeof kBwdConfigs[0] == sizeof ab_flash::kBwdHeadDims / sizeof(int) &&
                  bwd_config_matches<0>() && bwd_config_matches<1>() && bwd_config_matches<2>() &&
                  bwd_config_matches<3>(),
              "ab_cuda_limits.h: AB_CUDA_FLASH_BWD_CONFIGS differs from flash_bwd.cuh's tile table");

using ab_flash::BwdParams;
using ab_flash::FwdParams;

// Query rows are addressed as (nb, H, S): dense (B, Hq, Sq); packed (1, Hq, Tq) with the batch
// stride 0, since a packed row's index already is its place in the (Tq, Hq, D) tensors.
struct RowArgs {
  int64_t nb, H, S;
};

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

// delta_i = sum_d dout_id out_id - dlse_i: one warp per row, lanes over the head dim (out, dout, dlse
// and delta as the backward's parameters address them).
template <typename T> __global__ void preprocess_kernel(const BwdParams bp, const RowArgs rows) {
  const FwdParams& f = bp.f;
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  const int64_t total = rows.nb * rows.H * rows.S;
  for (int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + (threadIdx.x >> 5); row < total; row += warps) {
    const int64_t i = row % rows.S, bh = row / rows.S, h = bh % rows.H, b = bh / rows.H;
    const T* o = static_cast<const T*>(f.out) + b * f.o_bs + h * f.o_hs + i * f.o_rs;
    const T* d = static_cast<const T*>(bp.dout) + b * bp.do_bs + h * bp.do_hs + i * bp.do_rs;
    float acc = 0.0f;
    for (int c = lane; c < f.Dv; c += 32) acc += to_f(o[c]) * to_f(d[c]);
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane == 0) {
      if (bp.dlse != nullptr) acc -= bp.dlse[b * bp.dl_bs + h * bp.dl_hs + i * bp.dl_rs];
      bp.delta[b * bp.de_bs + h * bp.de_hs + i * bp.de_rs] = acc;
    }
  }
}

template <typename T> struct ConvArgs {
  const float* acc;
  T* dq;
  int64_t a_bs, a_hs, a_rs, dq_bs, dq_hs, dq_rs;
  RowArgs rows;
  int D;
  float scale;
};

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }

// dq = scale * accumulator, in q's dtype.
template <typename T> __global__ void convert_kernel(const ConvArgs<T> a) {
  const int64_t total = a.rows.nb * a.rows.H * a.rows.S * a.D;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = idx % a.D, row = idx / a.D;
    const int64_t i = row % a.rows.S, bh = row / a.rows.S, h = bh % a.rows.H, b = bh / a.rows.H;
    a.dq[b * a.dq_bs + h * a.dq_hs + i * a.dq_rs + c] =
        from_f<T>(a.acc[b * a.a_bs + h * a.a_hs + i * a.a_rs + c] * a.scale);
  }
}

// The sinks' gradient (docs/semantics.md, "Attention sinks and ALiBi"): the sink's weight in row i
// is exp(s_h - lse_i) (the forward's lse holds the sink), and d s_h = -sum_i exp(s_h - lse_i) delta_i
// with delta_i = dout_i . out_i - dlse_i (step 2's).  Rows are addressed as
// RowArgs (packed: rows [first, first + S) of the (Hq, Tq) lse, the ones some sequence holds).
struct SinkArgs {
  const float* sinks;  // (Hq,) contiguous
  const float* lse;
  const float* delta;
  float* dsinks;       // (Hq,), element h at h * ds_s
  int64_t l_bs, l_hs, l_rs, de_bs, de_hs, de_rs, ds_s;
  RowArgs rows;
  int64_t first;
};

constexpr int kSinkThreads = 256;

// One block per query head: thread t sums rows t, t + 256, ... in order, then the block adds the
// 256 partial sums in a fixed tree, so the result does not depend on timing.  A sink of -inf has
// weight 0 in every row (and lse may then be -inf: never exp(-inf + inf)).
__global__ void __launch_bounds__(kSinkThreads) sinks_grad_kernel(const SinkArgs a) {
  __shared__ float part[kSinkThreads];
  const int h = blockIdx.x, tid = threadIdx.x;
  const float s = a.sinks[h];
  float acc = 0.0f;
  if (s != -INFINITY) {
    const int64_t n = a.rows.nb * a.rows.S;
    for (int64_t r = tid; r < n; r += kSinkThreads) {
      const int64_t b = r / a.rows.S, i = a.first + r % a.rows.S;
      const float lse = a.lse[b * a.l_bs + h * a.l_hs + i * a.l_rs];
      acc += expf(s - lse) * a.delta[b * a.de_bs + h * a.de_hs + i * a.de_rs];
    }
  }
  part[tid] = acc;
  __syncthreads();
  for (int w = kSinkThreads / 2; w > 0; w >>= 1) {
    if (tid < w) part[tid] += part[tid + w];
    __syncthreads();
  }
  if (tid == 0) a.dsinks[h * a.ds_s] = -part[0];
}

unsigned grid_for(int64_t work, int per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return (unsigned)(blocks < (1 << 20) ? (blocks > 0 ? blocks : 1) : (1 << 20));
}

int64_t packed_rows(const ab_attn_params* p) { return p->cu_seqlens_q ? p->q.sizes[0] : p->B * p->Sq; }

// Workspace: delta (float32, one per query row and head), then on the fast path the dQ
// accumulator (float32, D per row), 256-byte aligned.
size_t delta_bytes(const ab_attn_params* p) {
  return ((size_t)(packed_rows(p) * p->Hq) * sizeof(float) + 255) / 256 * 256;
}

size_t accum_bytes(const ab_attn_params* p) {
  return p->deterministic ? 0 : (size_t)(packed_rows(p) * p->Hq * p->D) * sizeof(float);
}

template <typename T>
ab_status run(int kD, BwdParams& bp, const ab_attn_params* p, const RowArgs& rows, cudaStream_t stream,
              ab_error* err) {
  // 2. delta: from dout . out without the forward's stats (with them, bwd_delta_kernel in bwd_launch)
  const FwdParams& f = bp.f;
  const int64_t nrows = rows.nb * rows.H * rows.S;
  const bool whole_rows = p->stats.ndim > 0;
  if (!whole_rows && nrows > 0) {
    AB_LAUNCH(grid_for(nrows, 8), 256, 0, stream, preprocess_kernel<T>)(bp, rows);
    ab_status st = ab_cuda_check(cudaGetLastError(), "flash_bwd preprocess launch", err);
    if (st != AB_OK) return st;
  }

  // (2. with stats,) 3. dK, dV (and dQ by atomics), or 4. the deterministic dQ kernel
  const int64_t hkv = p->Hkv;
  const int64_t q_tiles = (int64_t)f.m_blocks * p->Hq * p->B;
  const int64_t row_blocks = whole_rows ? q_tiles : 0;
  const int64_t dkv_blocks = (int64_t)bp.n_blocks * hkv * p->B;
  const int64_t dq_blocks = p->deterministic ? q_tiles : 0;
  if (q_tiles > INT32_MAX || dkv_blocks > INT32_MAX)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "flash backward on CUDA: too many thread blocks for one grid");
  ab_status st;
  switch (kD) {
    case 64: st = ab_flash::bwd_launch<T, 64>(bp, row_blocks, dkv_blocks, dq_blocks, stream, err); break;
    case 128: st = ab_flash::bwd_launch<T, 128>(bp, row_blocks, dkv_blocks, dq_blocks, stream, err); break;
    case 192: st = ab_flash::bwd_launch<T, 192>(bp, row_blocks, dkv_blocks, dq_blocks, stream, err); break;
    case 256: st = ab_flash::bwd_launch<T, 256>(bp, row_blocks, dkv_blocks, dq_blocks, stream, err); break;
    default: return ab_error_set(err, AB_ERR_UNSUPPORTED, "flash backward on CUDA: no kernel for head dim %d", kD);
  }
  if (st != AB_OK) return st;

  // 5. the sinks' gradient (delta is ready; nothing else is read)
  if (p->dsinks.ndim && p->Hq > 0) {
    SinkArgs sa;
    sa.sinks = f.sinks;
    sa.lse = f.lse;
    sa.delta = bp.delta;
    sa.dsinks = static_cast<float*>(p->dsinks.data);
    sa.l_bs = f.l_bs, sa.l_hs = f.l_hs, sa.l_rs = f.l_rs;
    sa.de_bs = bp.de_bs, sa.de_hs = bp.de_hs, sa.de_rs = bp.de_rs;
    sa.ds_s = ab_flash::eff_stride(p->dsinks, 0);
    if (p->cu_seqlens_q) {  // the rows of the sequences: [cu_q[0], cu_q[B])
      sa.first = p->cu_seqlens_q[0];
      sa.rows = RowArgs{1, p->Hq, p->cu_seqlens_q[p->B] - p->cu_seqlens_q[0]};
    } else {
      sa.first = 0;
      sa.rows = rows;
    }
    AB_LAUNCH((unsigned)p->Hq, kSinkThreads, 0, stream, sinks_grad_kernel)(sa);
    if ((st = ab_cuda_check(cudaGetLastError(), "flash_bwd sinks launch", err)) != AB_OK) return st;
  }
  if (p->deterministic) return AB_OK;

  // 4. fast path: dq from the accumulator
  ConvArgs<T> ca;
  ca.acc = bp.dq_accum;
  ca.dq = static_cast<T*>(bp.dq);
  ca.a_bs = bp.a_bs, ca.a_hs = bp.a_hs, ca.a_rs = bp.a_rs;
  ca.dq_bs = bp.dq_bs, ca.dq_hs = bp.dq_hs, ca.dq_rs = bp.dq_rs;
  ca.rows = rows;
  ca.D = (int)p->D;
  ca.scale = bp.scale;
  const int64_t n = nrows * p->D;
  if (n == 0) return AB_OK;
  AB_LAUNCH(grid_for(n, 256), 256, 0, stream, convert_kernel<T>)(ca);
  return ab_cuda_check(cudaGetLastError(), "flash_bwd convert launch", err);
}

}  // namespace

extern "C" size_t ab_cuda_flash_bwd_workspace(const ab_attn_params* p) { return delta_bytes(p) + accum_bytes(p); }

extern "C" ab_status ab_cuda_flash_bwd(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                                       const int32_t* cu_seqlens_k_dev, void* workspace, size_t workspace_bytes,
                                       void* stream, ab_error* err) {
  FwdParams fp;
  bool empty = false;
  const ab_flash::Serves serves = {"flash backward", 256, true, 1, true};
  ab_status st = ab_flash::prepare(p, serves, cu_seqlens_q_dev, cu_seqlens_k_dev, fp, &empty, err);
  if (st != AB_OK) return st;
  if (p->dlse.ndim && p->dlse.dtype != AB_DTYPE_F32)
    return ab_error_set(err, AB_ERR_INVALID, "flash backward on CUDA: grad_lse must be float32");
  if (p->dmask.ndim) return ab_error_set(err, AB_ERR_UNSUPPORTED, "flash backward on CUDA takes no attn_mask");
  if (p->dsinks.ndim && (p->dsinks.dtype != AB_DTYPE_F32 || (p->dsinks.sizes[0] > 1 && p->dsinks.strides[0] != 1)))
    return ab_error_set(err, AB_ERR_INVALID, "flash backward on CUDA: grad_sinks must be contiguous float32");
  if (empty) {  // B or Hq is 0: no row, so the sinks' gradient is 0
    if (p->dsinks.ndim && p->Hq > 0)
      return ab_cuda_check(cudaMemsetAsync(p->dsinks.data, 0, (size_t)p->Hq * sizeof(float),
                                           static_cast<cudaStream_t>(stream)),
                           "flash_bwd: cudaMemsetAsync", err);
    return AB_OK;
  }
  if ((st = ab_flash::check_layout(p->dout, serves.who, "grad_out", err)) != AB_OK) return st;
  if ((st = ab_flash::check_layout(p->dq, serves.who, "dq", err)) != AB_OK) return st;
  if ((st = ab_flash::check_layout(p->dk, serves.who, "dk", err)) != AB_OK) return st;
  if ((st = ab_flash::check_layout(p->dv, serves.who, "dv", err)) != AB_OK) return st;
  if (workspace_bytes < ab_cuda_flash_bwd_workspace(p))
    return ab_error_set(err, AB_ERR_INVALID, "flash backward on CUDA: workspace of %zu bytes, needs %zu",
                        workspace_bytes, ab_cuda_flash_bwd_workspace(p));

  using ab_flash::eff_stride;
  const bool packed = p->cu_seqlens_q != nullptr;
  BwdParams bp = {};
  bp.f = fp;
  bp.dout = p->dout.data;
  bp.dq = p->dq.data;
  bp.dk = p->dk.data;
  bp.dv = p->dv.data;
  const int64_t Tq = packed ? p->q.sizes[0] : 0;
  RowArgs rows;
  if (packed) {  // (T, H, D): the row stride is dim 0, the head stride dim 1
    bp.do_bs = 0, bp.do_hs = eff_stride(p->dout, 1), bp.do_rs = eff_stride(p->dout, 0);
    bp.dq_bs = 0, bp.dq_hs = eff_stride(p->dq, 1), bp.dq_rs = eff_stride(p->dq, 0);
    bp.dk_bs = 0, bp.dk_hs = eff_stride(p->dk, 1), bp.dk_rs = eff_stride(p->dk, 0);
    bp.dv_bs = 0, bp.dv_hs = eff_stride(p->dv, 1), bp.dv_rs = eff_stride(p->dv, 0);
    bp.de_bs = 0, bp.de_hs = Tq, bp.de_rs = 1;         // delta (Hq, Tq), like lse
    bp.a_bs = 0, bp.a_hs = p->D, bp.a_rs = p->Hq * p->D;  // accumulator (Tq, Hq, D)
    rows = RowArgs{1, p->Hq, Tq};
  } else {
    bp.do_bs = eff_stride(p->dout, 0), bp.do_hs = eff_stride(p->dout, 1), bp.do_rs = eff_stride(p->dout, 2);
    bp.dq_bs = eff_stride(p->dq, 0), bp.dq_hs = eff_stride(p->dq, 1), bp.dq_rs = eff_stride(p->dq, 2);
    bp.dk_bs = eff_stride(p->dk, 0), bp.dk_hs = eff_stride(p->dk, 1), bp.dk_rs = eff_stride(p->dk, 2);
    bp.dv_bs = eff_stride(p->dv, 0), bp.dv_hs = eff_stride(p->dv, 1), bp.dv_rs = eff_stride(p->dv, 2);
    bp.de_bs = p->Hq * p->Sq, bp.de_hs = p->Sq, bp.de_rs = 1;  // delta (B, Hq, Sq)
    bp.a_bs = p->Hq * p->Sq * p->D, bp.a_hs = p->Sq * p->D, bp.a_rs = p->D;  // accumulator (B, Hq, Sq, D)
    rows = RowArgs{p->B, p->Hq, p->Sq};
  }
  if (p->dlse.ndim) {
    bp.dlse = static_cast<const float*>(p->dlse.data);
    if (packed)  // (Hq, Tq), like lse
      bp.dl_bs = 0, bp.dl_hs = eff_stride(p->dlse, 0), bp.dl_rs = eff_stride(p->dlse, 1);
    else
      bp.dl_bs = eff_stride(p->dlse, 0), bp.dl_hs = eff_stride(p->dlse, 1), bp.dl_rs = eff_stride(p->dlse, 2);
  }
  unsigned char* ws = static_cast<unsigned char*>(workspace);
  bp.delta = reinterpret_cast<float*>(ws);
  bp.dq_accum = p->deterministic ? nullptr : reinterpret_cast<float*>(ws + delta_bytes(p));
  bp.n_blocks = (int)((p->Sk + ab_flash::kBwdBN - 1) / ab_flash::kBwdBN);
  bp.f.m_blocks = (int)((p->Sq + ab_flash::kBwdBM - 1) / ab_flash::kBwdBM);
  bp.scale = (float)p->scale;

  const int kD = ab_flash::padded_head_dim(ab_flash::kBwdHeadDims, p->D, p->Dv);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (bp.dq_accum != nullptr && accum_bytes(p) > 0) {
    st = ab_cuda_check(cudaMemsetAsync(bp.dq_accum, 0, accum_bytes(p), s), "flash_bwd: cudaMemsetAsync", err);
    if (st != AB_OK) return st;
  }
  if (p->q.dtype == AB_DTYPE_F16) return run<__half>(kD, bp, p, rows, s, err);
  return run<__nv_bfloat16>(kD, bp, p, rows, s, err);
}
