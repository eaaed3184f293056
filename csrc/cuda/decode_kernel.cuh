// decode_kernel.cuh -- the KV-cache decode kernels on CUDA (docs/decode.md, "The CUDA kernel"):
// attention of a few query tokens against a dense or paged cache, with the CPU decode kernel's
// semantics (csrc/cpu/decode_cpu.c).  Included by decode.cu only, which checks a call, fills
// DecodeParams and launches, in stream order:
//
//   append_kernel   the new keys (rotated) and values into the cache at cache_seqlens[b] + t;
//   attend_kernel   one block per (split of the key range, KV head and tile of query rows, batch
//                   row): every query row of the tile (tokens x the query heads of the KV head) is
//                   attended in one pass over the keys, so each key and value byte is read once
//                   for all the query heads that use it (GQA);
//   merge_kernel    with split-KV, the splits' (out, lse) merged in float32 (ab.merge_attention_states'
//                   rule).
// Attention sinks join each row once, where its final (out, lse) is written: by attend_kernel
// when the key range is not split, else by merge_kernel after the merge (add_sink).
//
// Lanes split a key row into chunks of 8 elements (one 16-byte load in 16-bit types, two in
// float32); a warp holds 32 / L keys at once, L = the chunks of a row rounded up to a power of two,
// and a block of kWarps warps walks its keys kWarps * 32 / L at a time.  Scores are reduced over the
// L lanes of a key with xor shuffles (every lane ends with the same sum, bit for bit), the online
// softmax state (max, sum, 8 accumulators per row) stays in registers, and at the end the key
// groups of a warp are merged with shuffles and the warps through shared memory.  Everything is
// float32; the queries are rotated, scaled and kept in shared memory as float32 rows.
#ifndef AB_DECODE_KERNEL_CUH
#define AB_DECODE_KERNEL_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "ab_cuda_internal.h"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 8;       // elements of a key row per lane and load
constexpr int kMaxHeadDim = 256;  // 32 lanes x 8
constexpr int kMaxRows = 8;     // query rows per block (registers: 8 accumulators per row per lane)
constexpr int64_t kMaxSplits = 128;  // splits of a row's key range (the merge: one thread each)

// An index tensor (int32 or int64; data NULL when absent): element (i, j) at i * s0 + j * s1.
struct Index {
  const void* data;
  int64_t s0, s1;
  int32_t is64;
};

// One call, as the kernels see it (decode.cu fill_params): pointers, strides in elements, sizes
// and options.  Cache offsets are int64: a cache can hold more than 2^31 elements.
struct DecodeParams {
  int64_t B, Sq, Hq, Hkv, D, G, rows;   // rows = Sq * G query rows per KV head
  int64_t row_tiles, nsplit;            // tiles of kRows rows; splits of each key range
  const void* q;                        // (B, Sq, Hq, D), any strides
  int64_t qs[4];
  void *kc, *vc;                        // caches; last dim contiguous, rows 16-byte aligned
  int64_t ks[3], vs[3];
  int64_t block_size, num_blocks;       // block_size 0: dense cache, num_blocks = its rows
  uint32_t bs_mul, bs_shift;            // position / block_size as umulhi(pos, bs_mul) >> bs_shift
  int32_t bs_fast;                      // (bs_mul 0: block_size 1), where every position is < 2^31
  int64_t cap;                          // positions a cache row holds
  Index block_table;                    // (B, max_blocks)
  const void *knew, *vnew;              // (B, snew, Hkv, D), any strides
  int64_t kns[4], vns[4], snew;
  const void *cos, *sin;                // (S_rot, rot_half), any float dtype
  int64_t cs[2], ss[2], rot_half, rot_len; // rot_half 0: no rotary; rot_len the table's rows
  int32_t cos_dtype, interleaved, q_per_token;
  Index seqlens, batch_idx, leftpad;
  int64_t seqlen;                       // every row's length when seqlens is absent (-1: cap)
  const float* alibi;                   // (Hq,) or (B, Hq); alibi_sb 0 for (Hq,)
  int64_t alibi_sb, alibi_sh;
  const void* sinks;                    // (Hq,) any float dtype, or NULL: one logit per query head
  int64_t sinks_s;
  int32_t sinks_dtype;
  void* out;                            // (B, Sq, Hq, D), q's dtype
  int64_t os[4];
  float* lse;                           // (B, Hq, Sq)
  int64_t ls[3];
  float* part;                          // (B, nsplit, Sq, Hq, D) split outputs, normalised
  float* part_lse;                      // (B, nsplit, Sq, Hq)
  float* part_ml;                       // (B, nsplit, Sq, Hq, 2): each split's running max (natural units)
                                        // and sum, what merge_kernel weighs the splits by
  float scale, softcap;
  int32_t causal;
  int64_t wl, wr;
};

