// flash_fwd.cuh -- what the flash forward's launcher (flash_fwd.cu) and its per-head-dim kernel
// instantiations (flash_fwd_hdim*.cu) share: the kernel's parameter struct, the tile table and
// the declaration of the per-(dtype, head dim) launch function.  FwdParams and its preparation
// (ab_flash::prepare) are also what the flash backward (flash_bwd.cuh) and the sage forward
// (sage_fwd.cuh) build their parameters on.
//
// The kernel itself is in flash_fwd_kernel.cuh; only the flash_fwd_hdim*.cu files include it, so
// editing the launcher does not recompile the kernels.
#ifndef AB_FLASH_FWD_CUH
#define AB_FLASH_FWD_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "ab_cuda_internal.h"

namespace ab_flash {

// Everything the kernel reads, filled once by the launcher (flash_fwd.cu) and passed by value.
// Strides are in elements.  Dense and packed calls share one layout of this struct:
//   dense:  row i of (b, h) of q is at  b * q_bs + h * q_hs + i * q_rs
//   packed: row i of sequence b, head h at  h * q_hs + (cu_q[b] + i) * q_rs  (q_bs = 0)
// and the same for k, v, out and lse (lse's "row" is the query position).
struct FwdParams {
  const void* q;  // (B, Hq, Sq, D) or (Tq, Hq, D)
  const void* k;  // (B, Hkv, Sk, D) or (Tk, Hkv, D)
  const void* v;  // (B, Hkv, Sk, Dv) or (Tk, Hkv, Dv)
  void* out;      // (B, Hq, Sq, Dv) or (Tq, Hq, Dv), q's dtype
  float* lse;     // (B, Hq, Sq) or (Hq, Tq), float32
  int64_t q_bs, q_hs, q_rs;
  int64_t k_bs, k_hs, k_rs;
  int64_t v_bs, v_hs, v_rs;
  int64_t o_bs, o_hs, o_rs;
  int64_t l_bs, l_hs, l_rs;
  const int32_t* cu_q;  // (B + 1,) device; NULL for dense calls
  const int32_t* cu_k;
  int Sq, Sk;           // dense lengths; packed: max_seqlen_q / max_seqlen_k
  int Hq, group;        // group = Hq / Hkv: query head h reads KV head h / group
  int D, Dv;            // the real head dims (the kernel's kD is padded up to an instantiated size)
  int m_blocks;         // query tiles per (batch, head): ceil(Sq / kBM)
  int causal;           // ab_causal
  int64_t window_left, window_right;  // -1 = unbounded; clamped to <= Sq + Sk by the launcher
  float scale_log2;     // scale * log2(e): scores are kept in base-2 units so exp2 can be used
  float softcap;        // 0 = off
  float softcap_in;     // 2 log2(e) scale / softcap: 2^(softcap_in (q . k)) = exp(2 scale (q . k) / softcap)
  float softcap_log2;   // softcap * log2(e)
  // dropout (ab_philox.h): row index of query i of (b, h) is (b * Hq + h) * Sq + i, with Sq the
  // dense length or max_seqlen_q, as on the CPU, so a packed call and its padded dense twin agree
  int dropout;                // 0 = off
  uint32_t drop_threshold;    // ab_dropout_threshold(dropout_p)
  float rdrop;                // 1 / (1 - dropout_p)
  uint64_t seed, offset;      // the stream's key and offset, unless rng_dev is set
  const int64_t* rng_dev;     // [seed, offset] in device memory (drawn on the GPU), or NULL
  // attention sinks and ALiBi (docs/semantics.md; the backward reads them too): NULL when absent
  const float* sinks;         // (Hq,) float32, contiguous: one logit per query head in each row's denominator
  const float* alibi;         // slopes (Hq,) or (B, Hq) float32: slope of (b, h) at b * alibi_bs + h * alibi_hs
  int64_t alibi_bs, alibi_hs;
};

// Tile table: rows of Q (kBM) and of K/V (kBN) per thread block, by padded head dim.  One block
// is 4 warps; each warp owns kBM / 4 query rows (one or two m16 tiles).  Shared memory is
// (kBM + 2 * kBN) * (kD + 8) * 2 bytes (Q, one K and one V tile, each row padded by 8 elements):
//
//   kD    kBM  kBN   smem      registers per thread (accumulators, floats)
//   32    128   64   20 KiB    S  64 + O 32
//   64    128   64   36 KiB    S  64 + O 64
//   96    128   64   52 KiB    S  64 + O 96
//   128   128   64   68 KiB    S  64 + O 128
//   160    64   64   63 KiB    S  32 + O 80
//   192    64   64   75 KiB    S  32 + O 96
//   224    64   64   87 KiB    S  32 + O 112
//   256    64   64   99 KiB    S  32 + O 128
//
// Beyond kD = 128 a block keeps 64 query rows, since 128 rows would need kD floats of O per
// thread; 99 KiB (kD = 256) is exactly the opt-in limit of sm_86/sm_89 (sm_80 and sm_90 allow
// 163 and 227 KiB).  The launcher refuses a device whose limit is lower than a config needs.
//
// With dropout a second kernel runs (a template flag, so the kernel without it pays nothing): its
// Philox words and keep bits need registers the kD = 96 and 128 configs do not have, so it keeps
// 64 query rows per block at every head dim.
template <int kD> struct FwdTile {
  static constexpr int kBM = kD <= 128 ? 128 : 64;
  static constexpr int kBMDropout = 64;
  static constexpr int kBN = 64;
};
// ptxas (nvcc 13.0, sm_80) puts kD = 96 and 128 at 250-255 registers with no spill, the others
// at 165-240; kBN = 128 for kD = 32 spilled, hence 64 throughout.  `--resource-usage` shows it.

constexpr int kFwdThreads = 128;  // 4 warps
constexpr int kSmemPad = 8;       // elements of padding per shared-memory row (see the kernel)

constexpr size_t fwd_smem_bytes(int kD, int kBM, int kBN) {
  return (size_t)(kBM + 2 * kBN) * (size_t)(kD + kSmemPad) * 2;
}

// The padded head dims that have kernels; D and Dv are rounded up to the next one.
constexpr int kFwdHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};

