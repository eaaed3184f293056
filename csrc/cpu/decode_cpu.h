/* decode_cpu.h -- attention against a KV cache on CPU: decode, speculative decoding and chunked
 * prefill, with flash-attn's flash_attn_with_kvcache semantics (docs/decode.md).
 *
 * One call: new keys and values (optional) are rotated (optional) and written into the cache in
 * place at each batch row's cache_seqlens, the queries are rotated at the same positions, then
 * every query attends to its row's keys [cache_leftpad, cache_seqlens + Snew), causal and window
 * aligned bottom-right (query t sits at position t + end - Sq, end the row's last key + 1).  The
 * cache is dense (B_cache, S_cache, Hkv, D), rows picked by cache_batch_idx, or paged
 * (num_blocks, block_size, Hkv, D) with block_table (B, max_blocks).
 *
 * Every value is checked before anything is written: a call that fails leaves the cache as it was.
 *
 * The attention itself is decode_cpu_impl.h, compiled once per ISA (in cpu_generic.c, cpu_avx2.c,
 * cpu_avx512.c, with the other kernel families): work items are (batch row, group of KV heads, split of the key range), each
 * streaming its keys once for every query row that reads them (Sq tokens x the query heads of its
 * KV heads); split results are merged with the lse rule of ab.merge_attention_states.
 */
#ifndef AB_DECODE_CPU_H
#define AB_DECODE_CPU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "../ab_core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ab_kvcache_params {
  int64_t B, Sq, Hq, Hkv, D;   /* from q (B, Sq, Hq, D) and the cache */
  ab_tensor q;                 /* (B, Sq, Hq, D), any strides */
  ab_tensor k_cache, v_cache;  /* (B_cache, S_cache, Hkv, D) or paged (num_blocks, block_size, Hkv, D);
                                  last dim contiguous; written in place when k_new is present */
  ab_tensor k_new, v_new;      /* (B, Snew, Hkv, D), optional (both or neither) */
  ab_tensor rotary_cos, rotary_sin; /* (S_rot, rotary_dim / 2), optional; need k_new */
  ab_tensor cache_seqlens;     /* (B,) int32 or int64: tokens already in each cache row; optional */
  int64_t cache_seqlen;        /* the same for every row when cache_seqlens is absent; -1 = full */
  ab_tensor cache_batch_idx;   /* (B,) int32 or int64: the dense cache row of each batch row; optional */
  ab_tensor cache_leftpad;     /* (B,) int32 or int64: first valid position of each row; optional */
  ab_tensor block_table;       /* (B, max_blocks) int32 or int64; present = paged cache */
  ab_tensor alibi_slopes;      /* (Hq,) or (B, Hq) float32, optional: bias -slope * |i' - j| */
  ab_tensor out;               /* (B, Sq, Hq, D), q's dtype */
  ab_tensor lse;               /* (B, Hq, Sq) float32 */
  double scale, softcap;
  int32_t causal;              /* bottom-right aligned */
  int64_t window_left, window_right; /* -1 = unbounded; aligned like causal */
  int32_t rotary_interleaved;  /* pairs (2i, 2i+1); else GPT-NeoX halves (i, i + rotary_dim / 2) */
  int32_t num_splits;          /* splits of each row's key range: 0 = chosen from the thread count */
  ab_tensor sinks;             /* (Hq,) floating, optional: one logit per query head in each row's softmax
                                  denominator, no value (ab_attn_params.sinks) */
  ab_tensor mask;              /* (B, Hq, Sq, S_cache) after broadcasting (zero strides), bool (false hides
                                  the key) or floating (added to the score, after softcap and ALiBi, as
                                  flash applies ab_attn_params.mask); key index = cache position; a dense
                                  cache without new keys only; optional.  Set for flash's calls only:
                                  its route to this kernel (flash_cpu.c) and, for the op's calls,
                                  _C.kvcache_fwd_cpu; attention_with_kvcache takes no mask. */
} ab_kvcache_params;

/* Bytes of workspace ab_kvcache_cpu_fwd needs for p on a pool of num_threads threads (0 when the
 * call is invalid: fwd then says why). */
size_t ab_kvcache_cpu_workspace_size(const ab_kvcache_params* p, int num_threads);
/* Whether the kernel multiplies a cache of kv_dtype in bfloat16 (AVX512_BF16, decode_cpu_impl.h) for a call
 * of `rows` query rows per KV head (Sq x Hq / Hkv): a bfloat16 cache on the AVX-512 (or AMX) path of a CPU
 * that has the instructions, on an Intel CPU for at most 2 rows (decode_cpu.c); ATTN_BACKENDS_DECODE_BF16_DOT
 * =1 or =0 forces it (read at every call). */
