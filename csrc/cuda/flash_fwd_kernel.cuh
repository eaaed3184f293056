// flash_fwd_kernel.cuh -- the flash forward kernel (FlashAttention-2 algorithm) for sm_80 and newer.
//
// One thread block computes one tile of kBM query rows of one (batch, head): out rows
// (kBM, Dv) and their lse.  The Q tile is loaded into shared memory once; K and V tiles of kBN
// keys stream through one K and one V buffer with cp.async, software-pipelined as in
// FlashAttention-2: V[j] is in flight while S = Q K[j]^T runs, and K[j+1] is in flight while the
// softmax and O += P V[j] run.  Every product is an mma.sync m16n8k16 (fp16/bf16 in, fp32
// accumulate) with operands read by ldmatrix; the probabilities P never leave registers: the
// accumulator layout of S is exactly the A-operand layout of the P V product, so P is only
// converted to 16 bits in place.  Softmax is online (running max m and sum l per row, in
// registers); O is rescaled when the max grows and divided by l once at the end.
//
// Included only by flash_fwd_hdim*.cu, which instantiate fwd_launch<T, kD>.  Semantics (causal
// alignment, window, softcap, lse, fully masked rows) follow docs/semantics.md and the CPU twin
// csrc/cpu/flash_cpu_impl.h.
#ifndef AB_FLASH_FWD_KERNEL_CUH
#define AB_FLASH_FWD_KERNEL_CUH

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

// ---- the kernel ---------------------------------------------------------------------------------

