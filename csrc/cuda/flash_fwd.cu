// flash_fwd.cu -- the flash forward on CUDA (FlashAttention-2 algorithm): the launcher.
//
// UNVERIFIED: compiled for sm_80 and sm_90a with nvcc 13.0 on 2026-11-21, never run (the machine
// it was written on has no GPU).  Check it against the math kernel before trusting a number.
//
// What it does: checks the call, rounds the head dim up to an instantiated size, fills the
// kernel's FwdParams (flash_fwd.cuh) for dense or packed (varlen) operands (ab_flash::prepare, the
// one preparation path that the backward's and sage's launchers share) and launches one thread block per (query tile, head, batch).
// The kernel is in flash_fwd_kernel.cuh, its instantiations in flash_fwd_hdim*.cu, the tile table
// in flash_fwd.cuh.
//
// Served: float16 and bfloat16; D and Dv multiples of 8 up to 256; causal (top-left and
// bottom-right), window, softcap, dropout, GQA/MQA, lse, attention sinks (float32) and ALiBi; any
// strides whose last dimension is
// contiguous and whose other strides (and data pointers) keep rows 16-byte aligned.  Not served
// (AB_ERR_UNSUPPORTED, so the caller can fall back): float32/float64, attn_mask, other strides.
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "ab_cuda_internal.h"
#include "ab_cuda_limits.h"
#include "flash_fwd.cuh"
#include "../ab_philox.h"

// ab_cuda_limits.h states this tile table (flash_fwd.cuh) for the planner: the build fails when the two
// differ.  Its shared memory is the config without dropout, the larger one (kBMDropout <= kBM).
namespace {
constexpr ab_cuda_config kFwdConfigs[] = {AB_CUDA_FLASH_FWD_CONFIGS};
template <int I> constexpr bool fwd_config_matches() {
  constexpr int kD = ab_flash::kFwdHeadDims[I];
  using Tile = ab_flash::FwdTile<kD>;
  return kFwdConfigs[I].head_dim == kD && Tile::kBMDropout <= Tile::kBM &&
         kFwdConfigs[I].smem == (int)ab_flash::fwd_smem_bytes(kD, Tile::kBM, Tile::kBN);
}
static_assert(sizeof kFwdConfigs / sizeof kFwdConfigs[0] == sizeof ab_flash::kFwdHeadDims / sizeof(int) &&
                  fwd_config_matches<0>() && fwd_config_matches<1>() && fwd_config_matches<2>() &&
                  fwd_config_matches<3>() && fwd_config_matches<4>() && fwd_config_matches<5>() &&
                  fwd_config_matches<6>() && fwd_config_matches<7>(),
              "ab_cuda_limits.h: AB_CUDA_FLASH_FWD_CONFIGS differs from flash_fwd.cuh's tile table");
}  // namespace

