// flash_bwd_kernel.cuh -- the flash backward kernels (FlashAttention-2 algorithm) for sm_80 and newer.
//
// UNVERIFIED: compiled for sm_80 and sm_90a with nvcc 13.0, never run (written without a GPU).
//
// Nothing of the forward is stored but out and lse: each kernel recomputes the probabilities of a
// (64 query x 64 key) tile from the saved lse, P = 2^(s log2(e) - lse log2(e)), exactly as the forward
// computed them, and with delta_i = sum_j P'_ij dP_ij - dlse_i (bwd_delta_kernel, below; or
// dout_i . out_i - dlse_i, flash_bwd.cu's preprocess_kernel, for calls without the forward's stats) forms
//   dP = dO V^T,   dS = P (keep dP / (1 - p) - delta) (1 - tanh^2 with softcap),   P' = keep P / (1 - p)
//   dV += P'^T dO,  dK += scale dS^T Q,  dQ += scale dS K.
// With attention sinks the forward's lse already holds the sink's term, so P needs nothing more;
// ALiBi's -slope |i + Sk - Sq - j| joins the base-2 scores after softcap, as in the forward, and
// changes nothing else (its gradient is not taken).  The sinks' own gradient is computed beside
// these kernels (flash_bwd.cu, sinks_grad_kernel).
// Every product is an mma.sync m16n8k16 with ldmatrix operands (fragment layouts: flash_common.cuh).
//
// delta_i is dout_i . out_i - dlse_i in exact arithmetic, but out is stored in 16 bits: on a saturated
// row (one key's P near 1) dS = P (dP - delta) is a difference of nearly equal values, and out's
// rounding became most of it (dq 0.147 from float64 against the rule's 0.060 on a bfloat16 call with
// logits near 20; docs/reliability.md).  So when the call's keys are its rows' whole (the forward's
// stats are passed, as autograd does), delta is the sum of the products the kernels see, dP and P' as
// tile_ds computes them, and each row's dS sums to dlse as it must.  The price: S and dP once more
// per tile (the CUDA math backward's pass 1 does the same, math_bwd.cu).  A call for a block of keys
// (the ring's) keeps dout . out: that is the whole row's delta, the sum over the block's keys is not.
//
// Three kernels, 8 warps each:
//   bwd_delta_kernel one block per (query tile, head, batch) walks the key tiles in order, recomputing
//                   S and dP, and writes delta_i for the other two (in a fixed order: reproducible);
//                   with the forward's stats only.
//   bwd_dkv_kernel  one block per (key tile, KV head, batch).  K and V stay in shared memory; the
//                   block walks the query heads of its KV head (GQA: their dK/dV contributions are
//                   summed in registers, in a fixed order) and, for each, the query tiles that see
//                   any of its keys.  Per tile: phase 1 (S, dP, then P' and dS to shared memory),
//                   phase 2 (dV and dK accumulate in registers), and on the fast path phase 3 (dQ of
//                   the tile, added to a float32 workspace with atomics; converted in flash_bwd.cu).
//   bwd_dq_kernel   the deterministic dQ: one block per (query tile, head, batch) walks the key
//                   tiles in order, recomputing phase 1, and accumulates dQ in registers.  With it
//                   no two blocks write the same element, so results are bitwise reproducible.
// Warp roles (w = warp 0..7):
//   phase 1: queries 16 (w & 3) .. +16  x  keys 32 (w >> 2) .. +32         (S and dP: 2 x 16 floats)
//   phase 2: keys 16 (w & 3) .. +16  x  head dims (w >> 2) kD/2 .. +kD/2    (dK, dV: kD/2 floats)
//   phase 3: queries 16 (w & 3) .. +16  x  head dims, 64 at a time (atomic) or kD/2 (dq kernel)
// P' and dS go through shared memory because phase 2 needs them transposed (keys as rows); they
// are read back with ldmatrix.trans.
#ifndef AB_FLASH_BWD_KERNEL_CUH
#define AB_FLASH_BWD_KERNEL_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "flash_bwd.cuh"
#include "flash_common.cuh"

