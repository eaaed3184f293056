// math_bwd.cu -- the math (exact reference) backward on CUDA.
//
// UNVERIFIED: compiled for sm_80 and sm_90a with nvcc 13.0, never run (written without a GPU).
// tests/test_cuda.py checks it against the float64 reference on the first GPU run.
//
// Two kernels; every output element is written by one thread block, in a fixed order, with no
// atomics, so the results are bitwise identical run after run (the reference needs no separate
// deterministic mode):
//   dq_kernel   one block per query row (b, h, i): recomputes p_j from the saved lse, reduces the row's
//               sum of them, Z_i, and delta_i = sum_j p_j dP_j / Z_i - dlse_i (both kept in the
//               workspace for dkv_kernel), writes the float mask's gradient dS_ij and
//               dq_i = scale sum_j dx_j k_j.
//   dkv_kernel  one block per key row (b, hk, j): over the query heads of KV head hk and their query
//               rows in order, dv_j = sum_i p'_ij dout_i and dk_j = scale sum_i dx_ij q_i; so GQA's
//               sum over the query heads of a group happens in one place, in a fixed order.
// The formulas are the CPU twin's (csrc/cpu/math_cpu_impl.h):
//   x_j = softcap tanh(scale q.k_j / softcap) + mask_ij;  p_j = exp(x_j - lse_i) / Z_i
//   dP_j = keep_ij / (1 - dropout_p) dout_i . v_j;  p'_j = keep_ij / (1 - dropout_p) p_j
//   delta_i = sum_j p_j dP_j - dlse_i;  dS_j = p_j (dP_j - delta_i);  dx_j = dS_j (1 - tanh^2)
// Z_i = sum_j exp(x_j - lse_i) is 1 but for lse's rounding to float32, which every p_j of the row
// shares (a factor 1 +- a few 1e-6 at logits near 30): the CPU twin recomputes the softmax from the
// scores instead; here dividing by Z_i does the same.  Without it a saturated row's dS = p (dP - p dP)
// kept that factor's distance from 1 times dP, and dq reached 5x torch's float32 error (the CUDA
// emulator, tests/test_cuda.py test_cuda_gradients_of_saturated_rows).
// A row with lse = -inf (no visible key) gets zero gradient.  Scores and accumulation are float32
// (float64 for float64 inputs), any strides, like the forward.  Clarity over speed.
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

struct BwdArgs {
  ab_attn_params p;
  void* delta;  // (2, B, Hq, Sq) Acc: delta_i, then 1 / Z_i, written by dq_kernel, read by dkv_kernel
};

// Everything both kernels recompute for one (query row, key) pair.
template <typename Acc> struct Pair {
  Acc p;   // probability before dropout (0 when the key is hidden)
  Acc pd;  // p'_j: after dropout, what dv sees
  Acc dp;  // dP_j: keep / (1 - dropout_p) * dout . v
  Acc th;  // tanh(raw / softcap), for the softcap derivative
};

// A row of q, k, v or dout: either already in shared memory in the accumulation type, or in
// global memory (element d at g[off + d * stride]).
template <typename T, typename Acc> struct Row {
  const Acc* s;
  const T* g;
  int64_t off, stride;
  __device__ __forceinline__ Acc operator[](int64_t d) const {
    return s != nullptr ? s[d] : load_acc<T, Acc>(g, off + d * stride);
  }
};

