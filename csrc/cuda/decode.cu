// decode.cu -- attention against a KV cache on CUDA (flash_attn_with_kvcache semantics,
// docs/decode.md): the launcher of the decode kernels (decode_kernel.cuh, decode_mma_kernel.cuh).
// It checks the call's shapes, dtypes, devices and layouts, picks the attention kernel (variant_of),
// fills DecodeParams once, picks the rows per block and the split count, and launches the cache
// write, the attention and (split-KV) the merge on the stream.
//
// The values of the index tensors (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) live
// on the device: the caller checks them on the host first (attn_backends/_kvcache.py host_rows, the
// same checks and messages as the CPU kernel's), so that a bad value raises before anything is
// written.  The kernels bound what they read and write by them anyway: a value out of range never
// reaches memory outside the caches.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <initializer_list>

#include "ab_cuda_internal.h"
#include "decode_kernel.cuh"
#include "decode_mma_kernel.cuh"
#include "../cpu/decode_cpu.h"

namespace {

// Splits chosen by the heuristic keep at least this many keys each: below it the merge and the
// per-block setup cost more than the parallelism gains.
constexpr int64_t kMinSplitKeys = 128;
// Blocks the heuristic aims for per SM: decode is bound by the bytes in flight, and one block of
// kThreads threads keeps 2 * kUnroll loads per lane in flight, so an SM wants several.  The value is
// not tuned on its own: on the H200 (issue 19) the first kernel read the cache at 6% of the bandwidth
// with one block per SM, but it also waited on a host copy every call, and the change to 4 came with
// the other changes of that rewrite, timed together (docs/benchmarks.md, "GPU").
constexpr int64_t kBlocksPerSM = 4;

bool paged(const ab_kvcache_params* p) { return p->block_table.ndim > 0; }

int64_t capacity(const ab_kvcache_params* p) {
  return paged(p) ? p->block_table.sizes[1] * p->k_cache.sizes[1] : p->k_cache.sizes[1];
}

// The attention kernel of a call: attend_kernel (one lane per 8 elements of a key row, float32
// arithmetic) or attend_mma_kernel (tensor cores, 16-bit caches only).  On the H200 (2026-12-04,
// docs/benchmarks.md, "Third GPU run"), in CUDA graphs, attend_mma_kernel took 0.43-0.45x
// attend_kernel's time where a KV head has 4 query rows (GQA 32/8, one token, bfloat16: 0.045 against
// 0.103 ms, 0.057 against 0.126) and 1.22x it where it has one (MHA, one token: 0.078 against 0.064
// ms): its cost follows keys x KV heads (16 rows a block whatever the call has), attend_kernel's keys x
// query rows.  So by default 16-bit calls whose KV heads have at least kMmaMinRows query rows (tokens x
// the query heads of a KV head) take attend_mma_kernel, the others attend_kernel.
// ATTN_BACKENDS_CUDA_DECODE_KERNEL, read at every call, forces one: "mma" or "lanes".  A device whose
// shared memory per block is too small for attend_mma_kernel's stages keeps attend_kernel.  The stage
// count is decided here, once per call.
constexpr int64_t kMmaMinRows = 2;  // between the measured 1 (attend_kernel faster) and 4 (mma faster)

struct Variant {
  bool mma;    // attend_mma_kernel, else attend_kernel
  int stages;  // attend_mma_kernel's stages (mma_stages)
  bool lo;     // attend_mma_kernel: the queries' lo half in shared memory (rotary tables given)
};

int mma_head_dim(int64_t D) { return D <= 64 ? 64 : D <= 128 ? 128 : 256; }

// attend_mma_kernel's stages at the head dim it is instantiated for (decode_mma_kernel.cuh), given
// the shared memory the device lets a block have: 3 at 128 where two blocks of them fit an SM, and
// 3 at 256 where one block of them fits (sm_90 both: one block an SM at 256 either way).
// ATTN_BACKENDS_CUDA_DECODE_STAGES=2 or 3 (read at every call) forces a count at head dims 128 and 256
// where it fits: on an sm_90, 2 stages at 128 without rotary tables are 73 KiB a block, three blocks
// an SM (12 warps, one tile in flight each) against two of 3 stages (8 warps, two tiles in flight
// each): the H200's profile (docs/decode.md) asks for more warps, the bytes in flight for the stages;
// not measured, so the default stays 3.
int mma_stages(int kd, int optin, bool lo) {
  if (kd == 64) return 4;
  const char* e = getenv("ATTN_BACKENDS_CUDA_DECODE_STAGES");
  const int forced = e != nullptr && (strcmp(e, "2") == 0 || strcmp(e, "3") == 0) ? e[0] - '0' : 0;
  if (forced && (size_t)optin >= mma_smem_bytes(kd, forced, lo)) return forced;
  if (kd == 128) return (size_t)optin >= 2 * mma_smem_bytes(128, 3, lo) ? 3 : 2;
  return (size_t)optin >= mma_smem_bytes(256, 3, lo) ? 3 : 2;
}

// The current device, and an attribute of a device (the current one by default): -1 where the runtime
// does not say, its error cleared, since a failed query is not the launch's error (the launchers check
// cudaGetLastError after each launch).
int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) return device;
  (void)cudaGetLastError();
  return -1;
}

