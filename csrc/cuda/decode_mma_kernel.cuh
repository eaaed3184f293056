// decode_mma_kernel.cuh -- the KV-cache attention on tensor cores (docs/decode.md, "The CUDA
// kernel"): attend_mma_kernel, for float16 and bfloat16 caches, the same call and semantics as
// attend_kernel (decode_kernel.cuh), whose cache write, split merge, row checks and epilogue it
// shares.  Included by decode.cu only, which picks one of the two per call.
//
// One block of 4 warps per (split of the key range, KV head and tile of 16 query rows, batch row),
// as attend_kernel's blocks.  The 16 query rows (tokens x the query heads of the KV head; rows past
// the call's are zeros) are one m16 tile; the keys stream through shared memory in tiles of
// kMmaKeys = 64 by cp.async, kStages tiles deep, so that kStages - 1 tiles are in flight while one
// is computed whatever the registers hold (the bytes in flight set a decode step's speed).  Each
// warp takes 16 keys of a tile: S = Q K^T is two m16n8 accumulators (mma.sync m16n8k16, fp32
// accumulation), the online softmax runs on them in registers, and O += P V is one k16 step of
// mma over the head dim.  The warps keep their own (max, sum, O) and merge once at the end
// (write_rows).  No shuffle sums a score and no lane repeats another's softmax: the arithmetic per
// key is a few tensor-core instructions, where attend_kernel's lanes summed every score over 16
// lanes and each repeated the softmax's scalar steps (decode.md: 16-bit decode was bound by that).
//
// Precision: the products take 16-bit operands, as torch's and flash-attn's kernels do, but the
// operands that are not the cache's own values are split in two, hi + lo (hi = x rounded to 16
// bits, lo = the rest rounded), and both halves multiplied: P for O += P V always, and the rotated
// queries (queries without rotary are the caller's 16-bit values, exact).  Everything else is
// float32, as in attend_kernel; the scale multiplies the float32 score (bfloat16: q is multiplied by the
// scale's power of two below 1 first, exactly, and the score by the rest).
//
// The default for 16-bit calls with two query rows or more per KV head since its H200 run of
// 2026-12-04 (decode.cu variant_of: 2.2-2.3x attend_kernel's speed in GQA, yet 0.40-0.51x torch's,
// bound by latency at 8 warps an SM; docs/benchmarks.md, "Third GPU run"); the CUDA emulator runs it
// in every CI run.
#ifndef AB_DECODE_MMA_KERNEL_CUH
#define AB_DECODE_MMA_KERNEL_CUH

#include <type_traits>

#include "decode_kernel.cuh"
#include "flash_common.cuh"

