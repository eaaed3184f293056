// fwd_common.cuh -- what the flash forward (flash_fwd_kernel.cuh) and the sage forward
// (sage_fwd_kernel.cuh) kernels share on top of flash_common.cuh: the block -> tile mapping and the
// steps of one key tile after the scores exist (masking, online softmax, O += P V) and the
// epilogue.  Both kernels use the same block shape (4 warps, each owning kBM / 4 query rows) and the
// same m16n8 accumulator layout for S, so everything from the float scores on is one code.
#ifndef AB_FWD_COMMON_CUH
#define AB_FWD_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "flash_common.cuh"
#include "flash_fwd.cuh"

namespace ab_flash {

constexpr int kWarps = kFwdThreads / 32;

// ---- one block's share of the problem -----------------------------------------------------------

// Which (query tile, head, batch) a block computes and the key tiles it visits.
struct BlockTiles : Seq {  // Seq: this sequence's first rows in the tensors and its lengths
  int64_t b;
  int h, hk;
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
  static_cast<Seq&>(bt) = seq_of(p, bt.b);
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

// Zeroes a warp's M x N accumulator tiles (float scores and O, or int32 sage scores).
template <typename A, int M, int N>
__device__ __forceinline__ void zero_tiles(A (&x)[M][N][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[m][n][e] = A(0);
}

// O = 0, and no row has seen a key yet (running max -inf, sum 0).
template <int kMT, int kDT>
__device__ __forceinline__ void init_rows(float (&o)[kMT][kDT][4], float (&row_m)[2 * kMT],
                                          float (&row_l)[2 * kMT]) {
  zero_tiles(o);
#pragma unroll
  for (int r = 0; r < 2 * kMT; ++r) {
    row_m[r] = -INFINITY;
    row_l[r] = 0.0f;
  }
}

// Attention sinks: each row starts with the sink's logit (base 2) as its running max and one term
// 2^0 in its sum, held by lane t == 0 (the four lanes of a row add their parts in the epilogue); the
// sink has no value, so O starts at 0.  A row that then sees no key ends with out 0, lse = sink.
template <int kMT>
__device__ __forceinline__ void sink_rows(const FwdParams& p, int h, int t, float (&row_m)[2 * kMT],
                                          float (&row_l)[2 * kMT]) {
  const float s = p.sinks[h] * 1.4426950408889634f;
#pragma unroll
  for (int r = 0; r < 2 * kMT; ++r) {
    row_m[r] = s;
    row_l[r] = t == 0 && s != -INFINITY ? 1.0f : 0.0f;
  }
}

// ALiBi over a tile of base-2 scores: s -= slope log2(e) |i + Sk - Sq - j|, flash-attn's alignment
// (per sequence for packed calls).  The distance is an exact integer until the float conversion.
template <int kMT, int kNT>
__device__ __forceinline__ void alibi_tile(float (&s)[kMT][kNT][4], float slope_log2, const BlockTiles& bt, int n0,
                                           int warp_row0, int g, int t) {
#pragma unroll
  for (int r = 0; r < 2 * kMT; ++r) {
    const int ii = bt.row0 + warp_row0 + 16 * (r >> 1) + g + 8 * (r & 1) + bt.k_len - bt.q_len;
    const int mt = r >> 1, e0 = 2 * (r & 1);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = e0; e < e0 + 2; ++e) {
        const int d = ii - (n0 + 8 * nt + 2 * t + (e & 1));
        s[mt][nt][e] -= slope_log2 * (float)(d < 0 ? -d : d);
      }
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
// Dropout: bit 4 nt + e of keep[mt] keeps element c[e] of key tile nt (dropout_keep4; all ones
// without dropout, which the compiler folds away).  The running sum l is of the weights before
// dropout; only P V sees the dropped ones, and the epilogue scales O by 1 / (1 - dropout_p).
template <typename T, int kMT, int kNT, int kDT>
__device__ __forceinline__ void softmax_tile(float (&s)[kMT][kNT][4], float (&row_m)[2 * kMT],
                                             float (&row_l)[2 * kMT], float (&o)[kMT][kDT][4],
                                             uint32_t (&pk)[kMT][kNT][2], const uint32_t (&keep)[kMT]) {
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
      const uint32_t kb = keep[mt] >> (4 * nt + e0);
      pk[mt][nt][r & 1] = MmaOps<T>::pack(kb & 1u ? p0 : 0.0f, kb & 2u ? p1 : 0.0f);
    }
    row_l[r] = row_l[r] * alpha + sum;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      o[mt][dt][e0] *= alpha;
      o[mt][dt][e0 + 1] *= alpha;
    }
  }
}

// The same without dropout (every element kept).
template <typename T, int kMT, int kNT, int kDT>
__device__ __forceinline__ void softmax_tile(float (&s)[kMT][kNT][4], float (&row_m)[2 * kMT],
                                             float (&row_l)[2 * kMT], float (&o)[kMT][kDT][4],
                                             uint32_t (&pk)[kMT][kNT][2]) {
  uint32_t keep[kMT];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) keep[mt] = 0xffffffffu;
  softmax_tile<T, kMT, kNT, kDT>(s, row_m, row_l, o, pk, keep);
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
    const float inv = l == 0.0f ? 0.0f : p.rdrop / l;  // rdrop = 1 / (1 - dropout_p), 1 without
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

}  // namespace ab_flash

#endif  // AB_FWD_COMMON_CUH