namespace ab_flash {

template <int kD> struct BwdLayout {
  static constexpr int kLd = kD + kSmemPad;       // row stride of the Q, dO, K, V tiles
  static constexpr int kLdS = kBwdBN + kSmemPad;  // row stride of P' and dS (72: an odd number of 16 bytes)
  static constexpr uint32_t kRowBytes = kLd * 2;
  static constexpr uint32_t kRowBytesS = kLdS * 2;
};

// Shared memory of both kernels, carved the same way.
template <typename T, int kD> struct BwdSmem {
  T *q, *dout, *k, *v, *p, *ds;
  float *lse, *delta;  // per query row of the tile: lse log2(e) (+inf for rows that see nothing), delta
  __device__ __forceinline__ explicit BwdSmem(unsigned char* raw) {
    using L = BwdLayout<kD>;
    q = reinterpret_cast<T*>(raw);
    dout = q + kBwdBM * L::kLd;
    k = dout + kBwdBM * L::kLd;
    v = k + kBwdBN * L::kLd;
    p = v + kBwdBN * L::kLd;
    ds = p + kBwdBM * L::kLdS;
    lse = reinterpret_cast<float*>(ds + kBwdBM * L::kLdS);
    delta = lse + kBwdBM;
  }
};

// ALiBi's slope of (batch b, query head h) in base-2 units, as the forward reads it; 0 without ALiBi.
__device__ __forceinline__ float alibi_slope_log2(const FwdParams& p, int64_t b, int h) {
  return p.alibi != nullptr ? p.alibi[b * p.alibi_bs + h * p.alibi_hs] * kLog2e : 0.0f;
}

// Issues the loads of a query tile of head h (Q and dO by cp.async, one group committed) and fills
// lse and delta of its rows (plain loads; rows past the end get lse = +inf, so P = 0 there; without
// kDelta, for bwd_delta_kernel, delta is not read and is 0).  The caller waits and synchronises.
template <typename T, int kD, bool kDelta = true>
__device__ __forceinline__ void load_query_tile(const BwdParams& bp, const BwdSmem<T, kD>& sm, int64_t b, int h,
                                                const Seq& sq, int row0, int tid) {
  const FwdParams& p = bp.f;
  const int rows = min(kBwdBM, sq.q_len - row0);
  const int64_t r0 = sq.q_start + row0;
  load_tile<T, kBwdBM, kD, kBwdThreads>(sm.q, static_cast<const T*>(p.q) + b * p.q_bs + h * p.q_hs + r0 * p.q_rs,
                                        p.q_rs, rows, p.D, tid);
  load_tile<T, kBwdBM, kD, kBwdThreads>(sm.dout,
                                        static_cast<const T*>(bp.dout) + b * bp.do_bs + h * bp.do_hs + r0 * bp.do_rs,
                                        bp.do_rs, rows, p.Dv, tid);
  cp_async_commit();
  if (tid < kBwdBM) {
    float l = INFINITY, d = 0.0f;
    if (tid < rows) {
      const float lse = p.lse[b * p.l_bs + h * p.l_hs + (r0 + tid) * p.l_rs];
      // lse = -inf: the row saw no key; +inf makes every P of the row 2^-inf = 0 (never NaN)
      l = lse == -INFINITY ? INFINITY : lse * kLog2e;
      if (kDelta) d = bp.delta[b * bp.de_bs + h * bp.de_hs + (r0 + tid) * bp.de_rs];
    }
    sm.lse[tid] = l;
    sm.delta[tid] = d;
  }
}

// Phase 1 for the tile (query rows row0.., keys n0..) in shared memory: S = Q K^T and dP = dO V^T,
// then P' (if kWriteP) and dS, in 16 bits, to sm.p and sm.ds as (query, key) row-major tiles.
// need_mask: some row of the tile sees only part of its keys (causal, window, sequence end).
// kAlibi: slope_log2 is ALiBi's slope of this (batch, head) times log2(e); the bias is a constant of
// the scores, so it enters P (as in the forward, after softcap) and nothing else.  A template flag,
// so that calls without ALiBi keep the kernels' registers as they were (the D = 256 dK/dV kernel is
// at the 255 limit: its ALiBi variant spills 20 bytes, docs/cuda.md).
// kRowSum (bwd_delta_kernel): nothing is written; rowsum[r] and psum[r] (rows 16 (w & 3) + g + 8 r)
// get this thread's shares of sum_j P_ij dP'_ij and of sum_j P_ij instead, with P and dP' (dP / (1 - p)
// where kept, else 0) as the dS below reads them.
template <typename T, int kD, bool kWriteP, bool kAlibi, bool kRowSum = false>
__device__ __forceinline__ void tile_ds(const FwdParams& p, const BwdSmem<T, kD>& sm, int row0, int n0, int q_len,
                                        int k_len, bool need_mask, float slope_log2, uint64_t drop_row0,
                                        uint64_t seed, uint64_t offset, float* rowsum = nullptr,
                                        float* psum = nullptr) {
  using Ops = MmaOps<T>;
  using L = BwdLayout<kD>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3, mi = lane >> 3, mr = lane & 7;
  const int wm = warp & 3, wn = warp >> 2;  // queries 16 wm .., keys 32 wn ..

  float s[4][4], dp[4][4];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
  // A operands (Q, dO rows) and B operands (K, V rows: B[k][n] = K[n][k]), as in the forward
  const uint32_t qa = smem_u32(sm.q + (16 * wm + mr + (mi & 1) * 8) * L::kLd + (mi >> 1) * 8);
  const uint32_t da = smem_u32(sm.dout + (16 * wm + mr + (mi & 1) * 8) * L::kLd + (mi >> 1) * 8);
  const uint32_t kb = smem_u32(sm.k + (32 * wn + mr + (mi >> 1) * 8) * L::kLd + (mi & 1) * 8);
  const uint32_t vb = smem_u32(sm.v + (32 * wn + mr + (mi >> 1) * 8) * L::kLd + (mi & 1) * 8);
#pragma unroll 2
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t a[4], bf[4];
    ldmatrix_x4(a, qa + kk * 32);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      ldmatrix_x4(bf, kb + np * 16 * L::kRowBytes + kk * 32);
      Ops::mma(s[2 * np], a, bf[0], bf[1]);
      Ops::mma(s[2 * np + 1], a, bf[2], bf[3]);
    }
    ldmatrix_x4(a, da + kk * 32);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      ldmatrix_x4(bf, vb + np * 16 * L::kRowBytes + kk * 32);
      Ops::mma(dp[2 * np], a, bf[0], bf[1]);
      Ops::mma(dp[2 * np + 1], a, bf[2], bf[3]);
    }
  }

  // keep bit 4 nt + e for element e of key tile nt (the forward drew the same ones)
  uint32_t keep = 0xffffffffu;
  if (p.dropout) {
    keep = 0;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
      keep |= dropout_keep4(seed, offset, drop_row0 + (uint64_t)(16 * wm + g), n0 + 32 * wn + 8 * nt, lane,
                            p.drop_threshold)
              << (4 * nt);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 16 * wm + g + 8 * r;  // in the tile
    const float lse2 = sm.lse[row], delta = sm.delta[row];
    int lo = 0, hi = k_len;
    if (need_mask) row_range(p, row0 + row, q_len, k_len, lo, hi);
    const int ii = row0 + row + k_len - q_len;  // ALiBi's bottom-right alignment, per sequence
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = 32 * wn + 8 * nt + 2 * t;
      float pv[2], dsv[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int idx = 2 * r + e;
        const float x = s[nt][idx];
        float th = 0.0f, sl;
        if (p.softcap > 0.0f) {  // the forward's formula, so P matches it to the last bit
          th = tanh_from_exp2y(fast_exp2(x * p.softcap_in));
          sl = th * p.softcap_log2;
        } else {
          sl = x * p.scale_log2;
        }
        if (kAlibi) {  // the forward's alibi_tile: the same float operations
          const int d = ii - (n0 + col + e);
          sl -= slope_log2 * (float)(d < 0 ? -d : d);
        }
        float pr = fast_exp2(sl - lse2);
        if (need_mask) {
          const int key = n0 + col + e;
          if (key < lo || key >= hi) pr = 0.0f;
        }
        const bool kept = (keep >> (4 * nt + idx)) & 1u;
        const float dpz = kept ? dp[nt][idx] * p.rdrop : 0.0f;
        if (kRowSum) {
          rowsum[r] += pr * dpz;
          psum[r] += pr;
          continue;
        }
        pv[e] = kept ? pr * p.rdrop : 0.0f;
        float ds = pr * (dpz - delta);
        if (p.softcap > 0.0f) ds *= 1.0f - th * th;
        dsv[e] = pr == 0.0f ? 0.0f : ds;  // hidden or underflowed keys contribute nothing
      }
      if (kRowSum) continue;
      if (kWriteP) *reinterpret_cast<uint32_t*>(sm.p + row * L::kLdS + col) = Ops::pack(pv[0], pv[1]);
      *reinterpret_cast<uint32_t*>(sm.ds + row * L::kLdS + col) = Ops::pack(dsv[0], dsv[1]);
    }
  }
}

