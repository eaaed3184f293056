// sage_fwd_kernel.cuh -- the sage forward on CUDA: the K prepass and the attention kernel
// (SageAttention recipe; sage_fwd.cuh has it in brief, docs/sage.md in full).
//
// UNVERIFIED: compiled for sm_80 and sm_90a with nvcc 13.0, never run (written on a machine with no
// GPU).  tests/test_sage_cuda.py checks it against the float64 reference and the CPU sage kernel.
//
// Per call, four launches on one stream:
//   1. stats: per (batch, KV head, chunk of kStatRows keys), each channel's sum, max and min.
//   2. finalize: per (batch, KV head), the chunks reduced to mean_d and c_d = sqrt(max |K - mean|).
//   3. quantize K: each key row of (K - mean) / c to int8 with its own scale (workspace).
//   4. attention: one block per (query tile, head, batch), as the flash kernel.  Its Q tile is
//      quantized on entry, straight from global memory (Q' = Q c with the block's KV head's c, one
//      int8 scale per row with the softmax scale and log2(e) folded in, and the row's bias
//      scale * q . mean); then K tiles (int8) and V tiles (16-bit) stream through shared memory
//      with cp.async exactly as in flash: V[j] in flight during S = Q K[j]^T, K[j+1] during the
//      softmax and P V.  S is an int32 mma.sync m16n8k32 whose accumulator layout is the m16n8
//      layout of the flash kernel's float S, so after dequantization the masking, online softmax,
//      P V and epilogue are flash's own code (fwd_common.cuh).
//
// Fragments of m16n8k32 with 8-bit operands (PTX ISA), lane = 4 g + t:
//   A (16 x 32, row): a[0] = A[g][4t .. 4t+3], a[1] = A[g + 8][4t ..], a[2] = A[g][16 + 4t ..],
//                     a[3] = A[g + 8][16 + 4t ..]
//   B (32 x 8, col):  b[0] = B[4t .. 4t+3][g], b[1] = B[16 + 4t ..][g]
//   C (16 x 8, s32):  c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g + 8][2t, 2t+1]
// Byte for byte, a 16 x 32 int8 tile is a 16 x 16 tile of 16-bit pairs, and these fragments are
// exactly what ldmatrix.x4 gives for it with the addressing the flash kernel uses for its 16 x 16
// Q and K blocks (r[i] = matrix i's row g, bytes 4t .. 4t+3).  So the int8 tiles are loaded and
// read as 16-bit tiles of kD / 2 columns: same loader, same conflict-free padding (16 bytes).
#ifndef AB_SAGE_FWD_KERNEL_CUH
#define AB_SAGE_FWD_KERNEL_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "fwd_common.cuh"
#include "sage_fwd.cuh"

