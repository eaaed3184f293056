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
// elements of P after the sum l is taken, from the shared Philox stream (same mask as the CPU).
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

#include "flash_common.cuh"
#include "flash_fwd.cuh"

namespace ab_flash {

constexpr int kWarps = kFwdThreads / 32;

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
  uint64_t seed = 0, offset = 0;
  if (kDropout) rng_pair(p, seed, offset);
  // dropout row index (ab_philox.h) of this tile's row 0: Sq is max_seqlen_q for packed calls
  const uint64_t drop_row0 = ((uint64_t)b * p.Hq + h) * (uint64_t)p.Sq + (uint64_t)row0;

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

    // Dropout: bit 4 nt + e of keep[mt] keeps element c[e] of key tile nt (dropout_keep4).  The
    // running sum l is of the weights before dropout; only P V sees the dropped ones, and O is
    // scaled by 1 / (1 - dropout_p) with 1 / l at the end.
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
        const uint32_t kb = keep[mt] >> (4 * nt + e0);
        pk[mt][nt][r & 1] = Ops::pack(kb & 1u ? p0 : 0.0f, kb & 2u ? p1 : 0.0f);
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
    const float inv = l == 0.0f ? 0.0f : p.rdrop / l;  // rdrop = 1 / (1 - dropout_p), 1 without
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

template <typename T, int kD, int kBM, int kBN, bool kDropout>
ab_status fwd_launch_config(const FwdParams& p, int64_t blocks, cudaStream_t stream, ab_error* err) {
  constexpr size_t kSmem = fwd_smem_bytes(kD, kBM, kBN);
  auto kernel = fwd_kernel<T, kD, kBM, kBN, kDropout>;
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

template <typename T, int kD>
ab_status fwd_launch(const FwdParams& p, int64_t blocks, cudaStream_t stream, ab_error* err) {
  if (p.dropout)
    return fwd_launch_config<T, kD, FwdTile<kD>::kBMDropout, FwdTile<kD>::kBN, true>(p, blocks, stream, err);
  return fwd_launch_config<T, kD, FwdTile<kD>::kBM, FwdTile<kD>::kBN, false>(p, blocks, stream, err);
}

}  // namespace ab_flash

#endif  // AB_FLASH_FWD_KERNEL_CUH