// q_i . k_j and dout_i . v_j, then the score, mask, probability (times inv_z: 1 / Z_i) and dropout
// of the pair.
template <typename T, typename Acc>
__device__ __forceinline__ Pair<Acc> pair(const ab_attn_params& p, int64_t b, int64_t h, int64_t i, int64_t j,
                                          Acc lse_i, Acc inv_z, const Row<T, Acc>& qr, const Row<T, Acc>& kr,
                                          const Row<T, Acc>& dor, const Row<T, Acc>& vr, uint64_t seed,
                                          uint64_t offset, uint32_t threshold, Acc rdrop) {
  Pair<Acc> r = {0, 0, 0, 0};
  const bool has_mask = p.mask.ndim > 0, bool_mask = has_mask && p.mask.dtype == AB_DTYPE_BOOL;
  const int64_t moff = has_mask ? b * p.mask.strides[0] + h * p.mask.strides[1] + i * p.mask.strides[2] +
                                      j * p.mask.strides[3]
                                : 0;
  if (bool_mask && load_scalar(p.mask.data, p.mask.dtype, moff) == 0) return r;
  Acc x = 0;
  for (int64_t d = 0; d < p.D; ++d) x += qr[d] * kr[d];
  x *= (Acc)p.scale;
  if (p.softcap > 0) {
    r.th = (Acc)tanh((double)x / p.softcap);
    x = (Acc)p.softcap * r.th;
  }
  if (has_mask && !bool_mask) x += (Acc)load_scalar(p.mask.data, p.mask.dtype, moff);
  r.p = (Acc)exp((double)(x - lse_i)) * inv_z;
  Acc dp = 0;
  for (int64_t d = 0; d < p.Dv; ++d) dp += dor[d] * vr[d];
  const bool keep = !(p.dropout_p > 0) ||
                    ab_dropout_keep(seed, offset, (uint64_t)((b * p.Hq + h) * p.Sq + i), (uint64_t)j, threshold);
  r.dp = keep ? dp * rdrop : (Acc)0;
  r.pd = keep ? r.p * rdrop : (Acc)0;
  return r;
}

// dx * scale for a pair, given delta_i; 0 for hidden or underflowed keys.
template <typename Acc>
__device__ __forceinline__ Acc grad_score(const ab_attn_params& p, const Pair<Acc>& r, Acc delta, Acc* ds_out) {
  Acc dx = r.p * (r.dp - delta);
  if (ds_out) *ds_out = dx;
  if (p.softcap > 0) dx *= (Acc)1 - r.th * r.th;
  return r.p == 0 ? (Acc)0 : dx * (Acc)p.scale;
}

template <typename Acc> __device__ __forceinline__ void store_scalar(const ab_tensor& t, int64_t off, Acc v) {
  if (t.dtype == AB_DTYPE_F64)
    static_cast<double*>(t.data)[off] = (double)v;
  else
    static_cast<float*>(t.data)[off] = (float)v;
}

template <typename Acc> __device__ Acc block_sum(Acc v, Acc* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  Acc s = 0;
  for (int w = 0; w < kThreads / 32; ++w) s += red[w];  // the same order in every thread
  __syncthreads();
  return s;
}