namespace {

constexpr int kMmaRows = 16;  // query rows per block: one m16 tile
constexpr int kMmaKeys = 64;  // keys per tile: 16 per warp
static_assert(kMmaKeys == 16 * kWarps, "each warp takes 16 keys of a tile");

// Tiles in shared memory at once (kStages - 1 in flight while one is computed), chosen by decode.cu
// (mma_stages): 4 at head dim 64 and 2 at 128, 78 KiB a block, which every sm_80+ device gives
// (sm_86 and sm_89: 99 KiB); 3 at 128 where two such blocks of 111 KiB fit an SM (sm_90: 227 KiB a
// block), two tiles in flight per block at no cost in blocks per SM; 2 at 256, 135 KiB (sm_80 and
// sm_90; decode.cu keeps attend_kernel where a device gives less).
// Dynamic shared memory: the K and V stages, then Q's hi half, then one int (16 bytes), then Q's lo
// half, which only rotated queries have (lo: rotary tables given; a call without them is launched
// without it, which at head dim 64 lets an sm_90 hold three blocks instead of two); after the key loop
// the warps' (O, max, sum) reuse the stages (the kernel checks they fit).
__host__ __device__ constexpr size_t mma_stage_bytes(int kD, int stages) {
  return (size_t)stages * 2 * kMmaKeys * (kD + ab_flash::kSmemPad) * 2;
}
__host__ __device__ constexpr size_t mma_smem_bytes(int kD, int stages, bool lo) {
  return mma_stage_bytes(kD, stages) + (size_t)(lo ? 2 : 1) * kMmaRows * (kD + ab_flash::kSmemPad) * 2 + 16;
}

// hi and lo halves of a pair (lower column first): hi = (x0, x1) rounded to T, lo = the remainders
// rounded to T; hi + lo holds about 16 significant bits.
template <typename T>
__device__ __forceinline__ void split_pack(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const T h0 = from_f<T>(x0), h1 = from_f<T>(x1);
  hi = ab_flash::MmaOps<T>::pack(to_f(h0), to_f(h1));
  lo = ab_flash::MmaOps<T>::pack(x0 - to_f(h0), x1 - to_f(h1));
}

// grid (nsplit * B, Hkv * row_tiles) with row_tiles = ceil(rows / 16), kThreads threads, dynamic
// shared memory mma_smem_bytes(kD, kStages, rotary tables given).  kD: the head dim rounded up to 64, 128 or 256
// (columns past D are zeros in Q, K and V).  Index values out of range, and keys in blocks the
// table does not name, make rows NaN as in attend_kernel.
template <typename T, int kD, int kStages>
__global__ void __launch_bounds__(kThreads) attend_mma_kernel(const DecodeParams p) {
  using Ops = ab_flash::MmaOps<T>;
  static_assert(kStages >= 2, "one tile in flight while one is computed");
  constexpr int kLd = kD + ab_flash::kSmemPad;  // padded rows: ldmatrix without bank conflicts
  constexpr uint32_t kRowBytes = kLd * sizeof(T);
  constexpr int kDT = kD / 8;                   // n8 tiles of O over the head dim
  constexpr int kChunks = kD * (int)sizeof(T) / 16;  // 16-byte chunks of a row
  static_assert(sizeof(T) == 2, "16-bit caches");
  static_assert(kD % 32 == 0 && (kD / 8) % 2 == 0, "ldmatrix.x4 pairs and the odd padded row stride");
  static_assert(2 * kMmaKeys == kThreads, "two threads copy each key of a tile");
  static_assert(mma_stage_bytes(kD, kStages) >= sizeof(float) * kWarps * kMmaRows * (kD + 8 + 2),
                "the warps' partial results fit where the stages were");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);  // (kStages, kMmaKeys, kLd)
  T* sV = sK + kStages * kMmaKeys * kLd;
  T* sQ = sV + kStages * kMmaKeys * kLd;   // (kMmaRows, kLd) hi
  int* holes = reinterpret_cast<int*>(sQ + kMmaRows * kLd);
  T* sQlo = reinterpret_cast<T*>(holes + 4);  // (kMmaRows, kLd) lo, with rotary tables only (q_split)

  const int64_t split = blockIdx.x % p.nsplit, b = blockIdx.x / p.nsplit;
  const int64_t hkv = blockIdx.y / p.row_tiles, r0 = (blockIdx.y % p.row_tiles) * kMmaRows;
  const int64_t nr = lmin(kMmaRows, p.rows - r0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  Row r = row_of(p, b);
  const bool bad = !r.ok;
  if (bad) r.seq = r.lo = r.end = r.row = 0;  // no keys

  // the queries, rotated at their positions (not scaled), as hi and lo halves; zeros past the rows
  // and past D.  Unrotated queries are q's own 16-bit values: lo is 0 and its products are skipped.
  const bool q_split = p.rot_half > 0;
  // bfloat16: q times 2**qe, the scale's power of two below 1 (exact wherever the result stays a normal
  // number), and the scores times sscale, the rest of the scale, so that q.k stays within float32's range
  // wherever the scaled score does (q near 1e10 and k near 1e30 under a scale of 1e-39 overflowed the
  // unscaled product, and the row became NaN); the CPU kernel does the same (ab_half.h, ab_bf16_scale_exp).
  // float16's q.k cannot overflow float32.  A scale of 0 makes q 0 (2**-400), so q.k is 0, not inf times 0.
  const int qe = !std::is_same<T, __nv_bfloat16>::value || !isfinite(p.scale) ? 0
                 : p.scale == 0.0f                                            ? -400
                                                                              : min(0, ilogbf(p.scale));
  const float sscale = ldexpf(p.scale, -qe);
  const T* qd = static_cast<const T*>(p.q);
  auto q_at = [&](int rr) {  // element offset of query row r0 + rr of q
    const int64_t tq = (r0 + rr) / p.G, hq = hkv * p.G + (r0 + rr) % p.G;
    return b * p.qs[0] + tq * p.qs[1] + hq * p.qs[2];
  };
  if (!q_split) {
    // every element this thread copies is loaded first, the loads in flight together, then stored:
    // a loop of load-then-store waited for each load in turn (sQlo is not read: q_split is false)
    constexpr int kPer = kMmaRows * kD / kThreads;
    static_assert(kMmaRows * kD % kThreads == 0, "whole rounds of the block's threads");
    T v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = tid + i * kThreads, rr = e / kD, d = e % kD;
      v[i] = rr < nr && d < p.D ? qd[q_at(rr) + d * p.qs[3]] : from_f<T>(0.0f);
      if (qe) v[i] = from_f<T>(ldexpf(to_f(v[i]), qe));
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = tid + i * kThreads;
      sQ[e / kD * kLd + e % kD] = v[i];
    }
  } else {
    for (int e = tid; e < kMmaRows * kD; e += kThreads) {
      const int rr = e / kD, d = e % kD;
      float x = 0.0f;
      if (rr < nr && d < p.D) {
        const int64_t base = q_at(rr);
        auto at = [&](int64_t i) { return to_f(qd[base + i * p.qs[3]]); };
        x = ldexpf(rotated(p, r.seq + (p.q_per_token ? (r0 + rr) / p.G : 0), d, at), qe);
      }
      const T hi = from_f<T>(x);
      sQ[rr * kLd + d] = hi;
      sQlo[rr * kLd + d] = from_f<T>(x - to_f(hi));
    }
  }
  if (tid == 0) *holes = 0;
  __syncthreads();  // holes is 0 before any copy can set it