int device_attr(cudaDeviceAttr attr, int device = -1) {
  int value = 0;
  if (device < 0) device = current_device();
  if (device >= 0 && cudaDeviceGetAttribute(&value, attr, device) == cudaSuccess) return value;
  (void)cudaGetLastError();
  return -1;
}

int device_smem_optin() {
  const int optin = device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  return optin > 0 ? optin : 0;
}

Variant variant_of(const ab_kvcache_params* p) {
  const Variant lanes{false, 0, false};
  if (p->q.dtype != AB_DTYPE_F16 && p->q.dtype != AB_DTYPE_BF16) return lanes;
  const char* e = getenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL");
  const bool want = e != nullptr && strcmp(e, "mma") == 0    ? true
                    : e != nullptr && strcmp(e, "lanes") == 0 ? false
                                                              : p->Sq * (p->Hq / p->Hkv) >= kMmaMinRows;
  if (!want) return lanes;
  const bool lo = p->rotary_cos.ndim > 0 && p->rotary_cos.sizes[1] > 0;  // the kernel's q_split (rot_half > 0)
  const int optin = device_smem_optin(), kd = mma_head_dim(p->D), stages = mma_stages(kd, optin, lo);
  return (size_t)optin >= mma_smem_bytes(kd, stages, lo) ? Variant{true, stages, lo} : lanes;
}

int rows_per_block(const ab_kvcache_params* p, Variant v) {
  if (v.mma) return kMmaRows;
  const int64_t rows = p->Sq * (p->Hq / p->Hkv);
  return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : kMaxRows;
}

int64_t row_tiles(const ab_kvcache_params* p, Variant v) {
  const int kr = rows_per_block(p, v);
  return (p->Sq * (p->Hq / p->Hkv) + kr - 1) / kr;
}

// attend_kernel's dynamic shared memory: q (kRows, D), the warps' accumulators (kWarps, kRows, D) and
// their (max, sum) (kWarps, kRows, 2), float32, then one int.
size_t lanes_smem(int rows, int64_t D) {
  return sizeof(float) * (size_t)(rows * D + kWarps * rows * D + kWarps * rows * 2 + 1);
}

// Splits of each row's key range: num_splits when given, else, when the (batch, KV head, row tile)
// blocks are fewer than the places the SMs have for them, the count that fills whole waves of those
// places (whole_wave_splits), each split keeping kMinSplitKeys keys of the cache's capacity
// (attend_kernel) or kMmaMinSplitKeys (attend_mma_kernel: four of its tiles).  The places: blocks an
// SM holds at once (mma_resident, lanes_resident) times the SMs.  Where the device does not say,
// attend_kernel aims at kBlocksPerSM blocks an SM, rounding up (the rule before 2026-12-04).
constexpr int64_t kMmaBlocksPerSM = 2;  // mma_resident where the device does not say
constexpr int64_t kMmaMinSplitKeys = 4 * kMmaKeys;