__device__ __forceinline__ int64_t index_at(const Index& t, int64_t i, int64_t j = 0) {
  const int64_t off = i * t.s0 + j * t.s1;
  return t.is64 ? static_cast<const int64_t*>(t.data)[off] : static_cast<const int32_t*>(t.data)[off];
}

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// One rotary table entry (any float dtype), read as the CPU reads it: through double.
__device__ __forceinline__ float table_at(const void* base, int32_t dtype, int64_t off) {
  switch (dtype) {
    case AB_DTYPE_F16: return __half2float(static_cast<const __half*>(base)[off]);
    case AB_DTYPE_BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[off]);
    case AB_DTYPE_F64: return (float)static_cast<const double*>(base)[off];
    default: return static_cast<const float*>(base)[off];
  }
}

// Element d of x rotated at table row pos: pairs (2i, 2i + 1) when interleaved, else the GPT-NeoX
// halves (i, i + rot_half), in float32 with every product rounded as on the CPU (no contraction
// into an FMA: the cache must hold the same bits whichever kernel wrote it).  x(e) reads element e.
template <typename X>
__device__ __forceinline__ float rotated(const DecodeParams& p, int64_t pos, int64_t d, X x) {
  const int64_t half = p.rot_half;
  if (d >= 2 * half) return x(d);
  const int64_t i = p.interleaved ? d / 2 : d % half;
  const int64_t d0 = p.interleaved ? 2 * i : i, d1 = p.interleaved ? 2 * i + 1 : i + half;
  pos = pos < p.rot_len ? pos : p.rot_len - 1;  // a row the host checks rejected
  const float c = table_at(p.cos, p.cos_dtype, pos * p.cs[0] + i * p.cs[1]);
  const float s = table_at(p.sin, p.cos_dtype, pos * p.ss[0] + i * p.ss[1]);
  const float x0 = x(d0), x1 = x(d1);
  return d == d0 ? __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)) : __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// A row's (out, lse) over its keys joined by its head's sink (docs/decode.md): returns the lse with
// the sink and sets factor, what out is multiplied by (exp(old lse - new lse)).  A row that saw no
// key gets out 0 and lse = the sink; a sink of -inf changes nothing.  The CPU kernel's
// ab_decode_add_sink, in the same float32 steps.
__device__ __forceinline__ float add_sink(const DecodeParams& p, int64_t hq, float lse, float& factor) {
  factor = 1.0f;
  if (p.sinks == nullptr) return lse;
  const float s = table_at(p.sinks, p.sinks_dtype, hq * p.sinks_s);
  if (s == -INFINITY) return lse;
  const float m = lse > s ? lse : s;
  const float wo = lse == -INFINITY ? 0.0f : expf(lse - m), total = wo + expf(s - m);
  factor = wo / total;
  return m + logf(total);
}

// A batch row's values.  The host checked them (attn_backends/_kvcache.py host_rows) before the
// launch; `ok` says whether they are in range, so that no value can make a kernel write or read
// outside the caches.
struct Row {
  int64_t seq, lo, end, row;
  bool ok;
};

__device__ __forceinline__ Row row_of(const DecodeParams& p, int64_t b) {
  Row r;
  r.seq = p.seqlens.data ? index_at(p.seqlens, b) : p.seqlen >= 0 ? p.seqlen : p.cap;
  r.lo = p.leftpad.data ? index_at(p.leftpad, b) : 0;
  r.row = p.batch_idx.data ? index_at(p.batch_idx, b) : b;
  r.ok = r.seq >= 0 && r.seq <= p.cap - p.snew && r.lo >= 0 && r.lo <= r.seq &&  // no seq + snew: it may wrap
         (p.block_size > 0 || (r.row >= 0 && r.row < p.num_blocks));
  r.end = r.ok ? r.seq + p.snew : 0;
  if (p.rot_half > 0) {  // the rotary tables hold every position the row rotates
    const int64_t qspan = p.q_per_token ? p.Sq : (p.Sq < 1 ? p.Sq : 1);
    r.ok = r.ok && r.seq + (p.snew > qspan ? p.snew : qspan) <= p.rot_len;
  }
  return r;
}

// Where position pos of batch row b lies: the cache's first-dim index (a dense cache: the row; a
// paged one: the block the table names, -1 where it names none of the cache) and the position in
// it.  The paged division by block_size is a multiply-high and a shift (bs_mul, bs_shift: decode.cu
// fast_divisor) where positions fit 31 bits, not a 64-bit division for each key.
struct Slot {
  int64_t first, at;
};

// pos / block_size and pos % block_size (a paged cache's block and place in it)
struct BlockPos {
  int64_t q, r;
};

__device__ __forceinline__ BlockPos block_pos(const DecodeParams& p, int64_t pos) {
  if (p.bs_fast) {
    const uint32_t x = (uint32_t)pos, qq = p.bs_mul ? __umulhi(x, p.bs_mul) >> p.bs_shift : x;
    return BlockPos{(int64_t)qq, (int64_t)(x - qq * (uint32_t)p.block_size)};
  }
  return BlockPos{pos / p.block_size, pos % p.block_size};
}