int ab_kvcache_cpu_bf16_products(ab_dtype kv_dtype, int64_t rows);
/* The query rows per KV head (Sq x Hq / Hkv) up to which this kernel serves a call better than flash
 * over a gathered view of the cache (attn_backends/_kvcache.py run_kernel and the fast path ask
 * here).  Every length (INT64_MAX) where tiles of many rows run the tiled products
 * (decode_cpu_impl.h): on the avx2 path (AMD EPYC, Zen 3, 2 threads, B=1 Hq=32 Hkv=8 D=128
 * Sk=4096, docs/benchmarks.md "Several query tokens") the kernel took 0.55-0.85x flash's time from
 * 64 to 512 rows, bfloat16 and float32.  With bfloat16 products, which the tiled products do not
 * use, the rows of the measurement before them (AVX-512, same shape): 64 in general, 48 where flash
 * reads the cache in place (a dense cache without cache_batch_idx: a view, no copy) and the cache
 * is long (64 rows: 15.7 ms in the kernel against 13.1 in flash; 48 rows: 12.1 against 13.4).  On an Intel
 * CPU, whose bfloat16 products stop at 2 rows (ab_kvcache_cpu_bf16_products), every length: on a Xeon with AMX
 * (2 threads, 2026-12-07) the tiled products took 0.83x flash's time at 128 rows (B=1 Hq=32 Hkv=8 Sk=4096, 32
 * tokens) and 0.92x at 64 (MHA, 64 tokens). */
int64_t ab_kvcache_cpu_max_rows(ab_dtype dt, int in_place, int64_t positions);

/* Decode's working set: the K and V bytes the last 64 calls of fwd read, each cache (K's address)
 * counted once, with its latest call's bytes.  fwd asks for the next chunk's keys and the pages of the
 * chunk after early on AMD's AVX-512 path when this passes half the L3 (decode_cpu.c from_dram). */
int64_t ab_kvcache_cpu_working_set(void);

/* An environment switch read at every call: 1 or 0 when `name` is set to "1" or "0", else -1 (the
 * caller's default).  decode_cpu.c's prefetch and product switches and flash_cpu.c's
 * ATTN_BACKENDS_FLASH_DECODE read through it. */
int ab_env_switch(const char* name);

/* The number of splits of each row's key range fwd uses for p on num_threads threads. */
int64_t ab_kvcache_cpu_splits(const ab_kvcache_params* p, int num_threads);
/* Shapes, dtypes, devices (device: the kernel's, CPU or CUDA) and options of a call, everything but
 * the index values: both decode kernels call it first (csrc/ab_params.c). */
ab_status ab_kvcache_params_check(const ab_kvcache_params* p, ab_device_type device, ab_error* err);

ab_status ab_kvcache_cpu_fwd(const ab_kvcache_params* p, void* workspace, size_t workspace_bytes,
                             const ab_cpu_pool* pool, ab_error* err);

/* ---- between decode_cpu.c and the per-ISA kernels (internal) ---------------------------------- */

/* A work item is (batch row, group of hg KV heads, split of the key range); its query rows are the
 * Sq tokens x hg * G heads of the group (G = Hq / Hkv). */
#define AB_DECODE_CHUNK 32 /* keys per chunk of a work item (decode_cpu_impl.h DC_CHUNK) */
#define AB_DECODE_DPAD 16 /* q and accumulator rows are padded to a multiple of 16 floats (32 with bf16_dot) */
#define AB_DECODE_TILE_ROWS 64 /* query rows per tile (tokens x the item's query heads), unless one token has more */
#define AB_DECODE_AMX_TILE_ROWS 256 /* the same with both products on tiles (decode_cpu_impl.h, "tiles of many rows") */
/* Query tokens per tile of a work item of HG query heads: as many as keep its rows within `rows`
 * (AB_DECODE_TILE_ROWS, or AB_DECODE_AMX_TILE_ROWS on tiles of many rows), at least one. */
static inline int64_t ab_decode_tile_tokens(int64_t HG, int64_t rows) { return HG >= rows ? 1 : rows / HG; }
/* rows per KV head (tokens of the tile x G) from which a tile without bfloat16 products takes the tiled
 * products (decode_cpu_impl.h); avx2, B=1 Hq=32 Hkv=8 D=128 Sk=4096: 12 rows 1.0-1.5x the row path's time,
 * 16 rows 0.7-1.1x (float32 about even), 24 rows 0.6-0.9x */
#define AB_DECODE_TILED_ROWS 16