// Blocks of attend_mma_kernel an SM holds at once.  Its shared memory binds: registers allow three or
// more a block up to head dim 128 and two at 256 (ptxas, sm_90a: 128-166 and 246-255 registers), shared
// memory two or three (one at 256).  Other architectures' register counts are not checked here: a build
// whose registers bound tighter would get splits for more blocks than an SM holds.
int64_t mma_resident(const ab_kvcache_params* p, Variant v) {
  const int device = current_device();
  const int per_sm = device_attr(cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  const int reserved = device_attr(cudaDevAttrReservedSharedMemoryPerBlock, device);
  if (per_sm < 0 || reserved < 0) return kMmaBlocksPerSM;
  const size_t block = mma_smem_bytes(mma_head_dim(p->D), v.stages, v.lo) + (size_t)reserved;
  const int64_t n = (int64_t)((size_t)per_sm / block);
  return n < 1 ? 1 : n;
}

// Blocks of the attend_kernel instance a call launches that an SM holds at once (the occupancy the
// runtime computes from its registers, threads and shared memory: with one query row 4, with 2-8
// rows 2, ptxas sm_90a), 0 where the runtime does not say.
template <typename T, int kRows, bool kPaged> int64_t lanes_occupancy(int64_t D) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, attend_kernel<T, kRows, kPaged>, kThreads, lanes_smem(kRows, D)) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

template <typename T, bool kPaged> int64_t lanes_occupancy_rows(int rows, int64_t D) {
  switch (rows) {
    case 1: return lanes_occupancy<T, 1, kPaged>(D);
    case 2: return lanes_occupancy<T, 2, kPaged>(D);
    case 4: return lanes_occupancy<T, 4, kPaged>(D);
    default: return lanes_occupancy<T, kMaxRows, kPaged>(D);
  }
}

template <typename T> int64_t lanes_occupancy_of(const ab_kvcache_params* p, Variant v) {
  const int rows = rows_per_block(p, v);
  return paged(p) ? lanes_occupancy_rows<T, true>(rows, p->D) : lanes_occupancy_rows<T, false>(rows, p->D);
}

// lanes_resident's answers, kept so that a decode call does not ask the runtime each time: per device
// (up to 16), dtype, rows per block, dense or paged and head dim / 8, the device's compute capability
// << 8 | (answer + 1); 0 where not asked yet.  The capability is checked at every call: the emulator
// stands for several devices in turn.
constexpr int kOccDevices = 16, kOccDims = kMaxHeadDim / kChunk + 1;
std::atomic<int> g_lanes_occ[kOccDevices][3][4][2][kOccDims];

int64_t lanes_resident(const ab_kvcache_params* p, Variant v) {
  const int device = current_device();
  const int major = device_attr(cudaDevAttrComputeCapabilityMajor, device);
  const int minor = device_attr(cudaDevAttrComputeCapabilityMinor, device);
  if (major < 0 || minor < 0) return 0;
  const int cc = major * 10 + minor, rows = rows_per_block(p, v);
  const int dt = p->q.dtype == AB_DTYPE_F16 ? 0 : p->q.dtype == AB_DTYPE_BF16 ? 1 : 2;
  std::atomic<int>* slot = device >= 0 && device < kOccDevices && p->D % kChunk == 0 && p->D <= kMaxHeadDim
                               ? &g_lanes_occ[device][dt][rows == 1 ? 0 : rows == 2 ? 1 : rows == 4 ? 2 : 3]
                                             [paged(p) ? 1 : 0][p->D / kChunk]
                               : nullptr;
  const int known = slot ? slot->load(std::memory_order_relaxed) : 0;
  if (known != 0 && known >> 8 == cc) return (known & 0xff) - 1;
  const int64_t n = dt == 0 ? lanes_occupancy_of<__half>(p, v)
                    : dt == 1 ? lanes_occupancy_of<__nv_bfloat16>(p, v)
                              : lanes_occupancy_of<float>(p, v);
  if (slot) slot->store(cc << 8 | (int)((n < 254 ? n : 254) + 1), std::memory_order_relaxed);
  return n;
}

