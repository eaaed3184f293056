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
// registers); O is rescaled when the max grows and divided by l once at the end.  Dropout zeroes
// elements of P after the sum l is taken, from the shared Philox stream (same mask as the CPU); it
// is a template flag, so the kernel without it pays nothing.
//
// Included only by flash_fwd_hdim*.cu, which instantiate fwd_launch<T, kD>.  Semantics (causal
// alignment, window, softcap, attention sinks, ALiBi, lse, fully masked rows) follow docs/semantics.md
// and the CPU twin csrc/cpu/flash_fwd_impl.h.  The per-tile steps after the scores (masking, online softmax, P V)
// and the epilogue are in fwd_common.cuh, shared with the sage kernel; the PTX wrappers, tile loader
// and dropout bits in flash_common.cuh, shared with the backward too.
#ifndef AB_FLASH_FWD_KERNEL_CUH
#define AB_FLASH_FWD_KERNEL_CUH

#include "fwd_common.cuh"

namespace ab_flash {

// ---- the kernel ---------------------------------------------------------------------------------

template <typename T, int kD, int kBM, int kBN, bool kDropout>
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

  BlockTiles bt;
  if (!block_tiles<kBM, kBN>(p, bt)) return;
  const T* q = static_cast<const T*>(p.q) + bt.b * p.q_bs + bt.h * p.q_hs + (bt.q_start + bt.row0) * p.q_rs;
  const T* k = static_cast<const T*>(p.k) + bt.b * p.k_bs + bt.hk * p.k_hs + bt.k_start * p.k_rs;
  const T* v = static_cast<const T*>(p.v) + bt.b * p.v_bs + bt.hk * p.v_hs + bt.k_start * p.v_rs;
  const int k_len = bt.k_len, j_begin = bt.j_begin, j_end = bt.j_end;
  uint64_t seed = 0, offset = 0;
  if (kDropout) ab_cuda_rng(p, seed, offset);
  // dropout row index (ab_philox.h) of this tile's row 0: Sq is max_seqlen_q for packed calls
  const uint64_t drop_row0 = ((uint64_t)bt.b * p.Hq + bt.h) * (uint64_t)p.Sq + (uint64_t)bt.row0;

  float o[kMT][kDT][4], row_m[2 * kMT], row_l[2 * kMT];  // see softmax_tile
  init_rows<kMT, kDT>(o, row_m, row_l);
  if (p.sinks != nullptr) sink_rows<kMT>(p, bt.h, t, row_m, row_l);
  // ALiBi's slope in base-2 units (0: none), one per block
  const float slope_log2 =
      p.alibi != nullptr ? p.alibi[bt.b * p.alibi_bs + bt.h * p.alibi_hs] * 1.4426950408889634f : 0.0f;

  // Prologue: Q and the first K tile in one cp.async group.
  load_tile<T, kBM, kD>(sQ, q, p.q_rs, bt.rows_here, p.D, tid);
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
    zero_tiles(s);
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
    // The branches are block-uniform and kept outside the element loops: a per-element select
    // would evaluate both sides and cost registers.
    if (p.softcap > 0.0f) {
      softcap_tile<kMT, kNT>(s, p.softcap_in, p.softcap_log2);  // raw q . k in: softcap_in has the scale
    } else {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] *= p.scale_log2;
    }
    if (slope_log2 != 0.0f) alibi_tile<kMT, kNT>(s, slope_log2, bt, n0, warp * 16 * kMT, g, t);
    if (n0 < bt.lo_max || n0 + kBN > bt.hi_min) mask_tile<kMT, kNT>(p, bt, s, n0, warp * 16 * kMT, g, t);

    // Dropout's keep bits (see softmax_tile); all ones without dropout.
    uint32_t keep[kMT];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) keep[mt] = 0xffffffffu;
    if (kDropout) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const uint64_t row_g = drop_row0 + (uint64_t)(warp * 16 * kMT + 16 * mt + g);
        uint32_t bits = 0;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
          bits |= dropout_keep4(seed, offset, row_g, n0 + 8 * nt, lane, p.drop_threshold) << (4 * nt);
        keep[mt] = bits;
      }
    }

    uint32_t pk[kMT][kNT][2];
    softmax_tile<T, kMT, kNT, kDT>(s, row_m, row_l, o, pk, keep);

    cp_async_wait<1>();  // all but K[j+1]: V[j] has landed
    __syncthreads();
    pv_tile<T, kMT, kNT, kDT>(pk, o, v_addr, kRowBytes);
    __syncthreads();  // every warp is done with V[j] (and K[j+1]'s group is still in flight)
  }

  cp_async_wait<0>();
  __syncthreads();  // Q's tile is no longer read by any warp (and no copy into it is pending)
  store_out<T, kD, kBM, kMT, kDT>(p, bt, o, row_m, row_l, sQ, warp, g, t, tid);
}

// ---- launch -------------------------------------------------------------------------------------

template <typename T, int kD, int kBM, int kBN, bool kDropout>
ab_status fwd_launch_config(const FwdParams& p, int64_t blocks, cudaStream_t stream, ab_error* err) {
  constexpr size_t kSmem = fwd_smem_bytes(kD, kBM, kBN);
  auto kernel = fwd_kernel<T, kD, kBM, kBN, kDropout>;
  const ab_status st = prepare_smem(kernel, kSmem, "flash", kD, err);
  if (st != AB_OK) return st;
  AB_LAUNCH((unsigned)blocks, kFwdThreads, kSmem, stream, kernel)(p);
  return ab_cuda_check(cudaGetLastError(), "flash_fwd launch", err);
}

template <typename T, int kD>
ab_status fwd_launch(const FwdParams& p, int64_t blocks, cudaStream_t stream, ab_error* err) {
  if (p.dropout)
    return fwd_launch_config<T, kD, FwdTile<kD>::kBMDropout, FwdTile<kD>::kBN, true>(p, blocks, stream, err);
  return fwd_launch_config<T, kD, FwdTile<kD>::kBM, FwdTile<kD>::kBN, false>(p, blocks, stream, err);
}

}  // namespace ab_flash

#endif  // AB_FLASH_FWD_KERNEL_CUH