template <typename T, int kD, int kBM, int kBN>
__global__ void __launch_bounds__(kFwdThreads) fwd_kernel(const FwdParams p) {
  using Ops = MmaOps<T>;
  constexpr int kMT = kBM / (16 * kWarps);  // m16 tiles per warp
  constexpr int kNT = kBN / 8;              // n8 tiles of S per m16 tile (keys)
  constexpr int kDT = kD / 8;               // n8 tiles of O per m16 tile (head dim)
  constexpr int kLd = kD + kSmemPad;
  static_assert(kMT >= 1 && kBM == kMT * 16 * kWarps, "kBM must be a multiple of 64");
  static_assert(kBN % 16 == 0 && kD % 32 == 0, "ldmatrix.x4 reads pairs of n8 tiles and k16 steps");
  static_assert((kD / 8) % 2 == 0, "padding to an odd number of 16-byte units needs kD / 8 even");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // (kBM, kLd); reused for the output tile at the end
  T* sK = sQ + kBM * kLd;                   // (kBN, kLd)
  T* sV = sK + kBN * kLd;                   // (kBN, kLd)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  // Block -> (query tile, head, batch).  Query tiles vary fastest (the blocks of one head share
  // its K/V in L2) and run last-first: under causal masking the last tiles see the most keys.
  const int64_t bid = blockIdx.x;
  const int m_block = p.m_blocks - 1 - (int)(bid % p.m_blocks);
  const int64_t bh = bid / p.m_blocks;
  const int h = (int)(bh % p.Hq);
  const int64_t b = bh / p.Hq;
  const int hk = h / p.group;

  int64_t q_start = 0, k_start = 0;
  int q_len = p.Sq, k_len = p.Sk;
  if (p.cu_q != nullptr) {  // packed: this sequence's rows of the (T, H, D) tensors
    q_start = p.cu_q[b];
    q_len = p.cu_q[b + 1] - p.cu_q[b];
    k_start = p.cu_k[b];
    k_len = p.cu_k[b + 1] - p.cu_k[b];
  }
  const int row0 = m_block * kBM;
  if (row0 >= q_len) return;  // whole block: a packed sequence shorter than max_seqlen_q

  const T* q = static_cast<const T*>(p.q) + b * p.q_bs + h * p.q_hs + (q_start + row0) * p.q_rs;
  const T* k = static_cast<const T*>(p.k) + b * p.k_bs + hk * p.k_hs + k_start * p.k_rs;
  const T* v = static_cast<const T*>(p.v) + b * p.v_bs + hk * p.v_hs + k_start * p.v_rs;
  const int rows_here = min(kBM, q_len - row0);

  // Block-wide ranges from the first and last real rows (lo, hi are monotone in the row):
  // keys [n_lo, n_hi) are all that any row sees; tiles inside [lo_max, hi_min) need no masking.
  int n_lo, hi_min, lo_max, n_hi;
  row_range(p, row0, q_len, k_len, n_lo, hi_min);
  row_range(p, row0 + rows_here - 1, q_len, k_len, lo_max, n_hi);
  const int j_begin = n_lo / kBN;
  const int j_end = n_hi > n_lo ? (n_hi + kBN - 1) / kBN : j_begin;  // no tile: every row is empty

  float o[kMT][kDT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.0f;
  // Running max (base-2 units, reduced over the 4 lanes that share a row) and this lane's part of
  // the running sum (reduced once at the end: every lane rescales it by the same factors).
  float row_m[2 * kMT], row_l[2 * kMT];
#pragma unroll
  for (int r = 0; r < 2 * kMT; ++r) {
    row_m[r] = -INFINITY;
    row_l[r] = 0.0f;
  }

  // Prologue: Q and the first K tile in one cp.async group.
  load_tile<T, kBM, kD>(sQ, q, p.q_rs, rows_here, p.D, tid);
  if (j_begin < j_end)
    load_tile<T, kBN, kD>(sK, k + (int64_t)j_begin * kBN * p.k_rs, p.k_rs, k_len - j_begin * kBN, p.D, tid);
  cp_async_commit();

  // ldmatrix row addresses of this lane (see the fragment layouts):
  //   Q (A operand): matrices (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8) of an m16 x k16 block
  //   K (B operand, S = Q K^T, so B[k][n] = K[n][k]: K rows are the "columns" n):
  //     matrices (keys +0, dims +0), (+0, +8), (+8, +0), (+8, +8) = b[0], b[1] of key tile n8 and
  //     b[0], b[1] of key tile n8 + 8, for one k16 step of head dims
  //   V (B operand, O = P V, B[k][n] = V[key k][dim n]; .trans since V rows are keys):
  //     matrices (keys +0, dims +0), (+8, +0), (+0, +8), (+8, +8) = b[0], b[1] of dim tile n8 and
  //     b[0], b[1] of dim tile n8 + 8, for one k16 step of keys
  const int mi = lane >> 3, mr = lane & 7;
  const uint32_t q_addr =
      smem_u32(sQ + (warp * 16 * kMT + mr + (mi & 1) * 8) * kLd + (mi >> 1) * 8);
  const uint32_t k_addr = smem_u32(sK + (mr + (mi >> 1) * 8) * kLd + (mi & 1) * 8);
  const uint32_t v_addr = smem_u32(sV + (mr + (mi & 1) * 8) * kLd + (mi >> 1) * 8);
  constexpr uint32_t kRowBytes = kLd * sizeof(T);

  for (int j = j_begin; j < j_end; ++j) {
    const int n0 = j * kBN;
    // V[j] streams in while S = Q K[j]^T runs.  The V buffer is free: the last P V finished
    // before the __syncthreads that ended the previous iteration.
    load_tile<T, kBN, kD>(sV, v + (int64_t)n0 * p.v_rs, p.v_rs, k_len - n0, p.Dv, tid);
    cp_async_commit();
    cp_async_wait<1>();  // everything but V[j]: Q and K[j] have landed (for this thread)
    __syncthreads();     // ... and for every thread

    // S = Q K^T (fp32), kMT x kNT tiles of m16 x n8 per warp.
    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
    // kk only moves the ldmatrix addresses; unrolling it fully lets the scheduler load the
    // fragments of many k-steps ahead, which costs registers the kD = 128 config does not have.
#pragma unroll 2
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t qa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        ldmatrix_x4(qa[mt], q_addr + mt * 16 * kRowBytes + kk * 16 * sizeof(T));
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_addr + np * 16 * kRowBytes + kk * 16 * sizeof(T));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Ops::mma(s[mt][2 * np], qa[mt], kb[0], kb[1]);
          Ops::mma(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with K[j]: the buffer may be refilled
    // K[j+1] streams in during the softmax and P V.  The group is committed even when empty so
    // that the wait below always means "all but the newest group".
    if (j + 1 < j_end)
      load_tile<T, kBN, kD>(sK, k + (int64_t)(n0 + kBN) * p.k_rs, p.k_rs, k_len - n0 - kBN, p.D, tid);
    cp_async_commit();

    // Scores in base-2 units (softcap first, as the CPU kernel), then causal/window masking.
    // Element e of tile (mt, nt) is row r = 2 * mt + (e >> 1), key n0 + 8 * nt + 2 * t + (e & 1).
    // The branches are block-uniform and kept outside the element loops: a per-element select
    // would evaluate both sides and cost registers.
    if (p.softcap > 0.0f) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mt][nt][e] = tanh_from_exp2y(fast_exp2(s[mt][nt][e] * p.softcap_in)) * p.softcap_log2;
    } else {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] *= p.scale_log2;
    }
    if (n0 < lo_max || n0 + kBN > hi_min) {  // a tile some row sees only in part
      // This thread's rows: r = 2 * mt + half is tile row warp * 16 * kMT + 16 * mt + g + 8 * half
      // (the rows of c[0..1] and c[2..3] of each m16 tile).  Their ranges are recomputed here
      // rather than kept in registers across the loop: only boundary tiles need them.
#pragma unroll
      for (int r = 0; r < 2 * kMT; ++r) {
        int lo, hi;
        row_range(p, row0 + warp * 16 * kMT + 16 * (r >> 1) + g + 8 * (r & 1), q_len, k_len, lo, hi);
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

    // Online softmax.  With m the new row max, earlier terms are rescaled by 2^(m_old - m).  A row
    // that has seen no visible key yet has m = -inf; it uses 0 as the reference so that
    // 2^(-inf - 0) = 0 instead of 2^(-inf + inf) = NaN.  A NaN score is skipped by fmaxf but
    // turns the row's sum into NaN, which the epilogue reports.
    // P goes straight to 16 bits: pk[mt][nt][half] holds the pair (row g + 8 half, keys 2t, 2t+1)
    // of key tile nt, i.e. c[2 half], c[2 half + 1] of S's accumulator, packed.
    uint32_t pk[kMT][kNT][2];
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
        pk[mt][nt][r & 1] = Ops::pack(p0, p1);
      }
      row_l[r] = row_l[r] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        o[mt][dt][e0] *= alpha;
        o[mt][dt][e0 + 1] *= alpha;
      }
    }

    cp_async_wait<1>();  // all but K[j+1]: V[j] has landed
    __syncthreads();

    // O += P V.  The A fragment of P for keys [16 kk, 16 kk + 16) is the S accumulators of key
    // tiles 2 kk and 2 kk + 1: a[0] = (row g, keys 2t, 2t+1) = S tile 2kk c[0..1], a[1] = (row
    // g + 8) = tile 2kk c[2..3], a[2] = (row g, keys 8 + 2t, ..) = tile 2kk+1 c[0..1], a[3] =
    // tile 2kk+1 c[2..3]; in pk's terms: pk[2kk][0], pk[2kk][1], pk[2kk+1][0], pk[2kk+1][1].
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
        ldmatrix_x4_trans(vb, v_addr + kk * 16 * kRowBytes + dp * 16 * sizeof(T));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Ops::mma(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
          Ops::mma(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with V[j] (and K[j+1]'s group is still in flight)
  }

  // ---- epilogue: O / l into shared memory (over Q's tile), then 16-byte stores ------------------
  cp_async_wait<0>();
  __syncthreads();  // Q's tile is no longer read by any warp (and no copy into it is pending)

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
      *reinterpret_cast<uint32_t*>(sQ + row * kLd + 8 * dt + 2 * t) = Ops::pack(o0, o1);
    }
    if (t == 0 && row0 + row < q_len) {
      const float lse = l != l ? l : l == 0.0f ? -INFINITY : row_m[r] * kLn2 + logf(l);
      p.lse[b * p.l_bs + h * p.l_hs + (q_start + row0 + row) * p.l_rs] = lse;
    }
  }
  __syncthreads();

  T* out = static_cast<T*>(p.out) + b * p.o_bs + h * p.o_hs + (q_start + row0) * p.o_rs;
  constexpr int kChunks = kD / 8;
  static_assert((kBM * kChunks) % kFwdThreads == 0, "output chunks must split evenly over the threads");