// The split count (1 to `most`) that gives the least waves(n) x (units a block + 1) for `blocks`
// blocks over `slots` places and a row of `keys` keys, where waves(n) = ceil(blocks x n / slots), a
// unit is kMmaKeys keys (a tile of attend_mma_kernel) and the 1 stands for a block's fixed cost (its
// queries, its epilogue); the smallest such n.  The blocks of a partial last wave run while most SMs
// idle: on the H200 (2026-12-04, Nsight Compute) the tensor-core attention of B=8 Hkv=8 over 2048
// positions took 5 splits for 2 blocks an SM (320 blocks for 264 places: 1.2 waves) and 55 us where
// B=1 over 16384 positions, the same bytes in one wave, took 40; this count is 4.
int64_t whole_wave_splits(int64_t blocks, int64_t slots, int64_t keys, int64_t most) {
  const int64_t units = (keys + kMmaKeys - 1) / kMmaKeys;
  int64_t best = 1, best_cost = -1;
  for (int64_t n = 1; n <= (most > 1 ? most : 1); ++n) {
    const int64_t cost = (blocks * n + slots - 1) / slots * ((units + n - 1) / n + 1);
    if (best_cost < 0 || cost < best_cost) {
      best = n;
      best_cost = cost;
    }
  }
  return best;
}

ab_status split_count(const ab_kvcache_params* p, Variant v, int64_t* nsplit, ab_error* err) {
  if (p->num_splits > 0) {
    *nsplit = p->num_splits < kMaxSplits ? p->num_splits : kMaxSplits;
    return AB_OK;
  }
  int device = 0, sms = 0;
  ab_status st = ab_cuda_check(cudaGetDevice(&device), "cudaGetDevice", err);
  if (st != AB_OK) return st;
  st = ab_cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute",
                     err);
  if (st != AB_OK) return st;
  const int64_t blocks = p->B * p->Hkv * row_tiles(p, v);
  const int64_t resident = v.mma ? mma_resident(p, v) : lanes_resident(p, v);
  const int64_t most_keys = capacity(p) / (v.mma ? kMmaMinSplitKeys : kMinSplitKeys);
  const int64_t most = most_keys < kMaxSplits ? most_keys : kMaxSplits;
  int64_t n = 1;
  if (resident > 0) {
    if (blocks > 0 && blocks < resident * sms) n = whole_wave_splits(blocks, resident * sms, capacity(p), most);
  } else if (blocks > 0 && blocks < kBlocksPerSM * sms) {
    n = (kBlocksPerSM * sms + blocks - 1) / blocks;
    n = n < most_keys ? n : most_keys;
  }
  *nsplit = n < 1 ? 1 : n > kMaxSplits ? kMaxSplits : n;
  return AB_OK;
}

size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

size_t workspace_for(const ab_kvcache_params* p, int64_t nsplit) {
  if (nsplit <= 1) return 0;
  const size_t rows = (size_t)(p->B * nsplit * p->Sq * p->Hq);
  return align256(rows * (size_t)p->D * sizeof(float)) + align256(rows * sizeof(float)) +
         align256(rows * 2 * sizeof(float));
}

#define TRY(expr)               \
  do {                          \
    ab_status s_ = (expr);      \
    if (s_ != AB_OK) return s_; \
  } while (0)