// The cache's first-dim index of position pos of batch row b: the row of a dense cache, the block the
// table names in a paged one (a read of the table), -1 where it names none of the cache.
__device__ __forceinline__ int64_t first_of(const DecodeParams& p, int64_t b, int64_t row, int64_t pos) {
  if (p.block_size == 0) return row;
  const int64_t blk = index_at(p.block_table, b, block_pos(p, pos).q);
  return blk < 0 || blk >= p.num_blocks ? -1 : blk;
}

__device__ __forceinline__ Slot slot_of(const DecodeParams& p, int64_t b, int64_t row, int64_t pos) {
  const int64_t first = first_of(p, b, row, pos);
  if (p.block_size == 0 || first < 0) return Slot{first, first < 0 ? 0 : pos};
  return Slot{first, block_pos(p, pos).r};
}

// Element offset of (slot s, head h, element 0) in a cache of strides cs, or -1 where s has no block.
__device__ __forceinline__ int64_t slot_off(const Slot& s, const int64_t* cs, int64_t h) {
  return s.first < 0 ? -1 : s.first * cs[0] + s.at * cs[1] + h * cs[2];
}

// Element offset of (position pos, head h, element 0) of batch row b in a cache of strides cs, or
// -1 where the block table names no block of the cache.
__device__ __forceinline__ int64_t cache_off(const DecodeParams& p, const int64_t* cs, int64_t b, int64_t row,
                                             int64_t pos, int64_t h) {
  return slot_off(slot_of(p, b, row, pos), cs, h);
}

__device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t lmax(int64_t a, int64_t b) { return a > b ? a : b; }

// The keys [ks, ke) of split `split` that any row of the tile [r0, r0 + nr) sees (causal and window
// bottom-right: query token t sits at position t + shift, shift = r.end - Sq).
struct KeyRange {
  int64_t ks, ke;
};

__device__ __forceinline__ KeyRange split_keys(const DecodeParams& p, const Row& r, int64_t r0, int64_t nr,
                                               int64_t split) {
  const int64_t shift = r.end - p.Sq;
  const int64_t first = r0 / p.G + shift, last = (r0 + nr - 1) / p.G + shift;
  int64_t klo = r.lo, khi = r.end;
  if (p.causal) khi = lmin(khi, last + 1);
  if (p.wr >= 0) khi = lmin(khi, last + p.wr + 1);
  if (p.wl >= 0) klo = lmax(klo, first - p.wl);
  khi = lmax(khi, klo);
  const int64_t per = (khi - klo + p.nsplit - 1) / p.nsplit;
  const int64_t ks = lmin(khi, klo + split * per);
  return KeyRange{ks, lmin(khi, ks + per)};
}

// One query row's share of the split [ks, ke): its visible keys [vlo, vhi) and its position (for
// ALiBi) as offsets from ks, and its ALiBi slope.  row = t * G + g (token t, query head hkv * G + g);
// a row past the call's (real false) sees nothing.
struct RowKeys {
  int vlo, vhi, ipos;
  float slope;
};

__device__ __forceinline__ RowKeys row_keys(const DecodeParams& p, const Row& r, int64_t b, int64_t hkv, int64_t row,
                                            bool real, const KeyRange& kr) {
  const int64_t hq = hkv * p.G + row % p.G;
  const int64_t i = row / p.G + r.end - p.Sq;
  int64_t lo = kr.ks, hi = kr.ke;
  if (p.causal) hi = lmin(hi, i + 1);
  if (p.wr >= 0) hi = lmin(hi, i + p.wr + 1);
  if (p.wl >= 0) lo = lmax(lo, i - p.wl);
  if (!real || hi < lo) hi = lo;
  RowKeys k;
  k.vlo = (int)(lo - kr.ks);
  k.vhi = (int)(hi - kr.ks);
  k.ipos = (int)lmin(lmax(i - kr.ks, -((int64_t)1 << 30)), (int64_t)1 << 30);  // ALiBi distances stay exact
  k.slope = p.alibi != nullptr && real ? p.alibi[b * p.alibi_sb + hq * p.alibi_sh] : 0.0f;
  return k;
}

// A scaled score as both attentions shape it, in float32: the softcap, then ALiBi's penalty for the
// distance between the row's position and key j (both counted from the split's first key).
__device__ __forceinline__ float shaped_score(const DecodeParams& p, const RowKeys& rk, float s, int j) {
  if (p.softcap > 0.0f) s = p.softcap * tanhf(s / p.softcap);
  if (p.alibi != nullptr) s -= rk.slope * fabsf((float)(rk.ipos - j));
  return s;
}

// ---- the cache write ---------------------------------------------------------------------------