  // the keys any row of the tile sees (causal and window bottom-right), and this split's share
  const KeyRange range = split_keys(p, r, r0, nr, split);
  const int64_t ks = range.ks, ke = range.ke;
  const int64_t ntiles = (ke - ks + kMmaKeys - 1) / kMmaKeys;

  // this lane's rows g and g + 8: visible keys [vlo, vhi) as offsets from ks, position (ALiBi)
  RowKeys rk[2];
  float row_m[2], row_l[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rk[h] = row_keys(p, r, b, hkv, r0 + g + 8 * h, g + 8 * h < nr, range);
    row_m[h] = -INFINITY;  // base-2 units
    row_l[h] = 0.0f;       // this lane's part of the row's sum
  }
  float o[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.0f;

  // Copy of tile i into stage st: two threads per key, each with every other 16-byte chunk of the
  // key's K and V rows.  Its key's place in the caches (one block-table lookup for a paged cache)
  // is looked up a tile ahead (lookup, then load_tile at the next iteration), so that the table's
  // read does not stand between the barrier and the copies.  Keys past the split's end, and keys in
  // a block the table does not name (a hole: the rows become NaN), are zero-filled.
  const T* kc = static_cast<const T*>(p.kc);
  const T* vc = static_cast<const T*>(p.vc);
  const int my_key = tid >> 1, my_half = tid & 1;
  struct Where {
    int64_t ko, vo;  // element offsets of the key's K and V rows (head hkv), -1: none
  };
  auto lookup = [&](int64_t i) {
    const int64_t j = ks + i * kMmaKeys + my_key;
    Where w{-1, -1};
    if (i < ntiles && j < ke) {
      const Slot sl = slot_of(p, b, r.row, j);
      w.ko = slot_off(sl, p.ks, hkv);
      w.vo = slot_off(sl, p.vs, hkv);
      if (w.ko < 0 || w.vo < 0) {
        *holes = 1;
        w.ko = w.vo = -1;
      }
    }
    return w;
  };
  // The row's start is picked once (a key without one reads nothing: its chunks are zero-filled, their
  // addresses those of the cache's first row, which every call with a key has); where the head dim
  // fills kD (block-uniform) each chunk is then the copy alone, at a constant offset, without a
  // 64-bit address and a branch per chunk.
  constexpr uint32_t kVBytes = (uint32_t)(kStages * kMmaKeys * kLd * sizeof(T));  // sV - sK
  const bool full = p.D == kD;
  auto load_tile = [&](const Where& w, int st) {
    // this thread's chunks my_half, my_half + 2, ...: from here on at constant offsets
    const uint32_t dk = ab_flash::smem_u32(sK + (st * kMmaKeys + my_key) * kLd + my_half * 8), dv = dk + kVBytes;
    const bool valid = w.ko >= 0;
    const T* kp = valid ? kc + w.ko + my_half * 8 : kc;
    const T* vp = valid ? vc + w.vo + my_half * 8 : vc;
    if (full) {
#pragma unroll
      for (int c = 0; c < kChunks; c += 2) {
        ab_flash::cp_async_16(dk + c * 16, kp + c * 8, valid);
        ab_flash::cp_async_16(dv + c * 16, vp + c * 8, valid);
      }
    } else {
#pragma unroll
      for (int c = 0; c < kChunks; c += 2) {
        const bool in = valid && (c + my_half) * 8 < p.D;
        ab_flash::cp_async_16(dk + c * 16, in ? kp + c * 8 : kp, in);
        ab_flash::cp_async_16(dv + c * 16, in ? vp + c * 8 : vp, in);
      }
    }
  };

  // ldmatrix addresses of this lane (flash_fwd_kernel.cuh has the fragment layouts): Q as the A
  // operand; this warp's 16 keys of K as S's B operand (two n8 tiles of keys per k16 step of the
  // head dim); its 16 keys of V as O's B operand, .trans (two n8 tiles of the head dim per load).
  const int mi = lane >> 3, mr = lane & 7;
  const uint32_t q_addr = ab_flash::smem_u32(sQ + (mr + (mi & 1) * 8) * kLd + (mi >> 1) * 8);
  // (sQlo exists only with rotary tables: a call without them is launched without its bytes)
  const uint32_t qlo_addr = q_split ? ab_flash::smem_u32(sQlo + (mr + (mi & 1) * 8) * kLd + (mi >> 1) * 8) : q_addr;
  const uint32_t k_addr0 = ab_flash::smem_u32(sK + (warp * 16 + mr + (mi >> 1) * 8) * kLd + (mi & 1) * 8);
  const uint32_t v_addr0 = ab_flash::smem_u32(sV + (warp * 16 + mr + (mi & 1) * 8) * kLd + (mi >> 1) * 8);
  constexpr uint32_t kStageBytes = kMmaKeys * kRowBytes;

#pragma unroll 1
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < ntiles) load_tile(lookup(st), st);
    ab_flash::cp_async_commit();  // committed even when empty: the waits below count groups
  }
  Where next = lookup(kStages - 1);  // the key of the first tile the loop copies
  // rows 8-15 are padding in most decode calls (nr <= 8: GQA groups up to 8, one token): their
  // softmax is skipped and their P is 0
  const bool upper = nr > 8;