// The shared check of a KV-cache call (csrc/ab_params.c: shapes, dtypes, devices, options), then this
// kernel's own limits: head dims, 16-byte cache rows, one dtype for the rotary tables, the pool's blocks.
ab_status check_call(const ab_kvcache_params* p, ab_error* err) {
  TRY(ab_kvcache_params_check(p, AB_DEVICE_CUDA, err));
  if (p->D % kChunk || p->D > kMaxHeadDim)
    return ab_error_set(err, AB_ERR_UNSUPPORTED,
                        "the CUDA decode kernel takes head dims that are multiples of 8 up to %d, got %lld",
                        kMaxHeadDim, (long long)p->D);
  // 16-byte rows: every key row of the caches is read with 16-byte loads
  for (const ab_tensor* c : {&p->k_cache, &p->v_cache}) {
    const size_t es = ab_dtype_size(c->dtype);
    bool ok = reinterpret_cast<uintptr_t>(c->data) % 16 == 0;
    for (int d = 0; d < 3; ++d) ok = ok && (c->sizes[d] <= 1 || (size_t)c->strides[d] * es % 16 == 0);
    if (!ok)
      return ab_error_set(err, AB_ERR_UNSUPPORTED,
                          "the CUDA decode kernel reads cache rows with 16-byte loads: the caches need a contiguous "
                          "last dim, a 16-byte aligned start and strides that are multiples of 16 bytes");
  }
  if (p->rotary_cos.ndim && p->rotary_sin.dtype != p->rotary_cos.dtype)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "the CUDA decode kernel takes rotary_cos and rotary_sin of one dtype");
  // attend_kernel keeps the blocks it looks up a step ahead in 32 bits (decode_kernel.cuh look_up)
  if (paged(p) && p->k_cache.sizes[0] > INT32_MAX)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "the CUDA decode kernel takes paged caches of fewer than 2^31 blocks");
  return AB_OK;
}

// (mul, shift) such that x / d == umulhi(x, mul) >> shift for every 0 <= x < 2^31, d >= 1 (mul 0 for
// d = 1: x itself).  With l = ceil(log2 d), mul = ceil(2^(31 + l) / d) < 2^32 and shift = l - 1:
// x * mul / 2^(31 + l) = x / d + x * e / (d * 2^(31 + l)) with e = mul * d - 2^(31 + l) < d <= 2^l, so
// the error term stays below 1 / d and the floor is exact (Granlund and Montgomery's method).
void fast_divisor(int64_t d, uint32_t* mul, uint32_t* shift) {
  if (d <= 1) {
    *mul = 0, *shift = 0;
    return;
  }
  int l = 0;
  while (((int64_t)1 << l) < d) ++l;
  *mul = (uint32_t)((((uint64_t)1 << (31 + l)) + (uint64_t)d - 1) / (uint64_t)d);
  *shift = (uint32_t)(l - 1);
}

Index index_of(const ab_tensor& t) {
  Index x{t.ndim ? t.data : nullptr, t.ndim ? t.strides[0] : 0, t.ndim > 1 ? t.strides[1] : 0,
          t.dtype == AB_DTYPE_I64};
  return x;
}

// Whether q rotates at one position per token (flash-attn: causal or a window shorter than the
// cache) or at cache_seqlens for every token (decode_cpu.c's rule).
bool q_per_token(const ab_kvcache_params* p) {
  const int64_t cap = capacity(p);
  return p->causal || (p->window_left >= 0 && p->window_left < cap) || (p->window_right >= 0 && p->window_right < cap);
}