// grid (snew, B): one new token of one batch row per block, the threads over its Hkv * D elements.
// Values, and keys without rotary, are copied bit for bit.
template <typename T>
__global__ void __launch_bounds__(kThreads) append_kernel(const DecodeParams p) {
  const int64_t t = blockIdx.x, b = blockIdx.y;
  const Row r = row_of(p, b);
  if (!r.ok) return;
  const int64_t pos = r.seq + t;
  const T* kn = static_cast<const T*>(p.knew);
  const T* vn = static_cast<const T*>(p.vnew);
  T* kc = static_cast<T*>(p.kc);
  T* vc = static_cast<T*>(p.vc);
  for (int64_t e = threadIdx.x; e < p.Hkv * p.D; e += kThreads) {
    const int64_t h = e / p.D, d = e % p.D;
    const int64_t ko = cache_off(p, p.ks, b, r.row, pos, h), vo = cache_off(p, p.vs, b, r.row, pos, h);
    if (ko < 0 || vo < 0) continue;
    const int64_t kb = b * p.kns[0] + t * p.kns[1] + h * p.kns[2];
    if (p.rot_half > 0)
      kc[ko + d] = from_f<T>(rotated(p, pos, d, [&](int64_t i) { return to_f(kn[kb + i * p.kns[3]]); }));
    else
      kc[ko + d] = kn[kb + d * p.kns[3]];
    vc[vo + d] = vn[b * p.vns[0] + t * p.vns[1] + h * p.vns[2] + d * p.vns[3]];
  }
}

// ---- the attention -----------------------------------------------------------------------------

// A chunk of kChunk elements as loaded (16 bytes in 16-bit types, 32 in float32), converted to
// float32 where it is used, so that the registers that wait on memory hold raw bytes.
template <typename T> struct Raw {
  uint4 u[(int)sizeof(T) * kChunk / 16];
};

template <typename T> __device__ __forceinline__ void load_raw(const T* ptr, Raw<T>& r) {
#pragma unroll
  for (int i = 0; i < (int)(sizeof(r.u) / sizeof(uint4)); ++i) r.u[i] = reinterpret_cast<const uint4*>(ptr)[i];
}

template <typename T> __device__ __forceinline__ void zero_raw(Raw<T>& r) {
#pragma unroll
  for (int i = 0; i < (int)(sizeof(r.u) / sizeof(uint4)); ++i) r.u[i] = uint4{};
}

template <typename T> __device__ __forceinline__ void to_floats(const Raw<T>& r, float x[kChunk]) {
  const T* e = reinterpret_cast<const T*>(r.u);
#pragma unroll
  for (int i = 0; i < kChunk; ++i) x[i] = to_f(e[i]);
}

// exp in the online softmax: the fast exponential (a few ulp) where the output is 16-bit, whose
// rounding is 2^-8 or 2^-11; the accurate one in float32.
template <typename T> __device__ __forceinline__ float softmax_exp(float x) { return __expf(x); }
template <> __device__ __forceinline__ float softmax_exp<float>(float x) { return expf(x); }

// Keys a lane holds at once: each lane loads its chunk of kUnroll keys before it uses any of them,
// and the next kUnroll while it computes, so that 2 * kUnroll loads of K and of V are in flight per
// lane (decode reads each byte once: the bytes in flight set the bandwidth).  Fewer in float32 and
// with 8 query rows, whose registers are twice as many.
#ifndef AB_DECODE_UNROLL16
#define AB_DECODE_UNROLL16 4  // kUnroll in 16-bit types below 8 rows (a build-time knob for tuning)
#endif
#ifndef AB_DECODE_MIN_BLOCKS
#define AB_DECODE_MIN_BLOCKS 1  // attend_kernel's blocks per SM for the register allocator (tuning knob)
#endif
template <typename T, int kRows> struct Unroll {
  static constexpr int value = (sizeof(T) == 4 || kRows >= 8) ? 2 : AB_DECODE_UNROLL16;
};

// The block each of keys j0 + u * spread (u < U) lies in, as first_of gives it (-1 where the table
// names none of the cache), and -1 past the split's end [.., ke), where nothing is read.  A read of
// the block table, which the keys' K and V loads wait on: attend_kernel looks a step's keys up a step
// before it loads them (load_keys), so that the table's read overlaps a step's arithmetic instead of
// preceding the loads.  A dense cache (kPaged false) reads no table and keeps nothing here.
template <bool kPaged, int U>
__device__ __forceinline__ void look_up(const DecodeParams& p, const Row& r, int64_t b, int64_t j0, int64_t spread,
                                        int64_t ke, int32_t (&first)[U]) {
  if constexpr (kPaged) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + u * spread;
      first[u] = j < ke ? (int32_t)first_of(p, b, r.row, j) : -1;  // decode.cu: num_blocks < 2^31
    }
  }
}

