/* flash_cpu.c -- the CPU flash entry points: check a call, run it on the ISA path's table
 * (cpu_kernels.h); and the flash family's answer to the planner (ab_flash_cpu_why_not).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../ab_planner.h"
#include "ab_cpu.h"
#include "cpu_kernels.h"
#include "decode_cpu.h"

/* The dtypes the flash tables are built for: float32 accumulation of float16, bfloat16, float32. */
static int flash_dtype_ok(ab_dtype dt) { return dt == AB_DTYPE_F32 || dt == AB_DTYPE_F16 || dt == AB_DTYPE_BF16; }

/* The planner's question (ab_planner.h, ab_why_not_fn), answered by the rule the calls are checked with. */
void ab_flash_cpu_why_not(const ab_call* c, char* out, size_t n) {
  out[0] = 0;
  if (!flash_dtype_ok(c->dtype))
    snprintf(out, n, "flash on CPU takes float16, bfloat16 or float32, got %s", ab_dtype_name(c->dtype));
}

static ab_status check_flash(const ab_attn_params* p, int backward, ab_error* err) {
  ab_status st = ab_attn_params_check(p, backward, err);
  if (st != AB_OK) return st;
  if (ab_cpu_isa_error()) return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s", ab_cpu_isa_error());
  if (p->q.device != AB_DEVICE_CPU)
    return ab_error_set(err, AB_ERR_INVALID, "flash CPU kernel called with non-CPU tensors");
  if (!flash_dtype_ok(p->q.dtype))
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "flash on CPU takes float16, bfloat16 or float32, got %s",
                        ab_dtype_name(p->q.dtype));
  return AB_OK;
}

/* ---- short queries: the decode kernel ---------------------------------------------------------
 *
 * A call of a few query tokens per sequence against many keys (decode through ab.attention, a patched
 * SDPA or flash_attn_varlen_func) leaves the flash kernel's tiles of query rows nearly empty, and it
 * reads each KV head's keys once per query head.  The decode kernel (decode_cpu.h) streams them once
 * for the whole GQA group: on the avx2 path (AMD EPYC, Zen 3, 2 threads; docs/benchmarks.md, "Short
 * queries") it took 0.09-0.41x flash's time at one token and 0.25-0.70x at four (GQA), 0.63-1.06x at
 * four for MHA, and at eight tokens 0.37-0.63x with groups of 4 or more over 1024 keys or more but
 * 1.4-1.7x for MHA (before the kernel's MHA tokens path: mha_many_tokens below).  So flash hands it
 * calls of at most AB_FLASH_DECODE_TOKENS tokens per sequence (AB_FLASH_DECODE_TOKENS_GQA for groups
 * of 4 or more, and for MHA where mha_many_tokens says so), and no more query rows per KV head than the
 * decode kernel serves well (ab_kvcache_cpu_max_rows), the calls it can express: no dropout, Dv = D,
 * keys with a contiguous last dimension, causal and windows aligned bottom-right (or the same either
 * way: Sq = Sk, for packed calls every sequence's), and a forward whose row statistics no backward will read (stats
 * absent: the direct calls, which have no autograd).  The calls without a gradient that take the op,
 * which keeps the statistics, ask the same rule (ab_flash_cpu_decode_route, through
 * _C.flash_decode_route) and go to the decode kernel's direct call from attn_backends/_providers/ours.py.
 * ATTN_BACKENDS_FLASH_DECODE=0 turns the route off. */
#define AB_FLASH_DECODE_TOKENS 4      /* MHA and small groups */
#define AB_FLASH_DECODE_TOKENS_GQA 8  /* groups of 4 query heads per KV head or more */

/* MHA (one query head per KV head) up to AB_FLASH_DECODE_TOKENS_GQA tokens where the decode kernel
 * measured faster than flash at 5 and 8 tokens (avx2, AMD EPYC Zen 3, 2 threads, 2026-11-27, after the
 * packed query rows of decode_cpu_impl.h): packed calls with 1024 keys or more (float32: 1.06-2.1x) or
 * 2-byte ones with 256 or more (1.04-3.2x; flash on packed (T, H, D) keys runs 1.3-3x slower than on
 * dense (B, H, S, D) ones), dense float32 calls with 2048 keys or more (1.26-1.70x).  Below that flash
 * was faster or even (dense float32 under 2048 keys 0.67-0.82x, dense bfloat16 0.84-1.21x). */