typedef struct ab_decode_run {
  const ab_kvcache_params* p;
  const float* qf;        /* (B, Sq, Hq, dpad) float32: q rotated and multiplied by scale; pad = 0 */
  const uint16_t* qb;     /* bf16_dot only: (B, Sq, Hq, dpad) bfloat16, q rotated (not scaled); pad = 0 */
  float* part;            /* (B, nsplit, Sq, Hq, dpad + 16): each split's out, lse at [dpad], running max at [dpad + 1]
                             and sum at [dpad + 2] (decode_cpu.c merge); NULL if nsplit 1 */
  const int64_t* lo;      /* (B,) first key position of the row (cache_leftpad) */
  const int64_t* end;     /* (B,) one past the last key (cache_seqlens + Snew) */
  const int64_t* row;     /* (B,) dense cache row; unused when paged */
  int64_t dpad, G, hg, nsplit, block_size; /* block_size 0: dense cache */
  int32_t kv_dtype;       /* ab_dtype of the cache */
  int32_t bf16_dot;       /* bfloat16 cache on an AVX512_BF16 CPU: products in bfloat16 (decode_cpu_impl.h);
                             dpad is then a multiple of 32 */
  const float* sink;      /* (Hq,) each query head's sink logit, -inf without sinks */
  struct ab_par_status* st;
  int32_t keys_next;      /* step 3 asks for the next chunk's key rows whatever the cache (decode_cpu.c) */
  int32_t values_ahead;   /* step 1 asks for the chunk's value rows whatever the cache (decode_cpu.c) */
  int32_t pages_ahead;    /* a line of each page of the chunk after next is asked for (decode_cpu.c) */
  int32_t scores_by_head; /* bfloat16 products: step 1 goes head by head, q rows in registers (decode_cpu.c) */
  int32_t four_keys;      /* no bfloat16 products: step 1 takes keys four (AVX2: two) at a time (decode_cpu.c) */
  int32_t pv_wide;        /* no bfloat16 products: step 3 holds four vectors of D per row (decode_cpu.c) */
  int32_t pv_pairs;       /* AVX2, bfloat16 cache: step 3 converts sixteen columns per load, by pairs (decode_cpu.c) */
  int32_t pv_keys;        /* MHA of one token: step 3 goes key by key over the heads (decode_cpu.c) */
  int32_t softmax_keys;   /* step 2 asks for part of the next chunk's key rows (decode_cpu.c) */
  int32_t keys_ahead;     /* step 1 asks for the key row two keys ahead into L1 (decode_cpu.c) */
  float bf_scale;         /* bf16_dot only: what multiplies a float32 score, the scale over the power of two
                             q was multiplied by before its rounding (ab_half.h, ab_bf16_scale_exp) */
  int32_t amx;            /* bf16_dot on a table with tiles: steps 1 and 3 on AMX tiles (decode_cpu_impl.h, "Tiles";
                             decode_cpu.c amx_tiles: one query token, 2 to 16 query heads per KV head, D a multiple
                             of 32 up to 256) */
  int32_t amx_rows;       /* bf16_dot on a table with tiles: every tile through the tiled products, both products
                             on tiles (decode_cpu_impl.h, "tiles of many rows"; decode_cpu.c amx_rows) */
  int32_t mha_runs;       /* bf16_dot, one query token, MHA: each head over runs of keys, its accumulators in
                             registers (decode_cpu_impl.h, "one-token MHA in runs of keys"; decode_cpu.c mha_runs) */
} ab_decode_run;

typedef struct ab_decode_cpu_table {
  const char* isa;
  /* items [begin, end) of (B * Hkv / hg * nsplit): attention of one (batch, head group, split) */
  void (*attend)(int64_t begin, int64_t end, void* run);
  /* n floats of a q row (zero past D) times 2**qexp, rounded to bfloat16 to nearest even (NaN quieted), into
   * rb; returns whether an element that is not 0 came out subnormal or 0, where the caller runs the float32
   * products and rb is not read (prepare_q in decode_cpu.c; on the AVX-512 path vcvtne2ps2bf16, which takes a
   * subnormal input as 0: such an input is lost either way) */
  int (*q_bf16)(const float* row, uint16_t* rb, int64_t n, int qexp);
  /* 1: the kernel of an AMX path (cpu_amx.c, real tiles; cpu_amx_emu.c, emulated ones), which takes steps 1
   * and 3 of the calls decode_cpu.c's amx_tiles admits, and both products of those amx_rows admits, on tiles;
   * 0: a vector path's */
  int tiles;
  /* 1: the kernel has the runs of keys of one-token MHA (decode_cpu_impl.h, run->mha_runs; the AVX-512 kernels) */
  int runs;
} ab_decode_cpu_table;

/* The current path's q_bf16 on n floats (tests: _C.decode_q_bf16). */
int ab_kvcache_cpu_q_bf16(const float* row, uint16_t* rb, int64_t n, int qexp);

/* A row's (out, lse) over its keys, joined by the sink s of its head (s = -inf: none): returns the
 * lse with the sink and sets *factor, what out is multiplied by (exp(lse - new lse)).  Applied once
 * per row, after the splits are merged, so the sink counts once. */
static inline float ab_decode_add_sink(float lse, float s, float* factor) {
  if (s == -INFINITY) {
    *factor = 1.0f;
    return lse;
  }
  const float m = lse > s ? lse : s;
  const float wo = lse == -INFINITY ? 0.0f : expf(lse - m), total = wo + expf(s - m);
  *factor = wo / total;
  return m + logf(total);
}

extern const ab_decode_cpu_table ab_decode_cpu_generic;
extern const ab_decode_cpu_table ab_decode_cpu_avx2;
extern const ab_decode_cpu_table ab_decode_cpu_avx512;
extern const ab_decode_cpu_table ab_decode_cpu_amx_vec;     /* cpu_amx.c: the avx512 kernel with tiles */
extern const ab_decode_cpu_table ab_decode_cpu_amx_emu_vec; /* cpu_amx_emu.c: the generic one with emulated tiles */

#ifdef __cplusplus
}
#endif

#endif /* AB_DECODE_CPU_H */