// The chunks cl of K and V of keys j0 + u * spread, u < U (zeros for a lane past the row's chunks), in
// the blocks look_up found (kPaged) or in the row of a dense cache; have[u] = whether the key is one
// of the split's keys [.., ke) and in the cache; hole is set where a key of the split lies in a block
// the block table does not name.
template <typename T, bool kPaged, int U>
__device__ __forceinline__ void load_keys(const DecodeParams& p, const Row& r, int64_t b, int64_t hkv, int64_t j0,
                                          int64_t spread, int64_t ke, int cl, bool has_chunk, const int32_t (&first)[U], Raw<T> (&kr)[U],
                                          Raw<T> (&vr)[U], bool (&have)[U], bool& hole) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t j = j0 + u * spread;
    int64_t ko = -1, vo = -1;
    if (j < ke) {  // one block for the key and its value
      const Slot sl = kPaged ? Slot{first[u], block_pos(p, j).r} : slot_of(p, b, r.row, j);
      ko = slot_off(sl, p.ks, hkv);
      vo = slot_off(sl, p.vs, hkv);
    }
    have[u] = ko >= 0 && vo >= 0;
    hole = hole || (j < ke && !have[u]);
    if (have[u] && has_chunk) {
      load_raw(static_cast<const T*>(p.kc) + ko + cl * kChunk, kr[u]);
      load_raw(static_cast<const T*>(p.vc) + vo + cl * kChunk, vr[u]);
    } else {
      zero_raw(kr[u]);
      zero_raw(vr[u]);
    }
  }
}

// (m, l, acc) <- the merge of two online-softmax states (max, sum of exp(s - max), sum of
// exp(s - max) v); a state that saw no key has m = -inf, l = 0 and acc = 0, and adds nothing.  A
// state whose scores were all NaN also has m = -inf (fmaxf skips NaN), but l = NaN: the sums carry it.
__device__ __forceinline__ void merge_state(float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) {
    l += l2;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) acc[c] += acc2[c];
    return;
  }
  const float a = m == -INFINITY ? 0.0f : expf(m - mn), a2 = m2 == -INFINITY ? 0.0f : expf(m2 - mn);
  l = l * a + l2 * a2;
#pragma unroll
  for (int c = 0; c < kChunk; ++c) acc[c] = acc[c] * a + acc2[c] * a2;
  m = mn;
}

// The end of an attention block: each warp's (max, sum, O) of rows [r0, r0 + nr) of KV head hkv
// merged and written, out and lse (one split) or the split's part (split-KV).  red holds the warps'
// unnormalised O, (kWarps, kRows, ld) float32; red_ml their (max, sum) pairs, (kWarps, kRows, 2);
// kBase2: the maxima are in base-2 units (scores times log2 e), else natural ones.  nan_rows: the
// block's index values were out of range or a key lay in a block the table does not name.  Every
// thread of the block calls it (it synchronises).
//
// First one thread per row turns its warps' (max, sum) into each warp's weight in the row's output
// (the sink's factor included) and the row's lse, written over red_ml: (weight, lse) for warp 0,
// (weight, -) for the others; then the block's threads sum the weighted O element by element.
template <typename T, int kRows, bool kBase2>
__device__ __forceinline__ void write_rows(const DecodeParams& p, const float* red, float* red_ml, int64_t ld,
                                           int64_t b, int64_t hkv, int64_t split, int64_t r0, int64_t nr,
                                           bool nan_rows) {
  const int tid = threadIdx.x;
  if (tid < nr) {
    const int64_t rr = tid;
    // a warp whose scores were all NaN has max -inf and sum NaN: NaN in, NaN out
    float mx = -INFINITY;
    bool nan = nan_rows;
    for (int w = 0; w < kWarps; ++w) {
      const float l = red_ml[(w * kRows + rr) * 2 + 1];
      mx = fmaxf(mx, red_ml[(w * kRows + rr) * 2]);
      nan = nan || l != l;
    }
    float a[kWarps], sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float mw = red_ml[(w * kRows + rr) * 2];
      a[w] = mx == -INFINITY || mw == -INFINITY ? 0.0f : kBase2 ? exp2f(mw - mx) : expf(mw - mx);
      sum += red_ml[(w * kRows + rr) * 2 + 1] * a[w];
    }
    // a row that saw no key: out exactly 0, lse -inf (the sink's logit with a sink)
    const float mx_e = kBase2 ? mx * 0.6931471805599453f : mx;
    float lse = sum > 0.0f ? mx_e + logf(sum) : -INFINITY;
    if (p.nsplit > 1) {  // the split's (max, sum): merge_kernel weighs by them rather than by the rounded lse
      const int64_t t = (r0 + rr) / p.G, hq = hkv * p.G + (r0 + rr) % p.G;
      const int64_t at = ((b * p.nsplit + split) * p.Sq + t) * p.Hq + hq;
      p.part_ml[at * 2] = mx_e;
      p.part_ml[at * 2 + 1] = sum;
    }
    float scale = sum > 0.0f ? 1.0f / sum : 0.0f;
    if (p.nsplit == 1) {
      float factor;
      lse = add_sink(p, hkv * p.G + (r0 + rr) % p.G, lse, factor);
      scale *= factor;
    }
    if (nan || sum != sum) lse = scale = NAN;
    for (int w = 0; w < kWarps; ++w) red_ml[(w * kRows + rr) * 2] = a[w] * scale;  // NaN stays NaN
    red_ml[rr * 2 + 1] = lse;
  }
  __syncthreads();
  for (int64_t rr = 0; rr < nr; ++rr) {
    float wt[kWarps];
    for (int w = 0; w < kWarps; ++w) wt[w] = red_ml[(w * kRows + rr) * 2];
    const float lse = red_ml[rr * 2 + 1];
    const int64_t t = (r0 + rr) / p.G, hq = hkv * p.G + (r0 + rr) % p.G;
    T* out = static_cast<T*>(p.out) + b * p.os[0] + t * p.os[1] + hq * p.os[2];
    const int64_t at = ((b * p.nsplit + split) * p.Sq + t) * p.Hq + hq;
    for (int64_t d = tid; d < p.D; d += kThreads) {
      float o = 0.0f;
      // a warp of weight 0 saw no key of the row: its O (0, or NaN from a value only other rows see)
      // adds nothing
      for (int w = 0; w < kWarps; ++w)
        if (wt[w] != 0.0f) o += red[(w * kRows + rr) * ld + d] * wt[w];
      if (p.nsplit == 1)
        out[d * p.os[3]] = from_f<T>(o);
      else
        p.part[at * p.D + d] = o;
    }
    if (tid == 0) {
      if (p.nsplit == 1)
        p.lse[b * p.ls[0] + hq * p.ls[1] + t * p.ls[2]] = lse;
      else
        p.part_lse[at] = lse;
    }
  }
}

