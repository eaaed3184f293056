// fwd_common.cuh -- what the flash forward (flash_fwd_kernel.cuh) and the sage forward
// (sage_fwd_kernel.cuh) kernels share: PTX wrappers and fragment layouts, the cp.async tile loader,
// the causal/window row ranges, and the steps of one key tile after the scores exist (masking,
// online softmax, O += P V) and the epilogue.  Both kernels use the same block shape (4 warps, each
// owning kBM / 4 query rows) and the same m16n8 accumulator layout for S, so everything from the
// float scores on is one code.
#ifndef AB_FWD_COMMON_CUH
#define AB_FWD_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "flash_fwd.cuh"

namespace ab_flash {

constexpr int kWarps = kFwdThreads / 32;
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

// tanh(y) given e = 2^(2 y log2(e)) = exp(2 y), as 1 - 2 / (exp(2y) + 1).  Its absolute error is
// a few 1e-7 (relative error is larger near 0, but the softmax only feels the absolute error of a
// score), and it is a handful of instructions where tanhf's inlined polynomial, unrolled over
// every score of a tile, made the kernel spill registers.  e = inf gives 1, e = 0 gives -1.
__device__ __forceinline__ float tanh_from_exp2y(float e) { return 1.0f - 2.0f * fast_rcp(e + 1.0f); }

template <typename T> struct MmaOps;

template <> struct MmaOps<__half> {
  // c += a b for one m16n8k16 tile
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // two floats -> one .b32 register, `lo` in the low half (the lower column of a fragment pair)
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <> struct MmaOps<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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
// is a multiple of 8, so a 16-byte chunk is either wholly inside or wholly padding.
template <typename T, int kRows, int kD>
__device__ __forceinline__ void load_tile(T* smem, const T* src, int64_t row_stride, int rows_valid,
                                          int cols_valid, int tid) {
  constexpr int kLd = kD + kSmemPad;
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  static_assert(sizeof(T) == 2, "16-bit elements (an int8 tile is loaded as pairs: uint16_t, kD / 2)");
  static_assert((kRows * kChunks) % kFwdThreads == 0, "tile chunks must split evenly over the threads");
  // Not unrolled on purpose: unrolled, the compiler hoists every chunk's 64-bit offset out of the
  // key loop and keeps them live in registers (dozens of them), which made the kernel spill.
#pragma unroll 1
  for (int it = 0; it < kRows * kChunks / kFwdThreads; ++it) {
    const int idx = it * kFwdThreads + tid;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r < rows_valid && c * 8 < cols_valid;
    const T* g = valid ? src + (int64_t)r * row_stride + c * 8 : src;
    cp_async_16(smem_u32(smem + r * kLd + c * 8), g, valid);
  }
}

// ---- masking ------------------------------------------------------------------------------------

// Visible keys [lo, hi) of query row i of a sequence of q_len queries and k_len keys, as
// row_range in flash_cpu_impl.h: i' = i + k_len - q_len for bottom-right causal, else i;
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


// ---- one block's share of the problem -----------------------------------------------------------

// Which (query tile, head, batch) a block computes and the key tiles it visits.
struct BlockTiles {
  int64_t b;
  int h, hk;
  int64_t q_start, k_start;  // first row of this sequence in the packed tensors (0 when dense)
  int q_len, k_len;
  int row0, rows_here;       // first query row of the tile, real rows in it
  int lo_max, hi_min;        // key tiles inside [lo_max, hi_min) need no masking
  int j_begin, j_end;        // key tiles [j_begin, j_end) hold every key any row sees
};

// Block -> (query tile, head, batch).  Query tiles vary fastest (the blocks of one head share its
// K/V in L2) and run last-first: under causal masking the last tiles see the most keys.  Returns
// false when the tile has no rows (a packed sequence shorter than max_seqlen_q).
template <int kBM, int kBN>
__device__ __forceinline__ bool block_tiles(const FwdParams& p, BlockTiles& bt) {
  const int64_t bid = blockIdx.x;
  const int m_block = p.m_blocks - 1 - (int)(bid % p.m_blocks);
  const int64_t bh = bid / p.m_blocks;
  bt.h = (int)(bh % p.Hq);
  bt.b = bh / p.Hq;
  bt.hk = bt.h / p.group;
  bt.q_start = bt.k_start = 0;
  bt.q_len = p.Sq;
  bt.k_len = p.Sk;
  if (p.cu_q != nullptr) {  // packed: this sequence's rows of the (T, H, D) tensors
    bt.q_start = p.cu_q[bt.b];
    bt.q_len = p.cu_q[bt.b + 1] - p.cu_q[bt.b];
    bt.k_start = p.cu_k[bt.b];
    bt.k_len = p.cu_k[bt.b + 1] - p.cu_k[bt.b];
  }
  bt.row0 = m_block * kBM;
  if (bt.row0 >= bt.q_len) return false;
  bt.rows_here = min(kBM, bt.q_len - bt.row0);
  // Block-wide ranges from the first and last real rows (lo, hi are monotone in the row):
  // keys [n_lo, n_hi) are all that any row sees; tiles inside [lo_max, hi_min) need no masking.
  int n_lo, n_hi;
  row_range(p, bt.row0, bt.q_len, bt.k_len, n_lo, bt.hi_min);
  row_range(p, bt.row0 + bt.rows_here - 1, bt.q_len, bt.k_len, bt.lo_max, n_hi);
  bt.j_begin = n_lo / kBN;
  bt.j_end = n_hi > n_lo ? (n_hi + kBN - 1) / kBN : bt.j_begin;  // no tile: every row is empty
  return true;
}

// ---- the steps of one key tile, on the float scores ---------------------------------------------
//
// s[mt][nt][e] is the m16n8 accumulator layout: element e of tile (mt, nt) is this warp's row
// 16 mt + g + 8 (e >> 1), key n0 + 8 nt + 2 t + (e & 1).  Scores are in base-2 units (scaled by
// log2 e) so that exp2 can be used.

// O = 0, and no row has seen a key yet (running max -inf, sum 0).
template <int kMT, int kDT>
__device__ __forceinline__ void init_rows(float (&o)[kMT][kDT][4], float (&row_m)[2 * kMT],
                                          float (&row_l)[2 * kMT]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.0f;
#pragma unroll
  for (int r = 0; r < 2 * kMT; ++r) {
    row_m[r] = -INFINITY;
    row_l[r] = 0.0f;
  }
}

// softcap over a tile: s = softcap tanh(y) in base-2 units (out_scale = softcap log2 e), where
// 2^(in_scale s) = exp(2 y) and y is the true score / softcap.  The flash kernel passes raw q . k
// (in_scale = 2 log2(e) scale / softcap), the sage kernel base-2 true scores (in_scale = 2 / softcap).
template <int kMT, int kNT>
__device__ __forceinline__ void softcap_tile(float (&s)[kMT][kNT][4], float in_scale, float out_scale) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = tanh_from_exp2y(fast_exp2(s[mt][nt][e] * in_scale)) * out_scale;
}

// Sets the scores of keys outside each row's [lo, hi) to -inf.  Called only for tiles some row
// sees in part; the ranges are recomputed here rather than kept in registers across the key loop.
// warp_row0 is the block-relative first row of this warp (warp * 16 * kMT).
template <int kMT, int kNT>
__device__ __forceinline__ void mask_tile(const FwdParams& p, const BlockTiles& bt, float (&s)[kMT][kNT][4],
                                          int n0, int warp_row0, int g, int t) {
#pragma unroll
  for (int r = 0; r < 2 * kMT; ++r) {
    int lo, hi;
    row_range(p, bt.row0 + warp_row0 + 16 * (r >> 1) + g + 8 * (r & 1), bt.q_len, bt.k_len, lo, hi);
    const int mt = r >> 1, e0 = 2 * (r & 1);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = e0; e < e0 + 2; ++e) {
        const int key = n0 + 8 * nt + 2 * t + (e & 1);
        if (key < lo || key >= hi) s[mt][nt][e] = -INFINITY;
      }
  }
}