// minBlocksPerSM = 1: without it ptxas for sm_90a held these kernels to 32 registers and spilled.
template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(const BwdArgs args) {
  const ab_attn_params& p = args.p;
  extern __shared__ unsigned char smem_raw[];
  Acc* qrow = reinterpret_cast<Acc*>(smem_raw);  // (D)
  Acc* dorow = qrow + p.D;                        // (Dv)
  Acc* dqrow = dorow + p.Dv;                      // (D)
  Acc* dsc = dqrow + p.D;                         // (kThreads): dx * scale of a chunk of keys
  Acc* red = dsc + kThreads;                      // (kThreads / 32)
  Acc* delta_ws = static_cast<Acc*>(args.delta);
  Acc* inv_ws = delta_ws + p.B * p.Hq * p.Sq;

  const T* qd = static_cast<const T*>(p.q.data);
  const T* kd = static_cast<const T*>(p.k.data);
  const T* vd = static_cast<const T*>(p.v.data);
  const T* dod = static_cast<const T*>(p.dout.data);
  const int64_t group = p.Hq / p.Hkv, rows = p.B * p.Hq * p.Sq;
  const uint32_t threshold = ab_dropout_threshold(p.dropout_p);
  const Acc rdrop = (Acc)(1.0 / (1.0 - p.dropout_p));
  uint64_t seed, offset;
  ab_cuda_rng(p, seed, offset);
  const bool want_dmask = p.dmask.ndim > 0;
  const int tid = threadIdx.x;

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t i = row % p.Sq, bh = row / p.Sq, h = bh % p.Hq, b = bh / p.Hq, hk = h / group;
    int64_t lo, hi;
    key_range(p, i, lo, hi);
    const Acc lse_i = (Acc)load_scalar(p.lse.data, p.lse.dtype,
                                       b * p.lse.strides[0] + h * p.lse.strides[1] + i * p.lse.strides[2]);
    if (lse_i == (Acc)-INFINITY) hi = lo;  // no visible key: zero gradient
    const Acc dlse_i = p.dlse.ndim ? (Acc)load_scalar(p.dlse.data, p.dlse.dtype,
                                                      b * p.dlse.strides[0] + h * p.dlse.strides[1] +
                                                          i * p.dlse.strides[2])
                                   : (Acc)0;
    const int64_t qoff = b * p.q.strides[0] + h * p.q.strides[1] + i * p.q.strides[2];
    const int64_t dooff = b * p.dout.strides[0] + h * p.dout.strides[1] + i * p.dout.strides[2];
    for (int64_t d = tid; d < p.D; d += kThreads) {
      qrow[d] = load_acc<T, Acc>(qd, qoff + d * p.q.strides[3]);
      dqrow[d] = 0;
    }
    for (int64_t d = tid; d < p.Dv; d += kThreads) dorow[d] = load_acc<T, Acc>(dod, dooff + d * p.dout.strides[3]);
    __syncthreads();

    const int64_t kbase = b * p.k.strides[0] + hk * p.k.strides[1];
    const int64_t vbase = b * p.v.strides[0] + hk * p.v.strides[1];
    const Row<T, Acc> qr = {qrow, nullptr, 0, 0}, dor = {dorow, nullptr, 0, 0};
    auto at = [&](int64_t j, Acc inv_z) {
      const Row<T, Acc> kr = {nullptr, kd, kbase + j * p.k.strides[2], p.k.strides[3]};
      const Row<T, Acc> vr = {nullptr, vd, vbase + j * p.v.strides[2], p.v.strides[3]};
      return pair<T, Acc>(p, b, h, i, j, lse_i, inv_z, qr, kr, dor, vr, seed, offset, threshold, rdrop);
    };

    // Pass 1: Z_i = sum_j exp(x_j - lse_i) and delta_i = sum_j p_j dP_j / Z_i - dlse_i.
    Acc part = 0, zpart = 0;
    for (int64_t j = lo + tid; j < hi; j += kThreads) {
      const Pair<Acc> r = at(j, (Acc)1);
      part += r.p * r.dp;
      zpart += r.p;
    }
    const Acc pdp = block_sum<Acc>(part, red), z = block_sum<Acc>(zpart, red);
    const Acc inv_z = z > 0 ? (Acc)1 / z : (Acc)0;
    const Acc delta = pdp * inv_z - dlse_i;
    if (tid == 0) {
      delta_ws[row] = delta;
      inv_ws[row] = inv_z;
    }

    // Pass 2: dS, the mask's gradient, and dq_i += dx_j k_j a chunk of keys at a time.
    const int64_t mbase = want_dmask ? b * p.dmask.strides[0] + h * p.dmask.strides[1] + i * p.dmask.strides[2] : 0;
    for (int64_t c = lo; c < hi; c += kThreads) {
      const int64_t j = c + tid;
      Acc ds = 0;
      if (j < hi) {
        Acc dS;
        ds = grad_score<Acc>(p, at(j, inv_z), delta, &dS);
        if (want_dmask) store_scalar<Acc>(p.dmask, mbase + j * p.dmask.strides[3], dS);
      }
      dsc[tid] = ds;
      __syncthreads();
      const int64_t n = hi - c < kThreads ? hi - c : kThreads;
      accum_rows<T, Acc>(dqrow, p.D, dsc, n, kd, kbase, c, p.k.strides[2], p.k.strides[3], tid);
      __syncthreads();
    }
    if (want_dmask)
      for (int64_t j = tid; j < p.Sk; j += kThreads)
        if (j < lo || j >= hi) store_scalar<Acc>(p.dmask, mbase + j * p.dmask.strides[3], (Acc)0);

    T* dqd = static_cast<T*>(p.dq.data);
    const int64_t dqoff = b * p.dq.strides[0] + h * p.dq.strides[1] + i * p.dq.strides[2];
    for (int64_t d = tid; d < p.D; d += kThreads) store_acc<T, Acc>(dqd, dqoff + d * p.dq.strides[3], dqrow[d]);
    __syncthreads();  // the rows in shared memory are reused by the next row
  }
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads, 1) dkv_kernel(const BwdArgs args) {
  const ab_attn_params& p = args.p;
  extern __shared__ unsigned char smem_raw[];
  Acc* krow = reinterpret_cast<Acc*>(smem_raw);  // (D)
  Acc* vrow = krow + p.D;                         // (Dv)
  Acc* dkrow = vrow + p.Dv;                       // (D)
  Acc* dvrow = dkrow + p.D;                       // (Dv)
  Acc* pdc = dvrow + p.Dv;                        // (kThreads): p' of a chunk of query rows
  Acc* dsc = pdc + kThreads;                      // (kThreads): dx * scale
  const Acc* delta_ws = static_cast<const Acc*>(args.delta);
  const Acc* inv_ws = delta_ws + p.B * p.Hq * p.Sq;

  const T* qd = static_cast<const T*>(p.q.data);
  const T* kd = static_cast<const T*>(p.k.data);
  const T* vd = static_cast<const T*>(p.v.data);
  const T* dod = static_cast<const T*>(p.dout.data);
  const int64_t group = p.Hq / p.Hkv, keys = p.B * p.Hkv * p.Sk;
  const uint32_t threshold = ab_dropout_threshold(p.dropout_p);
  const Acc rdrop = (Acc)(1.0 / (1.0 - p.dropout_p));
  uint64_t seed, offset;
  ab_cuda_rng(p, seed, offset);
  const int tid = threadIdx.x;

  for (int64_t key = blockIdx.x; key < keys; key += gridDim.x) {
    const int64_t j = key % p.Sk, bk = key / p.Sk, hk = bk % p.Hkv, b = bk / p.Hkv;
    const int64_t koff = b * p.k.strides[0] + hk * p.k.strides[1] + j * p.k.strides[2];
    const int64_t voff = b * p.v.strides[0] + hk * p.v.strides[1] + j * p.v.strides[2];
    for (int64_t d = tid; d < p.D; d += kThreads) {
      krow[d] = load_acc<T, Acc>(kd, koff + d * p.k.strides[3]);
      dkrow[d] = 0;
    }
    for (int64_t d = tid; d < p.Dv; d += kThreads) {
      vrow[d] = load_acc<T, Acc>(vd, voff + d * p.v.strides[3]);
      dvrow[d] = 0;
    }
    __syncthreads();

    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const int64_t qbase = b * p.q.strides[0] + h * p.q.strides[1];
      const int64_t dobase = b * p.dout.strides[0] + h * p.dout.strides[1];
      for (int64_t c = 0; c < p.Sq; c += kThreads) {
        const int64_t i = c + tid;
        Acc pd = 0, ds = 0;
        if (i < p.Sq) {
          int64_t lo, hi;
          key_range(p, i, lo, hi);
          const Acc lse_i = (Acc)load_scalar(p.lse.data, p.lse.dtype,
                                             b * p.lse.strides[0] + h * p.lse.strides[1] + i * p.lse.strides[2]);
          if (j >= lo && j < hi && lse_i != (Acc)-INFINITY) {
            const Row<T, Acc> qr = {nullptr, qd, qbase + i * p.q.strides[2], p.q.strides[3]};
            const Row<T, Acc> dor = {nullptr, dod, dobase + i * p.dout.strides[2], p.dout.strides[3]};
            const Row<T, Acc> kr = {krow, nullptr, 0, 0}, vr = {vrow, nullptr, 0, 0};
            const int64_t row = (b * p.Hq + h) * p.Sq + i;
            const Pair<Acc> r =
                pair<T, Acc>(p, b, h, i, j, lse_i, inv_ws[row], qr, kr, dor, vr, seed, offset, threshold, rdrop);
            pd = r.pd;
            ds = grad_score<Acc>(p, r, delta_ws[row], nullptr);
          }
        }
        pdc[tid] = pd;
        dsc[tid] = ds;
        __syncthreads();
        const int64_t n = p.Sq - c < kThreads ? p.Sq - c : kThreads;
        accum_rows<T, Acc>(dvrow, p.Dv, pdc, n, dod, dobase, c, p.dout.strides[2], p.dout.strides[3], tid);
        accum_rows<T, Acc>(dkrow, p.D, dsc, n, qd, qbase, c, p.q.strides[2], p.q.strides[3], tid);
        __syncthreads();
      }
    }

    T* dkd = static_cast<T*>(p.dk.data);
    T* dvd = static_cast<T*>(p.dv.data);
    const int64_t dkoff = b * p.dk.strides[0] + hk * p.dk.strides[1] + j * p.dk.strides[2];
    const int64_t dvoff = b * p.dv.strides[0] + hk * p.dv.strides[1] + j * p.dv.strides[2];
    for (int64_t d = tid; d < p.D; d += kThreads) store_acc<T, Acc>(dkd, dkoff + d * p.dk.strides[3], dkrow[d]);
    for (int64_t d = tid; d < p.Dv; d += kThreads) store_acc<T, Acc>(dvd, dvoff + d * p.dv.strides[3], dvrow[d]);
    __syncthreads();
  }
}