// grid (nsplit * B, Hkv * row_tiles), kThreads threads: split `split` of batch row b's key range,
// for query rows [tile * kRows, + kRows) of KV head hkv (row = t * G + g: token t, query head
// hkv * G + g).  Dynamic shared memory: q (kRows, D), the warps' accumulators (kWarps, kRows, D)
// and their (max, sum) (kWarps, kRows, 2), float32, then one int.  A batch row whose index values
// are out of range (possible only where the host did not check them: attn_backends/_kvcache.py
// run_cuda_kernel) reads and writes no position outside the caches, and its rows come out NaN, out
// and lse; so do the rows of a tile that would read a key in a block the block table does not name.
// kPaged: the cache is paged (p.block_size > 0), its block table read a step ahead (look_up).  The
// look-ahead takes registers: with one query row, 134-138 against 123-128 dense (ptxas, sm_90a), which
// would leave 3 blocks an SM where the dense kernel has 4 (kBlocksPerSM in decode.cu), so the paged
// one-row kernels are held to 4 blocks an SM (128 registers, 24-32 bytes of spills).
template <typename T, int kRows, bool kPaged>
__global__ void __launch_bounds__(kThreads, kPaged && kRows == 1 ? 4 : AB_DECODE_MIN_BLOCKS) attend_kernel(const DecodeParams p) {
  constexpr int U = Unroll<T, kRows>::value;
  extern __shared__ unsigned char smem_raw[];
  float* qs = reinterpret_cast<float*>(smem_raw);
  float* red = qs + kRows * p.D;
  float* red_ml = red + kWarps * kRows * p.D;
  int* holes = reinterpret_cast<int*>(red_ml + kWarps * kRows * 2);

  const int64_t split = blockIdx.x % p.nsplit, b = blockIdx.x / p.nsplit;
  const int64_t hkv = blockIdx.y / p.row_tiles, r0 = (blockIdx.y % p.row_tiles) * kRows;
  const int64_t nr = lmin(kRows, p.rows - r0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  Row r = row_of(p, b);
  const bool bad = !r.ok;
  if (bad) r.seq = r.lo = r.end = r.row = 0;  // no keys

  // the queries: rotated at their positions, times scale, float32; rows past nr stay zero
  const T* qd = static_cast<const T*>(p.q);
  for (int64_t e = tid; e < kRows * p.D; e += kThreads) {
    const int64_t rr = e / p.D, d = e % p.D;
    float x = 0.0f;
    if (rr < nr) {
      const int64_t t = (r0 + rr) / p.G, hq = hkv * p.G + (r0 + rr) % p.G;
      const int64_t base = b * p.qs[0] + t * p.qs[1] + hq * p.qs[2];
      auto at = [&](int64_t i) { return to_f(qd[base + i * p.qs[3]]); };
      x = p.rot_half > 0 ? rotated(p, r.seq + (p.q_per_token ? t : 0), d, at) : at(d);
      x = __fmul_rn(x, p.scale);
    }
    qs[e] = x;
  }
  if (tid == 0) *holes = 0;

  // the keys any row of the tile sees (causal and window bottom-right), and this split's share
  const KeyRange range = split_keys(p, r, r0, nr, split);
  const int64_t ks = range.ks, ke = range.ke;

  // lanes: L per key (a power of two), chunk cl of the key's row; 32 / L keys per warp, U each
  const int nchunk = (int)(p.D / kChunk);
  int L = 1;
  while (L < nchunk) L <<= 1;
  const int sub = lane / L, cl = lane % L;
  const bool has_chunk = cl < nchunk;
  const int64_t spread = (int64_t)kWarps * (32 / L), step = spread * U;

  // each row's visible keys [vlo, vhi) (causal and window, bottom-right; empty past nr), as offsets
  // from the split's first key, and its position (ALiBi) the same way
  float m[kRows], l[kRows], acc[kRows][kChunk];
  RowKeys rk[kRows];
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) acc[rr][c] = 0.0f;
    rk[rr] = row_keys(p, r, b, hkv, r0 + rr, rr < nr, range);
  }
  __syncthreads();  // qs written

  const int64_t mine = warp * (32 / L) + sub;  // this lane's first key in each step
  Raw<T> kr[U], vr[U];
  bool have[U], hole = false;
  int32_t first[U];
  look_up<kPaged, U>(p, r, b, ks + mine, spread, ke, first);
  load_keys<T, kPaged, U>(p, r, b, hkv, ks + mine, spread, ke, cl, has_chunk, first, kr, vr, have, hole);
  look_up<kPaged, U>(p, r, b, ks + mine + step, spread, ke, first);
  for (int64_t base = ks; base < ke; base += step) {
    const int64_t j0 = base + mine;
    // the next step's keys are requested before this one's arithmetic: their loads overlap it; the
    // block table's entries of the step after are read now, for the next step's requests
    Raw<T> nk[U], nv[U];
    bool next_have[U];
    load_keys<T, kPaged, U>(p, r, b, hkv, j0 + step, spread, ke, cl, has_chunk, first, nk, nv, next_have, hole);
    look_up<kPaged, U>(p, r, b, j0 + 2 * step, spread, ke, first);
    float kx[U][kChunk], vx[U][kChunk];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      to_floats(kr[u], kx[u]);
      to_floats(vr[u], vx[u]);
    }
    // the scores of every row and key, then their sums over the L lanes of a key, level by level
    // over all of them at once (independent shuffles in flight), then the online softmax
    float s[kRows][U];
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
#pragma unroll
      for (int u = 0; u < U; ++u) s[rr][u] = 0.0f;
      if (has_chunk) {
        const float* q = qs + rr * p.D + cl * kChunk;
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
          const float qc = q[c];
#pragma unroll
          for (int u = 0; u < U; ++u) s[rr][u] += qc * kx[u][c];
        }
      }
    }
    for (int o = 1; o < L; o <<= 1)
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr)
#pragma unroll
        for (int u = 0; u < U; ++u) s[rr][u] += __shfl_xor_sync(0xffffffffu, s[rr][u], o);
    const int jr = (int)(j0 - ks);  // key u at offset jr + u * spread from the split's first key
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      // the online softmax, U keys at a time: rescale once by exp(old max - new max)
      bool seen[U], any = false;
      float mn = m[rr];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = jr + u * (int)spread;
        seen[u] = have[u] && j >= rk[rr].vlo && j < rk[rr].vhi;
        if (seen[u]) {
          s[rr][u] = shaped_score(p, rk[rr], s[rr][u], j);
          mn = fmaxf(mn, s[rr][u]);
          any = true;
        }
      }
      if (any) {
        // while every score seen is -inf or NaN the reference is 0, not the max: exp(-inf - 0) = 0
        // where exp(-inf + inf) would be NaN, and a NaN score still makes the sum NaN
        const float ref = mn == -INFINITY ? 0.0f : mn;
        const float a = softmax_exp<T>(m[rr] - ref);
        l[rr] *= a;
#pragma unroll
        for (int c = 0; c < kChunk; ++c) acc[rr][c] *= a;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (!seen[u]) continue;
          const float e = softmax_exp<T>(s[rr][u] - ref);
          l[rr] += e;
#pragma unroll
          for (int c = 0; c < kChunk; ++c) acc[rr][c] += e * vx[u][c];
        }
        m[rr] = mn;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kr[u] = nk[u];
      vr[u] = nv[u];
      have[u] = next_have[u];
    }
  }

  // the warp's key groups merged (lanes cl, cl + L, ... hold the same elements), then the warps
  for (int o = L; o < 32; o <<= 1) {
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      float other[kChunk];
#pragma unroll
      for (int c = 0; c < kChunk; ++c) other[c] = __shfl_xor_sync(0xffffffffu, acc[rr][c], o);
      const float m2 = __shfl_xor_sync(0xffffffffu, m[rr], o), l2 = __shfl_xor_sync(0xffffffffu, l[rr], o);
      merge_state(m[rr], l[rr], acc[rr], m2, l2, other);
    }
  }
  if (sub == 0 && has_chunk) {
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr)
#pragma unroll
      for (int c = 0; c < kChunk; ++c) red[(warp * kRows + rr) * p.D + cl * kChunk + c] = acc[rr][c];
  }
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      red_ml[(warp * kRows + rr) * 2] = m[rr];
      red_ml[(warp * kRows + rr) * 2 + 1] = l[rr];
    }
  }
  if (hole) *holes = 1;
  __syncthreads();
  write_rows<T, kRows, false>(p, red, red_ml, p.D, b, hkv, split, r0, nr, bad || *holes);
}