#pragma unroll 1
  for (int64_t i = 0; i < ntiles; ++i) {
    ab_flash::cp_async_wait<kStages - 2>();  // tile i has landed (this thread's copies) ...
    __syncthreads();  // ... and every thread's; every warp is done with tile i - 1 (and Q is written)
    if (i + kStages - 1 < ntiles) load_tile(next, (int)((i + kStages - 1) % kStages));
    ab_flash::cp_async_commit();
    next = lookup(i + kStages);  // read during this tile's arithmetic, used at the next iteration
    const uint32_t soff = (uint32_t)(i % kStages) * kStageBytes;

    // S = Q K^T for this warp's 16 keys: s[nt] holds rows g, g + 8 and keys 8 nt + 2t, + 1.  Up to
    // head dim 128 the k16 steps go into kChains independent accumulators (even steps, odd steps),
    // added at the end: each mma waits on the one kChains steps before it, not on the last (the
    // warps are few and wait on such chains, docs/decode.md); at 256 the registers are all taken.
    constexpr int kChains = kD <= 128 ? 2 : 1;
    float s[2][4], sc[kChains][2][4];
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[c][nt][e] = 0.0f;
#pragma unroll 4
    for (int kk = 0; kk < kD / 16; ++kk) {
      float(&acc)[2][4] = sc[kk % kChains];
      uint32_t qa[4], kb[4];
      ab_flash::ldmatrix_x4(qa, q_addr + kk * 32);
      ab_flash::ldmatrix_x4(kb, k_addr0 + soff + kk * 32);
      Ops::mma(acc[0], qa, kb[0], kb[1]);
      Ops::mma(acc[1], qa, kb[2], kb[3]);
      if (q_split) {
        ab_flash::ldmatrix_x4(qa, qlo_addr + kk * 32);
        Ops::mma(acc[0], qa, kb[0], kb[1]);
        Ops::mma(acc[1], qa, kb[2], kb[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = sc[0][nt][e];
#pragma unroll
        for (int c = 1; c < kChains; ++c) s[nt][e] += sc[c][nt][e];
      }

    // scores as attend_kernel takes them (scale, softcap, ALiBi, in float32), then base 2; keys a
    // row does not see are -inf.  The online softmax per row, the row's max shared by its 4 lanes.
    const int jw = (int)(i * kMmaKeys) + warp * 16;  // this warp's first key, from ks
    uint32_t phi[2][2], plo[2][2];  // [nt][h]: the (keys 2t, 2t + 1) pair of row g + 8 h
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h == 1 && !upper) {  // block-uniform
        phi[0][1] = phi[1][1] = plo[0][1] = plo[1][1] = 0u;
        continue;
      }
      float mx = row_m[h];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const int j = jw + 8 * nt + 2 * t + (e & 1);
          float x = shaped_score(p, rk[h], s[nt][e] * sscale, j);
          x = j >= rk[h].vlo && j < rk[h].vhi ? x * ab_flash::kLog2e : -INFINITY;
          s[nt][e] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // a row that has seen no key yet keeps the reference 0: 2^(-inf - 0) = 0, not NaN; a NaN
      // score is skipped by fmaxf and makes the sum NaN (NaN in, NaN out)
      const float ref = mx == -INFINITY ? 0.0f : mx;
      const float alpha = ab_flash::fast_exp2(row_m[h] - ref);
      row_m[h] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float p0 = ab_flash::fast_exp2(s[nt][2 * h] - ref), p1 = ab_flash::fast_exp2(s[nt][2 * h + 1] - ref);
        sum += p0 + p1;
        split_pack<T>(p0, p1, phi[nt][h], plo[nt][h]);
      }
      row_l[h] = row_l[h] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        o[dt][2 * h] *= alpha;
        o[dt][2 * h + 1] *= alpha;
      }
    }

    // O += P V over this warp's 16 keys: P's A fragment is S's accumulator layout (fwd_common.cuh
    // pv_tile), once for hi and once for lo
    const uint32_t pa_hi[4] = {phi[0][0], phi[0][1], phi[1][0], phi[1][1]};
    const uint32_t pa_lo[4] = {plo[0][0], plo[0][1], plo[1][0], plo[1][1]};