constexpr int64_t kMaxGrid = 1 << 20;  // grid-stride beyond this

template <typename T, typename Acc>
ab_status launch(const ab_attn_params* p, void* workspace, cudaStream_t stream, ab_error* err) {
  BwdArgs args;
  args.p = *p;
  args.delta = workspace;
  const size_t smem_dq = sizeof(Acc) * (size_t)(2 * p->D + p->Dv + kThreads + kThreads / 32);
  const size_t smem_dkv = sizeof(Acc) * (size_t)(2 * p->D + 2 * p->Dv + 2 * kThreads);
  if (smem_dq > 48 * 1024 || smem_dkv > 48 * 1024)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "math backward on CUDA: head dims too large (D=%lld Dv=%lld)",
                        (long long)p->D, (long long)p->Dv);
  const int64_t rows = p->B * p->Hq * p->Sq, keys = p->B * p->Hkv * p->Sk;
  if (rows > 0) {
    AB_LAUNCH((unsigned)(rows < kMaxGrid ? rows : kMaxGrid), kThreads, smem_dq, stream, dq_kernel<T, Acc>)(args);
    ab_status st = ab_cuda_check(cudaGetLastError(), "math_bwd dq launch", err);
    if (st != AB_OK) return st;
  }
  if (keys > 0) {
    AB_LAUNCH((unsigned)(keys < kMaxGrid ? keys : kMaxGrid), kThreads, smem_dkv, stream, dkv_kernel<T, Acc>)(args);
    return ab_cuda_check(cudaGetLastError(), "math_bwd dkv launch", err);
  }
  return AB_OK;
}

