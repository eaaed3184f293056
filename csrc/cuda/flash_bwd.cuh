// flash_bwd.cuh -- what the flash backward's launcher (flash_bwd.cu) and its per-head-dim kernel
// instantiations (flash_bwd_hdim*.cu) share: the parameter struct, the tile sizes and the
// declaration of the per-(dtype, head dim) launch function.  The kernels are in
// flash_bwd_kernel.cuh.
#ifndef AB_FLASH_BWD_CUH
#define AB_FLASH_BWD_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "flash_fwd.cuh"

namespace ab_flash {

// The forward's parameters (q, k, v, out, lse, lengths, masking, softcap and dropout options, filled
// by the same ab_flash::prepare) plus what only the backward reads and writes.  Strides in
// elements, with the forward's dense/packed convention (packed: *_bs = 0, rows are cu_q[b] + i).
struct BwdParams {
  FwdParams f;
  const void* dout;  // like out
  int64_t do_bs, do_hs, do_rs;
  void* dq;          // like q, q's dtype
  void* dk;          // like k
  void* dv;          // like v
  int64_t dq_bs, dq_hs, dq_rs;
  int64_t dk_bs, dk_hs, dk_rs;
  int64_t dv_bs, dv_hs, dv_rs;
  const float* dlse;  // the lse's gradient (like lse), or NULL
  int64_t dl_bs, dl_hs, dl_rs;
  // workspace (float32, from torch's allocator): delta_i (sum_j P'_ij dP_ij / Z_i, or dout_i . out_i,
  // minus dlse_i) per query row,
  // laid out like lse; dq_accum (rows like delta, D columns) on the atomic path, else NULL
  float* delta;
  int64_t de_bs, de_hs, de_rs;
  float* dq_accum;
  int64_t a_bs, a_hs, a_rs;
  int n_blocks;  // key tiles per (batch, KV head): ceil(Sk / kBwdBN)
  float scale;   // the softmax scale (natural units): dq = scale dS K, dk = scale dS^T Q
};

// One tile size for every head dim: 64 query rows x 64 keys, 8 warps.  Shared memory holds the Q,
// dO, K and V tiles (rows padded by 8 elements, as the forward's) and P', dS (64 x 72) in 16 bits:
//   kD    64: 54 KiB   128: 87 KiB   192: 119 KiB   256: 151 KiB
// so kD = 192 and 256 need sm_80 or sm_90 (sm_86 and sm_89 allow 99 KiB per block; the launcher
// refuses with AB_ERR_UNSUPPORTED there).  Registers: dK and dV accumulators are kD / 2 floats per
// thread (each warp owns 16 keys x kD / 2 columns of both).
constexpr int kBwdThreads = 256;
constexpr int kBwdBM = 64;  // query rows per tile
constexpr int kBwdBN = 64;  // keys per tile
constexpr int kBwdHeadDims[] = {64, 128, 192, 256};

constexpr size_t bwd_smem_bytes(int kD) {
  return (size_t)(2 * kBwdBM + 2 * kBwdBN) * (size_t)(kD + kSmemPad) * 2 +
         (size_t)2 * kBwdBM * (kBwdBN + kSmemPad) * 2 + (size_t)2 * kBwdBM * sizeof(float);
}

// Launches the delta kernel (row_blocks = m_blocks * Hq * B thread blocks, or 0 where the caller
// filled delta from dout . out), the dK/dV kernel
// (dkv_blocks = n_blocks * Hkv * B; with dq_accum set it also adds dQ with float32 atomics) and,
// when dq_blocks > 0, the deterministic dQ kernel (dq_blocks = m_blocks * Hq * B).  Defined in
// flash_bwd_kernel.cuh, instantiated in flash_bwd_hdim*.cu.
template <typename T, int kD>
ab_status bwd_launch(const BwdParams& p, int64_t row_blocks, int64_t dkv_blocks, int64_t dq_blocks,
                     cudaStream_t stream, ab_error* err);

}  // namespace ab_flash

#endif  // AB_FLASH_BWD_CUH