#pragma unroll
    for (int dp = 0; dp < kDT / 2; ++dp) {
      uint32_t vb[4];
      ab_flash::ldmatrix_x4_trans(vb, v_addr0 + soff + dp * 16 * (uint32_t)sizeof(T));
      Ops::mma(o[2 * dp], pa_hi, vb[0], vb[1]);
      Ops::mma(o[2 * dp + 1], pa_hi, vb[2], vb[3]);
      Ops::mma(o[2 * dp], pa_lo, vb[0], vb[1]);
      Ops::mma(o[2 * dp + 1], pa_lo, vb[2], vb[3]);
    }
  }
  ab_flash::cp_async_wait<0>();
  __syncthreads();  // no warp reads a stage any more, and no copy into one is pending

  // the warps' (O, max, sum) where the stages were, then merged and written (write_rows).  O's rows
  // are kD + 8 floats apart, so that the pairs the lanes of a half-warp store fall in 32 different
  // banks; rows past the call's are not stored (write_rows reads rows < nr only).
  constexpr int kLdo = kD + 8;
  float* red = reinterpret_cast<float*>(smem_raw);  // (kWarps, kMmaRows, kLdo)
  float* red_ml = red + kWarps * kMmaRows * kLdo;   // (kWarps, kMmaRows, 2)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int rr = g + 8 * h;
    if (rr >= nr) continue;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
      *reinterpret_cast<float2*>(red + (warp * kMmaRows + rr) * kLdo + 8 * dt + 2 * t) =
          make_float2(o[dt][2 * h], o[dt][2 * h + 1]);
    if (t == 0) {
      red_ml[(warp * kMmaRows + rr) * 2] = row_m[h];
      red_ml[(warp * kMmaRows + rr) * 2 + 1] = l;
    }
  }
  __syncthreads();
  write_rows<T, kMmaRows, true>(p, red, red_ml, kLdo, b, hkv, split, r0, nr, bad || *holes);
}

}  // namespace

#endif  // AB_DECODE_MMA_KERNEL_CUH
