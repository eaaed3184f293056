// flash_common.cuh -- what every tensor-core attention kernel on CUDA (the flash forward and
// backward, the sage forward) shares: the PTX wrappers (mma.sync, ldmatrix, cp.async, ex2/rcp),
// the fragment layouts they rely on, the shared-memory tile loader, a sequence's rows in dense or
// packed tensors, the visible key range of a query row, the dropout keep bits of an mma tile and
// the shared-memory check before a launch.  The forward-only steps (online softmax, P V, the
// epilogue) build on it in fwd_common.cuh.  Included by the *_kernel.cuh headers only.
#ifndef AB_FLASH_COMMON_CUH
#define AB_FLASH_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "flash_fwd.cuh"
#include "../ab_philox.h"

namespace ab_flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- PTX wrappers -------------------------------------------------------------------------------
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16" and ldmatrix), used everywhere
// below.  In a warp, lane = 4 * g + t: g = lane >> 2 (0..7, the "group"), t = lane & 3.
//
// mma.m16n8k16, A (16 x 16, row-major; 4 x .b32, each two 16-bit elements, lower column in the
// low half):
//   a[0] = A[g    ][2t, 2t+1]      a[1] = A[g + 8][2t, 2t+1]
//   a[2] = A[g    ][2t+8, 2t+9]    a[3] = A[g + 8][2t+8, 2t+9]
// B (16 x 8, k x n, "col": for a fixed column n the two k-consecutive elements share a register):
//   b[0] = B[2t, 2t+1][g]          b[1] = B[2t+8, 2t+9][g]
// C/D (16 x 8, fp32):
//   c[0], c[1] = C[g][2t, 2t+1]    c[2], c[3] = C[g + 8][2t, 2t+1]
//
// ldmatrix.m8n8.x4.b16: lanes 8i .. 8i+7 give the addresses of rows 0..7 of matrix i (each row 8
// contiguous 16-bit elements, 16-byte aligned); register r[i] receives matrix i:
//   plain:  r[i] = M_i[g][2t, 2t+1]
//   .trans: r[i] = M_i[2t, 2t+1][g]   (element pair from rows 2t and 2t+1, column g)

#ifdef AB_CUDA_EMULATE
// The emulated build (csrc/cuda/emu, docs/cuda.md): the same instructions, executed by the emulator
// on the host with these fragment layouts.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return ab_emu::cvta_shared(p); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) { ab_emu::ldmatrix_x4(r, addr, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) { ab_emu::ldmatrix_x4(r, addr, true); }
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  ab_emu::cp_async(dst, src, 16, valid);
}
__device__ __forceinline__ void cp_async_commit() { ab_emu::cp_async_commit(); }
template <int N> __device__ __forceinline__ void cp_async_wait() { ab_emu::cp_async_wait(N); }
__device__ __forceinline__ float fast_exp2(float x) { return ab_emu::ex2_approx(x); }
__device__ __forceinline__ float fast_rcp(float x) { return ab_emu::rcp_approx(x); }
#else
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16 bytes global -> shared, bypassing L1.  When !valid, src-size 0 makes the copy write 16 zero
// bytes and read nothing: rows past the sequence end and head-dim padding become exact zeros.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 2^x with the hardware approximation (relative error ~2^-22); ex2(-inf) = +0, ex2(NaN) = NaN.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x with the hardware approximation; rcp(inf) = +0.
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

#endif  // AB_CUDA_EMULATE

// tanh(y) given e = 2^(2 y log2(e)) = exp(2 y), as 1 - 2 / (exp(2y) + 1).  Its absolute error is
// a few 1e-7 (relative error is larger near 0, but the softmax only feels the absolute error of a
// score), and it is a handful of instructions where tanhf's inlined polynomial, unrolled over
// every score of a tile, made the kernel spill registers.  e = inf gives 1, e = 0 gives -1.
__device__ __forceinline__ float tanh_from_exp2y(float e) { return 1.0f - 2.0f * fast_rcp(e + 1.0f); }

template <typename T> struct MmaOps;