DecodeParams fill_params(const ab_kvcache_params* p, Variant v, int64_t nsplit, void* workspace) {
  DecodeParams d{};
  d.B = p->B;
  d.Sq = p->Sq;
  d.Hq = p->Hq;
  d.Hkv = p->Hkv;
  d.D = p->D;
  d.G = p->Hq / p->Hkv;
  d.rows = p->Sq * d.G;
  d.row_tiles = row_tiles(p, v);
  d.nsplit = nsplit;
  d.q = p->q.data;
  for (int i = 0; i < 4; ++i) d.qs[i] = p->q.strides[i];
  d.kc = p->k_cache.data;
  d.vc = p->v_cache.data;
  for (int i = 0; i < 3; ++i) {
    d.ks[i] = p->k_cache.strides[i];
    d.vs[i] = p->v_cache.strides[i];
  }
  d.block_size = paged(p) ? p->k_cache.sizes[1] : 0;
  d.num_blocks = p->k_cache.sizes[0];
  d.cap = capacity(p);
  // block sizes above 2^30 never arise (a multiple of 16 rows of a cache); capped for the shift's sake
  d.bs_fast = d.block_size > 0 && d.block_size <= ((int64_t)1 << 30) && d.cap <= ((int64_t)1 << 31) - 1;
  if (d.bs_fast) fast_divisor(d.block_size, &d.bs_mul, &d.bs_shift);
  d.block_table = index_of(p->block_table);
  if (p->k_new.ndim) {
    d.knew = p->k_new.data;
    d.vnew = p->v_new.data;
    d.snew = p->k_new.sizes[1];
    for (int i = 0; i < 4; ++i) {
      d.kns[i] = p->k_new.strides[i];
      d.vns[i] = p->v_new.strides[i];
    }
  }
  if (p->rotary_cos.ndim) {
    d.cos = p->rotary_cos.data;
    d.sin = p->rotary_sin.data;
    for (int i = 0; i < 2; ++i) {
      d.cs[i] = p->rotary_cos.strides[i];
      d.ss[i] = p->rotary_sin.strides[i];
    }
    d.rot_half = p->rotary_cos.sizes[1];
    d.rot_len = p->rotary_cos.sizes[0];
    d.cos_dtype = p->rotary_cos.dtype;
  }
  d.interleaved = p->rotary_interleaved;
  d.q_per_token = q_per_token(p);
  d.seqlens = index_of(p->cache_seqlens);
  d.batch_idx = index_of(p->cache_batch_idx);
  d.leftpad = index_of(p->cache_leftpad);
  d.seqlen = p->cache_seqlen;
  if (p->alibi_slopes.ndim) {
    d.alibi = static_cast<const float*>(p->alibi_slopes.data);
    d.alibi_sb = p->alibi_slopes.ndim == 2 ? p->alibi_slopes.strides[0] : 0;
    d.alibi_sh = p->alibi_slopes.strides[p->alibi_slopes.ndim - 1];
  }
  if (p->sinks.ndim) {
    d.sinks = p->sinks.data;
    d.sinks_s = p->sinks.strides[0];
    d.sinks_dtype = p->sinks.dtype;
  }
  d.out = p->out.data;
  for (int i = 0; i < 4; ++i) d.os[i] = p->out.strides[i];
  d.lse = static_cast<float*>(p->lse.data);
  for (int i = 0; i < 3; ++i) d.ls[i] = p->lse.strides[i];
  if (nsplit > 1) {
    d.part = static_cast<float*>(workspace);
    const size_t rows = (size_t)(p->B * nsplit * p->Sq * p->Hq);
    d.part_lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + align256(rows * (size_t)p->D * sizeof(float)));
    d.part_ml = reinterpret_cast<float*>(reinterpret_cast<char*>(d.part_lse) + align256(rows * sizeof(float)));
  }
  d.scale = (float)p->scale;
  d.softcap = (float)p->softcap;
  d.causal = p->causal;
  // a side of the capacity or more hides no key: unbounded, as flash-attn makes it (and no position
  // is ever added to a side near 2**63)
  d.wl = p->window_left >= d.cap ? -1 : p->window_left;
  d.wr = p->window_right >= d.cap ? -1 : p->window_right;
  return d;
}

template <typename T, int kRows>
ab_status launch_attend(const DecodeParams& d, cudaStream_t stream, ab_error* err) {
  const size_t smem = lanes_smem(kRows, d.D);
  const dim3 grid((unsigned)(d.nsplit * d.B), (unsigned)(d.Hkv * d.row_tiles));
  if (d.block_size > 0)
    AB_LAUNCH(grid, kThreads, smem, stream, attend_kernel<T, kRows, true>)(d);
  else
    AB_LAUNCH(grid, kThreads, smem, stream, attend_kernel<T, kRows, false>)(d);
  return ab_cuda_check(cudaGetLastError(), "kvcache_fwd attention launch", err);
}

template <typename T, int kD, int kStages>
ab_status launch_attend_mma(const DecodeParams& d, bool lo, cudaStream_t stream, ab_error* err) {
  // the instance's limit (one per kernel and device) is the size with the lo half wherever that fits,
  // whatever this call's: a call without it setting the smaller limit could otherwise fall between
  // another thread's setting and its launch of a call with it
  const size_t smem = mma_smem_bytes(kD, kStages, lo), most = mma_smem_bytes(kD, kStages, true);
  const size_t limit = (size_t)device_smem_optin() >= most ? most : smem;
  TRY(ab_flash::prepare_smem(attend_mma_kernel<T, kD, kStages>, limit, "paged_attention", kD, err));
  const dim3 grid((unsigned)(d.nsplit * d.B), (unsigned)(d.Hkv * d.row_tiles));
  AB_LAUNCH(grid, kThreads, smem, stream, attend_mma_kernel<T, kD, kStages>)(d);
  return ab_cuda_check(cudaGetLastError(), "kvcache_fwd attention launch", err);
}