// Phase 2: dv += P'^T dO and dk += dS^T Q for this warp's 16 keys x kD / 2 head dims.  The A
// operands (P'^T, dS^T: keys as rows) are the (query, key) tiles read with ldmatrix.trans; the B
// operands (dO, Q: queries as the k dimension) are read like V in the forward.
template <typename T, int kD>
__device__ __forceinline__ void tile_dkv(float dk[kD / 16][4], float dv[kD / 16][4], const BwdSmem<T, kD>& sm) {
  using Ops = MmaOps<T>;
  using L = BwdLayout<kD>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int mi = lane >> 3, mr = lane & 7;
  const int wm = warp & 3, wn = warp >> 2;  // keys 16 wm .., head dims wn kD/2 ..
  // A = M^T from M stored (query, key): matrix i covers queries +8 (i >> 1), keys +8 (i & 1)
  const uint32_t pa = smem_u32(sm.p + (mr + (mi >> 1) * 8) * L::kLdS + 16 * wm + (mi & 1) * 8);
  const uint32_t sa = smem_u32(sm.ds + (mr + (mi >> 1) * 8) * L::kLdS + 16 * wm + (mi & 1) * 8);
  const uint32_t db = smem_u32(sm.dout + (mr + (mi & 1) * 8) * L::kLd + wn * (kD / 2) + (mi >> 1) * 8);
  const uint32_t qb = smem_u32(sm.q + (mr + (mi & 1) * 8) * L::kLd + wn * (kD / 2) + (mi >> 1) * 8);
#pragma unroll
  for (int kk = 0; kk < kBwdBM / 16; ++kk) {
    uint32_t a[4], bf[4];
    ldmatrix_x4_trans(a, pa + kk * 16 * L::kRowBytesS);
#pragma unroll
    for (int dp = 0; dp < kD / 32; ++dp) {
      ldmatrix_x4_trans(bf, db + kk * 16 * L::kRowBytes + dp * 32);
      Ops::mma(dv[2 * dp], a, bf[0], bf[1]);
      Ops::mma(dv[2 * dp + 1], a, bf[2], bf[3]);
    }
    ldmatrix_x4_trans(a, sa + kk * 16 * L::kRowBytesS);
#pragma unroll
    for (int dp = 0; dp < kD / 32; ++dp) {
      ldmatrix_x4_trans(bf, qb + kk * 16 * L::kRowBytes + dp * 32);
      Ops::mma(dk[2 * dp], a, bf[0], bf[1]);
      Ops::mma(dk[2 * dp + 1], a, bf[2], bf[3]);
    }
  }
}