#pragma unroll
  for (int it = 0; it < kBM * kChunks / kFwdThreads; ++it) {
    const int idx = it * kFwdThreads + tid;
    const int r = idx / kChunks, c = idx % kChunks;
    if (r < rows_here && c * 8 < p.Dv)
      *reinterpret_cast<uint4*>(out + (int64_t)r * p.o_rs + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + r * kLd + c * 8);
  }
}

// ---- launch -------------------------------------------------------------------------------------

template <typename T, int kD>
ab_status fwd_launch(const FwdParams& p, int64_t blocks, cudaStream_t stream, ab_error* err) {
  constexpr int kBM = FwdTile<kD>::kBM, kBN = FwdTile<kD>::kBN;
  constexpr size_t kSmem = fwd_smem_bytes(kD, kBM, kBN);
  auto kernel = fwd_kernel<T, kD, kBM, kBN>;
  int device = 0, smem_optin = 0;
  ab_status st = ab_cuda_check(cudaGetDevice(&device), "flash_fwd: cudaGetDevice", err);
  if (st != AB_OK) return st;
  st = ab_cuda_check(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                     "flash_fwd: cudaDeviceGetAttribute", err);
  if (st != AB_OK) return st;
  if ((size_t)smem_optin < kSmem)
    return ab_error_set(err, AB_ERR_UNSUPPORTED,
                        "flash on CUDA: head dim %d needs %zu bytes of shared memory per block, this "
                        "device allows %d",
                        kD, kSmem, smem_optin);
  if (kSmem > 48 * 1024) {
    st = ab_cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem),
                       "flash_fwd: cudaFuncSetAttribute", err);
    if (st != AB_OK) return st;
  }
  kernel<<<(unsigned)blocks, kFwdThreads, kSmem, stream>>>(p);
  return ab_cuda_check(cudaGetLastError(), "flash_fwd launch", err);
}

}  // namespace ab_flash

#endif  // AB_FLASH_FWD_KERNEL_CUH
