// sage_fwd.cuh -- what the sage forward's launcher (sage_fwd.cu) and its kernel instantiations
// (sage_fwd_hdim*.cu) share: the parameter struct, the tile table, the workspace layout and the
// warp-level row helpers the K prepass and the kernel's Q quantization both use.
//
// The recipe (docs/sage.md, "CUDA"): per (batch, KV head), K's mean over the sequence and a channel
// factor c = sqrt(max_j |K_jd - mean_d|) (1 where that is 0 or not finite); K' = (K - mean) / c and
// Q' = Q c (half of each K channel's range moves into Q; the scores are unchanged), both quantized
// to int8 per row (symmetric, round to nearest even, float32 scales); S = Q' K'^T in int32 with
// mma.sync m16n8k32, dequantized, plus scale * q . mean (what the smoothing took off each row);
// then the flash kernel's online softmax and P V in float16/bfloat16 with float32 accumulation.
#ifndef AB_SAGE_FWD_CUH
#define AB_SAGE_FWD_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "flash_fwd.cuh"

namespace ab_sage {

using ab_flash::FwdParams;

// Everything the prepass and the kernel read besides FwdParams (whose k is read by the prepass only).
// Key row j of sequence b, KV head hk is row hk * Ktot + krow0(b) + j of kq and ks, where krow0 is
// b * Sk (dense) or cu_k[b] (packed).
struct SageParams {
  FwdParams f;
  int8_t* kq;      // (Hkv, Ktot, kD) int8: (K - mean) / c, quantized per key; zero past D
  float* ks;       // (Hkv, Ktot) the int8 scale of each key row
  float* mean;     // (B, Hkv, kD) K's mean over the sequence, per channel (0 past D)
  float* cfac;     // (B, Hkv, kD) the channel factor c (1 past D)
  float* part;     // (B, Hkv, chunks, 3, kD) the prepass's partial sums, maxima and minima
  int64_t Ktot;    // B * Sk (dense) or total_k (packed)
  int Hkv;
  int chunks;      // ceil(Sk / kStatRows): stats blocks per (batch, KV head)
  float softcap_in2;  // 2 / softcap: tanh(x / softcap) from 2^(2 s / softcap), s = x log2(e)
};

// Tile table: rows of Q (kBM) and of K/V (kBN) per block of 4 warps.  Shared memory, bytes:
//   Q int8 kBM (kD + 16), K int8 kBN (kD + 16), K scales kBN * 4, V kBN (kD + 8) * 2,
//   Q rows' (scale, bias) kBM * 8; at the end the output tile, kBM (kD + 8) * 2, over all of it.
//
//   kD    kBM  kBN   smem      registers (nvcc 13.0, sm_80)
//   64    128   64   25 KiB    255
//   128   128   32   34 KiB    242
//   256    64   64   68 KiB    242
//
// kD = 128 keeps the flash kernel's 128 query rows (each V fragment read from shared memory feeds
// two m16 tiles: P V is most of the work) but takes keys 32 at a time: with 64, ptxas spilled
// (255 registers; the flash kernel's same config sits at 255 with no spill, and the int8 path's
// scales and bookkeeping are a few registers more).  kBM = 64 with kBN = 64 fits too (185
// registers) but reads every V fragment for one m16 tile only.
template <int kD> struct SageTile {
  static constexpr int kBM = kD <= 128 ? 128 : 64;
  static constexpr int kBN = kD == 128 ? 32 : 64;
};

constexpr int kSagePad8 = 16;  // bytes of padding per int8 row (an odd number of 16-byte units)

// Offsets of the buffers, and the total (at least the output tile's size).
__host__ __device__ constexpr size_t sage_smem_k(int kD, int kBM) { return (size_t)kBM * (kD + kSagePad8); }
__host__ __device__ constexpr size_t sage_smem_ks(int kD, int kBM, int kBN) {
  return sage_smem_k(kD, kBM) + (size_t)kBN * (kD + kSagePad8);
}
__host__ __device__ constexpr size_t sage_smem_v(int kD, int kBM, int kBN) {
  return sage_smem_ks(kD, kBM, kBN) + (size_t)kBN * 4;
}
__host__ __device__ constexpr size_t sage_smem_qsb(int kD, int kBM, int kBN) {
  return sage_smem_v(kD, kBM, kBN) + (size_t)kBN * (kD + ab_flash::kSmemPad) * 2;
}
__host__ __device__ constexpr size_t sage_smem_bytes(int kD, int kBM, int kBN) {
  const size_t buffers = sage_smem_qsb(kD, kBM, kBN) + (size_t)kBM * 8;
  const size_t out_tile = (size_t)kBM * (kD + ab_flash::kSmemPad) * 2;
  return buffers > out_tile ? buffers : out_tile;
}

// The padded head dims that have kernels; D and Dv are rounded up to the next one.  64 and 128 are
// the common sizes; everything else pays for its padding (D = 96 runs the kD = 128 kernel).
constexpr int kSageHeadDims[] = {64, 128, 256};

// The prepass: blocks of kPrepThreads threads; a stats block reduces kStatRows keys, a quantize
// block kQuantRows keys.
constexpr int kPrepThreads = 128;
constexpr int kStatRows = 256;
constexpr int kQuantRows = 64;

// Launches the K prepass (stats, their reduction into mean and c, K quantized) and then the
// attention kernel, for dtype T (__half or __nv_bfloat16) and padded head dim kD, on `stream`.
// Defined in sage_fwd_kernel.cuh, instantiated in sage_fwd_hdim*.cu.
template <typename T, int kD>
ab_status sage_launch(SageParams& sp, const ab_attn_params* p, cudaStream_t stream, ab_error* err);

}  // namespace ab_sage

#endif  // AB_SAGE_FWD_CUH