// Phase 3: acc += dS K for this warp's 16 query rows x kTiles n8 tiles of head dims from col0.
// A = dS (query, key) row-major (plain ldmatrix); B[k][n] = K[key k][dim n] (.trans, like V).
template <typename T, int kD, int kTiles>
__device__ __forceinline__ void tile_dq(float acc[kTiles][4], const BwdSmem<T, kD>& sm, int col0) {
  using Ops = MmaOps<T>;
  using L = BwdLayout<kD>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int mi = lane >> 3, mr = lane & 7, wm = warp & 3;
  const uint32_t aa = smem_u32(sm.ds + (16 * wm + mr + (mi & 1) * 8) * L::kLdS + (mi >> 1) * 8);
  const uint32_t kb = smem_u32(sm.k + (mr + (mi & 1) * 8) * L::kLd + col0 + (mi >> 1) * 8);
#pragma unroll
  for (int kk = 0; kk < kBwdBN / 16; ++kk) {
    uint32_t a[4], bf[4];
    ldmatrix_x4(a, aa + kk * 32);
#pragma unroll
    for (int dp = 0; dp < kTiles / 2; ++dp) {
      ldmatrix_x4_trans(bf, kb + kk * 16 * L::kRowBytes + dp * 32);
      Ops::mma(acc[2 * dp], a, bf[0], bf[1]);
      Ops::mma(acc[2 * dp + 1], a, bf[2], bf[3]);
    }
  }
}