// ---- split-KV: the merge -----------------------------------------------------------------------

// The sum of v over the block's threads, in a fixed order (each warp's xor tree, then the warps' in
// order): every thread gets the same bits, run after run.  Uses red[kWarps]; syncs twice.
__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += red[w];
  __syncthreads();  // red free again
  return total;
}

// The largest v over the block's threads (NaN counts as none: fmaxf); every thread gets it.
__device__ __forceinline__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  return mx;
}

// One block per output row (b, t, hq), grid-stride: out = sum_s w_s out_s, w_s = exp(lse_s - max) /
// sum exp(lse_s - max), lse = max + log(sum); a row no split saw stays 0 / -inf; then the sink joins
// (add_sink).  Thread s reads split s's lse (kMaxSplits <= kThreads), the block reduces them, and the
// weights go through shared memory to the threads of the row's elements: no thread walks the splits'
// lse one dependent load after another (with 66 splits that chain was three passes of global loads).
template <typename T>
__global__ void __launch_bounds__(kThreads) merge_kernel(const DecodeParams p) {
  static_assert(kMaxSplits <= kThreads, "one thread per split");
  __shared__ float weight[kMaxSplits];
  __shared__ float red[kWarps];
  const int tid = threadIdx.x;
  const int64_t n = p.B * p.Sq * p.Hq;
  for (int64_t idx = blockIdx.x; idx < n; idx += gridDim.x) {
    const int64_t hq = idx % p.Hq, t = idx / p.Hq % p.Sq, b = idx / (p.Hq * p.Sq);
    // split s of this row at first + s * stride
    const int64_t first = (b * p.nsplit * p.Sq + t) * p.Hq + hq, stride = p.Sq * p.Hq;
    const float ls = tid < p.nsplit ? p.part_lse[first + tid * stride] : -INFINITY;
    // split s's running max and sum (write_rows): the weights are l_s exp(m_s - max m), not exp(lse_s - max
    // lse), whose float32 lse carries a rounding error of |lse| 2**-24 into every weight (the CPU merge's
    // rule, csrc/cpu/decode_cpu.c merge)
    const float ms = tid < p.nsplit ? p.part_ml[(first + tid * stride) * 2] : -INFINITY;
    const float lsum = tid < p.nsplit ? p.part_ml[(first + tid * stride) * 2 + 1] : 0.0f;
    // a split that saw a NaN score makes the row NaN; so do index values out of range (attend_kernel)
    const float nan_seen = block_sum(ls != ls ? 1.0f : 0.0f, red);
    const bool nan = nan_seen > 0.0f || !row_of(p, b).ok;
    const float mx = block_max(lsum > 0.0f ? ms : -INFINITY, red);
    const float e = mx != -INFINITY && lsum > 0.0f && ls == ls ? lsum * expf(ms - mx) : 0.0f;
    const float total = block_sum(e, red);
    if (tid < p.nsplit) weight[tid] = total > 0.0f ? e / total : 0.0f;
    float factor;
    float lse = add_sink(p, hq, total > 0.0f ? mx + logf(total) : -INFINITY, factor);
    if (nan) lse = factor = NAN;
    __syncthreads();  // weight written
    for (int64_t d = tid; d < p.D; d += kThreads) {
      float o = 0.0f;
      const float* part = p.part + first * p.D + d;
#pragma unroll 4
      for (int64_t s = 0; s < p.nsplit; ++s) o += weight[s] * part[s * stride * p.D];
      static_cast<T*>(p.out)[b * p.os[0] + t * p.os[1] + hq * p.os[2] + d * p.os[3]] = from_f<T>(o * factor);
    }
    if (tid == 0) p.lse[b * p.ls[0] + hq * p.ls[1] + t * p.ls[2]] = lse;
    __syncthreads();  // weight read before the next row writes it
  }
}

}  // namespace

#endif  // AB_DECODE_KERNEL_CUH