template <> struct MmaOps<__half> {
  // c += a b for one m16n8k16 tile
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#ifdef AB_CUDA_EMULATE
    ab_emu::mma_m16n8k16(c, a, b0, b1, false);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
  // two floats -> one .b32 register, `lo` in the low half (the lower column of a fragment pair)
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <> struct MmaOps<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#ifdef AB_CUDA_EMULATE
    ab_emu::mma_m16n8k16(c, a, b0, b1, true);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// ---- tiles in shared memory ---------------------------------------------------------------------
//
// A tile is kRows rows of kD 16-bit elements, row stride kLd = kD + 8.  The 8 padding elements
// (16 bytes) make the row stride an odd number of 16-byte units (kD / 8 is even for every
// instantiated kD), so the 8 rows one ldmatrix phase reads fall in 8 different 16-byte bank groups:
// no bank conflicts, with no swizzle to get wrong.

// Issues the copy of rows [0, kRows) x columns [0, kD) of a global tile whose row r starts at
// src + r * row_stride; rows >= rows_valid and columns >= cols_valid are zero-filled.  cols_valid
// is a multiple of 8, so a 16-byte chunk is either wholly inside or wholly padding.  kThreads is
// the block size (the forward kernels' 128, the backward's 256).
template <typename T, int kRows, int kD, int kThreads = kFwdThreads>
__device__ __forceinline__ void load_tile(T* smem, const T* src, int64_t row_stride, int rows_valid,
                                          int cols_valid, int tid) {
  constexpr int kLd = kD + kSmemPad;
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  static_assert(sizeof(T) == 2, "16-bit elements (an int8 tile is loaded as pairs: uint16_t, kD / 2)");
  static_assert((kRows * kChunks) % kThreads == 0, "tile chunks must split evenly over the threads");
  // Not unrolled on purpose: unrolled, the compiler hoists every chunk's 64-bit offset out of the
  // key loop and keeps them live in registers (dozens of them), which made the kernel spill.
#pragma unroll 1
  for (int it = 0; it < kRows * kChunks / kThreads; ++it) {
    const int idx = it * kThreads + tid;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r < rows_valid && c * 8 < cols_valid;
    const T* g = valid ? src + (int64_t)r * row_stride + c * 8 : src;
    cp_async_16(smem_u32(smem + r * kLd + c * 8), g, valid);
  }
}

// ---- sequences and masking ----------------------------------------------------------------------

// One sequence's rows of batch entry b: where they start in the (possibly packed) tensors and how
// many.  Dense: start 0, lengths Sq and Sk.  Packed: this sequence's rows of the (T, H, D) tensors.
struct Seq {
  int64_t q_start, k_start;
  int q_len, k_len;
};

__device__ __forceinline__ Seq seq_of(const FwdParams& p, int64_t b) {
  Seq s = {0, 0, p.Sq, p.Sk};
  if (p.cu_q != nullptr) {
    s.q_start = p.cu_q[b];
    s.q_len = p.cu_q[b + 1] - p.cu_q[b];
    s.k_start = p.cu_k[b];
    s.k_len = p.cu_k[b + 1] - p.cu_k[b];
  }
  return s;
}

// Visible keys [lo, hi) of query row i of a sequence of q_len queries and k_len keys, as
// row_range in csrc/cpu/cpu_tiles_impl.h: i' = i + k_len - q_len for bottom-right causal, else i;
// causal keeps j <= i', the window keeps i' - left <= j <= i' + right.  Clamped to [0, k_len]
// with hi >= lo, so lo and hi are non-decreasing in i (the block-level ranges rely on that).
__device__ __forceinline__ void row_range(const FwdParams& p, int i, int q_len, int k_len, int& lo,
                                          int& hi) {
  const int64_t ii = (int64_t)i + (p.causal == AB_CAUSAL_BOTTOM_RIGHT ? (int64_t)k_len - q_len : 0);
  int64_t l = 0, h = k_len;
  if (p.causal != AB_CAUSAL_NONE && ii + 1 < h) h = ii + 1;
  if (p.window_right >= 0 && ii + p.window_right + 1 < h) h = ii + p.window_right + 1;
  if (p.window_left >= 0 && ii - p.window_left > l) l = ii - p.window_left;
  if (l > k_len) l = k_len;
  if (h < l) h = l;
  lo = (int)l;
  hi = (int)h;
}

// ---- dropout ------------------------------------------------------------------------------------
//
// The keep bits of this lane's four accumulator elements of one m16 x n8 tile (bit e for c[e]:
// rows g and g + 8, keys key0 + 2t and key0 + 2t + 1), from the shared Philox stream
// (ab_philox.h: one call gives the words of keys 4q .. 4q + 3 of one row).  Lanes t and t ^ 1 need
// the same key quad for both rows, so each computes one row (even t: row g, odd t: row g + 8) and
// they swap the half the other one needs: one Philox call per lane per tile instead of two.
// row_g is the dropout row index (ab_philox.h) of accumulator row g; key0 is a multiple of 8.
// Every lane of the warp must call it (shuffles).
__device__ __forceinline__ uint32_t dropout_keep4(uint64_t seed, uint64_t offset, uint64_t row_g, int key0,
                                                  int lane, uint32_t threshold) {
  const int t = lane & 3;
  const bool odd = (t & 1) != 0;
  uint32_t w[4];
  ab_dropout_words(seed, offset, row_g + (odd ? 8u : 0u), (uint64_t)(key0 / 4 + (t >> 1)), w);
  // even t uses words 0, 1 of its quad (keys 2t, 2t + 1 with t even), odd t words 2, 3
  const uint32_t s0 = odd ? w[0] : w[2], s1 = odd ? w[1] : w[3];
  const uint32_t r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
  const uint32_t a0 = odd ? r0 : w[0], a1 = odd ? r1 : w[1];  // row g
  const uint32_t b0 = odd ? w[2] : r0, b1 = odd ? w[3] : r1;  // row g + 8
  return (uint32_t)(a0 >= threshold) | (uint32_t)(a1 >= threshold) << 1 | (uint32_t)(b0 >= threshold) << 2 |
         (uint32_t)(b1 >= threshold) << 3;
}

// ---- launch -------------------------------------------------------------------------------------

// Before launching `kernel` with `smem` bytes of dynamic shared memory on the current device:
// refuses a device whose opt-in limit is lower (AB_ERR_UNSUPPORTED, so the caller can fall back)
// and raises the kernel's limit past the default 48 KiB.  `who` and kD name the config in messages.
template <typename Kernel>
ab_status prepare_smem(Kernel kernel, size_t smem, const char* who, int kD, ab_error* err) {
  int device = 0, smem_optin = 0;
  ab_status st = ab_cuda_check(cudaGetDevice(&device), "cudaGetDevice", err);
  if (st != AB_OK) return st;
  st = ab_cuda_check(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                     "cudaDeviceGetAttribute", err);
  if (st != AB_OK) return st;
  if ((size_t)smem_optin < smem)
    return ab_error_set(err, AB_ERR_UNSUPPORTED,
                        "%s on CUDA: head dim %d needs %zu bytes of shared memory per block, this device "
                        "allows %d",
                        who, kD, smem, smem_optin);
  if (smem > 48 * 1024)
    return ab_cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                         "cudaFuncSetAttribute", err);
  return AB_OK;
}

}  // namespace ab_flash

#endif  // AB_FLASH_COMMON_CUH