// Writes a warp's accumulator tile (16 rows from row0 + 16 (w & 3), n8 tiles from col0) times
// `mul` as 16-bit pairs; rows >= rows_valid and columns >= cols_valid are skipped.
template <typename T, int kTiles>
__device__ __forceinline__ void store_acc_tile(T* base, int64_t row_stride, const float acc[kTiles][4], float mul,
                                               int row0, int rows_valid, int col0, int cols_valid) {
  using Ops = MmaOps<T>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 16 * (warp & 3) + g + 8 * r;
    if (row >= rows_valid) continue;
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      const int col = col0 + 8 * nt + 2 * t;
      if (col < cols_valid)
        *reinterpret_cast<uint32_t*>(base + (int64_t)row * row_stride + col) =
            Ops::pack(acc[nt][2 * r] * mul, acc[nt][2 * r + 1] * mul);
    }
  }
}

// A query tile's walk over the key tiles its rows see, as the delta and dQ kernels take it (one block per
// (query tile, head, batch), block index m_block + m_blocks (h + Hq b)).
struct RowTile {
  int64_t b;
  int h, hk;
  Seq sq;
  int row0, rows;
  int lo_last, hi_first;  // the last row's first key, the first row's end: tiles inside both need no mask
  int j_begin, j_end;     // the key tiles some row sees
  uint64_t seed, offset, drop_row0;
  float slope_log2;       // ALiBi's, base 2 (0 without)
  __device__ __forceinline__ bool need_mask(int n0) const { return n0 < lo_last || n0 + kBwdBN > hi_first; }
};

// This block's tile; false when it lies past its sequence's end (a packed sequence shorter than max_seqlen_q).
template <bool kAlibi>
__device__ __forceinline__ bool row_tile(const FwdParams& p, RowTile& rt) {
  const int64_t bid = blockIdx.x;
  const int m_block = (int)(bid % p.m_blocks);
  const int64_t bh = bid / p.m_blocks;
  rt.h = (int)(bh % p.Hq);
  rt.b = bh / p.Hq;
  rt.hk = rt.h / p.group;
  rt.sq = seq_of(p, rt.b);
  rt.row0 = m_block * kBwdBM;
  if (rt.row0 >= rt.sq.q_len) return false;
  rt.rows = min(kBwdBM, rt.sq.q_len - rt.row0);
  int n_lo, n_hi;
  row_range(p, rt.row0, rt.sq.q_len, rt.sq.k_len, n_lo, rt.hi_first);
  row_range(p, rt.row0 + rt.rows - 1, rt.sq.q_len, rt.sq.k_len, rt.lo_last, n_hi);
  rt.j_begin = n_lo / kBwdBN;
  rt.j_end = n_hi > n_lo ? (n_hi + kBwdBN - 1) / kBwdBN : rt.j_begin;
  rt.seed = rt.offset = 0;
  if (p.dropout) ab_cuda_rng(p, rt.seed, rt.offset);
  rt.drop_row0 = ((uint64_t)rt.b * p.Hq + rt.h) * (uint64_t)p.Sq + (uint64_t)rt.row0;
  rt.slope_log2 = kAlibi ? alibi_slope_log2(p, rt.b, rt.h) : 0.0f;
  return true;
}