static int mha_many_tokens(ab_dtype dt, int64_t Sk, int packed) {
  if (packed) return Sk >= 1024 || (dt != AB_DTYPE_F32 && Sk >= 256);
  return dt == AB_DTYPE_F32 && Sk >= 2048;
}

static int64_t decode_tokens(ab_dtype dt, int64_t G, int64_t Sk, int packed) {
  /* ATTN_BACKENDS_FLASH_DECODE=0: flash keeps them (read at every call) */
  if (G < 1 || ab_env_switch("ATTN_BACKENDS_FLASH_DECODE") == 0) return 0;
  const int64_t rows = ab_kvcache_cpu_max_rows(dt, 1, Sk) / G;
  const int64_t tokens = G >= 4 || (G == 1 && mha_many_tokens(dt, Sk, packed)) ? AB_FLASH_DECODE_TOKENS_GQA
                                                                                 : AB_FLASH_DECODE_TOKENS;
  return rows < tokens ? rows : tokens;
}

/* Whether every sequence of the packed call p has as many keys as queries (top-left and bottom-right
 * alignment are then the same). */
static int packed_square(const ab_attn_params* p) {
  for (int64_t b = 0; b < p->B; ++b)
    if (p->cu_seqlens_q[b + 1] - p->cu_seqlens_q[b] != p->cu_seqlens_k[b + 1] - p->cu_seqlens_k[b]) return 0;
  return 1;
}

int64_t ab_flash_cpu_decode_route(const ab_attn_params* p) {
  if (p->dropout_p > 0 || p->Dv != p->D || p->Hkv < 1 || p->Sk < 1 ||
      p->k.strides[p->k.ndim - 1] != 1 || p->v.strides[p->v.ndim - 1] != 1)
    return 0;
  if (p->cu_seqlens_q && (p->B < 1 || p->q.sizes[0] != p->B * p->Sq)) return 0; /* not Sq queries each */
  if (p->Sq > decode_tokens(p->q.dtype, p->Hq / p->Hkv, p->Sk, p->cu_seqlens_q != NULL)) return 0;
  const int windowed = p->window_left >= 0 || p->window_right >= 0;
  if (p->causal != AB_CAUSAL_BOTTOM_RIGHT && (p->causal == AB_CAUSAL_TOP_LEFT || windowed) &&
      !(p->cu_seqlens_q ? packed_square(p) : p->Sq == p->Sk))
    return 0;
  return p->Sq;
}

static ab_tensor bshd(const ab_tensor* t) { /* (B, H, S, D) seen as (B, S, H, D) */
  ab_tensor v = *t;
  v.sizes[1] = t->sizes[2], v.sizes[2] = t->sizes[1];
  v.strides[1] = t->strides[2], v.strides[2] = t->strides[1];
  return v;
}

/* A (Tq, H, D) tensor of B sequences of Sq rows each seen as (B, Sq, H, D). */
static ab_tensor by_sequence(const ab_tensor* t, int64_t B, int64_t Sq) {
  ab_tensor v = *t;
  v.ndim = 4;
  v.sizes[0] = B, v.sizes[1] = Sq, v.sizes[2] = t->sizes[1], v.sizes[3] = t->sizes[2];
  v.strides[0] = Sq * t->strides[0], v.strides[1] = t->strides[0];
  v.strides[2] = t->strides[1], v.strides[3] = t->strides[2];
  return v;
}

/* The int32 view of n values from data, step apart (0: the one value for every row). */
static ab_tensor index_view(const int32_t* data, int64_t n, int64_t step) {
  ab_tensor v;
  memset(&v, 0, sizeof v);
  v.data = (void*)data;
  v.dtype = AB_DTYPE_I32;
  v.device = AB_DEVICE_CPU;
  v.device_index = -1;
  v.ndim = 1;
  v.sizes[0] = n;
  v.strides[0] = step;
  return v;
}