namespace ab_flash {

int64_t eff_stride(const ab_tensor& t, int dim) { return t.sizes[dim] <= 1 ? 0 : t.strides[dim]; }

ab_status check_layout(const ab_tensor& t, const char* who, const char* name, ab_error* err) {
  // no element, nothing read or written: any strides (torch's contiguous() keeps an empty view's)
  for (int d = 0; d < t.ndim; ++d)
    if (t.sizes[d] == 0) return AB_OK;
  const int last = t.ndim - 1;
  if (t.sizes[last] > 1 && t.strides[last] != 1)
    return ab_error_set(err, AB_ERR_UNSUPPORTED,
                        "%s on CUDA needs %s's last dim contiguous (stride 1), got stride %lld", who, name,
                        (long long)t.strides[last]);
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s on CUDA needs %s's data 16-byte aligned", who, name);
  for (int d = 0; d < last; ++d)
    if (eff_stride(t, d) % 8 != 0)
      return ab_error_set(err, AB_ERR_UNSUPPORTED,
                          "%s on CUDA needs %s's strides to be multiples of 8 elements, got %lld in dim %d",
                          who, name, (long long)t.strides[d], d);
  return AB_OK;
}

namespace {

// Longest sequence the kernel indexes with 32-bit row numbers (with room for a tile past the end).
constexpr int64_t kMaxSeqLen = (int64_t)1 << 30;

int64_t clamp_window(int64_t w, int64_t Sq, int64_t Sk) {
  // A window wider than Sq + Sk hides nothing, so it is unbounded; this keeps i' +- w in range.
  return w < 0 || w > Sq + Sk ? -1 : w;
}

}  // namespace

ab_status prepare(const ab_attn_params* p, const Serves& serves, const int32_t* cu_q_dev, const int32_t* cu_k_dev,
                  FwdParams& fp, bool* empty, ab_error* err) {
  const char* who = serves.who;
  *empty = false;
  ab_status st = ab_attn_params_check(p, serves.backward, err);
  if (st != AB_OK) return st;
  if (p->q.device != AB_DEVICE_CUDA)
    return ab_error_set(err, AB_ERR_INVALID, "%s CUDA kernel called with non-CUDA tensors", who);
  if (p->q.dtype != AB_DTYPE_F16 && p->q.dtype != AB_DTYPE_BF16)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s on CUDA takes float16 or bfloat16, got %s", who,
                        ab_dtype_name(p->q.dtype));
  if (p->mask.ndim) return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s on CUDA takes no attn_mask", who);
  if (p->dropout_p > 0 && !serves.dropout)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s on CUDA has no dropout (dropout_p = %g)", who, p->dropout_p);
  if ((p->sinks.ndim || p->alibi.ndim) && !serves.sinks_alibi)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s on CUDA takes no %s", who,
                        p->sinks.ndim ? "sinks" : "alibi_slopes");
  if (p->sinks.ndim && (p->sinks.dtype != AB_DTYPE_F32 || (p->sinks.sizes[0] > 1 && p->sinks.strides[0] != 1)))
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s on CUDA takes contiguous float32 sinks, got %s", who,
                        ab_dtype_name(p->sinks.dtype));
  const bool packed = p->cu_seqlens_q != nullptr;
  if (packed && (cu_q_dev == nullptr || cu_k_dev == nullptr))
    return ab_error_set(err, AB_ERR_INVALID, "%s on CUDA: packed call without device cu_seqlens", who);
  // the head-dim rule the planner applies too (ab_cuda_limits.h); the shared memory is checked at
  // launch, against the device (prepare_smem)
  const ab_cuda_family family = serves.backward ? AB_CUDA_FLASH_BWD : serves.dropout ? AB_CUDA_FLASH_FWD
                                                                                     : AB_CUDA_SAGE_FWD;
  char why[192];
  if (ab_cuda_kernel_why_not(family, p->D, p->Dv, 0, why, sizeof why) || p->D > serves.max_head_dim ||
      p->Dv > serves.max_head_dim)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s", why[0] ? why : "head dim beyond this kernel's table");
  if (p->Sq > kMaxSeqLen || p->Sk > kMaxSeqLen)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s on CUDA takes sequences up to 2^30 rows", who);
  if (p->B == 0 || p->Hq == 0 || (p->Sq == 0 && !serves.backward)) {
    *empty = true;  // the layout of empty tensors does not matter
    return AB_OK;
  }
  if ((st = check_layout(p->q, who, "q", err)) != AB_OK) return st;
  if ((st = check_layout(p->k, who, "k", err)) != AB_OK) return st;
  if ((st = check_layout(p->v, who, "v", err)) != AB_OK) return st;
  if ((st = check_layout(p->out, who, "out", err)) != AB_OK) return st;

  fp = FwdParams{};
  fp.q = p->q.data;
  fp.k = p->k.data;
  fp.v = p->v.data;
  fp.out = p->out.data;
  fp.lse = static_cast<float*>(p->lse.data);
  if (packed) {  // q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), out (Tq, Hq, Dv), lse (Hq, Tq)
    fp.q_bs = 0, fp.q_hs = eff_stride(p->q, 1), fp.q_rs = eff_stride(p->q, 0);
    fp.k_bs = 0, fp.k_hs = eff_stride(p->k, 1), fp.k_rs = eff_stride(p->k, 0);
    fp.v_bs = 0, fp.v_hs = eff_stride(p->v, 1), fp.v_rs = eff_stride(p->v, 0);
    fp.o_bs = 0, fp.o_hs = eff_stride(p->out, 1), fp.o_rs = eff_stride(p->out, 0);
    fp.l_bs = 0, fp.l_hs = eff_stride(p->lse, 0), fp.l_rs = eff_stride(p->lse, 1);
    fp.cu_q = cu_q_dev;
    fp.cu_k = cu_k_dev;
  } else {  // q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), out (B, Hq, Sq, Dv), lse (B, Hq, Sq)
    fp.q_bs = eff_stride(p->q, 0), fp.q_hs = eff_stride(p->q, 1), fp.q_rs = eff_stride(p->q, 2);
    fp.k_bs = eff_stride(p->k, 0), fp.k_hs = eff_stride(p->k, 1), fp.k_rs = eff_stride(p->k, 2);
    fp.v_bs = eff_stride(p->v, 0), fp.v_hs = eff_stride(p->v, 1), fp.v_rs = eff_stride(p->v, 2);
    fp.o_bs = eff_stride(p->out, 0), fp.o_hs = eff_stride(p->out, 1), fp.o_rs = eff_stride(p->out, 2);
    fp.l_bs = eff_stride(p->lse, 0), fp.l_hs = eff_stride(p->lse, 1), fp.l_rs = eff_stride(p->lse, 2);
    fp.cu_q = nullptr;
    fp.cu_k = nullptr;
  }
  fp.Sq = (int)p->Sq;
  fp.Sk = (int)p->Sk;
  fp.Hq = (int)p->Hq;
  fp.group = (int)(p->Hq / p->Hkv);
  fp.D = (int)p->D;
  fp.Dv = (int)p->Dv;
  fp.causal = (int)p->causal;
  fp.window_left = clamp_window(p->window_left, p->Sq, p->Sk);
  fp.window_right = clamp_window(p->window_right, p->Sq, p->Sk);
  const double log2e = 1.4426950408889634;
  fp.scale_log2 = (float)(p->scale * log2e);
  fp.softcap = (float)p->softcap;
  fp.softcap_in = p->softcap > 0 ? (float)(2.0 * log2e * p->scale / p->softcap) : 0.0f;
  fp.softcap_log2 = (float)(p->softcap * log2e);
  fp.dropout = p->dropout_p > 0;
  fp.drop_threshold = ab_dropout_threshold(p->dropout_p);
  fp.rdrop = (float)(1.0 / (1.0 - p->dropout_p));
  fp.seed = p->seed;
  fp.offset = p->offset;
  fp.rng_dev = p->rng_dev;
  fp.sinks = p->sinks.ndim ? static_cast<const float*>(p->sinks.data) : nullptr;
  fp.alibi = p->alibi.ndim ? static_cast<const float*>(p->alibi.data) : nullptr;
  fp.alibi_bs = p->alibi.ndim == 2 ? p->alibi.strides[0] : 0;
  fp.alibi_hs = p->alibi.ndim ? p->alibi.strides[p->alibi.ndim - 1] : 0;
  return AB_OK;
}

}  // namespace ab_flash