// K and V of the key tile at n0 into shared memory, waited for and visible to the block.
template <typename T, int kD>
__device__ __forceinline__ void load_key_tile(const FwdParams& p, const BwdSmem<T, kD>& sm, const RowTile& rt, int n0,
                                              int tid) {
  const int64_t r0 = rt.sq.k_start + n0;
  load_tile<T, kBwdBN, kD, kBwdThreads>(sm.k, static_cast<const T*>(p.k) + rt.b * p.k_bs + rt.hk * p.k_hs + r0 * p.k_rs,
                                        p.k_rs, rt.sq.k_len - n0, p.D, tid);
  load_tile<T, kBwdBN, kD, kBwdThreads>(sm.v, static_cast<const T*>(p.v) + rt.b * p.v_bs + rt.hk * p.v_hs + r0 * p.v_rs,
                                        p.v_rs, rt.sq.k_len - n0, p.Dv, tid);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
}

// delta_i = sum_j P'_ij dP_ij / Z_i - dlse_i (= dout_i . out_i - dlse_i before out's rounding) for the
// rows of one query tile, Z_i = sum_j P_ij + the sink's weight: the P recomputed from the float32 lse
// are the true ones times 2^(lse's rounding) (1 +- a few 1e-6 at logits near 30), and without Z a
// one-hot row's dS = P (dP - P dP) kept that factor's distance from 1 times dP (dq 3e-4 where the
// true one is 2e-11).  The key tiles the rows see, in order; each thread sums its elements of a row,
// the row's four lanes and then its two warps (keys 0..31, 32..63 of each tile) are added in a fixed
// order.  Every row of the tile is written, those that see no key too (delta = -dlse).
template <typename T, int kD, bool kAlibi>
__global__ void __launch_bounds__(kBwdThreads) bwd_delta_kernel(const BwdParams bp) {
  const FwdParams& p = bp.f;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const BwdSmem<T, kD> sm(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, wm = warp & 3, wn = warp >> 2;

  RowTile rt;
  if (!row_tile<kAlibi>(p, rt)) return;
  const int rows = rt.rows;
  load_query_tile<T, kD, false>(bp, sm, rt.b, rt.h, rt.sq, rt.row0, tid);

  float rowsum[2] = {0.0f, 0.0f}, psum[2] = {0.0f, 0.0f};
  for (int j = rt.j_begin; j < rt.j_end; ++j) {
    const int n0 = j * kBwdBN;
    load_key_tile<T, kD>(p, sm, rt, n0, tid);
    tile_ds<T, kD, false, kAlibi, true>(p, sm, rt.row0, n0, rt.sq.q_len, rt.sq.k_len, rt.need_mask(n0), rt.slope_log2,
                                        rt.drop_row0, rt.seed, rt.offset, rowsum, psum);
    __syncthreads();  // K and V are refilled by the next iteration
  }
  cp_async_wait<0>();

  // the row's four lanes (t), then its two warps (wn), through shared memory (sm.p is free here)
  float* part = reinterpret_cast<float*>(sm.p);  // [2][kBwdBM] of rowsum, then [2][kBwdBM] of psum
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float x = rowsum[r], y = psum[r];
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    y += __shfl_xor_sync(0xffffffffu, y, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    y += __shfl_xor_sync(0xffffffffu, y, 2);
    if (t == 0) {
      part[wn * kBwdBM + 16 * wm + g + 8 * r] = x;
      part[(2 + wn) * kBwdBM + 16 * wm + g + 8 * r] = y;
    }
  }
  __syncthreads();
  if (tid < rows) {
    const int64_t r = rt.sq.q_start + rt.row0 + tid, b = rt.b;
    const int h = rt.h;
    float z = part[2 * kBwdBM + tid] + part[3 * kBwdBM + tid];
    // the sink's weight, as P is recomputed: 2^(sink log2(e) - lse log2(e)) (0 for a row that saw nothing)
    if (p.sinks != nullptr) z += fast_exp2(p.sinks[h] * kLog2e - sm.lse[tid]);
    float d = z > 0.0f ? (part[tid] + part[kBwdBM + tid]) / z : 0.0f;
    if (bp.dlse != nullptr) d -= bp.dlse[b * bp.dl_bs + h * bp.dl_hs + r * bp.dl_rs];
    bp.delta[b * bp.de_bs + h * bp.de_hs + r * bp.de_rs] = d;
  }
}

template <typename T, int kD, bool kAlibi>
__global__ void __launch_bounds__(kBwdThreads) bwd_dkv_kernel(const BwdParams bp) {
  const FwdParams& p = bp.f;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const BwdSmem<T, kD> sm(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, wm = warp & 3, wn = warp >> 2;

  const int64_t bid = blockIdx.x;
  const int n_block = (int)(bid % bp.n_blocks);
  const int64_t bk = bid / bp.n_blocks;
  const int hkv = p.Hq / p.group;
  const int hk = (int)(bk % hkv);
  const int64_t b = bk / hkv;
  const Seq sq = seq_of(p, b);
  const int n0 = n_block * kBwdBN;
  if (n0 >= sq.k_len) return;  // a packed sequence shorter than max_seqlen_k: no rows here

  load_tile<T, kBwdBN, kD, kBwdThreads>(sm.k, static_cast<const T*>(p.k) + b * p.k_bs + hk * p.k_hs + (sq.k_start + n0) * p.k_rs,
                                        p.k_rs, sq.k_len - n0, p.D, tid);
  load_tile<T, kBwdBN, kD, kBwdThreads>(sm.v, static_cast<const T*>(p.v) + b * p.v_bs + hk * p.v_hs + (sq.k_start + n0) * p.v_rs,
                                        p.v_rs, sq.k_len - n0, p.Dv, tid);
  cp_async_commit();

  uint64_t seed = 0, offset = 0;
  if (p.dropout) ab_cuda_rng(p, seed, offset);

  float dk[kD / 16][4], dv[kD / 16][4];
#pragma unroll
  for (int i = 0; i < kD / 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;

  const int m_blocks = (sq.q_len + kBwdBM - 1) / kBwdBM;
  for (int h = hk * p.group; h < (hk + 1) * p.group; ++h) {
    for (int m = 0; m < m_blocks; ++m) {
      const int row0 = m * kBwdBM, rows = min(kBwdBM, sq.q_len - row0);
      // rows' visible ranges are monotone: the first row's lo and the last row's hi bound them
      int lo_first, hi_first, lo_last, hi_last;
      row_range(p, row0, sq.q_len, sq.k_len, lo_first, hi_first);
      row_range(p, row0 + rows - 1, sq.q_len, sq.k_len, lo_last, hi_last);
      if (hi_last <= n0 || lo_first >= n0 + kBwdBN) continue;  // no row of this tile sees these keys
      const bool need_mask = n0 < lo_last || n0 + kBwdBN > hi_first;

      load_query_tile<T, kD>(bp, sm, b, h, sq, row0, tid);
      cp_async_wait<0>();
      __syncthreads();
      const uint64_t drop_row0 = ((uint64_t)b * p.Hq + h) * (uint64_t)p.Sq + (uint64_t)row0;
      tile_ds<T, kD, true, kAlibi>(p, sm, row0, n0, sq.q_len, sq.k_len, need_mask,
                                   kAlibi ? alibi_slope_log2(p, b, h) : 0.0f, drop_row0, seed, offset);
      __syncthreads();
      tile_dkv<T, kD>(dk, dv, sm);
      if (bp.dq_accum != nullptr) {
        // dQ of this tile, 64 head dims at a time (16 floats per thread), added with atomics
        float* acc_base = bp.dq_accum + b * bp.a_bs + h * bp.a_hs + (sq.q_start + row0) * bp.a_rs;
#pragma unroll 1
        for (int c0 = 0; c0 < kD; c0 += 64) {
          float acc[4][4];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
          tile_dq<T, kD, 4>(acc, sm, c0 + 32 * wn);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = 16 * wm + g + 8 * r;
            if (row >= rows) continue;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              const int col = c0 + 32 * wn + 8 * nt + 2 * t;
              if (col < p.D) {
                atomicAdd(acc_base + (int64_t)row * bp.a_rs + col, acc[nt][2 * r]);
                atomicAdd(acc_base + (int64_t)row * bp.a_rs + col + 1, acc[nt][2 * r + 1]);
              }
            }
          }
        }
      }
      __syncthreads();  // the tiles are refilled by the next iteration
    }
  }
  cp_async_wait<0>();  // K and V were never waited for when no query tile sees this key tile

  const int64_t krow0 = sq.k_start + n0;
  store_acc_tile<T, kD / 16>(static_cast<T*>(bp.dk) + b * bp.dk_bs + hk * bp.dk_hs + krow0 * bp.dk_rs, bp.dk_rs, dk,
                             bp.scale, 0, sq.k_len - n0, wn * (kD / 2), p.D);
  store_acc_tile<T, kD / 16>(static_cast<T*>(bp.dv) + b * bp.dv_bs + hk * bp.dv_hs + krow0 * bp.dv_rs, bp.dv_rs, dv,
                             1.0f, 0, sq.k_len - n0, wn * (kD / 2), p.Dv);
}

template <typename T, int kD, bool kAlibi>
__global__ void __launch_bounds__(kBwdThreads) bwd_dq_kernel(const BwdParams bp) {
  const FwdParams& p = bp.f;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const BwdSmem<T, kD> sm(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, wn = warp >> 2;

  RowTile rt;
  if (!row_tile<kAlibi>(p, rt)) return;
  load_query_tile<T, kD>(bp, sm, rt.b, rt.h, rt.sq, rt.row0, tid);

  float acc[kD / 16][4];
#pragma unroll
  for (int i = 0; i < kD / 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;

  for (int j = rt.j_begin; j < rt.j_end; ++j) {  // in order: the sum's order never changes
    const int n0 = j * kBwdBN;
    load_key_tile<T, kD>(p, sm, rt, n0, tid);
    tile_ds<T, kD, false, kAlibi>(p, sm, rt.row0, n0, rt.sq.q_len, rt.sq.k_len, rt.need_mask(n0), rt.slope_log2,
                                  rt.drop_row0, rt.seed, rt.offset);
    __syncthreads();
    tile_dq<T, kD, kD / 16>(acc, sm, wn * (kD / 2));
    __syncthreads();
  }
  cp_async_wait<0>();

  store_acc_tile<T, kD / 16>(
      static_cast<T*>(bp.dq) + rt.b * bp.dq_bs + rt.h * bp.dq_hs + (rt.sq.q_start + rt.row0) * bp.dq_rs, bp.dq_rs, acc,
      bp.scale, 0, rt.rows, wn * (kD / 2), p.D);
}

template <typename T, int kD>
ab_status bwd_launch(const BwdParams& p, int64_t row_blocks, int64_t dkv_blocks, int64_t dq_blocks,
                     cudaStream_t stream, ab_error* err) {
  constexpr size_t kSmem = bwd_smem_bytes(kD);
  const bool alibi = p.f.alibi != nullptr;
  auto delta = alibi ? bwd_delta_kernel<T, kD, true> : bwd_delta_kernel<T, kD, false>;
  auto dkv = alibi ? bwd_dkv_kernel<T, kD, true> : bwd_dkv_kernel<T, kD, false>;
  auto dq = alibi ? bwd_dq_kernel<T, kD, true> : bwd_dq_kernel<T, kD, false>;
  ab_status st = prepare_smem(delta, kSmem, "flash backward", kD, err);
  if (st != AB_OK) return st;
  if ((st = prepare_smem(dkv, kSmem, "flash backward", kD, err)) != AB_OK) return st;
  if ((st = prepare_smem(dq, kSmem, "flash backward", kD, err)) != AB_OK) return st;
  if (row_blocks > 0) {
    AB_LAUNCH((unsigned)row_blocks, kBwdThreads, kSmem, stream, delta)(p);
    st = ab_cuda_check(cudaGetLastError(), "flash_bwd delta launch", err);
    if (st != AB_OK) return st;
  }
  if (dkv_blocks > 0) {
    AB_LAUNCH((unsigned)dkv_blocks, kBwdThreads, kSmem, stream, dkv)(p);
    st = ab_cuda_check(cudaGetLastError(), "flash_bwd dkv launch", err);
    if (st != AB_OK) return st;
  }
  if (dq_blocks > 0) {
    AB_LAUNCH((unsigned)dq_blocks, kBwdThreads, kSmem, stream, dq)(p);
    st = ab_cuda_check(cudaGetLastError(), "flash_bwd dq launch", err);
  }
  return st;
}

}  // namespace ab_flash

#endif  // AB_FLASH_BWD_KERNEL_CUH