// Online softmax over one tile.  With m the new row max, earlier terms are rescaled by
// 2^(m_old - m).  A row that has seen no visible key yet has m = -inf; it uses 0 as the reference
// so that 2^(-inf - 0) = 0 instead of 2^(-inf + inf) = NaN.  A NaN score is skipped by fmaxf but
// turns the row's sum into NaN, which the epilogue reports.
// row_m is the running max (reduced over the 4 lanes that share a row), row_l this lane's part of
// the running sum (reduced once at the end: every lane rescales it by the same factors).
// P goes straight to 16 bits: pk[mt][nt][half] holds the pair (row g + 8 half, keys 2t, 2t+1) of
// key tile nt, i.e. c[2 half], c[2 half + 1] of S's accumulator, packed.
template <typename T, int kMT, int kNT, int kDT>
__device__ __forceinline__ void softmax_tile(float (&s)[kMT][kNT][4], float (&row_m)[2 * kMT],
                                             float (&row_l)[2 * kMT], float (&o)[kMT][kDT][4],
                                             uint32_t (&pk)[kMT][kNT][2]) {
#pragma unroll
  for (int r = 0; r < 2 * kMT; ++r) {
    const int mt = r >> 1, e0 = 2 * (r & 1);
    float mx = row_m[r];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][e0], s[mt][nt][e0 + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 lanes of group g share the row
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float ref = mx == -INFINITY ? 0.0f : mx;
    const float alpha = fast_exp2(row_m[r] - ref);
    row_m[r] = mx;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const float p0 = fast_exp2(s[mt][nt][e0] - ref), p1 = fast_exp2(s[mt][nt][e0 + 1] - ref);
      sum += p0 + p1;  // the sum is of the fp32 weights; P V uses them rounded to 16 bits
      pk[mt][nt][r & 1] = MmaOps<T>::pack(p0, p1);
    }
    row_l[r] = row_l[r] * alpha + sum;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      o[mt][dt][e0] *= alpha;
      o[mt][dt][e0 + 1] *= alpha;
    }
  }
}