size_t acc_size(const ab_attn_params* p) { return p->q.dtype == AB_DTYPE_F64 ? sizeof(double) : sizeof(float); }

}  // namespace

extern "C" size_t ab_cuda_math_bwd_workspace(const ab_attn_params* p) {
  return (size_t)(2 * p->B * p->Hq * p->Sq) * acc_size(p);
}

extern "C" ab_status ab_cuda_math_bwd(const ab_attn_params* p, void* workspace, size_t workspace_bytes,
                                      void* stream, ab_error* err) {
  if (p->cu_seqlens_q)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "math takes dense calls (pad packed sequences first)");
  ab_status st = ab_attn_params_check(p, 1, err);
  if (st != AB_OK) return st;
  if (workspace_bytes < ab_cuda_math_bwd_workspace(p))
    return ab_error_set(err, AB_ERR_INVALID, "math backward on CUDA: workspace of %zu bytes, needs %zu",
                        workspace_bytes, ab_cuda_math_bwd_workspace(p));
  if (p->B == 0 || p->Hq == 0 || (p->Sq == 0 && p->Sk == 0)) return AB_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->q.dtype) {
    case AB_DTYPE_F32: return launch<float, float>(p, workspace, s, err);
    case AB_DTYPE_F16: return launch<__half, float>(p, workspace, s, err);
    case AB_DTYPE_BF16: return launch<__nv_bfloat16, float>(p, workspace, s, err);
    case AB_DTYPE_F64: return launch<double, double>(p, workspace, s, err);
    default: return ab_error_set(err, AB_ERR_INVALID, "math backward on CUDA: unsupported dtype");
  }
}