namespace {

using ab_flash::FwdParams;
using ab_flash::FwdTile;

template <typename T, int kD>
ab_status run(FwdParams& fp, const ab_attn_params* p, cudaStream_t stream, ab_error* err) {
  constexpr int kBM = FwdTile<kD>::kBM, kBMDropout = FwdTile<kD>::kBMDropout;
  const int bm = fp.dropout ? kBMDropout : kBM;
  fp.m_blocks = (int)((p->Sq + bm - 1) / bm);
  const int64_t blocks = (int64_t)fp.m_blocks * p->Hq * p->B;
  if (blocks > INT32_MAX)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "flash on CUDA: %lld thread blocks exceed the grid limit",
                        (long long)blocks);
  return ab_flash::fwd_launch<T, kD>(fp, blocks, stream, err);
}

template <typename T>
ab_status dispatch(int kD, FwdParams& fp, const ab_attn_params* p, cudaStream_t stream, ab_error* err) {
  switch (kD) {
    case 32: return run<T, 32>(fp, p, stream, err);
    case 64: return run<T, 64>(fp, p, stream, err);
    case 96: return run<T, 96>(fp, p, stream, err);
    case 128: return run<T, 128>(fp, p, stream, err);
    case 160: return run<T, 160>(fp, p, stream, err);
    case 192: return run<T, 192>(fp, p, stream, err);
    case 224: return run<T, 224>(fp, p, stream, err);
    case 256: return run<T, 256>(fp, p, stream, err);
    default: return ab_error_set(err, AB_ERR_UNSUPPORTED, "flash on CUDA: no kernel for head dim %d", kD);
  }
}

}  // namespace

extern "C" ab_status ab_cuda_flash_fwd(const ab_attn_params* p, const int32_t* cu_seqlens_q_dev,
                                       const int32_t* cu_seqlens_k_dev, void* stream, ab_error* err) {
  FwdParams fp;
  bool empty = false;
  const ab_flash::Serves serves = {"flash", 256, true, 0, true};
  ab_status st = ab_flash::prepare(p, serves, cu_seqlens_q_dev, cu_seqlens_k_dev, fp, &empty, err);
  if (st != AB_OK || empty) return st;
  const int kD = ab_flash::padded_head_dim(ab_flash::kFwdHeadDims, p->D, p->Dv);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p->q.dtype == AB_DTYPE_F16) return dispatch<__half>(kD, fp, p, s, err);
  return dispatch<__nv_bfloat16>(kD, fp, p, s, err);
}