// O += P V for one tile of V (kNT * 8 keys) in shared memory; v_addr is this lane's ldmatrix
// address in it (see the kernels), row_bytes the tile's row stride.  The A fragment of P for keys
// [16 kk, 16 kk + 16) is the S accumulators of key tiles 2 kk and 2 kk + 1: a[0] = (row g, keys
// 2t, 2t+1) = S tile 2kk c[0..1], a[1] = (row g + 8) = tile 2kk c[2..3], a[2] = (row g, keys
// 8 + 2t, ..) = tile 2kk+1 c[0..1], a[3] = tile 2kk+1 c[2..3]; in pk's terms: pk[2kk][0],
// pk[2kk][1], pk[2kk+1][0], pk[2kk+1][1].
template <typename T, int kMT, int kNT, int kDT>
__device__ __forceinline__ void pv_tile(const uint32_t (&pk)[kMT][kNT][2], float (&o)[kMT][kDT][4],
                                        uint32_t v_addr, uint32_t row_bytes) {
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) {
    uint32_t pa[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      pa[mt][0] = pk[mt][2 * kk][0];
      pa[mt][1] = pk[mt][2 * kk][1];
      pa[mt][2] = pk[mt][2 * kk + 1][0];
      pa[mt][3] = pk[mt][2 * kk + 1][1];
    }
#pragma unroll
    for (int dp = 0; dp < kDT / 2; ++dp) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, v_addr + kk * 16 * row_bytes + dp * 16 * sizeof(T));
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        MmaOps<T>::mma(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
        MmaOps<T>::mma(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
      }
    }
  }
}

// ---- epilogue: O / l through shared memory, then 16-byte stores ----------------------------------
//
// stage is a (kBM, kD + kSmemPad) tile of T no warp reads any more (the caller synchronizes first).
// Writes this block's rows of out and lse.
template <typename T, int kD, int kBM, int kMT, int kDT>
__device__ __forceinline__ void store_out(const FwdParams& p, const BlockTiles& bt, float (&o)[kMT][kDT][4],
                                          const float (&row_m)[2 * kMT], const float (&row_l)[2 * kMT], T* stage,
                                          int warp, int g, int t, int tid) {
  constexpr int kLd = kD + kSmemPad;
#pragma unroll
  for (int r = 0; r < 2 * kMT; ++r) {
    const int mt = r >> 1, e0 = 2 * (r & 1);
    float l = row_l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // l == 0: no visible key (out exactly 0, lse -inf); l NaN: a NaN reached the row (NaN out);
    // otherwise l >= 1 (the max term contributes 2^0).
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    const int row = warp * 16 * kMT + 16 * mt + g + 8 * (r & 1);
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const float o0 = l == 0.0f ? 0.0f : o[mt][dt][e0] * inv;
      const float o1 = l == 0.0f ? 0.0f : o[mt][dt][e0 + 1] * inv;
      *reinterpret_cast<uint32_t*>(stage + row * kLd + 8 * dt + 2 * t) = MmaOps<T>::pack(o0, o1);
    }
    if (t == 0 && bt.row0 + row < bt.q_len) {
      const float lse = l != l ? l : l == 0.0f ? -INFINITY : row_m[r] * kLn2 + logf(l);
      p.lse[bt.b * p.l_bs + bt.h * p.l_hs + (bt.q_start + bt.row0 + row) * p.l_rs] = lse;
    }
  }
  __syncthreads();

  T* out = static_cast<T*>(p.out) + bt.b * p.o_bs + bt.h * p.o_hs + (bt.q_start + bt.row0) * p.o_rs;
  constexpr int kChunks = kD / 8;
  static_assert((kBM * kChunks) % kFwdThreads == 0, "output chunks must split evenly over the threads");
#pragma unroll
  for (int it = 0; it < kBM * kChunks / kFwdThreads; ++it) {
    const int idx = it * kFwdThreads + tid;
    const int r = idx / kChunks, c = idx % kChunks;
    if (r < bt.rows_here && c * 8 < p.Dv)
      *reinterpret_cast<uint4*>(out + (int64_t)r * p.o_rs + c * 8) =
          *reinterpret_cast<const uint4*>(stage + r * kLd + c * 8);
  }
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

#endif  // AB_FWD_COMMON_CUH
