// sage_fwd.cu -- the sage forward on CUDA (INT8 Q.K^T, SageAttention recipe): the launcher.
//
// UNVERIFIED: compiled for sm_80 and sm_90a with nvcc 13.0, never run (the machine it was written
// on has no GPU).  tests/test_sage_cuda.py is the check to run on a GPU before trusting it.
//
// What it does: checks the call (the contract of the CUDA flash forward, shared through
// ab_flash::prepare), rounds the head dim up to an instantiated size, lays out the
// workspace, and launches the prepass and the kernel (sage_fwd_kernel.cuh, instantiated in
// sage_fwd_hdim*.cu).
//
// Served: float16 and bfloat16; D and Dv multiples of 8 up to 256 (padded to 64, 128 or 256);
// causal (top-left and bottom-right), window, softcap, GQA/MQA, lse; dense or packed.  Not served
// (AB_ERR_UNSUPPORTED): float32/float64, attn_mask, dropout, rows that are not 16-byte aligned.
//
// Workspace (the caller's, through torch's allocator; each part 256-byte aligned):
//   kq    (Hkv, Ktot, kD) int8     K smoothed and quantized, one row per key
//   ks    (Hkv, Ktot) float32      each key's int8 scale
//   mean  (B, Hkv, kD) float32     K's mean per channel over each sequence
//   cfac  (B, Hkv, kD) float32     the channel factor c
//   part  (B, Hkv, chunks, 3, kD)  the prepass's partial sums, maxima, minima
// Ktot = B * Sk dense, total_k packed; chunks = ceil(Sk / 256).  For B = 1, Hkv = 8, Sk = 16k,
// D = 128: 16 MiB + 0.5 MiB, about half of K's own size in bfloat16.
#include <cuda_runtime.h>
#include <stdint.h>

#include "ab_cuda_internal.h"
#include "ab_cuda_limits.h"
#include "sage_fwd.cuh"

namespace {

// ab_cuda_limits.h states this tile table (sage_fwd.cuh) for the planner: the build fails when the two
// differ.
constexpr ab_cuda_config kSageConfigs[] = {AB_CUDA_SAGE_FWD_CONFIGS};
template <int I> constexpr bool sage_config_matches() {
  constexpr int kD = ab_sage::kSageHeadDims[I];
  using Tile = ab_sage::SageTile<kD>;
  return kSageConfigs[I].head_dim == kD && kSageConfigs[I].smem == (int)ab_sage::sage_smem_bytes(kD, Tile::kBM, Tile::kBN);
}
static_assert(sizeof kSageConfigs / sizeof kSageConfigs[0] == sizeof ab_sage::kSageHeadDims / sizeof(int) &&
                  sage_config_matches<0>() && sage_config_matches<1>() && sage_config_matches<2>(),
              "ab_cuda_limits.h: AB_CUDA_SAGE_FWD_CONFIGS differs from sage_fwd.cuh's tile table");

using ab_sage::SageParams;

size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

struct Workspace {
  size_t kq, ks, mean, cfac, part, total;  // byte offsets, and the size
};

Workspace workspace_layout(int kD, int64_t B, int64_t Hkv, int64_t Ktot, int64_t chunks) {
  Workspace w;
  w.kq = 0;
  w.ks = w.kq + align256((size_t)(Hkv * Ktot * kD));
  w.mean = w.ks + align256(sizeof(float) * (size_t)(Hkv * Ktot));
  w.cfac = w.mean + align256(sizeof(float) * (size_t)(B * Hkv * kD));
  w.part = w.cfac + align256(sizeof(float) * (size_t)(B * Hkv * kD));
  w.total = w.part + align256(sizeof(float) * (size_t)(B * Hkv * chunks * 3 * kD));
  return w;
}

template <typename T>
ab_status dispatch(int kD, SageParams& sp, const ab_attn_params* p, cudaStream_t stream, ab_error* err) {
  switch (kD) {
    case 64: return ab_sage::sage_launch<T, 64>(sp, p, stream, err);
    case 128: return ab_sage::sage_launch<T, 128>(sp, p, stream, err);
    case 256: return ab_sage::sage_launch<T, 256>(sp, p, stream, err);
    default: return ab_error_set(err, AB_ERR_UNSUPPORTED, "sage on CUDA: no kernel for head dim %d", kD);
  }
}

}  // namespace

extern "C" ab_status ab_cuda_sage_fwd(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                                      const int32_t* cu_seqlens_k_dev, void* workspace, size_t* workspace_bytes,
                                      void* stream, ab_error* err) {
  SageParams sp = {};
  bool empty = false;
  // sage serves the flash forward's contract minus dropout, forward only, head dims up to 256
  const ab_flash::Serves serves = {"sage", 256, false, 0};
  ab_status st = ab_flash::prepare(p, serves, cu_seqlens_q_dev, cu_seqlens_k_dev, sp.f, &empty, err);
  if (st != AB_OK) return st;
  if (empty) {
    if (workspace == nullptr) *workspace_bytes = 0;
    return AB_OK;
  }
  const int kD = ab_flash::padded_head_dim(ab_sage::kSageHeadDims, p->D, p->Dv);
  const bool packed = p->cu_seqlens_q != nullptr;
  const int64_t Ktot = packed ? p->k.sizes[0] : p->B * p->Sk;
  const int64_t chunks = (p->Sk + ab_sage::kStatRows - 1) / ab_sage::kStatRows;
  const Workspace w = workspace_layout(kD, p->B, p->Hkv, Ktot, chunks);
  if (workspace == nullptr) {  // the size query
    *workspace_bytes = w.total;
    return AB_OK;
  }
  if (*workspace_bytes < w.total)
    return ab_error_set(err, AB_ERR_INVALID, "sage on CUDA: workspace of %zu bytes, needs %zu", *workspace_bytes,
                        w.total);
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return ab_error_set(err, AB_ERR_INVALID, "sage on CUDA: the workspace must be 256-byte aligned");

  char* base = static_cast<char*>(workspace);
  sp.kq = reinterpret_cast<int8_t*>(base + w.kq);
  sp.ks = reinterpret_cast<float*>(base + w.ks);
  sp.mean = reinterpret_cast<float*>(base + w.mean);
  sp.cfac = reinterpret_cast<float*>(base + w.cfac);
  sp.part = reinterpret_cast<float*>(base + w.part);
  sp.Ktot = Ktot;
  sp.Hkv = (int)p->Hkv;
  sp.chunks = (int)chunks;
  sp.softcap_in2 = p->softcap > 0 ? (float)(2.0 / p->softcap) : 0.0f;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p->q.dtype == AB_DTYPE_F16) return dispatch<__half>(kD, sp, p, s, err);
  return dispatch<__nv_bfloat16>(kD, sp, p, s, err);
}