namespace ab_sage {

using ab_flash::BlockTiles;
using ab_flash::kFwdThreads;
using ab_flash::kSmemPad;
using ab_flash::kWarps;

constexpr unsigned kFull = 0xffffffffu;

// ---- PTX ----------------------------------------------------------------------------------------

// c += a b for one m16n8k32 tile of int8 (s32 accumulate; |sum| <= 256 * 127 * 127 < 2^31).
__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef AB_CUDA_EMULATE
  ab_emu::mma_m16n8k32_s8(c, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// 4 bytes global -> shared; !valid writes 4 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
#ifdef AB_CUDA_EMULATE
  ab_emu::cp_async(dst, src, 4, valid);
#else
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
#endif
}

// ---- one row across a warp ------------------------------------------------------------------------
//
// The prepass and the Q quantization read a row of kD channels with the whole warp, lane l holding
// channels [l kE, l kE + kE), kE = kD / 32 (2, 4 or 8: one 4-, 8- or 16-byte load per lane).

template <int kBytes> struct Vec;
template <> struct Vec<4> { using type = uint32_t; };
template <> struct Vec<8> { using type = uint2; };
template <> struct Vec<16> { using type = uint4; };

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// This lane's kE values of a row whose first D channels are real (zeros past D).  D is a multiple
// of 8 and kE divides 8, so a lane's chunk is wholly inside or wholly past D; rows are 16-byte
// aligned (the launcher's layout check), so the load is aligned.
template <typename T, int kE>
__device__ __forceinline__ void load_lane(const T* row, int lane, int D, float (&x)[kE]) {
  using V = typename Vec<kE * sizeof(T)>::type;
  if (lane * kE < D) {
    const V raw = *reinterpret_cast<const V*>(row + lane * kE);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kE; ++i) x[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kE; ++i) x[i] = 0.0f;
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Quantizes a row held across the warp to int8, symmetric, round to nearest even:
// q = rint(x 127 / amax), and stores this lane's kE values at dst (kE-byte aligned).  Returns the
// row's scale amax / 127 (every lane gets it): 0 for a zero row, NaN when any value is inf or NaN
// (fmaxf would skip a NaN, so those are looked for explicitly), with the int8 values then 0.
// |x| 127 / amax <= 127 (1 + 2 eps) < 127.5 never rounds past 127.
template <int kE>
__device__ __forceinline__ float quant_row(const float (&x)[kE], int8_t* dst) {
  float amax = 0.0f;
  bool bad = false;
#pragma unroll
  for (int i = 0; i < kE; ++i) {
    amax = fmaxf(amax, fabsf(x[i]));
    bad |= !isfinite(x[i]);
  }
  amax = warp_max(amax);
  bad = __any_sync(kFull, bad);
  const float inv = amax > 0.0f && !bad ? 127.0f / amax : 0.0f;
  uint32_t w[(kE + 3) / 4] = {};
#pragma unroll
  for (int i = 0; i < kE; ++i)
    w[i / 4] |= (uint32_t)(uint8_t)(int8_t)__float2int_rn(x[i] * inv) << (8 * (i % 4));
  if constexpr (kE == 2) *reinterpret_cast<uint16_t*>(dst) = (uint16_t)w[0];
  if constexpr (kE == 4) *reinterpret_cast<uint32_t*>(dst) = w[0];
  if constexpr (kE == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  return bad ? __int_as_float(0x7fc00000) : amax / 127.0f;
}

// The keys of (batch b, KV head hk): start row in the packed tensors (0 when dense), count, and
// their first row in the workspace.
struct KeySeq {
  int64_t start, ws_row0;
  int len;
};

__device__ __forceinline__ KeySeq key_seq(const SageParams& sp, int64_t b, int hk) {
  KeySeq s;
  if (sp.f.cu_k != nullptr) {
    s.start = sp.f.cu_k[b];
    s.len = sp.f.cu_k[b + 1] - sp.f.cu_k[b];
    s.ws_row0 = (int64_t)hk * sp.Ktot + s.start;
  } else {
    s.start = 0;
    s.len = sp.f.Sk;
    s.ws_row0 = (int64_t)hk * sp.Ktot + b * sp.f.Sk;
  }
  return s;
}

// ---- the K prepass ----------------------------------------------------------------------------------

// Block (chunk, batch, KV head): sum, max and min of each channel over keys
// [chunk kStatRows, + kStatRows), written to part.  A NaN in K reaches the sum (so the mean, and
// every score of the sequence: NaN in, NaN out); fmaxf/fminf skip it.
template <typename T, int kD>
__global__ void __launch_bounds__(kPrepThreads) k_stats_kernel(const SageParams sp) {
  constexpr int kE = kD / 32, kW = kPrepThreads / 32;
  __shared__ float red[kW][3][kD];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t bh = blockIdx.x / sp.chunks;
  const int chunk = (int)(blockIdx.x % sp.chunks);
  const int64_t b = bh / sp.Hkv;
  const int hk = (int)(bh % sp.Hkv);
  const KeySeq ks = key_seq(sp, b, hk);
  const int j0 = chunk * kStatRows;
  if (j0 >= ks.len) return;  // the whole block: this sequence is shorter (packed)
  const int j1 = min(ks.len, j0 + kStatRows);
  const T* k = static_cast<const T*>(sp.f.k) + b * sp.f.k_bs + hk * sp.f.k_hs + ks.start * sp.f.k_rs;

  float sum[kE], mx[kE], mn[kE];
#pragma unroll
  for (int i = 0; i < kE; ++i) {
    sum[i] = 0.0f;
    mx[i] = -INFINITY;
    mn[i] = INFINITY;
  }
  for (int j = j0 + warp; j < j1; j += kW) {
    float x[kE];
    load_lane<T, kE>(k + (int64_t)j * sp.f.k_rs, lane, sp.f.D, x);
#pragma unroll
    for (int i = 0; i < kE; ++i) {
      sum[i] += x[i];
      mx[i] = fmaxf(mx[i], x[i]);
      mn[i] = fminf(mn[i], x[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < kE; ++i) {
    red[warp][0][lane * kE + i] = sum[i];
    red[warp][1][lane * kE + i] = mx[i];
    red[warp][2][lane * kE + i] = mn[i];
  }
  __syncthreads();
  float* out = sp.part + ((int64_t)bh * sp.chunks + chunk) * 3 * kD;
  for (int d = threadIdx.x; d < kD; d += kPrepThreads) {
    float s = red[0][0][d], a = red[0][1][d], z = red[0][2][d];
#pragma unroll
    for (int w = 1; w < kW; ++w) {
      s += red[w][0][d];
      a = fmaxf(a, red[w][1][d]);
      z = fminf(z, red[w][2][d]);
    }
    out[d] = s;
    out[kD + d] = a;
    out[2 * kD + d] = z;
  }
}

// Block (batch, KV head): mean_d = sum / len and c_d = sqrt(max(max_d - mean_d, mean_d - min_d)),
// i.e. sqrt(max_j |K_jd - mean_d|), with c = 1 where that is 0 (a constant channel, the channels
// past D, an empty sequence) or not finite.  K' = (K - mean) / c has the range sqrt(range) per
// channel, Q' = Q c takes the other factor: a channel 100x wider than the rest costs K's int8 grid
// 10x instead of 100x, and Q's grid the other 10x.
template <int kD>
__global__ void __launch_bounds__(kPrepThreads) k_finalize_kernel(const SageParams sp) {
  const int64_t bh = blockIdx.x;
  const KeySeq ks = key_seq(sp, bh / sp.Hkv, (int)(bh % sp.Hkv));
  const int chunks = (ks.len + kStatRows - 1) / kStatRows;
  const float* part = sp.part + (int64_t)bh * sp.chunks * 3 * kD;
  for (int d = threadIdx.x; d < kD; d += kPrepThreads) {
    float s = 0.0f, a = -INFINITY, z = INFINITY;
    for (int c = 0; c < chunks; ++c) {
      s += part[(int64_t)c * 3 * kD + d];
      a = fmaxf(a, part[(int64_t)c * 3 * kD + kD + d]);
      z = fminf(z, part[(int64_t)c * 3 * kD + 2 * kD + d]);
    }
    const float mean = ks.len > 0 ? s / (float)ks.len : 0.0f;
    float c = ks.len > 0 ? sqrtf(fmaxf(a - mean, mean - z)) : 1.0f;
    if (!(c > 0.0f) || isinf(c)) c = 1.0f;  // !(c > 0) also catches NaN
    sp.mean[bh * kD + d] = mean;
    sp.cfac[bh * kD + d] = c;
  }
}

// Block (chunk, batch, KV head): keys [chunk kQuantRows, + kQuantRows) of (K - mean) / c to int8,
// one row per warp at a time, one scale per key.
template <typename T, int kD>
__global__ void __launch_bounds__(kPrepThreads) k_quant_kernel(const SageParams sp, int chunks) {
  constexpr int kE = kD / 32, kW = kPrepThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t bh = blockIdx.x / chunks;
  const int chunk = (int)(blockIdx.x % chunks);
  const int64_t b = bh / sp.Hkv;
  const int hk = (int)(bh % sp.Hkv);
  const KeySeq ks = key_seq(sp, b, hk);
  const int j0 = chunk * kQuantRows;
  if (j0 >= ks.len) return;
  const int j1 = min(ks.len, j0 + kQuantRows);
  const T* k = static_cast<const T*>(sp.f.k) + b * sp.f.k_bs + hk * sp.f.k_hs + ks.start * sp.f.k_rs;
  float mean[kE], inv_c[kE];
#pragma unroll
  for (int i = 0; i < kE; ++i) {
    mean[i] = sp.mean[bh * kD + lane * kE + i];
    inv_c[i] = 1.0f / sp.cfac[bh * kD + lane * kE + i];
  }
  for (int j = j0 + warp; j < j1; j += kW) {
    float x[kE];
    load_lane<T, kE>(k + (int64_t)j * sp.f.k_rs, lane, sp.f.D, x);
#pragma unroll
    for (int i = 0; i < kE; ++i) x[i] = (x[i] - mean[i]) * inv_c[i];
    const float s = quant_row<kE>(x, sp.kq + (ks.ws_row0 + j) * kD + lane * kE);
    if (lane == 0) sp.ks[ks.ws_row0 + j] = s;
  }
}

// ---- the attention kernel -------------------------------------------------------------------------

template <typename T, int kD, int kBM, int kBN>
__global__ void __launch_bounds__(kFwdThreads) sage_kernel(const SageParams sp) {
  using namespace ab_flash;
  const FwdParams& p = sp.f;
  constexpr int kMT = kBM / (16 * kWarps);  // m16 tiles per warp
  constexpr int kNT = kBN / 8;              // n8 tiles of S per m16 tile (keys)
  constexpr int kDT = kD / 8;               // n8 tiles of O per m16 tile (head dim)
  constexpr int kE = kD / 32;               // channels per lane in the Q quantization
  constexpr int kLd8 = kD + kSagePad8;      // bytes per int8 row in shared memory
  constexpr int kLdV = kD + kSmemPad;       // elements per V row
  static_assert(kMT >= 1 && kBM == kMT * 16 * kWarps, "kBM must be a multiple of 64");
  static_assert(kBN % 16 == 0 && kD % 64 == 0, "ldmatrix.x4 pairs n8 tiles; kE = kD / 32 must be even");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  int8_t* sQ = reinterpret_cast<int8_t*>(smem_raw);                                   // (kBM, kLd8)
  int8_t* sK = reinterpret_cast<int8_t*>(smem_raw + sage_smem_k(kD, kBM));            // (kBN, kLd8)
  float* sKs = reinterpret_cast<float*>(smem_raw + sage_smem_ks(kD, kBM, kBN));       // (kBN,) K's scales
  T* sV = reinterpret_cast<T*>(smem_raw + sage_smem_v(kD, kBM, kBN));                 // (kBN, kLdV)
  float2* sQsb = reinterpret_cast<float2*>(smem_raw + sage_smem_qsb(kD, kBM, kBN));  // (kBM,) Q rows' (scale, bias)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  BlockTiles bt;
  if (!block_tiles<kBM, kBN>(p, bt)) return;
  const T* q = static_cast<const T*>(p.q) + bt.b * p.q_bs + bt.h * p.q_hs + (bt.q_start + bt.row0) * p.q_rs;
  const T* v = static_cast<const T*>(p.v) + bt.b * p.v_bs + bt.hk * p.v_hs + bt.k_start * p.v_rs;
  const KeySeq kseq = key_seq(sp, bt.b, bt.hk);
  const int64_t ws_row0 = kseq.ws_row0;
  const int k_len = bt.k_len, j_begin = bt.j_begin, j_end = bt.j_end;

  // K tile j (int8 rows and their scales) as one cp.async batch; rows past the sequence are zeros.
  // The int8 rows go as rows of kD / 2 16-bit pairs (see the file comment).
  auto load_k = [&](int j) {
    const int n0 = j * kBN;
    const uint16_t* rows = reinterpret_cast<const uint16_t*>(sp.kq + (ws_row0 + n0) * kD);
    load_tile<uint16_t, kBN, kD / 2>(reinterpret_cast<uint16_t*>(sK), rows, kD / 2, k_len - n0, kD / 2, tid);
    const bool valid = n0 + tid < k_len;
    if (tid < kBN) cp_async_4(smem_u32(sKs + tid), sp.ks + ws_row0 + n0 + (valid ? tid : 0), valid);
  };
  if (j_begin < j_end) load_k(j_begin);
  cp_async_commit();

  // Q quantization, while K[j_begin] is in flight.  Each warp quantizes the rows it multiplies
  // (its ldmatrix reads only those), one row at a time across its lanes: Q' = Q c, one int8 scale
  // per row, and the row's bias q . mean; the softmax scale and log2(e) go into both, so that
  // S = acc * (row scale) * (key scale) + bias is in base-2 units.  Rows past the sequence end
  // quantize zeros.
  {
    const int64_t mc = ((int64_t)bt.b * sp.Hkv + bt.hk) * kD + lane * kE;
    float cf[kE], mean[kE];
#pragma unroll
    for (int i = 0; i < kE; ++i) {
      cf[i] = sp.cfac[mc + i];
      mean[i] = sp.mean[mc + i];
    }
#pragma unroll 2
    for (int r = 0; r < 16 * kMT; ++r) {
      const int row = warp * 16 * kMT + r;
      float x[kE];
      if (row < bt.rows_here) {
        load_lane<T, kE>(q + (int64_t)row * p.q_rs, lane, p.D, x);
      } else {
#pragma unroll
        for (int i = 0; i < kE; ++i) x[i] = 0.0f;
      }
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < kE; ++i) {
        dot += x[i] * mean[i];
        x[i] *= cf[i];
      }
      dot = warp_sum(dot);
      const float s = quant_row<kE>(x, sQ + row * kLd8 + lane * kE);
      if (lane == 0) sQsb[row] = make_float2(s * p.scale_log2, dot * p.scale_log2);
    }
  }
  float o[kMT][kDT][4], row_m[2 * kMT], row_l[2 * kMT];  // see softmax_tile
  init_rows<kMT, kDT>(o, row_m, row_l);

  // ldmatrix addresses: the flash kernel's for its Q and K (fragment layouts above), in bytes of
  // int8 rows; V's as in flash.
  const int mi = lane >> 3, mr = lane & 7;
  const uint32_t q_addr = smem_u32(sQ + (warp * 16 * kMT + mr + (mi & 1) * 8) * kLd8 + (mi >> 1) * 16);
  const uint32_t k_addr = smem_u32(sK + (mr + (mi >> 1) * 8) * kLd8 + (mi & 1) * 16);
  const uint32_t v_addr = smem_u32(sV + (mr + (mi & 1) * 8) * kLdV + (mi >> 1) * 8);
  constexpr uint32_t kRowBytesV = kLdV * sizeof(T);

  for (int j = j_begin; j < j_end; ++j) {
    const int n0 = j * kBN;
    // V[j] streams in while S = Q K[j]^T runs (the buffer was freed by the last iteration's sync).
    load_tile<T, kBN, kD>(sV, v + (int64_t)n0 * p.v_rs, p.v_rs, k_len - n0, p.Dv, tid);
    cp_async_commit();
    cp_async_wait<1>();  // everything but V[j]: K[j] has landed (for this thread)
    __syncthreads();     // ... and for every thread; also publishes the int8 Q tile and its scales

    int acc[kMT][kNT][4];
    zero_tiles(acc);
#pragma unroll 2
    for (int kk = 0; kk < kD / 32; ++kk) {
      uint32_t qa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(qa[mt], q_addr + mt * 16 * kLd8 + kk * 32);
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_addr + np * 16 * kLd8 + kk * 32);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_s8(acc[mt][2 * np], qa[mt], kb[0], kb[1]);
          mma_s8(acc[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }
    // Dequantize (int8 scales of row and key; the bias restores the smoothing's shift, so the
    // scores are the true ones in base-2 units) before the K buffer, scales included, is released.
    // The rows' (scale, bias) are read from shared memory each tile: kept in registers across the
    // loop they made the kD = 128 kernel spill.  This lane's rows r = 2 mt + half are warp rows
    // 16 mt + g + 8 half (the accumulator layout).
    float s[kMT][kNT][4];
    float2 rsb[2 * kMT];
#pragma unroll
    for (int r = 0; r < 2 * kMT; ++r) rsb[r] = sQsb[warp * 16 * kMT + 16 * (r >> 1) + g + 8 * (r & 1)];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const float2 kss = *reinterpret_cast<const float2*>(sKs + 8 * nt + 2 * t);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        s[mt][nt][0] = fmaf((float)acc[mt][nt][0], rsb[2 * mt].x * kss.x, rsb[2 * mt].y);
        s[mt][nt][1] = fmaf((float)acc[mt][nt][1], rsb[2 * mt].x * kss.y, rsb[2 * mt].y);
        s[mt][nt][2] = fmaf((float)acc[mt][nt][2], rsb[2 * mt + 1].x * kss.x, rsb[2 * mt + 1].y);
        s[mt][nt][3] = fmaf((float)acc[mt][nt][3], rsb[2 * mt + 1].x * kss.y, rsb[2 * mt + 1].y);
      }
    }
    __syncthreads();  // every warp is done with K[j]
    if (j + 1 < j_end) load_k(j + 1);  // in flight during the softmax and P V
    cp_async_commit();                 // committed even when empty: the waits count groups

    if (p.softcap > 0.0f)  // on the true scores (already scaled, base 2), as the CPU kernel
      softcap_tile<kMT, kNT>(s, sp.softcap_in2, p.softcap_log2);
    if (n0 < bt.lo_max || n0 + kBN > bt.hi_min) mask_tile<kMT, kNT>(p, bt, s, n0, warp * 16 * kMT, g, t);

    uint32_t pk[kMT][kNT][2];
    softmax_tile<T, kMT, kNT, kDT>(s, row_m, row_l, o, pk);

    cp_async_wait<1>();  // all but K[j+1]: V[j] has landed
    __syncthreads();
    pv_tile<T, kMT, kNT, kDT>(pk, o, v_addr, kRowBytesV);
    __syncthreads();  // every warp is done with V[j]
  }

  cp_async_wait<0>();
  __syncthreads();  // no warp reads shared memory any more: the output tile is staged over it
  store_out<T, kD, kBM, kMT, kDT>(p, bt, o, row_m, row_l, reinterpret_cast<T*>(smem_raw), warp, g, t, tid);
}

// ---- launch -------------------------------------------------------------------------------------

template <typename T, int kD>
ab_status sage_launch(SageParams& sp, const ab_attn_params* p, cudaStream_t stream, ab_error* err) {
  constexpr int kBM = SageTile<kD>::kBM, kBN = SageTile<kD>::kBN;
  constexpr size_t kSmem = sage_smem_bytes(kD, kBM, kBN);
  auto kernel = sage_kernel<T, kD, kBM, kBN>;
  const int64_t bhk = p->B * p->Hkv;
  sp.f.m_blocks = (int)((p->Sq + kBM - 1) / kBM);
  const int64_t blocks = (int64_t)sp.f.m_blocks * p->Hq * p->B;
  const int quant_chunks = (int)((p->Sk + kQuantRows - 1) / kQuantRows);
  if (blocks > INT32_MAX || bhk * sp.chunks > INT32_MAX || bhk * quant_chunks > INT32_MAX)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "sage on CUDA: %lld thread blocks exceed the grid limit",
                        (long long)blocks);
  const ab_status st = ab_flash::prepare_smem(kernel, kSmem, "sage", kD, err);
  if (st != AB_OK) return st;
  // The prepass: no launch has an empty grid (Sk = 0 skips the two that read K; finalize still
  // writes mean 0 and c 1, which the Q quantization reads).
  if (sp.chunks > 0) AB_LAUNCH((unsigned)(bhk * sp.chunks), kPrepThreads, 0, stream, k_stats_kernel<T, kD>)(sp);
  AB_LAUNCH((unsigned)bhk, kPrepThreads, 0, stream, k_finalize_kernel<kD>)(sp);
  if (quant_chunks > 0)
    AB_LAUNCH((unsigned)(bhk * quant_chunks), kPrepThreads, 0, stream, k_quant_kernel<T, kD>)(sp, quant_chunks);
  AB_LAUNCH((unsigned)blocks, kFwdThreads, kSmem, stream, kernel)(sp);
  return ab_cuda_check(cudaGetLastError(), "sage_fwd launch", err);
}

}  // namespace ab_sage

#endif  // AB_SAGE_FWD_KERNEL_CUH