// The stride of a dim of size <= 1 is never multiplied by a non-zero index: 0, so that an arbitrary
// stride there (torch allows any) does not fail the alignment check.
int64_t eff_stride(const ab_tensor& t, int dim);
// Rows of `t` must be 16-byte chunks the kernels can cp.async: contiguous last dim, 16-byte
// aligned data, every other stride a multiple of 8 elements.  `who` names the backend in messages.
ab_status check_layout(const ab_tensor& t, const char* who, const char* name, ab_error* err);

// What a kernel family serves beyond the contract every CUDA tensor-core kernel shares (float16 or
// bfloat16, no attn_mask, D and Dv multiples of 8, sequences up to 2^30 rows, rows the kernels can
// cp.async).
struct Serves {
  const char* who;   // the backend's name in messages: "flash", "flash backward", "sage"
  int max_head_dim;  // D and Dv up to this
  bool dropout;      // dropout_p > 0 is served (flash); else AB_ERR_UNSUPPORTED (sage)
  int backward;      // 1: a backward call (ab_attn_params_check's flag; the caller then checks dout
                     // and the gradients' layout itself)
  bool sinks_alibi;  // attention sinks and ALiBi are served (flash forward and backward); else AB_ERR_UNSUPPORTED
};

// The one parameter-preparation path of the flash forward, the flash backward and the sage
// forward: checks the call against `serves` and fills fp for dense or packed operands (dropout
// fields included: off, rdrop = 1, when dropout_p is 0).  *empty is set, and fp left unfilled,
// when there is nothing to compute: B or Hq is 0, or (forward only) Sq is 0; a backward with Sq = 0
// still zeroes dk and dv.  fp.m_blocks is left to the caller (it depends on the tile).  Defined in
// flash_fwd.cu.
ab_status prepare(const ab_attn_params* p, const Serves& serves, const int32_t* cu_q_dev, const int32_t* cu_k_dev,
                  FwdParams& fp, bool* empty, ab_error* err);

// The padded head dim of a call: the first of `dims` (ascending) that holds max(D, Dv); 0 if none.
template <size_t N> int padded_head_dim(const int (&dims)[N], int64_t D, int64_t Dv) {
  const int64_t dmax = D > Dv ? D : Dv;
  for (int d : dims)
    if (d >= dmax) return d;
  return 0;
}

// Launches the forward kernel for dtype T (__half or __nv_bfloat16) and padded head dim kD on the
// current device.  Defined in flash_fwd_kernel.cuh, instantiated in flash_fwd_hdim*.cu.
template <typename T, int kD>
ab_status fwd_launch(const FwdParams& p, int64_t blocks, cudaStream_t stream, ab_error* err);

}  // namespace ab_flash

#endif  // AB_FLASH_FWD_CUH