/* The call p through the decode kernel.  Dense: its (B, H, S, D) tensors seen as (B, S, H, D).
 * Packed: sequence b's Sq queries are batch row b, and its keys are those of the one cache row, the
 * packed k and v, from cu_seqlens_k[b] (cache_leftpad) to cu_seqlens_k[b + 1] (cache_seqlens); lse
 * (Hq, Tq) seen as (B, Hq, Sq). */
static ab_status fwd_by_decode(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  ab_kvcache_params d;
  memset(&d, 0, sizeof d);
  d.B = p->B, d.Sq = p->Sq, d.Hq = p->Hq, d.Hkv = p->Hkv, d.D = p->D;
  if (p->cu_seqlens_q) {
    d.q = by_sequence(&p->q, p->B, p->Sq), d.out = by_sequence(&p->out, p->B, p->Sq);
    d.k_cache = by_sequence(&p->k, 1, p->k.sizes[0]), d.v_cache = by_sequence(&p->v, 1, p->v.sizes[0]);
    d.cache_seqlens = index_view(p->cu_seqlens_k + 1, p->B, 1);
    d.cache_leftpad = index_view(p->cu_seqlens_k, p->B, 1);
    d.cache_batch_idx = index_view(p->cu_seqlens_k, p->B, 0); /* cu_seqlens_k[0] = 0 for every row */
    d.lse = p->lse;
    d.lse.ndim = 3;
    d.lse.sizes[0] = p->B, d.lse.sizes[1] = p->Hq, d.lse.sizes[2] = p->Sq;
    d.lse.strides[0] = p->Sq * p->lse.strides[1], d.lse.strides[1] = p->lse.strides[0];
    d.lse.strides[2] = p->lse.strides[1];
  } else {
    d.q = bshd(&p->q), d.out = bshd(&p->out), d.k_cache = bshd(&p->k), d.v_cache = bshd(&p->v);
    d.cache_seqlen = p->Sk;
    d.lse = p->lse; /* (B, Hq, Sq) float32: every forward has it (ab_attn_params_check) */
  }
  d.alibi_slopes = p->alibi;
  d.sinks = p->sinks;
  d.mask = p->mask; /* (B, Hq, Sq, Sk): dense calls only (packed ones take none) */
  d.scale = p->scale, d.softcap = p->softcap;
  d.causal = p->causal != AB_CAUSAL_NONE;
  d.window_left = p->window_left, d.window_right = p->window_right;
  const int threads = pool ? pool->num_threads : 1;
  const size_t bytes = ab_kvcache_cpu_workspace_size(&d, threads);
  void* ws = bytes ? malloc(bytes) : NULL;
  ab_status st;
  if (bytes && !ws)
    st = ab_error_set(err, AB_ERR_NOMEM, "out of memory for the decode kernel's %zu bytes of workspace", bytes);
  else
    st = bytes ? ab_kvcache_cpu_fwd(&d, ws, bytes, pool, err)
               : ab_error_set(err, AB_ERR_INVALID, "the decode kernel refused a call flash handed it");
  free(ws);
  return st;
}

ab_status ab_flash_cpu_fwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  ab_status st = check_flash(p, 0, err);
  if (st != AB_OK || p->B == 0 || p->Hq == 0 || p->Sq == 0) return st;
  if (!p->stats.ndim && ab_flash_cpu_decode_route(p)) return fwd_by_decode(p, pool, err);
  return ab_cpu_kernels_get()->flash_fwd(p, pool, err);
}

ab_status ab_flash_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  ab_status st = check_flash(p, 1, err);
  if (st != AB_OK) return st;
  if (p->B == 0 || p->Hkv == 0) return p->dsinks.ndim ? ab_sinks_cpu_bwd(p, pool, err) : AB_OK;
  st = ab_cpu_kernels_get()->flash_bwd(p, pool, err);
  if (st == AB_OK && p->dsinks.ndim) st = ab_sinks_cpu_bwd(p, pool, err);
  return st;
}