template <typename T>
ab_status run(const ab_kvcache_params* p, Variant v, const DecodeParams& d, cudaStream_t stream, ab_error* err) {
  if (d.snew > 0 && d.B > 0) {
    AB_LAUNCH(dim3((unsigned)d.snew, (unsigned)d.B), kThreads, 0, stream, append_kernel<T>)(d);
    TRY(ab_cuda_check(cudaGetLastError(), "kvcache_fwd cache write launch", err));
  }
  if (d.B == 0 || d.rows == 0) return AB_OK;
  if constexpr (sizeof(T) == 2) {
    if (v.mma) {
      switch (mma_head_dim(d.D)) {
        case 64: TRY((launch_attend_mma<T, 64, 4>(d, v.lo, stream, err))); break;
        case 128:
          if (v.stages == 3)
            TRY((launch_attend_mma<T, 128, 3>(d, v.lo, stream, err)));
          else
            TRY((launch_attend_mma<T, 128, 2>(d, v.lo, stream, err)));
          break;
        default:
          if (v.stages == 3)
            TRY((launch_attend_mma<T, 256, 3>(d, v.lo, stream, err)));
          else
            TRY((launch_attend_mma<T, 256, 2>(d, v.lo, stream, err)));
          break;
      }
    }
  }
  if (!v.mma) {
    switch (rows_per_block(p, v)) {
      case 1: TRY((launch_attend<T, 1>(d, stream, err))); break;
      case 2: TRY((launch_attend<T, 2>(d, stream, err))); break;
      case 4: TRY((launch_attend<T, 4>(d, stream, err))); break;
      default: TRY((launch_attend<T, kMaxRows>(d, stream, err))); break;
    }
  }
  if (d.nsplit > 1) {
    const int64_t n = d.B * d.Sq * d.Hq, most = 1 << 20;  // grid-stride beyond this
    AB_LAUNCH((unsigned)(n < most ? n : most), kThreads, 0, stream, merge_kernel<T>)(d);
    TRY(ab_cuda_check(cudaGetLastError(), "kvcache_fwd merge launch", err));
  }
  return AB_OK;
}

}  // namespace

extern "C" size_t ab_cuda_kvcache_workspace(const ab_kvcache_params* p) {
  ab_error ignored;
  int64_t nsplit = 1;
  if (check_call(p, &ignored) != AB_OK || split_count(p, variant_of(p), &nsplit, &ignored) != AB_OK) return 0;
  return workspace_for(p, nsplit);
}

extern "C" ab_status ab_cuda_kvcache_fwd(const ab_kvcache_params* p, void* workspace, size_t workspace_bytes,
                                         void* stream, ab_error* err) {
  TRY(check_call(p, err));
  const Variant v = variant_of(p);
  if (p->B > 65535 || p->Hkv * row_tiles(p, v) > 65535)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "the CUDA decode kernel takes B and Hkv * query tiles up to 65535");
  int64_t nsplit = 1;
  TRY(split_count(p, v, &nsplit, err));
  const size_t need = workspace_for(p, nsplit);
  if (workspace_bytes < need || (need > 0 && workspace == nullptr))
    return ab_error_set(err, AB_ERR_INVALID, "the CUDA decode kernel needs %zu bytes of workspace, got %zu", need,
                        workspace_bytes);
  const DecodeParams d = fill_params(p, v, nsplit, workspace);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->q.dtype) {
    case AB_DTYPE_F16: return run<__half>(p, v, d, s, err);
    case AB_DTYPE_BF16: return run<__nv_bfloat16>(p, v, d, s, err);
    default: return run<float>(p, v, d, s, err);
  }
}
