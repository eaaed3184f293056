/* decode_cpu_impl.h -- the KV-cache attention kernel (decode_cpu.h), one source for every ISA.
 *
 * Included by cpu_generic.c / cpu_avx2.c / cpu_avx512.c, and by cpu_amx.c / cpu_amx_emu.c with steps 1 and 3 on
 * tiles for the calls they serve ("Tiles" below), through cpu_isa_impl.h with AB_ISA_SFX set; VLEN follows from
 * the ISA's flags (ab_vec.h).
 *
 * Decode is memory-bound: per key, the arithmetic is a few dot products of length D while the
 * key and value rows are 2 * D elements read from DRAM.  So one work item is (batch row, group of
 * hg KV heads, split of the key range) and streams its keys once for every query row that reads
 * them: the Sq tokens x hg * G query heads of the group (G = Hq / Hkv; rows r = t * hg * G +
 * h * G + g).  hg is as large as keeps those rows within DC_ROWS, so one key's rows for the group
 * are one contiguous read.  Keys go by chunks of DC_CHUNK, which may span pages of a paged cache
 * (one block_table lookup per page, the chunk's row offsets computed once, DC(chunk_at)), so a
 * paged cache is read in the same chunks, with the same sums, as a dense one:
 *   1. scores, key by key in the cache's order: each key row is loaded once (converted to float32
 *      in registers) and dotted with four query rows at a time (q is float32, already rotated and
 *      scaled, in L1); the key row two keys ahead (where run->keys_ahead says so) and the chunk's
 *      value rows are prefetched head by head between the dot products (DC(pf)), and where
 *      run->pages_ahead says so, one line of each 4 KiB page of the chunk after next first
 *      (DC(touch_pages));
 *   2. softcap, ALiBi and the visibility of each key to each row, then the online softmax per row
 *      (running max m, sum l, the accumulator rescaled by exp(m_old - m_new)), vectorized over the
 *      chunk's keys;
 *   3. O += P V, head by head: the value rows stream past the accumulators of four rows x two
 *      vectors of D (four vectors on the AVX-512 path where D allows, run->pv_wide; one row x eight
 *      for MHA) held in registers; in a paged cache, block by block
 *      of the chunk, every head's rows of one block before the next block's (DC(block_end)).
 * Without bfloat16 products, step 1 takes four keys at a time on the AVX-512 path (two on AVX2) where
 * each token sees all of them or none (run->four_keys, DC(key_group_scores)): the same sums, the query
 * vectors loaded once for the keys.
 * With a bfloat16 cache on a CPU with AVX512_BF16 (run->bf16_dot), steps 1 and 3 multiply in
 * bfloat16 with vdpbf16ps ("bfloat16 products" below); there step 1 may go head by head instead of key
 * by key (run->scores_by_head, DC(head_scores_bf)), so four query rows stay in registers.
 * The state of a row (m, l and its D accumulators) lives in the thread's scratch, in L1 for the
 * decode shapes.  Query rows go by tiles of whole tokens (DC_ROWS rows, at least one token), so
 * scratch stays bounded for long chunked-prefill queries, which re-stream their keys per tile.
 * A tile with DC_TILED_ROWS rows per KV head or more (several query tokens) takes the tiled
 * products instead of steps 1-3: the flash micro-kernel over a chunk's keys converted once
 * ("tiled products" below).
 *
 * A split writes its normalized output and lse to the run's partial buffer; decode_cpu.c merges the
 * splits.  With one split the item writes the output itself.
 */

#include <math.h>
#include <string.h>

#include "ab_cpu.h"
#include "ab_vec.h"
#include "decode_cpu.h"

#define DC_CAT2(a, b) a##b
#define DC_CAT(a, b) DC_CAT2(a, b)
#define DC(name) DC_CAT(name, AB_ISA_SFX)

#define DC_CHUNK AB_DECODE_CHUNK /* keys per chunk: the scores of a tile (64 rows x 32 keys) are 8 KiB */
#define DC_ROWS AB_DECODE_TILE_ROWS /* query rows per tile, unless one token alone has more (G > 64) */
#define DC_NV (DC_CHUNK / VLEN)
#define DC_KEYS_AHEAD 2 /* key rows prefetched ahead of the scores' loads */
#define DC_AMX_BLOCK 4  /* tiles of many rows: chunks of keys per pass over the accumulators ("tiles of many rows") */

/* VLEN elements of the cache at base + off, as float32. */
static inline __attribute__((always_inline)) vf DC(ld)(const void* base, int64_t off, const int dt) {
  if (dt == AB_DTYPE_F32) return vload((const float*)base + off);
  const uint16_t* s = (const uint16_t*)base + off;
  if (dt == AB_DTYPE_BF16) {
#if VLEN == 16
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)s)), 16);
#elif VLEN == 8
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)s)), 16);
#else
    vu u;
    for (int i = 0; i < VLEN; ++i) u[i] = (uint32_t)s[i] << 16;
    return (vf)u;
#endif
  }
#if VLEN == 16
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
#elif VLEN == 8
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
#else
  vf v;
  for (int i = 0; i < VLEN; ++i) v[i] = ab_f16_to_f32(s[i]);
  return v;
#endif
}

/* The last n < VLEN elements of a row, zero-filled: reading past the row could pull in a NaN that
 * 0 * NaN would spread. */
static inline vf DC(ld_tail)(const void* base, int64_t off, int64_t n, const int dt) {
  float tmp[VLEN] = {0};
  ab_vec_load_row(base, (ab_dtype)dt, off, n, 1, tmp);
  return vload(tmp);
}

#if VLEN == 8
/* Sixteen bfloat16 of the cache at base + off as two vectors of float32, from one load: the even columns
 * (each 32-bit lane's low half, shifted up) to *e, the odd ones (the high half, masked) to *o.  Two
 * instructions for sixteen columns where DC(ld) takes two (a widening load and a shift) for eight. */
static inline __attribute__((always_inline)) void DC(ld_pair)(const void* base, int64_t off, vf* e, vf* o) {
  const __m256i x = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + off));
  *e = (vf)_mm256_slli_epi32(x, 16);
  *o = (vf)_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u));
}

/* An accumulator row kept by pairs (DC(pv_rows) with eo: each block of sixteen columns as its eight even
 * columns, then its eight odd ones) back in column order, in place; D a multiple of 16. */
static inline void DC(eo_unpermute)(float* acc, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) {
    const __m256 e = _mm256_loadu_ps(acc + d), o = _mm256_loadu_ps(acc + d + 8);
    const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o); /* columns 0-3 | 8-11, 4-7 | 12-15 */
    _mm256_storeu_ps(acc + d, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(acc + d + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}
#endif

static inline float DC(hsum)(vf v) {
#if VLEN == 16
  return _mm512_reduce_add_ps((__m512)v);
#elif VLEN == 8
  __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
#else
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

#if VLEN == 16 || VLEN == 8
/* Four floats of w to s[0], s[st], s[2 st], s[3 st]. */
static inline __attribute__((always_inline)) void DC(store4)(__m128 w, float* s, int64_t st) {
  float out[4];
  _mm_storeu_ps(out, w);
  s[0] = out[0];
  s[st] = out[1];
  s[2 * st] = out[2];
  s[3 * st] = out[3];
}
#endif

#if VLEN == 16
/* DC(hsum4) in parts (AVX-512).  DC(lanes4): four rows' chains to one vector whose 128-bit lane L
 * holds the rows' sums of their lane L elements, [r0, r1, r2, r3], each (e0 + e2) + (e1 + e3).
 * DC(sums4): one such vector's four sums, (L0 + L2) + (L1 + L3), times scale, to s[r * st].
 * DC(sums4x4): four keys' vectors reduced together, 128-bit lanes across vectors (the same sums in
 * the same order, so the same bits as a key at a time), times scale, stored row by row as four
 * floats, s[r * st + key]: a quarter of the cross-lane steps and stores per key (step 1 head by head,
 * bfloat16 GQA decode from the L3 of a Zen 4 0.93-0.95x the time on one core, DC(head_scores_bf); and
 * DC(dot4xk)). */
/* a + b, or max(a, b) where mx (a constant wherever it is inlined) */
static inline __attribute__((always_inline)) __m512 DC(op)(__m512 a, __m512 b, int mx) {
  return mx ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b);
}
static inline __attribute__((always_inline)) __m128 DC(op128)(__m128 a, __m128 b, int mx) {
  return mx ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
}

/* DC(lanes4)'s tree with DC(op) */
static inline __attribute__((always_inline)) __m512 DC(tree4)(__m512 a0, __m512 a1, __m512 a2, __m512 a3, int mx) {
  const __m512 x01 = DC(op)(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1), mx);
  const __m512 x23 = DC(op)(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3), mx);
  return DC(op)(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23))),
                _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23))), mx);
}

static inline __attribute__((always_inline)) __m512 DC(lanes4)(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  return DC(tree4)(a0, a1, a2, a3, 0);
}

/* One DC(tree4) vector's four results, (L0 op L2) op (L1 op L3). */
static inline __attribute__((always_inline)) __m128 DC(fold4)(__m512 y, int mx) {
  const __m256 lo = _mm512_castps512_ps256(y), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1));
  const __m256 z = mx ? _mm256_max_ps(lo, hi) : _mm256_add_ps(lo, hi);
  return DC(op128)(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1), mx);
}

/* DC(rows4): four rows' vectors reduced together, each to its max (mx; no NaN lanes, so the order is free)
 * or its sum, to out[0..3]: each row's result comes from its own vector alone, in the same order whatever
 * the others (so a row has the same bits in any group), for about the cross-lane steps of one row (the
 * softmax's per-row reductions were a serial chain, DC(softmax)). */
static inline __attribute__((always_inline)) void DC(rows4)(__m512 a0, __m512 a1, __m512 a2, __m512 a3, int mx,
                                                           float* out) {
  _mm_storeu_ps(out, DC(fold4)(DC(tree4)(a0, a1, a2, a3, mx), mx));
}

static inline __attribute__((always_inline)) void DC(sums4)(__m512 y, float scale, float* s, int64_t st) {
  DC(store4)(_mm_mul_ps(DC(fold4)(y, 0), _mm_set1_ps(scale)), s, st);
}

static inline __attribute__((always_inline)) void DC(sums4x4)(__m512 y0, __m512 y1, __m512 y2, __m512 y3, float scale,
                                                             float* s, int64_t st) {
  /* [y0: L0 + L2, L1 + L3 | y1: the same], then [y0, y1, y2, y3]: (L0 + L2) + (L1 + L3) each */
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x44), _mm512_shuffle_f32x4(y0, y1, 0xEE));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(y2, y3, 0x44), _mm512_shuffle_f32x4(y2, y3, 0xEE));
  const __m512 w = _mm512_mul_ps(
      _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD)), _mm512_set1_ps(scale));
  /* [key][row] to [row][key] */
  const __m512 t = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
  _mm_storeu_ps(s, _mm512_castps512_ps128(t));
  _mm_storeu_ps(s + st, _mm512_extractf32x4_ps(t, 1));
  _mm_storeu_ps(s + 2 * st, _mm512_extractf32x4_ps(t, 2));
  _mm_storeu_ps(s + 3 * st, _mm512_extractf32x4_ps(t, 3));
}
#endif

/* The lane sums of four vectors times scale, to s[0], s[st], s[2 st], s[3 st]: one transposing
 * reduction instead of four horizontal ones, and one multiply. */
static inline void DC(hsum4)(vf a0, vf a1, vf a2, vf a3, float scale, float* s, int64_t st) {
#if VLEN == 16
  DC(sums4)(DC(lanes4)((__m512)a0, (__m512)a1, (__m512)a2, (__m512)a3), scale, s, st);
#elif VLEN == 8
  const __m256 x01 = _mm256_add_ps(_mm256_unpacklo_ps((__m256)a0, (__m256)a1), _mm256_unpackhi_ps((__m256)a0, (__m256)a1));
  const __m256 x23 = _mm256_add_ps(_mm256_unpacklo_ps((__m256)a2, (__m256)a3), _mm256_unpackhi_ps((__m256)a2, (__m256)a3));
  const __m256 y = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x01), _mm256_castps_pd(x23))),
                                 _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x01), _mm256_castps_pd(x23))));
  DC(store4)(_mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1)), _mm_set1_ps(scale)), s, st);
#else
  s[0] = DC(hsum)(a0) * scale;
  s[st] = DC(hsum)(a1) * scale;
  s[2 * st] = DC(hsum)(a2) * scale;
  s[3 * st] = DC(hsum)(a3) * scale;
#endif
}

/* Four dot products of length D: q rows at q + i * qs with cache rows at kb + ko + i * kst (kst 0:
 * one key row shared by four query rows of a GQA group, loaded once).  Scores to s + i * st; the
 * query rows' pad lanes are 0.  n (a constant at each call site) fewer rows, 2 or 3, with kst 0: the last
 * rows of a GQA group whose G is not a multiple of four (G = 2, 3, 6, 7), the key row converted once for them
 * where DC(dot1) converted it per row; each row's sum is the four rows' (the same FMAs in each lane, DC(hsum4)'s
 * tree over its own vector), the last row's chain repeated for the tree.  One row left (G = 5) stays DC(dot1):
 * its two chains cost no more. */
static inline __attribute__((always_inline)) void DC(dot4)(const float* q, int64_t qs, const void* kb, int64_t ko,
                                                          int64_t kst, int64_t D, const int dt, float* s,
                                                          int64_t st, const int n) {
  const int64_t full = D / VLEN * VLEN;
  vf a0 = vset1(0.0f), a1 = a0, a2 = a0, a3 = a0;
  int64_t d = 0;
  for (; d < full; d += VLEN) {
    if (kst == 0) {
      const vf k = DC(ld)(kb, ko + d, dt);
      a0 += vload(q + d) * k;
      a1 += vload(q + qs + d) * k;
      if (n > 2) a2 += vload(q + 2 * qs + d) * k;
      if (n > 3) a3 += vload(q + 3 * qs + d) * k;
    } else {
      a0 += vload(q + d) * DC(ld)(kb, ko + d, dt);
      a1 += vload(q + qs + d) * DC(ld)(kb, ko + kst + d, dt);
      a2 += vload(q + 2 * qs + d) * DC(ld)(kb, ko + 2 * kst + d, dt);
      a3 += vload(q + 3 * qs + d) * DC(ld)(kb, ko + 3 * kst + d, dt);
    }
  }
  if (d < D) {
    a0 += vload(q + d) * DC(ld_tail)(kb, ko + d, D - d, dt);
    a1 += vload(q + qs + d) * DC(ld_tail)(kb, ko + kst + d, D - d, dt);
    if (n > 2) a2 += vload(q + 2 * qs + d) * DC(ld_tail)(kb, ko + 2 * kst + d, D - d, dt);
    if (n > 3) a3 += vload(q + 3 * qs + d) * DC(ld_tail)(kb, ko + 3 * kst + d, D - d, dt);
  }
  if (n == 4) {
    DC(hsum4)(a0, a1, a2, a3, 1.0f, s, st); /* q is scaled already */
    return;
  }
  if (n == 2) a2 = a1;
  float t[4];
  DC(hsum4)(a0, a1, a2, a2, 1.0f, t, 1);
  for (int i = 0; i < n; ++i) s[i * st] = t[i];
}

#if VLEN == 16 || VLEN == 8
#define DC_NK (VLEN == 16 ? 4 : 2) /* keys per group of step 1 (run->four_keys) */
/* DC(dot4) for DC_NK keys at once: four query rows (q + i * qs) against key k's rows at kb + ko[k] + i * kst
 * (kst 0: one row for the four query rows, GQA; kst a constant 0 or not at each call site), 4 x DC_NK
 * chains in registers (sixteen with AVX-512's 32 registers, eight with AVX2's 16), each query vector
 * loaded once for the keys, where DC(dot4) reloads the query rows at every key.  Each sum is DC(dot4)'s
 * bit for bit: the same FMAs in each lane, then DC(hsum4)'s tree (lanes (e0 + e2) + (e1 + e3) within 128
 * bits, then (L0 + L2) + (L1 + L3) across them), on AVX-512 for the sixteen at once.  Row i's score of
 * key k to s[i * st + k]. */
static inline __attribute__((always_inline)) void DC(dot4xk)(const float* q, int64_t qs, const void* kb,
                                                            const int64_t* ko, int64_t kst, int64_t D,
                                                            const int dt, float* s, int64_t st, const int tail) {
  const int64_t full = D / VLEN * VLEN;
  vf a[DC_NK][4]; /* [key][row] */
  for (int k = 0; k < DC_NK; ++k)
    for (int i = 0; i < 4; ++i) a[k][i] = vset1(0.0f);
  for (int64_t d = 0; d < full; d += VLEN) {
    vf qv[4];
    for (int i = 0; i < 4; ++i) qv[i] = vload(q + i * qs + d);
    for (int k = 0; k < DC_NK; ++k) {
      const vf kv = DC(ld)(kb, ko[k] + d, dt);
      for (int i = 0; i < 4; ++i) a[k][i] += qv[i] * (kst ? DC(ld)(kb, ko[k] + i * kst + d, dt) : kv);
    }
  }
  if (tail) { /* D % VLEN != 0 (a constant at each call site): the last vector zero-filled past D, as DC(dot4) */
    vf qv[4];
    for (int i = 0; i < 4; ++i) qv[i] = vload(q + i * qs + full);
    for (int k = 0; k < DC_NK; ++k)
      for (int i = 0; i < 4; ++i) a[k][i] += qv[i] * DC(ld_tail)(kb, ko[k] + i * kst + full, D - full, dt);
  }
#if VLEN == 16
  __m512 y[4];
  for (int k = 0; k < 4; ++k) y[k] = DC(lanes4)((__m512)a[k][0], (__m512)a[k][1], (__m512)a[k][2], (__m512)a[k][3]);
  DC(sums4x4)(y[0], y[1], y[2], y[3], 1.0f, s, st); /* times 1: the same bits */
#else
  for (int k = 0; k < DC_NK; ++k) DC(hsum4)(a[k][0], a[k][1], a[k][2], a[k][3], 1.0f, s + k, st);
#endif
}
#endif

/* One dot product of length D, in two chains so a lone row is not bound by the FMA latency. */
static inline __attribute__((always_inline)) void DC(dot1)(const float* q, const void* kb, int64_t ko, int64_t D,
                                                          const int dt, float* s) {
  const int64_t full = D / VLEN * VLEN;
  vf a0 = vset1(0.0f), a1 = a0;
  int64_t d = 0;
  for (; d + 2 * VLEN <= full; d += 2 * VLEN) {
    a0 += vload(q + d) * DC(ld)(kb, ko + d, dt);
    a1 += vload(q + d + VLEN) * DC(ld)(kb, ko + d + VLEN, dt);
  }
  if (d < full) {
    a0 += vload(q + d) * DC(ld)(kb, ko + d, dt);
    d += VLEN;
  }
  if (d < D) a1 += vload(q + d) * DC(ld_tail)(kb, ko + d, D - d, dt);
  *s = DC(hsum)(a0 + a1);
}

/* n dot products of length D (n a constant at each call site, at most 8) of packed query rows against one
 * key row: row i's block db of VLEN elements at q + db * bs + i * VLEN, so one pointer walks all n rows
 * and the n sums stay in registers as n independent chains.  (With a pointer per row, as DC(dot4) takes
 * them, the compiler kept reloading the row pointers from the stack inside the MHA tokens' loop: 11
 * loads per 4 FMAs.)  The sums are those of DC(dot4) (one chain per row, DC(hsum4)) for groups of four
 * and of DC(dot1) (two chains) for a lone row, bit for bit.  Scores to s + i * ss. */
static inline __attribute__((always_inline)) void DC(dotp)(const int n, const float* q, int64_t bs, const void* kb,
                                                          int64_t ko, int64_t D, const int dt, float* s, int64_t ss) {
  const int64_t full = D / VLEN * VLEN;
  vf a[8];
  for (int i = 0; i < 8; ++i) a[i] = vset1(0.0f);
  int64_t d = 0;
  if (n == 1) { /* two chains, as DC(dot1) */
    for (; d + 2 * VLEN <= full; d += 2 * VLEN, q += 2 * bs) {
      a[0] += vload(q) * DC(ld)(kb, ko + d, dt);
      a[1] += vload(q + bs) * DC(ld)(kb, ko + d + VLEN, dt);
    }
    if (d < full) {
      a[0] += vload(q) * DC(ld)(kb, ko + d, dt);
      d += VLEN;
      q += bs;
    }
    if (d < D) a[1] += vload(q) * DC(ld_tail)(kb, ko + d, D - d, dt);
    *s = DC(hsum)(a[0] + a[1]);
    return;
  }
  for (; d < full; d += VLEN, q += bs) {
    const vf k = DC(ld)(kb, ko + d, dt);
    for (int i = 0; i < n; ++i) a[i] += vload(q + i * VLEN) * k;
  }
  if (d < D) {
    const vf k = DC(ld_tail)(kb, ko + d, D - d, dt);
    for (int i = 0; i < n; ++i) a[i] += vload(q + i * VLEN) * k;
  }
  int i = 0;
  for (; i + 4 <= n; i += 4) DC(hsum4)(a[i], a[i + 1], a[i + 2], a[i + 3], 1.0f, s + i * ss, ss);
  for (; i < n; ++i) s[i * ss] = DC(hsum)(a[i]);
}

/* n packed rows (as DC(dotp)) against one key row: eight at a time, then four, then one by one. */
static inline __attribute__((always_inline)) void DC(dotp_rows)(int64_t n, const float* q, int64_t bs, const void* kb,
                                                               int64_t ko, int64_t D, const int dt, float* s,
                                                               int64_t ss) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) DC(dotp)(8, q + i * VLEN, bs, kb, ko, D, dt, s + i * ss, ss);
  if (i + 4 <= n) {
    DC(dotp)(4, q + i * VLEN, bs, kb, ko, D, dt, s + i * ss, ss);
    i += 4;
  }
  for (; i < n; ++i) DC(dotp)(1, q + i * VLEN, bs, kb, ko, D, dt, s + i * ss, ss);
}

/* Prefetches spread over a key's heads, issued head by head between the dot products rather than a
 * whole key row at once: a burst of a row's lines fills every fill buffer, the next loads wait behind
 * it and the arithmetic stalls with them (measured: bfloat16 GQA decode 20-25% faster spread out).
 * Per head h: the K row of the key DC_KEYS_AHEAD keys ahead into L1 (k), and the V row of this key
 * into L2 for step 3 (v; NULL where the hardware prefetchers keep up, see DC(item)); `bytes` per
 * head, heads kstep / vstep bytes apart. */
typedef struct DC(pf) {
  const char *k, *v;
  int64_t kstep, vstep, bytes;
} DC(pf);

static inline __attribute__((always_inline)) void DC(pf_head)(const DC(pf) * f, int64_t h) {
  if (!f) return;
  if (f->k) SYM(pf_lines)(f->k + h * f->kstep, f->bytes, 3);
  if (f->v) SYM(pf_lines)(f->v + h * f->vstep, f->bytes, 2);
}

/* The next chunk's key rows of one head, asked for into L2 while step 3 works through this chunk's
 * values (bytes per row at base + off[j] * es, j < n), one or two rows per key of step 3, so the
 * memory system is busy through step 3 as well and step 1 of the next chunk finds its keys near. */
typedef struct DC(kpf) {
  const char* base;
  const int64_t* off;
  int64_t n, bytes, es;
} DC(kpf);

static inline __attribute__((always_inline)) void DC(kpf_key)(const DC(kpf) * kp, int64_t j) {
  if (kp && j < kp->n) SYM(pf_lines)(kp->base + kp->off[j] * kp->es, kp->bytes, 2);
}

/* The scores of one token's rows for one key: hg heads x G rows, q at q (rows at stride dpad,
 * row (h, g) = h * G + g), key rows at kb + ko + h * ks2, scores to s + row * DC_CHUNK.  Groups of
 * four rows share a key row (G >= 4) or four heads go together (MHA). */
static inline __attribute__((always_inline)) void DC(key_scores)(const float* q, int64_t dpad, int64_t hg,
                                                                int64_t G, const void* kb, int64_t ko,
                                                                int64_t ks2, int64_t D, const int dt, float* s,
                                                                const DC(pf) * f) {
  if (G == 1) {
    int64_t h = 0;
    for (; h + 4 <= hg; h += 4) {
      for (int i = 0; i < 4; ++i) DC(pf_head)(f, h + i);
      DC(dot4)(q + h * dpad, dpad, kb, ko + h * ks2, ks2, D, dt, s + h * DC_CHUNK, DC_CHUNK, 4);
    }
    for (; h < hg; ++h) {
      DC(pf_head)(f, h);
      DC(dot1)(q + h * dpad, kb, ko + h * ks2, D, dt, s + h * DC_CHUNK);
    }
    return;
  }
  for (int64_t h = 0; h < hg; ++h) {
    DC(pf_head)(f, h);
    const float* qh = q + h * G * dpad;
    float* sh = s + h * G * DC_CHUNK;
    int64_t g = 0;
    for (; g + 4 <= G; g += 4)
      DC(dot4)(qh + g * dpad, dpad, kb, ko + h * ks2, 0, D, dt, sh + g * DC_CHUNK, DC_CHUNK, 4);
    /* three or two rows left: one conversion of the key row for them */
    if (G - g == 3)
      DC(dot4)(qh + g * dpad, dpad, kb, ko + h * ks2, 0, D, dt, sh + g * DC_CHUNK, DC_CHUNK, 3);
    else if (G - g == 2)
      DC(dot4)(qh + g * dpad, dpad, kb, ko + h * ks2, 0, D, dt, sh + g * DC_CHUNK, DC_CHUNK, 2);
    if (G - g >= 2) g = G;
    for (; g < G; ++g) DC(dot1)(qh + g * dpad, kb, ko + h * ks2, D, dt, sh + g * DC_CHUNK);
  }
}

/* `call` with DT, the name it passes as its cache dtype, a constant for each of the three, so that the code
 * it inlines is compiled for each (the out-of-line copies of step 1 below). */
#define DC_PER_DTYPE(dt, call)          \
  do {                                  \
    if ((dt) == AB_DTYPE_F32) {         \
      enum { DT = AB_DTYPE_F32 };       \
      call;                             \
    } else if ((dt) == AB_DTYPE_BF16) { \
      enum { DT = AB_DTYPE_BF16 };      \
      call;                             \
    } else {                            \
      enum { DT = AB_DTYPE_F16 };       \
      call;                             \
    }                                   \
  } while (0)

/* DC(key_scores) out of line, one copy per cache dtype, as DC(key_group_scores): inlined into DC(item),
 * whose registers are all taken, the four query rows' pointers lived on the stack and each FMA of
 * DC(dot4) waited behind a reload of its pointer (six loads more per eight elements of a key row). */
static __attribute__((noinline)) void DC(key_scores_out)(const float* q, int64_t dpad, int64_t hg, int64_t G,
                                                        const void* kb, int64_t ko, int64_t ks2, int64_t D,
                                                        const int dt, float* s, const DC(pf) * f) {
  DC_PER_DTYPE(dt, DC(key_scores)(q, dpad, hg, G, kb, ko, ks2, D, DT, s, f));
}

#ifdef DC_NK
/* DC(key_scores) for DC_NK keys at once (run->four_keys; G 1 or a multiple of four, DC(dot4xk)): the keys'
 * rows at kb + ko4[k] + h * ks2, row (h, g)'s score of key k to s + row * DC_CHUNK + k; f (NULL: none) the
 * keys' prefetches, issued head by head as DC(key_scores) issues one key's. */
static inline __attribute__((always_inline)) void DC(key_group_scores_as)(const float* q, int64_t dpad,
                                                                         int64_t hg, int64_t G, const void* kb,
                                                                         const int64_t* ko4, int64_t ks2, int64_t D,
                                                                         const int dt, float* s, const DC(pf) * f) {
  int64_t ko[DC_NK];
  if (G == 1) { /* MHA: four heads at a time, each its own key rows, as DC(key_scores) */
    int64_t h = 0;
    for (; h + 4 <= hg; h += 4) {
      for (int i = 0; i < 4 && f; ++i)
        for (int k = 0; k < DC_NK; ++k) DC(pf_head)(f + k, h + i);
      for (int k = 0; k < DC_NK; ++k) ko[k] = ko4[k] + h * ks2;
      if (D % VLEN)
        DC(dot4xk)(q + h * dpad, dpad, kb, ko, ks2, D, dt, s + h * DC_CHUNK, DC_CHUNK, 1);
      else
        DC(dot4xk)(q + h * dpad, dpad, kb, ko, ks2, D, dt, s + h * DC_CHUNK, DC_CHUNK, 0);
    }
    for (; h < hg; ++h)
      for (int k = 0; k < DC_NK; ++k) {
        if (f) DC(pf_head)(f + k, h);
        DC(dot1)(q + h * dpad, kb, ko4[k] + h * ks2, D, dt, s + h * DC_CHUNK + k);
      }
    return;
  }
  for (int64_t h = 0; h < hg; ++h) {
    if (f)
      for (int k = 0; k < DC_NK; ++k) DC(pf_head)(f + k, h);
    for (int k = 0; k < DC_NK; ++k) ko[k] = ko4[k] + h * ks2;
    const float* qh = q + h * G * dpad;
    float* sh = s + h * G * DC_CHUNK;
    for (int64_t g = 0; g < G; g += 4) {
      if (D % VLEN)
        DC(dot4xk)(qh + g * dpad, dpad, kb, ko, 0, D, dt, sh + g * DC_CHUNK, DC_CHUNK, 1);
      else /* without the tail, the sums stay in registers */
        DC(dot4xk)(qh + g * dpad, dpad, kb, ko, 0, D, dt, sh + g * DC_CHUNK, DC_CHUNK, 0);
    }
  }
}

/* Out of line, one copy per cache dtype: inlined into DC(item), whose registers are all taken, the
 * chains' pointers went to the stack. */
static __attribute__((noinline)) void DC(key_group_scores)(const float* q, int64_t dpad, int64_t hg, int64_t G,
                                                          const void* kb, const int64_t* ko4, int64_t ks2, int64_t D,
                                                          const int dt, float* s, const DC(pf) * f) {
  DC_PER_DTYPE(dt, DC(key_group_scores_as)(q, dpad, hg, G, kb, ko4, ks2, D, DT, s, f));
}
#endif

/* The scores of n tokens' rows for one key, one query row per KV head (MHA): hg heads, the rows packed
 * (DC(dotp)) with head h's at qp + h * hs, blocks bs apart; key rows at kb + ko + h * ks2, token i's
 * scores of head h to s + i * ss + h * DC_CHUNK.  The tokens of a head share its key row, eight at a
 * time (loaded once for the eight; by heads, as DC(key_scores) goes for one token, each row of q meets
 * its own key row). */
static inline __attribute__((always_inline)) void DC(token_scores)(const float* qp, int64_t hs, int64_t bs, int64_t n,
                                                                  int64_t hg, const void* kb, int64_t ko, int64_t ks2,
                                                                  int64_t D, const int dt, float* s, int64_t ss,
                                                                  const DC(pf) * f) {
  for (int64_t h = 0; h < hg; ++h) {
    DC(pf_head)(f, h);
    DC(dotp_rows)(n, qp + h * hs, bs, kb, ko + h * ks2, D, dt, s + h * DC_CHUNK, ss);
  }
}

/* acc_r += sum_j P[r][j] v_j for M rows (acc row stride dpad, P row stride ps) and the nk
 * value rows at vb + vo[j] + ho, NB vectors of D at a time: M * NB accumulators stay in
 * registers while the chunk's value rows stream past (M and NB are constants at each call site).
 * eo (AVX2, a bfloat16 cache, D a multiple of 16; NB even): the value rows are read by DC(ld_pair) and
 * the accumulators hold each block of sixteen columns as its even columns, then its odd ones, until
 * DC(eo_unpermute); each column's sum is the same. */
static inline __attribute__((always_inline)) void DC(pv_rows)(const int M, const int NB, float* acc,
                                                             int64_t dpad, const float* P, int64_t ps, const void* vb,
                                                             const int64_t* vo, int64_t ho, int64_t nk, int64_t D,
                                                             const int dt, const DC(kpf) * kp, const int eo) {
  const int64_t full = D / VLEN * VLEN;
  int64_t d = 0;
  for (; d + NB * VLEN <= full; d += NB * VLEN, kp = NULL) {
    vf o[4][8];
    for (int i = 0; i < M; ++i)
      for (int n = 0; n < NB; ++n) o[i][n] = vload(acc + i * dpad + d + n * VLEN);
    for (int64_t j = 0; j < nk; ++j) {
      DC(kpf_key)(kp, j);
      vf v[8];
#if VLEN == 8
      if (eo)
        for (int n = 0; n < NB; n += 2) DC(ld_pair)(vb, vo[j] + ho + d + n * VLEN, &v[n], &v[n + 1]);
      else
#endif
        for (int n = 0; n < NB; ++n) v[n] = DC(ld)(vb, vo[j] + ho + d + n * VLEN, dt);
      for (int i = 0; i < M; ++i) {
        const vf pj = vset1(P[i * ps + j]);
        for (int n = 0; n < NB; ++n) o[i][n] += pj * v[n];
      }
    }
    for (int i = 0; i < M; ++i)
      for (int n = 0; n < NB; ++n) vstore(acc + i * dpad + d + n * VLEN, o[i][n]);
  }
#if VLEN == 8
  for (; eo && d < D; d += 2 * VLEN, kp = NULL) { /* what is left of D (a multiple of 16): a pair at a time */
    vf o[4][2];
    for (int i = 0; i < M; ++i)
      for (int n = 0; n < 2; ++n) o[i][n] = vload(acc + i * dpad + d + n * VLEN);
    for (int64_t j = 0; j < nk; ++j) {
      DC(kpf_key)(kp, j);
      vf v[2];
      DC(ld_pair)(vb, vo[j] + ho + d, &v[0], &v[1]);
      for (int i = 0; i < M; ++i) {
        const vf pj = vset1(P[i * ps + j]);
        for (int n = 0; n < 2; ++n) o[i][n] += pj * v[n];
      }
    }
    for (int i = 0; i < M; ++i)
      for (int n = 0; n < 2; ++n) vstore(acc + i * dpad + d + n * VLEN, o[i][n]);
  }
#endif
  /* what is left of D: one vector at a time, the last one zero-filled past D */
  for (; d < D; d += VLEN, kp = NULL) {
    vf o[4];
    for (int i = 0; i < M; ++i) o[i] = vload(acc + i * dpad + d);
    for (int64_t j = 0; j < nk; ++j) {
      DC(kpf_key)(kp, j);
      const vf v = D - d < VLEN ? DC(ld_tail)(vb, vo[j] + ho + d, D - d, dt) : DC(ld)(vb, vo[j] + ho + d, dt);
      for (int i = 0; i < M; ++i) o[i] += vset1(P[i * ps + j]) * v;
    }
    for (int i = 0; i < M; ++i) vstore(acc + i * dpad + d, o[i]);
  }
}

/* O += P V for n rows that read the same value rows (a GQA group's, or the tokens of one MHA head),
 * accumulator rows as apart and P rows ps apart: four at a time (two vectors of D each), then the
 * rest with more vectors per row, so a lone row (MHA, one token) still has eight chains in flight. */
static inline __attribute__((always_inline)) void DC(pv_as)(float* acc, int64_t n, int64_t as, const float* P,
                                                           int64_t ps, const void* vb, const int64_t* vo, int64_t ho,
                                                           int64_t nk, int64_t D, const int dt, const DC(kpf) * kp,
                                                           int wide, const int eo) {
  int64_t r = 0;
#if VLEN == 16
  /* with 32 registers, four vectors of D per row where D allows (run->pv_wide): half the passes over the
   * chunk's value rows and half the loads of P, sixteen chains (the sums of each row and column are the same) */
  if (wide && D % (4 * VLEN) == 0)
    for (; r + 4 <= n; r += 4, kp = NULL)
      DC(pv_rows)(4, 4, acc + r * as, as, P + r * ps, ps, vb, vo, ho, nk, D, dt, kp, eo);
#endif
  for (; r + 4 <= n; r += 4, kp = NULL) DC(pv_rows)(4, 2, acc + r * as, as, P + r * ps, ps, vb, vo, ho, nk, D, dt, kp, eo);
  switch (n - r) {
    case 3: DC(pv_rows)(3, 2, acc + r * as, as, P + r * ps, ps, vb, vo, ho, nk, D, dt, kp, eo); break;
    case 2: DC(pv_rows)(2, 4, acc + r * as, as, P + r * ps, ps, vb, vo, ho, nk, D, dt, kp, eo); break;
    case 1: DC(pv_rows)(1, 8, acc + r * as, as, P + r * ps, ps, vb, vo, ho, nk, D, dt, kp, eo); break;
    default: break;
  }
}

/* DC(pv_as) with eo (DC(pv_rows)) a constant in each copy, so that its loops are compiled for it. */
static inline __attribute__((always_inline)) void DC(pv)(float* acc, int64_t n, int64_t as, const float* P,
                                                        int64_t ps, const void* vb, const int64_t* vo, int64_t ho,
                                                        int64_t nk, int64_t D, const int dt, const DC(kpf) * kp,
                                                        int wide, int eo) {
  if (eo)
    DC(pv_as)(acc, n, as, P, ps, vb, vo, ho, nk, D, dt, kp, wide, 1);
  else
    DC(pv_as)(acc, n, as, P, ps, vb, vo, ho, nk, D, dt, kp, wide, 0);
}

/* O += P V for the hg heads of one MHA token key by key (run->pv_keys): every head's row of key j, then key
 * j + 1's, so the value rows stream past in the cache's own order (DC(pv) goes head by head: each head's
 * rows of the chunk, a row of the cache apart).  The accumulators (hg rows, dpad apart) stay in L1 and are
 * read and written at every key; each column's sum is DC(pv)'s, key after key, so the bits are the same.
 * Meanwhile the next chunk's key rows of each head (kq; head h's hstep bytes on), key by key too. */
static inline __attribute__((always_inline)) void DC(pv_keys)(float* acc, int64_t hg, int64_t dpad, const float* P,
                                                             const void* vb, const int64_t* vo, int64_t hs,
                                                             int64_t nk, int64_t D, const int dt, const DC(kpf) * kq,
                                                             int64_t hstep) {
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t h = 0; h < hg; ++h) {
      if (kq) {
        DC(kpf) kh = *kq;
        kh.base += h * hstep;
        DC(kpf_key)(&kh, j);
      }
      const vf pj = vset1(P[h * DC_CHUNK + j]);
      float* a = acc + h * dpad;
      const int64_t o = vo[j] + h * hs;
      int64_t d = 0;
      for (; d + VLEN <= D; d += VLEN) vstore(a + d, vload(a + d) + pj * DC(ld)(vb, o + d, dt));
      if (d < D) vstore(a + d, vload(a + d) + pj * DC(ld_tail)(vb, o + d, D - d, dt));
    }
}

/* ---- bfloat16 products (AVX512_BF16), for bfloat16 caches on CPUs that have it ----------------
 *
 * vdpbf16ps multiplies pairs of bfloat16 and adds both products to a float32 lane: per 32 elements
 * of a key row, one load and one instruction per query row instead of two conversions and two FMAs.
 * Its operands must both be bfloat16, so on this path:
 *   - q is rounded to bfloat16 once per call (decode_cpu.c: rotated in float32 first, as flash-attn
 *     rounds it to q's dtype; a bfloat16 q without rotary is exact), times the scale's power of two
 *     below 1 (exact: ab_half.h ab_bf16_scale_exp, so that q.k stays within float32's range wherever the
 *     score does), and the rest of the scale (run->bf_scale) multiplies the float32 score;
 *   - P is rounded to bfloat16 per chunk for O += P V (as the same-dtype reference and flash-attn
 *     round it), the accumulation stays float32.  A pair of keys (j, j + 1) is one instruction: the
 *     two value rows interleaved by unpacklo/hi_epi16 against the broadcast pair (P_j, P_j+1).  The
 *     unpacks work inside 128-bit lanes, so each 32-column block of an accumulator row holds its
 *     columns permuted (lane i of the lo half: column (i / 4) * 8 + i % 4, of the hi half: that + 4)
 *     until DC(bf_unpermute) puts them back at the end of a tile.
 * The instructions are emitted by inline assembly, so this ISA file needs no -mavx512bf16 and the
 * code only runs when decode_cpu.c has seen the feature at run time (ab_cpu_features). */
#if VLEN == 16
#define DC_BF16 1
static inline __attribute__((always_inline)) __m512 DC(dpbf16)(__m512 acc, __m512i a, __m512i b) {
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

/* 32 float32 as 32 bfloat16, round to nearest even: lo's 16 in the low half, hi's in the high. */
static inline __attribute__((always_inline)) __m512i DC(cvt2bf16)(__m512 lo, __m512 hi) {
  __m512i r;
  __asm__("vcvtne2ps2bf16 %1, %2, %0" : "=v"(r) : "v"(lo), "v"(hi));
  return r;
}

static inline __attribute__((always_inline)) __m512i DC(ldbf)(const uint16_t* s, __mmask32 m) {
  return m == (__mmask32)~0u ? _mm512_loadu_si512((const void*)s) : _mm512_maskz_loadu_epi16(m, s);
}

/* Four bfloat16 dot products of length D, times scale: q rows at q + i * qs (bfloat16, zero past
 * D), cache rows at kb + ko + i * kst (kst 0: one key row for four query rows). */
static inline __attribute__((always_inline)) void DC(dot4bf)(const uint16_t* q, int64_t qs, const uint16_t* kb,
                                                            int64_t ko, int64_t kst, int64_t D, float scale,
                                                            float* s) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; d += 32) {
    const __mmask32 m = D - d >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (D - d)) - 1);
    const __m512i k0 = DC(ldbf)(kb + ko + d, m);
    const __m512i k1 = kst ? DC(ldbf)(kb + ko + kst + d, m) : k0;
    const __m512i k2 = kst ? DC(ldbf)(kb + ko + 2 * kst + d, m) : k0;
    const __m512i k3 = kst ? DC(ldbf)(kb + ko + 3 * kst + d, m) : k0;
    a0 = DC(dpbf16)(a0, _mm512_loadu_si512((const void*)(q + d)), k0);
    a1 = DC(dpbf16)(a1, _mm512_loadu_si512((const void*)(q + qs + d)), k1);
    a2 = DC(dpbf16)(a2, _mm512_loadu_si512((const void*)(q + 2 * qs + d)), k2);
    a3 = DC(dpbf16)(a3, _mm512_loadu_si512((const void*)(q + 3 * qs + d)), k3);
  }
  DC(hsum4)((vf)a0, (vf)a1, (vf)a2, (vf)a3, scale, s, DC_CHUNK);
}

static inline __attribute__((always_inline)) void DC(dot1bf)(const uint16_t* q, const uint16_t* kb, int64_t ko,
                                                            int64_t D, float scale, float* s) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    a0 = DC(dpbf16)(a0, _mm512_loadu_si512((const void*)(q + d)), _mm512_loadu_si512((const void*)(kb + ko + d)));
    a1 = DC(dpbf16)(a1, _mm512_loadu_si512((const void*)(q + d + 32)),
                    _mm512_loadu_si512((const void*)(kb + ko + d + 32)));
  }
  for (; d < D; d += 32) {
    const __mmask32 m = D - d >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (D - d)) - 1);
    a0 = DC(dpbf16)(a0, _mm512_loadu_si512((const void*)(q + d)), DC(ldbf)(kb + ko + d, m));
  }
  *s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) * scale;
}

/* DC(key_scores) for bfloat16 q rows (row stride dq) against a bfloat16 cache. */
static inline __attribute__((always_inline)) void DC(key_scores_bf)(const uint16_t* q, int64_t dq, int64_t hg,
                                                                   int64_t G, const uint16_t* kb, int64_t ko,
                                                                   int64_t ks2, int64_t D, float scale, float* s,
                                                                   const DC(pf) * f) {
  if (G == 1) {
    int64_t h = 0;
    for (; h + 4 <= hg; h += 4) {
      for (int i = 0; i < 4; ++i) DC(pf_head)(f, h + i);
      DC(dot4bf)(q + h * dq, dq, kb, ko + h * ks2, ks2, D, scale, s + h * DC_CHUNK);
    }
    for (; h < hg; ++h) {
      DC(pf_head)(f, h);
      DC(dot1bf)(q + h * dq, kb, ko + h * ks2, D, scale, s + h * DC_CHUNK);
    }
    return;
  }
  for (int64_t h = 0; h < hg; ++h) {
    DC(pf_head)(f, h);
    const uint16_t* qh = q + h * G * dq;
    float* sh = s + h * G * DC_CHUNK;
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) DC(dot4bf)(qh + g * dq, dq, kb, ko + h * ks2, 0, D, scale, sh + g * DC_CHUNK);
    for (; g < G; ++g) DC(dot1bf)(qh + g * dq, kb, ko + h * ks2, D, scale, sh + g * DC_CHUNK);
  }
}

/* Step 1 head by head (run->scores_by_head): the scores of one KV head's G rows (G a multiple of four,
 * NBK = ceil(D / 32) <= 4 blocks a row, q at q, rows dq apart) against keys [a, e) of the chunk, K rows
 * at kb + ko[i] + hk.  Four query rows stay in registers (NBK x 4 vectors) while the head's key rows
 * stream past, so a key costs one load per block instead of five (DC(key_scores_bf) reloads the four
 * rows at every key, since all of the group's heads are too many to keep).  The sums are
 * DC(dot4bf)'s, block by block, and its DC(hsum4)'s tree, four keys at a time (DC(sums4x4)): the same
 * bits.  Scores to s + g * DC_CHUNK + i.
 * In the first pass of rows (g = 0), for the keys [pa, pe) leaves out (those an earlier token of the tile
 * asked for already): the value row of key i into L2 (vpf: the V base, or NULL) and the key row two keys
 * ahead into L1 (kpf: the K base, or NULL; row offsets kao[i + 2], i + 2 < nka), as DC(pf) asks in key
 * order. */
static inline __attribute__((always_inline)) void DC(head_scores_bf)(const int NBK, const uint16_t* q, int64_t dq,
                                                                    int64_t G, const uint16_t* kb, const int64_t* ko,
                                                                    int64_t hk, int64_t a, int64_t e, int64_t D,
                                                                    float scale, float* s, const char* vpf,
                                                                    const int64_t* vo, int64_t hv, const char* kpf,
                                                                    const int64_t* kao, int64_t nka, int64_t pa,
                                                                    int64_t pe, int64_t es) {
  const __mmask32 mlast = D % 32 ? (__mmask32)((1u << (D % 32)) - 1) : (__mmask32)~0u;
  for (int64_t g = 0; g < G; g += 4) {
    __m512i qv[4][4];
    for (int i = 0; i < 4; ++i)
      for (int n = 0; n < NBK; ++n) qv[i][n] = _mm512_loadu_si512((const void*)(q + (g + i) * dq + n * 32));
    float* sg = s + g * DC_CHUNK;
    /* one key's four chains, reduced to the sums of each 128-bit lane (DC(hsum4)'s first steps) */
#define DC_HEAD_KEY(i, y)                                                                                        \
  do {                                                                                                           \
    if (g == 0 && ((i) < pa || (i) >= pe)) {                                                                     \
      if (vpf) SYM(pf_lines)(vpf + (vo[i] + hv) * es, D * es, 2);                                                \
      if (kpf && (i) + DC_KEYS_AHEAD < nka) SYM(pf_lines)(kpf + (kao[(i) + DC_KEYS_AHEAD] + hk) * es, D * es, 3); \
    }                                                                                                            \
    const uint16_t* k = kb + ko[i] + hk;                                                                         \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                                  \
    for (int n = 0; n < NBK; ++n) {                                                                              \
      const __m512i kk = DC(ldbf)(k + n * 32, n == NBK - 1 ? mlast : (__mmask32)~0u);                            \
      a0 = DC(dpbf16)(a0, qv[0][n], kk);                                                                         \
      a1 = DC(dpbf16)(a1, qv[1][n], kk);                                                                         \
      a2 = DC(dpbf16)(a2, qv[2][n], kk);                                                                         \
      a3 = DC(dpbf16)(a3, qv[3][n], kk);                                                                         \
    }                                                                                                            \
    y = DC(lanes4)(a0, a1, a2, a3);                                                                              \
  } while (0)
    int64_t i = a;
    for (; i + 4 <= e; i += 4) {
      __m512 y0, y1, y2, y3;
      DC_HEAD_KEY(i, y0);
      DC_HEAD_KEY(i + 1, y1);
      DC_HEAD_KEY(i + 2, y2);
      DC_HEAD_KEY(i + 3, y3);
      DC(sums4x4)(y0, y1, y2, y3, scale, sg + i, DC_CHUNK);
    }
    for (; i < e; ++i) {
      __m512 y;
      DC_HEAD_KEY(i, y);
      DC(sums4)(y, scale, sg + i, DC_CHUNK);
    }
#undef DC_HEAD_KEY
  }
}

/* 32 weights (lo's 16, then hi's) as bfloat16 pairs to dst (word i: weights 2i and 2i + 1); returns the rounded
 * weights as float32, pair by pair summed (16 lanes), for their sum. */
static inline __attribute__((always_inline)) __m512 DC(bf16_pairs)(__m512 lo, __m512 hi, void* dst) {
  const __m512i x = DC(cvt2bf16)(lo, hi);
  _mm512_storeu_si512(dst, x);
  /* the pairs' low words (key 2i) shifted up and the high words (key 2i + 1) masked: the float32 values */
  return _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                       _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u))));
}

/* The P rows of n query rows (row stride DC_CHUNK floats) as bfloat16 pairs (P_2i, P_2i+1), written
 * over the first half of each row: word i of row r is then the pair for keys 2i and 2i + 1.  The rounded
 * weights' sum is added to lb[r]: the output is divided by it rather than by l (the unrounded sum, which
 * lse keeps), so that the weights P V applies sum to 1.  Divided by l, rounding P (up to 2**-8 of each
 * weight, the same way for keys of equal scores) scaled the whole output: value rows of 1000 gave 996
 * or 1004 where the exact result, and torch's, is 1000. */
static inline void DC(p_to_bf16)(float* P, int64_t n, float* lb) {
  for (int64_t r = 0; r < n; ++r) {
    float* row = P + r * DC_CHUNK;
    lb[r] += _mm512_reduce_add_ps(DC(bf16_pairs)(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16), row));
  }
}

/* acc_r += sum_j P[r][j] v_j for M rows over NB blocks of 32 columns from column d0 (the last block
 * loaded under mask m), two keys per instruction; accumulators in the permuted column order. */
static inline __attribute__((always_inline)) void DC(pvbf_rows)(const int M, const int NB, float* acc, int64_t dpad,
                                                               const uint32_t* Pw, const uint16_t* vb,
                                                               const int64_t* vo, int64_t ho, int64_t nk,
                                                               int64_t d0, __mmask32 m, const DC(kpf) * kp) {
  __m512 o[4][4][2];
  for (int i = 0; i < M; ++i)
    for (int n = 0; n < NB; ++n) {
      o[i][n][0] = _mm512_loadu_ps(acc + i * dpad + d0 + n * 32);
      o[i][n][1] = _mm512_loadu_ps(acc + i * dpad + d0 + n * 32 + 16);
    }
  for (int64_t j = 0; j < nk; j += 2) {
    DC(kpf_key)(kp, j);
    DC(kpf_key)(kp, j + 1);
    __m512i lo[4], hi[4];
    for (int n = 0; n < NB; ++n) {
      const __mmask32 mn = n == NB - 1 ? m : (__mmask32)~0u;
      const __m512i a = DC(ldbf)(vb + vo[j] + ho + d0 + n * 32, mn);
      const __m512i b = j + 1 < nk ? DC(ldbf)(vb + vo[j + 1] + ho + d0 + n * 32, mn) : _mm512_setzero_si512();
      lo[n] = _mm512_unpacklo_epi16(a, b);
      hi[n] = _mm512_unpackhi_epi16(a, b);
    }
    for (int i = 0; i < M; ++i) {
      const __m512i pw = _mm512_set1_epi32((int)Pw[i * DC_CHUNK + j / 2]);
      for (int n = 0; n < NB; ++n) {
        o[i][n][0] = DC(dpbf16)(o[i][n][0], lo[n], pw);
        o[i][n][1] = DC(dpbf16)(o[i][n][1], hi[n], pw);
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int n = 0; n < NB; ++n) {
      _mm512_storeu_ps(acc + i * dpad + d0 + n * 32, o[i][n][0]);
      _mm512_storeu_ps(acc + i * dpad + d0 + n * 32 + 16, o[i][n][1]);
    }
}

/* M rows over all of D: NB blocks at a time, then one block at a time, the last one masked. */
static inline __attribute__((always_inline)) void DC(pvbf_m)(const int M, const int NB, float* acc, int64_t dpad,
                                                            const uint32_t* Pw, const uint16_t* vb,
                                                            const int64_t* vo, int64_t ho, int64_t nk, int64_t D,
                                                            const DC(kpf) * kp) {
  int64_t d = 0;
  for (; d + NB * 32 <= D; d += NB * 32, kp = NULL)
    DC(pvbf_rows)(M, NB, acc, dpad, Pw, vb, vo, ho, nk, d, (__mmask32)~0u, kp);
  for (; d < D; d += 32, kp = NULL) {
    const __mmask32 m = D - d >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (D - d)) - 1);
    DC(pvbf_rows)(M, 1, acc, dpad, Pw, vb, vo, ho, nk, d, m, kp);
  }
}

/* DC(pv) on the bfloat16 path: P already converted by DC(p_to_bf16). */
static inline __attribute__((always_inline)) void DC(pv_bf)(float* acc, int64_t n, int64_t dpad, const float* P,
                                                           const uint16_t* vb, const int64_t* vo, int64_t ho,
                                                           int64_t nk, int64_t D, const DC(kpf) * kp) {
  const uint32_t* Pw = (const uint32_t*)P;
  int64_t r = 0;
  for (; r + 4 <= n; r += 4, kp = NULL) DC(pvbf_m)(4, 2, acc + r * dpad, dpad, Pw + r * DC_CHUNK, vb, vo, ho, nk, D, kp);
  switch (n - r) {
    case 3: DC(pvbf_m)(3, 2, acc + r * dpad, dpad, Pw + r * DC_CHUNK, vb, vo, ho, nk, D, kp); break;
    case 2: DC(pvbf_m)(2, 4, acc + r * dpad, dpad, Pw + r * DC_CHUNK, vb, vo, ho, nk, D, kp); break;
    case 1: DC(pvbf_m)(1, 4, acc + r * dpad, dpad, Pw + r * DC_CHUNK, vb, vo, ho, nk, D, kp); break;
    default: break;
  }
}

/* DC(pv_keys) on the bfloat16 path (one-token MHA, run->pv_keys): every head's pair of value rows of keys
 * (j, j + 1), interleaved as DC(pvbf_rows) does, against its pair of P, then the next pair's; the
 * accumulators (hg rows, dpad apart, permuted as DC(pvbf_rows) leaves them) in L1.  The same instruction on
 * the same operands for each column and pair, in the same order: the same bits. */
static inline __attribute__((always_inline)) void DC(pv_keys_bf)(float* acc, int64_t hg, int64_t dpad, const float* P,
                                                                const uint16_t* vb, const int64_t* vo, int64_t hs,
                                                                int64_t nk, int64_t D, const DC(kpf) * kq,
                                                                int64_t hstep) {
  const uint32_t* Pw = (const uint32_t*)P;
  for (int64_t j = 0; j < nk; j += 2)
    for (int64_t h = 0; h < hg; ++h) {
      if (kq) {
        DC(kpf) kh = *kq;
        kh.base += h * hstep;
        DC(kpf_key)(&kh, j);
        DC(kpf_key)(&kh, j + 1);
      }
      const __m512i pw = _mm512_set1_epi32((int)Pw[h * DC_CHUNK + j / 2]);
      float* a = acc + h * dpad;
      const uint16_t *v0 = vb + vo[j] + h * hs, *v1 = j + 1 < nk ? vb + vo[j + 1] + h * hs : NULL;
      for (int64_t d = 0; d < D; d += 32) {
        const __mmask32 m = D - d >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (D - d)) - 1);
        const __m512i x = DC(ldbf)(v0 + d, m), y = v1 ? DC(ldbf)(v1 + d, m) : _mm512_setzero_si512();
        _mm512_storeu_ps(a + d, DC(dpbf16)(_mm512_loadu_ps(a + d), _mm512_unpacklo_epi16(x, y), pw));
        _mm512_storeu_ps(a + d + 16, DC(dpbf16)(_mm512_loadu_ps(a + d + 16), _mm512_unpackhi_epi16(x, y), pw));
      }
    }
}

#else
#define DC_BF16 0
#endif

#if defined(AB_AMX_SFX)
#define DC_AMX 1
#else
#define DC_AMX 0
#endif

#if DC_BF16 || DC_AMX
/* The column of a 32-column block that lane i (< 16) of the lo half of unpacklo/hi_epi16's interleave holds;
 * the hi half's lane i holds that column + 4. */
#define DC_BF_COL(i) (((i) / 4) * 8 + (i) % 4)

/* An accumulator row back in column order (see above), in place, dpad a multiple of 32. */
static inline void DC(bf_unpermute)(float* acc, int64_t dpad) {
  for (int64_t d = 0; d < dpad; d += 32) {
    float t[32];
    for (int i = 0; i < 16; ++i) {
      t[DC_BF_COL(i)] = acc[d + i];
      t[DC_BF_COL(i) + 4] = acc[d + 16 + i];
    }
    memcpy(acc + d, t, sizeof t);
  }
}
#endif

#if DC_AMX
#include "ab_amx.h"
/* ---- tiles (AMX-BF16): steps 1 and 3 of one-token GQA decode over a bfloat16 cache -------------
 *
 * Where the vector products are what holds decode back (an Intel Xeon issues one vdpbf16ps per 0.6 ns,
 * a quarter of its FMA rate: bfloat16 GQA ran at 38 ns per key and KV head on one core with the cache in
 * the L3, against 20 ns of memory time per thread from DRAM), the AMX paths' kernel (cpu_amx.c, and
 * cpu_amx_emu.c on emulated tiles) takes the products of the calls decode_cpu.c's amx_tiles admits (one
 * query token, G = Hq / Hkv from 2 to 16, D a multiple of 32 up to 256, run->amx) on tiles, per KV head
 * and chunk of 32 keys:
 *   - step 1, S^T = K Q^T: A is 16 key rows of the head straight from the cache (tileloadd at the
 *     cache's row stride; rows that are not one stride apart, at a page's end or past the chunk's
 *     end, are copied to scratch first, zero past the end), B the head's G query rows as VNNI pairs of
 *     q (packed once per tile, DC(amx_q)), C the 16 keys' G scores; D / 32 products per 16 keys; the
 *     scores are then written to S row by row, times run->bf_scale, as the vector path leaves them;
 *   - step 2, the softmax, is the vector path's, and P is rounded to bfloat16 pairs (DC(p_to_bf16));
 *   - step 3, O += P V: A is the head's G rows of P (32 keys, 16 pairs), B the chunk's value rows
 *     interleaved by pairs of keys as the vector path's unpacklo/hi_epi16 interleave them (DC(amx_pack_v)),
 *     16 columns a tile, so the accumulators keep the vector path's permuted columns (DC(bf_unpermute)
 *     puts them back), C the accumulators of those 16 columns, loaded from and stored to the tile's
 *     scratch around each product.
 * The sums are the tile unit's, not vdpbf16ps's: on the emulation the bits differ from the vector path's, on
 * the one Xeon measured they matched for small calls but not all (both within the correctness rule); they are
 * the same for a dense and a paged cache (the tiles hold the same rows).  From DRAM the tiles were slower than
 * the vector products there (docs/decode.md, "Tiles"), so the avx512 path takes them only when asked. */
#define DC_AMX_S0 0 /* scores of keys 0-15 of the chunk: 16 rows x G floats */
#define DC_AMX_S1 1 /* keys 16-31 */
#define DC_AMX_K0 2 /* 16 key rows x 32 elements */
#define DC_AMX_K1 7
#define DC_AMX_Q 3 /* 16 pairs of q elements x G rows */
#define DC_AMX_P 4 /* G rows of P x 16 pairs of keys */
#define DC_AMX_V 5 /* 16 pairs of value rows x 16 columns */
#define DC_AMX_O 6 /* G accumulator rows x 16 columns */

static void DC(amx_config)(int64_t G) {
  ab_tilecfg c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  const uint16_t g4 = (uint16_t)(G * 4);
  c.rows[DC_AMX_S0] = c.rows[DC_AMX_S1] = c.rows[DC_AMX_Q] = 16;
  c.colsb[DC_AMX_S0] = c.colsb[DC_AMX_S1] = c.colsb[DC_AMX_Q] = g4;
  c.rows[DC_AMX_K0] = c.rows[DC_AMX_K1] = c.rows[DC_AMX_V] = 16;
  c.colsb[DC_AMX_K0] = c.colsb[DC_AMX_K1] = c.colsb[DC_AMX_V] = 64;
  c.rows[DC_AMX_P] = c.rows[DC_AMX_O] = (uint8_t)G;
  c.colsb[DC_AMX_P] = c.colsb[DC_AMX_O] = 64;
  AMX_CONFIG(&c);
}

/* One head's G query rows (bfloat16, rb + g * dpad) as the B operand of step 1, D / 32 tiles of 16 rows x G
 * words: word (r, g) of tile db is the pair (q_g[32 db + 2r], q_g[32 db + 2r + 1]). */
static inline void DC(amx_q)(const uint16_t* rb, int64_t dpad, int64_t G, int64_t D, uint32_t* qt) {
  for (int64_t db = 0; db < D / 32; ++db)
    for (int64_t r = 0; r < 16; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* x = rb + g * dpad + db * 32 + 2 * r;
        qt[(db * 16 + r) * G + g] = (uint32_t)x[0] | (uint32_t)x[1] << 16;
      }
}

/* For each 16 keys of the chunk (offsets ko, nk keys), the elements between their rows where all 16 are one
 * stride apart, which a tile then loads straight from the cache, else INT64_MIN (a page's end, the chunk's
 * end: DC(amx_scores) copies them).  The same for every head of the chunk. */
static inline void DC(amx_key_strides)(const int64_t* ko, int64_t nk, int64_t kst[2]) {
  for (int x = 0; x < 2; ++x) {
    const int64_t* o = ko + 16 * x;
    int uniform = nk - 16 * x >= 16;
    for (int64_t i = 2; i < 16 && uniform; ++i) uniform = o[i] - o[i - 1] == o[1] - o[0];
    kst[x] = uniform ? o[1] - o[0] : INT64_MIN;
  }
}

/* The A operands of S^T = K Q^T for one head and chunk: the chunk's nk keys (rows at kb + ko[i] + hoff; kst from
 * DC(amx_key_strides)), 16 keys a tile: base[x] and stride[x] (bytes) of keys 16 x .. 16 x + 15, straight from
 * the cache where they are one stride apart, else copied to kt + 16 x D (zero past nk). */
static inline void DC(amx_key_tiles)(const uint16_t* kb, const int64_t* ko, const int64_t kst[2], int64_t nk,
                                     int64_t hoff, int64_t D, uint16_t* kt, const uint16_t* base[2],
                                     int64_t stride[2]) {
  for (int x = 0; x < 2; ++x) {
    const int64_t* o = ko + 16 * x;
    const int64_t n = nk - 16 * x < 16 ? nk - 16 * x : 16;
    base[x] = kb;
    stride[x] = 0;
    if (n <= 0) continue;
    if (kst[x] != INT64_MIN) {
      base[x] = kb + o[0] + hoff;
      stride[x] = kst[x] * (int64_t)sizeof(uint16_t);
    } else {
      uint16_t* dst = kt + 16 * x * D;
      for (int64_t i = 0; i < 16; ++i) {
        if (i < n)
          memcpy(dst + i * D, kb + o[i] + hoff, (size_t)D * sizeof(uint16_t));
        else
          memset(dst + i * D, 0, (size_t)D * sizeof(uint16_t));
      }
      base[x] = dst;
      stride[x] = D * (int64_t)sizeof(uint16_t);
    }
  }
}

/* Step 1 on tiles for one head: the scores of the chunk's nk keys (rows at kb + ko[i] + hoff) against its G
 * query rows (qt, DC(amx_q)), times scale, into S (row g at S + g * DC_CHUNK, key i at [i]).  Each 16 keys' rows
 * go to a tile straight from the cache where DC(amx_key_strides) found them one stride apart (kst), else through
 * kt (16 rows of D, zero past nk); st: scratch for 32 x G floats. */
static inline void DC(amx_scores)(const uint16_t* kb, const int64_t* ko, const int64_t kst[2], int64_t nk,
                                  int64_t hoff, int64_t D, int64_t G, const uint32_t* qt, float scale, float* S,
                                  uint16_t* kt, float* st) {
  const uint16_t* base[2];
  int64_t stride[2];
  DC(amx_key_tiles)(kb, ko, kst, nk, hoff, D, kt, base, stride);
  const int two = nk > 16;
  AMX_ZERO(DC_AMX_S0);
  if (two) AMX_ZERO(DC_AMX_S1);
  for (int64_t db = 0; db < D / 32; ++db) {
    AMX_LOAD(DC_AMX_Q, qt + db * 16 * G, G * 4);
    AMX_LOAD(DC_AMX_K0, base[0] + db * 32, stride[0]);
    AMX_DPBF16(DC_AMX_S0, DC_AMX_K0, DC_AMX_Q);
    if (two) {
      AMX_LOAD(DC_AMX_K1, base[1] + db * 32, stride[1]);
      AMX_DPBF16(DC_AMX_S1, DC_AMX_K1, DC_AMX_Q);
    }
  }
  AMX_STORE(DC_AMX_S0, st, G * 4);
  if (two) AMX_STORE(DC_AMX_S1, st + 16 * G, G * 4);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nk; ++i) S[g * DC_CHUNK + i] = st[i * G + g] * scale;
}

/* The chunk's value rows of one head (vb + vo[i] + hoff, i < nk) as the B operands of step 3: for each block
 * of 32 columns, two tiles (its lo and hi halves) of 16 rows, row r the keys (2r, 2r + 1) interleaved as
 * unpacklo / unpackhi_epi16 interleave them (DC(pvbf_rows)); a key past nk is a zero row. */
static inline void DC(amx_pack_v)(const uint16_t* vb, const int64_t* vo, int64_t hoff, int64_t nk, int64_t D,
                                  uint16_t* vp) {
  for (int64_t r = 0; r < 16; ++r) {
    const uint16_t* a = 2 * r < nk ? vb + vo[2 * r] + hoff : NULL;
    const uint16_t* b = 2 * r + 1 < nk ? vb + vo[2 * r + 1] + hoff : NULL;
    for (int64_t db = 0; db < D / 32; ++db) {
      uint16_t* lo = vp + ((db * 2) * 16 + r) * 32;
      uint16_t* hi = lo + 16 * 32;
#if DC_BF16
      const __m512i x = a ? _mm512_loadu_si512((const void*)(a + db * 32)) : _mm512_setzero_si512();
      const __m512i y = b ? _mm512_loadu_si512((const void*)(b + db * 32)) : _mm512_setzero_si512();
      _mm512_storeu_si512((void*)lo, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512((void*)hi, _mm512_unpackhi_epi16(x, y));
#else
      for (int i = 0; i < 16; ++i) { /* the vector path's interleave, lane by lane */
        const int64_t c = db * 32 + DC_BF_COL(i);
        lo[2 * i] = a ? a[c] : 0;
        lo[2 * i + 1] = b ? b[c] : 0;
        hi[2 * i] = a ? a[c + 4] : 0;
        hi[2 * i + 1] = b ? b[c + 4] : 0;
      }
#endif
    }
  }
}

/* Step 3 on tiles for one head: acc (G rows, dpad apart, permuted columns) += P V over the chunk's keys, P the
 * head's G rows as bfloat16 pairs (DC(p_to_bf16): row g at P + g * DC_CHUNK floats, zero past the chunk's end),
 * V packed by DC(amx_pack_v) into vp. */
static inline void DC(amx_pv)(float* acc, int64_t dpad, const float* P, const uint16_t* vp, int64_t D) {
  AMX_LOAD(DC_AMX_P, P, DC_CHUNK * (int64_t)sizeof(float));
  for (int64_t c = 0; c < D / 16; ++c) {
    AMX_LOAD(DC_AMX_O, acc + c * 16, dpad * (int64_t)sizeof(float));
    AMX_LOAD(DC_AMX_V, vp + c * 16 * 32, 64);
    AMX_DPBF16(DC_AMX_O, DC_AMX_P, DC_AMX_V);
    AMX_STORE(DC_AMX_O, acc + c * 16, dpad * (int64_t)sizeof(float));
  }
}

/* ---- tiles of many rows (AMX-BF16): the tiled products on tiles ------------------------------
 *
 * With many query rows per KV head (chunked prefill, speculative decoding) a bfloat16 cache's tiles go through
 * the tiled products' steps ("tiled products" below: head by head, the scores transposed, keys x rows, and
 * the rows' state head-major, each head's rows padded to 16) with both products on tiles, where the vector
 * kernel's float32 FMAs leave the time to the arithmetic (decode_cpu.c amx_rows admits them):
 *   - S^T = K Q^T: A is 16 key rows straight from the cache (as DC(amx_scores): rows that are not one
 *     stride apart go through scratch), B 16 of the head's query rows as VNNI pairs of q (DC(amx_qt), once
 *     per tile), C the 16 keys' scores of those 16 rows, stored straight into the transposed scores;
 *   - the softmax is the tiled products' (DC(softmax_t)), with the sum of the weights as rounded kept as
 *     the bfloat16 products keep it;
 *   - O += P V: P^T is rounded to bfloat16 and transposed to rows of 32 keys (DC(amx_p_rows)), the A
 *     operand; B the chunk's value rows by pairs of keys (DC(amx_pack_v), the vector path's permuted
 *     columns, put back at the end), C 16 rows x 16 columns of the accumulators.
 * Every tile of this mode is 16 rows of 64 bytes (DC(amx_rows_config)). */
#define DC_AMXR_C0 0 /* scores of keys 0-15: 16 keys x 16 query rows */
#define DC_AMXR_C1 1 /* keys 16-31 */
#define DC_AMXR_K0 2 /* 16 key rows x 32 elements */
#define DC_AMXR_K1 3
#define DC_AMXR_Q 4 /* 16 pairs of q elements x 16 query rows */
#define DC_AMXR_P 5 /* 16 rows of P x 16 pairs of keys */
#define DC_AMXR_V 6 /* 16 pairs of value rows x 16 columns */
#define DC_AMXR_O 7 /* 16 accumulator rows x 16 columns */

static void DC(amx_rows_config)(void) {
  ab_tilecfg c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  AMX_CONFIG(&c);
}

/* A head's rh query rows (bfloat16, D elements; row r, of token r / G and query head r % G, at q + r / G * ts +
 * r % G * gs) as the B operands of S^T = K Q^T: word (d / 2) * rhp + r is the pair (q_r[d], q_r[d + 1]); rows
 * rh .. rhp are 0. */
static inline void DC(amx_qt)(const uint16_t* q, int64_t ts, int64_t gs, int64_t G, int64_t rh, int64_t rhp,
                              int64_t D, uint32_t* qv) {
  for (int64_t r = 0; r < rhp; ++r) {
    const uint16_t* x = r < rh ? q + r / G * ts + r % G * gs : NULL;
    for (int64_t d2 = 0; d2 < D / 2; ++d2)
      qv[d2 * rhp + r] = x ? (uint32_t)x[2 * d2] | (uint32_t)x[2 * d2 + 1] << 16 : 0u;
  }
}

/* S^T = K Q^T on tiles for one chunk and 16 query rows of a head: the chunk's nk keys (A operands from
 * DC(amx_key_tiles)) against the rows' q (qv: the head's B operands, DC(amx_qt), rhp rows, from row rb), times
 * scale, into st (key i of row r at st[i * 16 + r]); keys past nk are not written. */
static inline void DC(amx_scores16)(const uint16_t* const base[2], const int64_t stride[2], int64_t nk, int64_t D,
                                    const uint32_t* qv, int64_t rhp, int64_t rb, float scale, float* st) {
  const int two = nk > 16;
  const int64_t qs = rhp * (int64_t)sizeof(uint32_t);
  AMX_ZERO(DC_AMXR_C0);
  if (two) AMX_ZERO(DC_AMXR_C1);
  for (int64_t db = 0; db < D / 32; ++db) {
    AMX_LOAD(DC_AMXR_Q, qv + db * 16 * rhp + rb, qs);
    AMX_LOAD(DC_AMXR_K0, base[0] + db * 32, stride[0]);
    AMX_DPBF16(DC_AMXR_C0, DC_AMXR_K0, DC_AMXR_Q);
    if (two) {
      AMX_LOAD(DC_AMXR_K1, base[1] + db * 32, stride[1]);
      AMX_DPBF16(DC_AMXR_C1, DC_AMXR_K1, DC_AMXR_Q);
    }
  }
  AMX_STORE(DC_AMXR_C0, st, 64);
  if (two) AMX_STORE(DC_AMXR_C1, st + 16 * 16, 64);
  const vf sc = vset1(scale);
  for (int64_t i = 0; i < nk * 16; i += VLEN) vstore(st + i, vload(st + i) * sc);
}

/* 32 keys of P^T (st: key i of row r at st[i * rhp + r], nk of them, 0 past nk) as bfloat16 at pb + kw r (row r),
 * rounded to nearest even; lb[r] += their sum as rounded, key by key in order. */
static inline void DC(amx_p_rows32)(const float* st, int64_t nk, int64_t kw, int64_t rhp, uint16_t* pb, float* lb) {
#if DC_BF16
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t rb = 0; rb < rhp; rb += 16) {
    __m512 sum = _mm512_setzero_ps();
    __m512i x[16]; /* x[j]: word r is row rb + r's pair of keys (2j, 2j + 1) */
    for (int j = 0; j < 16; ++j) {
      const __m512 a = 2 * j < nk ? _mm512_loadu_ps(st + 2 * j * rhp + rb) : _mm512_setzero_ps();
      const __m512 b = 2 * j + 1 < nk ? _mm512_loadu_ps(st + (2 * j + 1) * rhp + rb) : _mm512_setzero_ps();
      const __m512i ab = DC(cvt2bf16)(a, b); /* words 0-15: a rounded, 16-31: b */
      sum += (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(ab)), 16);
      sum += (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(ab, 1)), 16);
      x[j] = _mm512_permutexvar_epi16(pairs, ab);
    }
    _mm512_storeu_ps(lb + rb, _mm512_loadu_ps(lb + rb) + sum);
    /* the 16 x 16 words transposed: row r gets word r of every x[j] */
    __m512i y[16], z[16];
    for (int i = 0; i < 8; ++i) {
      y[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
      y[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
    }
    for (int g = 0; g < 4; ++g) { /* z[4g + c]: lane L holds word 4L + c of x[4g .. 4g + 3] */
      z[4 * g] = _mm512_unpacklo_epi64(y[4 * g], y[4 * g + 2]);
      z[4 * g + 1] = _mm512_unpackhi_epi64(y[4 * g], y[4 * g + 2]);
      z[4 * g + 2] = _mm512_unpacklo_epi64(y[4 * g + 1], y[4 * g + 3]);
      z[4 * g + 3] = _mm512_unpackhi_epi64(y[4 * g + 1], y[4 * g + 3]);
    }
    for (int c = 0; c < 4; ++c) { /* rows 4L + c: lane L of z[c], z[4 + c], z[8 + c], z[12 + c] */
      const __m512i s0 = _mm512_shuffle_i32x4(z[c], z[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(z[8 + c], z[12 + c], 0x44);
      const __m512i s2 = _mm512_shuffle_i32x4(z[c], z[4 + c], 0xee), s3 = _mm512_shuffle_i32x4(z[8 + c], z[12 + c], 0xee);
      uint16_t* o = pb + (rb + c) * kw;
      _mm512_storeu_si512((void*)o, _mm512_shuffle_i32x4(s0, s1, 0x88));
      _mm512_storeu_si512((void*)(o + 4 * kw), _mm512_shuffle_i32x4(s0, s1, 0xdd));
      _mm512_storeu_si512((void*)(o + 8 * kw), _mm512_shuffle_i32x4(s2, s3, 0x88));
      _mm512_storeu_si512((void*)(o + 12 * kw), _mm512_shuffle_i32x4(s2, s3, 0xdd));
    }
  }
#else
  for (int64_t r = 0; r < rhp; ++r) {
    float sum = 0.0f;
    for (int64_t i = 0; i < DC_CHUNK; ++i) {
      const uint16_t u = ab_f32_to_bf16(i < nk ? st[i * rhp + r] : 0.0f);
      pb[r * kw + i] = u;
      sum += ab_bf16_to_f32(u);
    }
    lb[r] += sum;
  }
#endif
}

/* P^T (st after DC(softmax_t): key i of row r at st[i * rhp + r], nk keys) as rows of bfloat16 for O += P V: row
 * r's kw keys (kw a multiple of 32) at pb + kw r, rounded to nearest even, 0 past nk; lb[r] += the sum of row r's
 * rounded weights, key by key in order (the bfloat16 products' DC(p_to_bf16) sum, 32 keys at a time). */
static inline void DC(amx_p_rows)(const float* st, int64_t nk, int64_t kw, int64_t rhp, uint16_t* pb, float* lb) {
  for (int64_t k0 = 0; k0 < kw; k0 += 32, st += 32 * rhp, pb += 32)
    DC(amx_p_rows32)(st, nk - k0, kw, rhp, pb, lb);
}

/* O += P V on tiles for one head over nc chunks of keys: acc (rhp rows, dpad apart, permuted columns as
 * DC(amx_pv)), P's rows from DC(amx_p_rows) (32 nc keys a row), chunk c's value rows packed by DC(amx_pack_v) at
 * vp + c * 32 * D words.  Each 16 x 16 block of the accumulators is loaded and stored once for the nc chunks: with
 * one chunk a pass, their loads and stores took more time than the products (rows of 1 KiB and more in L2). */
static inline void DC(amx_pv_rows)(float* acc, int64_t dpad, int64_t rhp, const uint16_t* pb, int nc,
                                   const uint16_t* vp, int64_t D) {
  const int64_t as = dpad * (int64_t)sizeof(float), kw = 32 * nc;
  for (int64_t rb = 0; rb < rhp; rb += 16) {
    /* chunk c's P in tile c (the scores' tiles, free by now: a tile's number is an immediate) */
    const int64_t ps = kw * (int64_t)sizeof(uint16_t);
    AMX_LOAD(0, pb + rb * kw, ps);
    if (nc > 1) AMX_LOAD(1, pb + rb * kw + 32, ps);
    if (nc > 2) AMX_LOAD(2, pb + rb * kw + 64, ps);
    if (nc > 3) AMX_LOAD(3, pb + rb * kw + 96, ps);
    for (int64_t x = 0; x < D / 16; ++x) {
      float* o = acc + rb * dpad + x * 16;
      const uint16_t* v = vp + x * 16 * 32;
      AMX_LOAD(DC_AMXR_O, o, as);
      AMX_LOAD(DC_AMXR_V, v, 64);
      AMX_DPBF16(DC_AMXR_O, 0, DC_AMXR_V);
      if (nc > 1) {
        AMX_LOAD(DC_AMXR_V, v + 32 * D, 64);
        AMX_DPBF16(DC_AMXR_O, 1, DC_AMXR_V);
      }
      if (nc > 2) {
        AMX_LOAD(DC_AMXR_V, v + 64 * D, 64);
        AMX_DPBF16(DC_AMXR_O, 2, DC_AMXR_V);
      }
      if (nc > 3) {
        AMX_LOAD(DC_AMXR_V, v + 96 * D, 64);
        AMX_DPBF16(DC_AMXR_O, 3, DC_AMXR_V);
      }
      AMX_STORE(DC_AMXR_O, o, as);
    }
  }
}

#if !DC_BF16
/* DC(p_to_bf16) of the vector path, element by element (the emulated tiles' build): the same rounding, the
 * rounded weights summed in order. */
static inline void DC(p_to_bf16)(float* P, int64_t n, float* lb) {
  for (int64_t r = 0; r < n; ++r) {
    float* row = P + r * DC_CHUNK;
    uint16_t t[DC_CHUNK];
    float sum = 0.0f;
    for (int i = 0; i < DC_CHUNK; ++i) {
      t[i] = ab_f32_to_bf16(row[i]);
      sum += ab_bf16_to_f32(t[i]);
    }
    memcpy(row, t, sizeof t);
    lb[r] += sum;
  }
}
#endif
#endif /* DC_AMX */

/* ab_decode_cpu_table.q_bf16 (decode_cpu.h): with AVX512_BF16 32 elements a step (the same bits as
 * ab_f32_to_bf16 of ab_ldexpf, but for a subnormal input, 0 here: lost either way), else element by element.
 * q of B=8 Hq=32 D=128 (32768 elements) took about 28 us a call element by element on a Zen 4 (SSE2, the
 * generic build), a tenth of a bfloat16 decode call over 128 keys. */
static int DC(q_bf16)(const float* row, uint16_t* rb, int64_t n, int qexp) {
  int64_t d = 0;
  int lost = 0;
#if DC_BF16
  if (ab_cpu_features_get()->avx512_bf16 && qexp >= -126 && qexp <= 127) { /* ab_ldexpf's exact multiply */
    const __m512 f = _mm512_set1_ps(ab_ldexpf(1.0f, qexp)), zero = _mm512_setzero_ps();
    const __m512i ex = _mm512_set1_epi16(0x7f80);
    __mmask32 l = 0;
    for (; d + 32 <= n; d += 32) {
      const __m512 lo = _mm512_loadu_ps(row + d), hi = _mm512_loadu_ps(row + d + 16);
      const __m512i x = DC(cvt2bf16)(_mm512_mul_ps(lo, f), _mm512_mul_ps(hi, f));
      _mm512_storeu_si512((void*)(rb + d), x);
      const __mmask32 nz = (__mmask32)_mm512_cmp_ps_mask(lo, zero, _CMP_NEQ_UQ) |
                           (__mmask32)_mm512_cmp_ps_mask(hi, zero, _CMP_NEQ_UQ) << 16;
      l |= nz & ~_mm512_test_epi16_mask(x, ex);
    }
    lost = l != 0;
  }
#endif
  for (; d < n; ++d) {
    rb[d] = ab_f32_to_bf16(ab_ldexpf(row[d], qexp));
    lost |= row[d] != 0.0f && (rb[d] & 0x7f80u) == 0; /* a subnormal or 0 from a value that is not 0 */
  }
  return lost;
}

/* The chunk of keys that starts at j: it ends at *je (at most DC_CHUNK keys, within khi), the K
 * and V rows of its keys (head h0) at ko[i] and vo[i], i < *je - j.  A chunk may span pages of a
 * paged cache: one block_table lookup per page it touches, then the rows of the page by stride,
 * so small pages (16 keys) still give whole chunks to the softmax and to P V. */
static inline void DC(chunk_at)(const ab_decode_run* run, int64_t b, int64_t h0, int64_t j, int64_t khi,
                                int64_t* je, int64_t* ko, int64_t* vo) {
  const ab_kvcache_params* p = run->p;
  const ab_tensor *kc = &p->k_cache, *vc = &p->v_cache;
  const int64_t bs = run->block_size, ks1 = kc->strides[1], vs1 = vc->strides[1];
  const int64_t e = j + DC_CHUNK < khi ? j + DC_CHUNK : khi;
  if (bs) {
    const ab_tensor* bt = &p->block_table;
    for (int64_t x = j; x < e;) {
      const int64_t i = b * bt->strides[0] + (x / bs) * bt->strides[1];
      const int64_t blk = bt->dtype == AB_DTYPE_I64 ? ((const int64_t*)bt->data)[i] : ((const int32_t*)bt->data)[i];
      const int64_t pe = (x / bs + 1) * bs < e ? (x / bs + 1) * bs : e;
      const int64_t k0 = blk * kc->strides[0] + (x % bs - x) * ks1 + h0 * kc->strides[2];
      const int64_t v0 = blk * vc->strides[0] + (x % bs - x) * vs1 + h0 * vc->strides[2];
      for (; x < pe; ++x) {
        ko[x - j] = k0 + x * ks1;
        vo[x - j] = v0 + x * vs1;
      }
    }
  } else {
    const int64_t k0 = run->row[b] * kc->strides[0] + h0 * kc->strides[2];
    const int64_t v0 = run->row[b] * vc->strides[0] + h0 * vc->strides[2];
    for (int64_t x = j; x < e; ++x) {
      ko[x - j] = k0 + x * ks1;
      vo[x - j] = v0 + x * vs1;
    }
  }
  *je = e;
}

/* Step 3 of DC(item) (and step 1 where it goes head by head, run->scores_by_head) goes through a chunk
 * (keys j .. j + nk) in runs of keys of one block: the run from key j + j0 ends at the chunk's end or
 * at the next block's first key, whichever comes first,
 * rounded up to an even count from the chunk's start (the bfloat16 products take the chunk's keys in
 * pairs 0-1, 2-3, ...; a chunk that starts inside a block, after a leftpad or at a split, would
 * otherwise cut a pair).
 * Every head's rows of one block are read before the next block's, so that the value rows of one
 * head (a row of the cache apart) are never a stride that breaks in the middle (a shuffled
 * block_table puts the chunk's second block anywhere).  The sums are the same, key after key, as
 * in one run: paged and dense caches keep the same bits.  Measured on an AMD Zen 4 (avx512 path,
 * 2 threads, blocks of 16 under a shuffled table, one process, on and off alternating;
 * docs/benchmarks.md "Decode on an AVX-512 AMD CPU, rerun"): paged decode took 0.91-0.99x the time,
 * and paged / dense went from 1.01-1.11 to 0.96-1.05; bfloat16 MHA 1.11 -> 1.05.  Not measured on
 * other CPUs; the several-token MHA tiles and the tiled products keep one run per chunk. */
static inline int64_t DC(block_end)(const ab_decode_run* run, int64_t j, int64_t j0, int64_t nk) {
  const int64_t bs = run->block_size;
  int64_t e = bs ? ((j + j0) / bs + 1) * bs - j : nk;
  e += e & 1;
  return e < nk ? e : nk;
}

/* The next chunk's key rows that step 3 asks for (DC(kpf)) while it reads keys j0 .. j1 of this one:
 * the same keys of the next chunk, so every run asks for its share. */
static inline DC(kpf) DC(kpf_run)(DC(kpf) kp, int64_t j0, int64_t j1) {
  const int64_t n = kp.n - j0;
  kp.off += j0;
  kp.n = n < 0 ? 0 : n < j1 - j0 ? n : j1 - j0;
  return kp;
}

/* One line on each 4 KiB page that n keys' rows lie on (offsets off; hg heads of D elements, hs apart;
 * es bytes an element; the span's first line on its first page, else the page's first), asked for with
 * the L2 hint: DC(item) does it two chunks ahead, so that the page walks and the DRAM pages of a chunk
 * start well before its rows are asked for (pages_ahead).  Heads next to each other in a row are one
 * span per key; else head by head, each head's keys in turn (consecutive keys share pages there). */
static inline void DC(touch_pages)(const char* base, const int64_t* off, int64_t n, int64_t hg, int64_t hs,
                                   int64_t D, int64_t es) {
  const int64_t runs = hs == D ? 1 : hg, len = (hs == D ? hg * D : D) * es;
  uintptr_t last = 0;
  for (int64_t h = 0; h < runs; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const uintptr_t x0 = (uintptr_t)(base + (off[i] + h * hs) * es);
      for (uintptr_t x = x0; x < x0 + (uintptr_t)len; x = (x & ~(uintptr_t)4095) + 4096)
        if (x >> 12 != last) {
          last = x >> 12;
          __builtin_prefetch((const void*)x, 0, 2);
        }
    }
}

/* Scratch of one thread: per row of a tile, the accumulators (dpad), scores (DC_CHUNK), m, l, the
 * ALiBi slope; per token, its key range.  For the tiled products (below): a chunk's K or V rows of
 * one head as float32 (kv, DC_CHUNK x dpad), the scores of one head's rows transposed (st, keys x
 * rows), the tile's query rows transposed, head by head (qt), and per row of a head the chunk's
 * visible keys [vlo, vhi) and key 0's distance from the row's query (d0). */
typedef struct DC(tile) {
  float *acc, *S, *m, *l, *slope, *mb; /* mb: a chunk's mask values (DC(mask_rows), DC(mask_tile)) */
  float* lb; /* with bfloat16 products: the sum of the weights as rounded for P V (DC(p_to_bf16)) */
  float *kv, *st, *qt, *vlo, *vhi, *d0;
  int64_t *tlo, *thi;
  uint16_t *kt, *vp; /* tiles (run->amx): 32 key rows (DC(amx_scores)), a chunk's value rows by pairs (DC(amx_pack_v)) */
} DC(tile);

/* ---- tiled products: tiles with many query rows per KV head --------------------------------
 *
 * With several query tokens (speculative decoding, chunked prefill) a tile holds Sq x G rows per
 * KV head, and the row-by-row dot products above (each a horizontal sum, each key row re-read and
 * re-converted per token) leave the FMA units mostly idle.  From DC_TILED_ROWS rows per head on, a
 * tile goes through the flash micro-kernel (cpu_tiles_impl.h) instead, chunk by chunk and head by
 * head, in flash's own orientation (query rows along the vector lanes):
 *   - the chunk's K rows are converted to float32 once (kv) and S^T = K Q^T (keys x rows, st) is
 *     SYM(scores_t) against the tile's query rows, transposed once per tile (qt): KC-wide blocked
 *     sums, as in flash;
 *   - the online softmax runs on st, VLEN rows per vector (DC(softmax_t)): no horizontal sums;
 *   - the chunk's V rows are converted once (kv) and O += P V is SYM(gemm) over all the head's
 *     rows (P^T read by row), the accumulators' running sum as in DC(pv).
 * The tile's rows are then head-major (row i of head h at h * rhp + i, rhp = the head's rows
 * padded to VLEN) rather than token-major.  Measured: docs/benchmarks.md, "Several query tokens". */
#define DC_TILED_ROWS AB_DECODE_TILED_ROWS

/* The D elements of a cache row as float32 at dst (ab_vec_load_row), zeros from D to the next
 * multiple of VLEN (O += P V reads whole vectors). */
static inline void DC(row_f32)(const void* base, int64_t off, int64_t D, const int dt, float* dst) {
  ab_vec_load_row(base, (ab_dtype)dt, off, D, 1, dst);
  for (int64_t d = D; d % VLEN; ++d) dst[d] = 0.0f;
}

/* The keys token t may see: [*lo, *hi), empty when lo >= hi.  t sits at position t + end - Sq. */
static inline void DC(token_keys)(const ab_kvcache_params* p, int64_t t, int64_t klo, int64_t end,
                                  int64_t* lo, int64_t* hi) {
  const int64_t ii = t + end - p->Sq;
  int64_t l = klo, h = end;
  if (p->causal && ii + 1 < h) h = ii + 1;
  if (p->window_right >= 0 && ii + p->window_right + 1 < h) h = ii + p->window_right + 1;
  if (p->window_left >= 0 && ii - p->window_left > l) l = ii - p->window_left;
  *lo = l;
  *hi = h;
}

/* The mask's values for token t's rows over a chunk's keys (key j on; lanes [a, e) read, the others
 * 0): row i (query head hq0 + i, i < nrows) at mb + i * DC_CHUNK, or row 0 alone when the mask is
 * the same for every head (head stride 0, as HF's (B, 1, Sq, Sk) masks); returns that row stride for
 * DC(softmax).  A bool mask gives 0 (seen) or -inf (hidden), a floating one its values. */
static int64_t DC(mask_rows)(const ab_kvcache_params* p, int64_t b, int64_t hq0, int64_t t, int64_t j, int64_t a,
                             int64_t e, int64_t nrows, float* mb) {
  const ab_tensor* mk = &p->mask;
  const int64_t ms3 = mk->strides[3], rows = mk->strides[1] ? nrows : 1;
  for (int64_t i = 0; i < rows; ++i) {
    float* row = mb + i * DC_CHUNK;
    const int64_t off = b * mk->strides[0] + (hq0 + i) * mk->strides[1] + t * mk->strides[2] + (j + a) * ms3;
    for (int64_t u = 0; u < a; ++u) row[u] = 0.0f;
    ab_vec_load_mask_row(mk->data, mk->dtype, off, e - a, ms3, row + a);
    for (int64_t u = e; u < DC_CHUNK; ++u) row[u] = 0.0f;
  }
  return mk->strides[1] ? DC_CHUNK : 0;
}

/* The rows of one token for one chunk: softcap, ALiBi, the mask (mb: DC(mask_rows), row i at
 * mb + i * mrs; NULL without one) and visibility on the raw scores St (rows of DC_CHUNK, keys [a, e)
 * of the chunk visible), then the online softmax, leaving P in St.
 * Rows go DC_SM_ROWS at a time (four on the AVX-512 path), branch-free over the group: their maxima and
 * their sums are reduced together (DC(rows4)), so the cross-lane steps of four rows overlap instead of making
 * one chain per row; the transforms (softcap, ALiBi, mask) go first, in place, only where there are any, so
 * the group's loop stays small enough to unroll into registers.  On a Zen 4 (2026-12-06, calls drawn at
 * random against the row-by-row loop), bfloat16 GQA decode from the L3 took 0.97-0.98x the time, from DRAM
 * 0.99-1.01x; float32 0.99-1.01x (docs/benchmarks.md, "The softmax four rows at a time").
 * With kq (run->softmax_keys; else NULL): the next chunk's key rows of the item's first nh heads (heads
 * hstep bytes apart), which step 3 then leaves out, asked for a few at a time between the rows, so that
 * the memory is not idle while the softmax computes. */
#define DC_SOFTMAX_KEYS_HEADS(hg) ((3 * (hg) + 7) / 8) /* 3 of 8 heads, at least 1: chosen by timing, decode_cpu.c */
#if VLEN == 16
#define DC_SM_ROWS 4
#else
#define DC_SM_ROWS 1
#endif
static inline void DC(softmax)(const DC(tile) * w, int64_t r0, int64_t nrows, float* St, int64_t a, int64_t e,
                               float cap, int alibi, float dist0, const vf* lanes, int64_t dpad, const float* mb,
                               int64_t mrs, int mbool, const DC(kpf) * kq, int64_t nh, int64_t hstep) {
  const vf lane0 = vset1((float)a), lane1 = vset1((float)e), ninf = vset1(-INFINITY);
  const int64_t nq = kq ? nh * kq->n : 0; /* key rows asked for here */
  if (cap > 0 || alibi || mb) /* the score's transforms, in place, so that the loop below stays small */
    for (int64_t i = 0; i < nrows; ++i)
      for (int v = 0; v < DC_NV; ++v) {
        vf x = vload(St + i * DC_CHUNK + v * VLEN);
        if (cap > 0) x = vset1(cap) * vtanh(x * vset1(1.0f / cap));
        if (alibi) {
          vf dist = vset1(dist0) + lanes[v];
          dist = vselect(dist < vset1(0.0f), -dist, dist);
          x -= vset1(w->slope[r0 + i]) * dist;
        }
        if (mb) { /* the mask, as flash applies it: a bool one hides the key, a float one is added */
          const vf mv = vload(mb + i * mrs + v * VLEN);
          x = mbool ? vselect(mv < vset1(0.0f), ninf, x) : x + mv;
        }
        vstore(St + i * DC_CHUNK + v * VLEN, x);
      }
  for (int64_t i0 = 0; i0 < nrows; i0 += DC_SM_ROWS) {
    const int n = nrows - i0 < DC_SM_ROWS ? (int)(nrows - i0) : DC_SM_ROWS;
    for (int64_t x = nq ? i0 * nq / nrows : 0; x < (nq ? (i0 + n) * nq / nrows : 0); ++x) { /* the rows' share */
      DC(kpf) kh = *kq;
      kh.base += x / kq->n * hstep;
      DC(kpf_key)(&kh, x % kq->n);
    }
    /* branch-free over the DC_SM_ROWS rows (past n: row 0 again, left out below) */
    vf xs[DC_SM_ROWS][DC_NV], mx[DC_SM_ROWS], sum[DC_SM_ROWS];
    int nan[DC_SM_ROWS];
    float cm[DC_SM_ROWS], sm[DC_SM_ROWS], m_new[DC_SM_ROWS];
#pragma GCC unroll 4
    for (int k = 0; k < DC_SM_ROWS; ++k) {
      const float* Sr = St + (i0 + (k < n ? k : 0)) * DC_CHUNK;
      vi nv = {0};
      mx[k] = ninf;
      for (int v = 0; v < DC_NV; ++v) {
        const vf x = vselect((lanes[v] >= lane0) & (lanes[v] < lane1), vload(Sr + v * VLEN), ninf);
        xs[k][v] = x;
        mx[k] = vmax(mx[k], x);
        nv |= x != x; /* a visible NaN score: the max above may drop it */
      }
      nan[k] = vany_lane(nv);
    }
#if DC_SM_ROWS == 4
    DC(rows4)((__m512)mx[0], (__m512)mx[1], (__m512)mx[2], (__m512)mx[3], 1, cm);
#else
    cm[0] = vmax_lanes(mx[0]);
#endif
    int live = 0; /* bit k: row k takes the softmax */
#pragma GCC unroll 4
    for (int k = 0; k < DC_SM_ROWS; ++k) {
      const int64_t r = r0 + i0 + (k < n ? k : 0);
      m_new[k] = cm[k] > w->m[r] ? cm[k] : w->m[r];
      /* not: a NaN score seen before (the row stays NaN; the end writes it so) or now, or nothing visible so
       * far (or -inf scores: weights 0) */
      live |= (k < n && w->l[r] == w->l[r] && !nan[k] && m_new[k] != -INFINITY) << k;
      const vf base = vset1(live >> k & 1 ? m_new[k] : 0.0f);
      sum[k] = vset1(0.0f);
      for (int v = 0; v < DC_NV; ++v) {
        const vf x = vexp_nonpos(xs[k][v] - base);
        if (k < n) vstore(St + (i0 + k) * DC_CHUNK + v * VLEN, x);
        sum[k] += x;
      }
    }
#if DC_SM_ROWS == 4
    DC(rows4)((__m512)sum[0], (__m512)sum[1], (__m512)sum[2], (__m512)sum[3], 0, sm);
#else
    sm[0] = vsum_lanes(sum[0]);
#endif
    for (int k = 0; k < n; ++k) {
      const int64_t r = r0 + i0 + k;
      float* Sr = St + (i0 + k) * DC_CHUNK;
      if (!(live >> k & 1)) {
        if (nan[k]) w->l[r] = __builtin_nanf(""); /* NaN in, NaN out, as the float64 reference does */
        memset(Sr, 0, DC_CHUNK * sizeof(float));
        continue;
      }
      const float m_old = w->m[r];
      const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new[k]);
      if (alpha != 1.0f) {
        float* acc = w->acc + r * dpad;
        for (int64_t d = 0; d < dpad; d += VLEN) vstore(acc + d, vload(acc + d) * vset1(alpha));
      }
      w->l[r] = w->l[r] * alpha + sm[k];
      w->lb[r] *= alpha; /* DC(p_to_bf16) adds the chunk's rounded weights */
      w->m[r] = m_new[k];
    }
  }
}

/* The online softmax of one head's rows over one chunk, on the transposed scores st (nk keys x rhp
 * rows, P left in place): softcap, ALiBi (slope and d0 per row), the mask (mbt: DC(mask_tile), key i of row r
 * at mbt[i * ms + r]; NULL without one) and visibility ([vlo, vhi) per row),
 * then per row the running max m, sum l (and lb, the sum of the rounded weights, where not NULL: tiles of
 * many rows) and the rescale of its accumulator row (rows < rh). */
static inline void DC(softmax_t)(float* st, int64_t nk, int64_t rhp, int64_t rh, float* m, float* l, float* lb,
                                 const float* slope, const float* vlo, const float* vhi, const float* d0, float cap,
                                 int alibi, float* acc, int64_t dpad, const float* mbt, int64_t ms, int mbool) {
  const vf ninf = vset1(-INFINITY), zero = vset1(0.0f), one = vset1(1.0f);
  for (int64_t v = 0; v < rhp; v += VLEN) {
    const vf lo = vload(vlo + v), hi = vload(vhi + v);
    vf mx = ninf;
    for (int64_t i = 0; i < nk; ++i) {
      vf x = vload(st + i * rhp + v);
      if (cap > 0) x = vset1(cap) * vtanh(x * vset1(1.0f / cap));
      const vf ki = vset1((float)i);
      if (alibi) {
        vf dist = vload(d0 + v) + ki;
        dist = vselect(dist < zero, -dist, dist);
        x -= vload(slope + v) * dist;
      }
      if (mbt) { /* the mask, as DC(softmax) applies it */
        const vf mv = vload(mbt + i * ms + v);
        x = mbool ? vselect(mv < zero, ninf, x) : x + mv;
      }
      x = vselect((ki >= lo) & (ki < hi), x, ninf);
      vstore(st + i * rhp + v, x);
      mx = vmax(mx, x);
    }
    const vf m_old = vload(m + v), m_new = vmax(m_old, mx);
    const vf base = vselect(m_new > ninf, m_new, zero); /* rows with nothing visible yet: weights 0 */
    vf sum = zero;
    for (int64_t i = 0; i < nk; ++i) {
      const vf e = vexp_nonpos(vload(st + i * rhp + v) - base);
      vstore(st + i * rhp + v, e);
      sum += e;
    }
    vf alpha = vselect(m_old > ninf, vexp_nonpos(m_old - base), zero);
    alpha = vselect(m_old == m_new, one, alpha);
    vstore(l + v, vload(l + v) * alpha + sum);
    if (lb) vstore(lb + v, vload(lb + v) * alpha);
    vstore(m + v, m_new);
    for (int u = 0; u < VLEN && v + u < rh; ++u) {
      const float a = alpha[u];
      if (a == 1.0f) continue;
      float* ar = acc + (v + u) * dpad;
      for (int64_t d = 0; d < dpad; d += VLEN) vstore(ar + d, vload(ar + d) * vset1(a));
    }
  }
}

/* The mask's values for a tiled tile's rows over keys [j, j + nk), transposed as softmax_t reads the
 * scores (key i of row r at mbt[i * rhp + r]): row r is token t0 + r / G of query head hq0 + r % G;
 * only the keys the row sees ([vlo, vhi), from j) are read, the rest and the pad rows are 0.  A bool
 * mask gives 0 or -inf, a floating one its values, as DC(mask_rows). */
static void DC(mask_tile)(const ab_kvcache_params* p, int64_t b, int64_t hq0, int64_t t0, int64_t G, int64_t j,
                          int64_t nk, int64_t rh, int64_t rhp, const float* vlo, const float* vhi, float* mbt) {
  const ab_tensor* mk = &p->mask;
  memset(mbt, 0, (size_t)(nk * rhp) * sizeof(float));
  float vals[DC_AMX_BLOCK * DC_CHUNK];
  for (int64_t r = 0; r < rh; ++r) {
    const int64_t lo = (int64_t)vlo[r], n = (int64_t)vhi[r] - lo;
    const int64_t off = b * mk->strides[0] + (hq0 + r % G) * mk->strides[1] + (t0 + r / G) * mk->strides[2] +
                        (j + lo) * mk->strides[3];
    ab_vec_load_mask_row(mk->data, mk->dtype, off, n, mk->strides[3], vals);
    for (int64_t i = 0; i < n; ++i) mbt[(lo + i) * rhp + r] = vals[i];
  }
}

/* The keys [j, je) each row of a tiled tile sees, from j (vlo, vhi: as floats for the softmax's lanes; pad rows
 * rh .. rhp none), and each row's key position minus query position at key j (d0, for ALiBi): row i is token
 * i / G from the tile's first, whose position is qpos0. */
static inline void DC(tiled_rows_seen)(const DC(tile) * w, int64_t rh, int64_t rhp, int64_t G, int64_t j,
                                       int64_t je, int64_t qpos0) {
  for (int64_t i = 0; i < rhp; ++i) { /* pad rows see nothing */
    int64_t lo = 0, hi = 0;
    w->d0[i] = 0.0f;
    if (i < rh) {
      const int64_t t = i / G; /* from t0 */
      lo = w->tlo[t] > j ? w->tlo[t] - j : 0;
      hi = (w->thi[t] < je ? w->thi[t] : je) - j;
      w->d0[i] = (float)(j - (qpos0 + t));
    }
    w->vlo[i] = (float)lo;
    w->vhi[i] = (float)(hi > lo ? hi : lo);
  }
}

/* Keys [j, je) of a tiled tile (tokens from t0 of batch row b, rh rows per head padded to rhp; K and V
 * rows of head h0 at ko, vo; the next chunk's nn keys at nko, nvo, asked for into L2 a chunk ahead),
 * head by head: S^T = K Q^T, the softmax (with the mask's tile, DC(mask_tile), where there is a
 * mask: built once for all heads when its head stride is 0), O += P V (above).  qpos0: the position
 * of the tile's first token. */
static inline __attribute__((always_inline)) void DC(tiled_chunk)(const ab_decode_run* run, const DC(tile) * w,
                                                                 int64_t rh, int64_t rhp, int64_t j, int64_t je,
                                                                 const int64_t* ko, const int64_t* vo,
                                                                 const int64_t* nko, const int64_t* nvo, int64_t nn,
                                                                 int64_t qpos0, const int dt, int64_t b, int64_t h0,
                                                                 int64_t t0) {
  const ab_kvcache_params* p = run->p;
  const int64_t D = p->D, G = run->G, dpad = run->dpad, nk = je - j, nvec = (D + VLEN - 1) / VLEN;
  const void *kb = p->k_cache.data, *vb = p->v_cache.data;
  const int64_t ks2 = p->k_cache.strides[2], vs2 = p->v_cache.strides[2], es = dt == AB_DTYPE_F32 ? 4 : 2;
  const int alibi = p->alibi_slopes.ndim > 0;
  DC(tiled_rows_seen)(w, rh, rhp, G, j, je, qpos0);
  const int masked = p->mask.ndim > 0, per_head = masked && p->mask.strides[1] != 0;
  if (masked && !per_head) DC(mask_tile)(p, b, h0 * G, t0, G, j, nk, rh, rhp, w->vlo, w->vhi, w->mb);
  for (int64_t h = 0; h < run->hg; ++h) {
    float* acc = w->acc + h * rhp * dpad;
    if (per_head) DC(mask_tile)(p, b, (h0 + h) * G, t0, G, j, nk, rh, rhp, w->vlo, w->vhi, w->mb);
    for (int64_t i = 0; i < nk; ++i) {
      DC(row_f32)(kb, ko[i] + h * ks2, D, dt, w->kv + i * dpad);
      if (i < nn) {
        SYM(pf_lines)((const char*)kb + (nko[i] + h * ks2) * es, D * es, 2);
        SYM(pf_lines)((const char*)vb + (nvo[i] + h * vs2) * es, D * es, 2);
      }
    }
    const float* qh = w->qt + h * dpad * rhp;
    SYM(scores_t)(nk, rhp / VLEN, D, w->kv, dpad, qh, rhp, w->st, rhp);
    DC(softmax_t)(w->st, nk, rhp, rh, w->m + h * rhp, w->l + h * rhp, NULL, w->slope + h * rhp, w->vlo, w->vhi,
                  w->d0, (float)p->softcap, alibi, acc, dpad, masked ? w->mb : NULL, rhp, p->mask.dtype == AB_DTYPE_BOOL);
    for (int64_t i = 0; i < nk; ++i) DC(row_f32)(vb, vo[i] + h * vs2, D, dt, w->kv + i * dpad);
    SYM(gemm)(rh, nvec, nk, w->st, 1, rhp, w->kv, dpad, acc, dpad, AB_ACC_RUN);
  }
}

#if DC_AMX
#if DC_AMX_BLOCK > 4
#error "DC(amx_pv_rows) holds at most 4 chunks' P in tiles"
#endif
/* Keys [klo, khi) of a tile of many rows on tiles ("tiles of many rows" above; rows as in DC(tiled_chunk): rh per
 * head padded to rhp, head h's query rows packed at qt + h * (D / 2) * rhp words), DC_AMX_BLOCK chunks at a time,
 * head by head: S^T = K Q^T chunk by chunk into one block of scores, the softmax over the block (with the mask's
 * tile where there is a mask), P rounded and transposed, O += P V with each accumulator block loaded and stored
 * once for the block's chunks.  qpos0: the position of the tile's first token. */
static void DC(amx_rows_keys)(const ab_decode_run* run, const DC(tile) * w, int64_t rh, int64_t rhp, int64_t klo,
                              int64_t khi, int64_t qpos0, int64_t b, int64_t h0, int64_t t0) {
  const ab_kvcache_params* p = run->p;
  const int64_t D = p->D, G = run->G, dpad = run->dpad, ks2 = p->k_cache.strides[2], vs2 = p->v_cache.strides[2];
  const uint16_t *kb = (const uint16_t*)p->k_cache.data, *vb = (const uint16_t*)p->v_cache.data;
  const int alibi = p->alibi_slopes.ndim > 0, masked = p->mask.ndim > 0, per_head = masked && p->mask.strides[1] != 0;
  int64_t ko[DC_AMX_BLOCK * DC_CHUNK], vo[DC_AMX_BLOCK * DC_CHUNK], nks[DC_AMX_BLOCK], kst[DC_AMX_BLOCK][2];
  for (int64_t j = klo, je; j < khi; j = je) {
    int nc = 0;
    for (je = j; nc < DC_AMX_BLOCK && je < khi; ++nc) {
      int64_t e;
      DC(chunk_at)(run, b, h0, je, khi, &e, ko + nc * DC_CHUNK, vo + nc * DC_CHUNK);
      nks[nc] = e - je;
      DC(amx_key_strides)(ko + nc * DC_CHUNK, nks[nc], kst[nc]);
      je = e;
    }
    const int64_t nk = je - j;
    DC(tiled_rows_seen)(w, rh, rhp, G, j, je, qpos0);
    if (masked && !per_head) DC(mask_tile)(p, b, h0 * G, t0, G, j, nk, rh, rhp, w->vlo, w->vhi, w->mb);
    for (int64_t h = 0; h < run->hg; ++h) {
      float* acc = w->acc + h * rhp * dpad;
      const uint32_t* qv = (const uint32_t*)w->qt + h * (D / 2) * rhp;
      if (per_head) DC(mask_tile)(p, b, (h0 + h) * G, t0, G, j, nk, rh, rhp, w->vlo, w->vhi, w->mb);
      for (int c = 0; c < nc; ++c)
        DC(amx_pack_v)(vb, vo + c * DC_CHUNK, h * vs2, nks[c], D, w->vp + c * 32 * D);
      /* 16 rows at a time: their scores, P and accumulators stay in L1 (the whole tile's, 256 rows x 128 keys,
       * went to L2 and back between the steps) */
      const uint16_t* base[DC_AMX_BLOCK][2];
      int64_t stride[DC_AMX_BLOCK][2];
      for (int c = 0; c < nc; ++c)
        DC(amx_key_tiles)(kb, ko + c * DC_CHUNK, kst[c], nks[c], h * ks2, D, w->kt + c * 32 * D, base[c], stride[c]);
      for (int64_t rb = 0; rb < rhp; rb += 16) {
        const int64_t live = rh - rb < 16 ? rh - rb : 16; /* rows of the block that are not padding */
        for (int c = 0; c < nc; ++c)
          DC(amx_scores16)(base[c], stride[c], nks[c], D, qv, rhp, rb, run->bf_scale, w->st + c * DC_CHUNK * 16);
        const int64_t r = h * rhp + rb;
        DC(softmax_t)(w->st, nk, 16, live, w->m + r, w->l + r, w->lb + r, w->slope + r, w->vlo + rb, w->vhi + rb,
                      w->d0 + rb, (float)p->softcap, alibi, acc + rb * dpad, dpad, masked ? w->mb + rb : NULL, rhp,
                      p->mask.dtype == AB_DTYPE_BOOL);
        DC(amx_p_rows)(w->st, nk, nc * DC_CHUNK, 16, (uint16_t*)w->S, w->lb + r);
        DC(amx_pv_rows)(acc + rb * dpad, dpad, 16, (const uint16_t*)w->S, nc, w->vp, D);
      }
    }
  }
}
#endif

/* Query tokens per tile of the run's work items of HG query heads (DC(item) and its scratch, DC(attend)). */
static inline int64_t DC(tile_tokens)(const ab_decode_run* run, int64_t HG) {
  return ab_decode_tile_tokens(HG, DC_AMX && run->amx_rows ? AB_DECODE_AMX_TILE_ROWS : AB_DECODE_TILE_ROWS);
}

#if VLEN == 16
/* ---- one-token MHA in runs of keys (run->mha_runs; the AVX-512 kernels) -----------------------
 *
 * MHA of one query token has one row per KV head, so the key-by-key steps above share nothing between a
 * key's heads, and each chunk of 32 keys costs every head a softmax, a rescale of its accumulators in L1 and
 * their loads and stores around each pair of value rows.  Here each head goes over a run of up to
 * DC_MR_KEYS keys of the item at a time instead (the row offsets found chunk by chunk, DC(chunk_at), so paged
 * and dense caches take the same sums):
 *   1. the head's q row in registers, sixteen keys' dot products at a time, their sums reduced together
 *      (DC(mr_sum16)) to one vector of sixteen scores; the key rows DC_MR_AHEAD keys on asked for into L1;
 *   2. softcap and ALiBi, then one online-softmax step for the run (its max, the weights, l and m);
 *   3. O += P V with the head's accumulators in registers, rescaled once per run; even and odd key pairs
 *      (keys) in their own accumulators, added at the end, so that the chains do not wait on the latency of
 *      the instruction before; with bfloat16 products the value rows DC_MR_VALUES_AHEAD keys on asked for
 *      into L1.
 * With bfloat16 products (BF) steps 1 and 3 take vdpbf16ps, the weights rounded to bfloat16 pairs as
 * DC(p_to_bf16) leaves them (lb their sum), two keys per instruction as DC(pvbf_rows), so the accumulators are
 * in its permuted column order; without them (float32, float16, and bfloat16 on CPUs without AVX512_BF16) the
 * products are float32 FMAs over the converted rows, the weights kept in float32.
 * Calls with a mask keep the chunk path, as does D > 128.  The sums go in another order than the chunk
 * path's: not its bits. */
#define DC_MR_KEYS (4 * DC_CHUNK)
/* step 1 asks for the key rows this many keys ahead into L1: 0.96-0.99x the time of 16 keys ahead (an Intel Xeon
 * with AMX, 2 threads, 2026-12-07, float32 and bfloat16 caches of 1.5-8 MiB); the value rows asked for in step 1 as well
 * took 1.01-1.09x */
#define DC_MR_AHEAD 32
/* with bfloat16 products, step 3 asks for the value rows this many keys ahead into L1: 0.88-0.95x the time with the
 * cache in the L3 (bfloat16 MHA of 3-4 MiB, 2 threads, 2026-12-07), 1.00x from the L2; 16 or 32 keys ahead
 * 0.95-0.98x; in float32 arithmetic 1.00-1.07x, so not there */
#define DC_MR_VALUES_AHEAD 8

/* 0, 1, .., 15 */
static inline __attribute__((always_inline)) vf DC(mr_lanes)(void) {
  return (vf)_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}

/* lane i: the sum of a[i]'s sixteen lanes */
static inline __attribute__((always_inline)) __m512 DC(mr_sum16)(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) /* per 128-bit lane: a[2i], a[2i+1], a[2i], a[2i+1] */
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) /* per 128-bit lane: a[4i] .. a[4i+3] */
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xee));
  for (int i = 0; i < 2; ++i) /* 128-bit lanes: c[2i] (0, 1 + 2, 3), c[2i+1] (the same) */
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

/* Step 1 of a run: the scores of n keys (K rows at kb + ko[i] + hk) against q (NB blocks of 32, zero past D),
 * times scale, to s[0 .. n rounded up to 16); past n, key n - 1's again. */
static inline __attribute__((always_inline)) void DC(mr_scores)(const int NB, const int tail, const uint16_t* q,
                                                               const uint16_t* kb, const int64_t* ko, int64_t hk,
                                                               int64_t n, __mmask32 mlast, float scale, float* s) {
  __m512i qv[4];
  for (int c = 0; c < NB; ++c) qv[c] = _mm512_loadu_si512((const void*)(q + c * 32));
  for (int64_t i = 0; i < n; i += 16) {
    __m512 a[16];
    for (int k = 0; k < 16; ++k) {
      const uint16_t* kr = kb + ko[i + k < n ? i + k : n - 1] + hk;
      if (i + DC_MR_AHEAD + k < n) SYM(pf_lines)((const char*)(kb + ko[i + DC_MR_AHEAD + k] + hk), NB * 64, 3);
      a[k] = _mm512_setzero_ps();
      for (int c = 0; c < NB; ++c)
        a[k] = DC(dpbf16)(a[k], qv[c], DC(ldbf)(kr + c * 32, tail && c == NB - 1 ? mlast : (__mmask32)~0u));
    }
    _mm512_storeu_ps(s + i, _mm512_mul_ps(DC(mr_sum16)(a), _mm512_set1_ps(scale)));
  }
}

/* Step 3 of a run: acc (NB blocks of 32, permuted) times alpha, plus the n keys' value rows (vb + vo[i] + hv)
 * weighted by the bfloat16 pairs Pw (pair i: keys 2i, 2i + 1; a last odd key's partner weighs 0).  Even and odd
 * pairs go to their own accumulators, added at the end: two chains per vector where one waits on vdpbf16ps's
 * latency. */
static inline __attribute__((always_inline)) void DC(mr_pv)(const int NB, const int tail, float* acc, float alpha,
                                                           const uint32_t* Pw, const uint16_t* vb, const int64_t* vo,
                                                           int64_t hv, int64_t n, __mmask32 mlast) {
  __m512 o[4][2], e[4][2];
  for (int c = 0; c < NB; ++c) {
    o[c][0] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 32), _mm512_set1_ps(alpha));
    o[c][1] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 32 + 16), _mm512_set1_ps(alpha));
    e[c][0] = e[c][1] = _mm512_setzero_ps();
  }
#define DC_MR_PAIR(acc_, j_)                                                                                   \
  do {                                                                                                         \
    if ((j_) + DC_MR_VALUES_AHEAD + 1 < n) {                                                                   \
      SYM(pf_lines)((const char*)(vb + vo[(j_) + DC_MR_VALUES_AHEAD] + hv), NB * 64, 3);                       \
      SYM(pf_lines)((const char*)(vb + vo[(j_) + DC_MR_VALUES_AHEAD + 1] + hv), NB * 64, 3);                   \
    }                                                                                                          \
    const __m512i pw = _mm512_set1_epi32((int)Pw[(j_) / 2]);                                                   \
    const uint16_t *v0 = vb + vo[j_] + hv, *v1 = vb + vo[(j_) + 1] + hv;                                       \
    for (int c = 0; c < NB; ++c) {                                                                             \
      const __mmask32 m = tail && c == NB - 1 ? mlast : (__mmask32)~0u;                                        \
      const __m512i x = DC(ldbf)(v0 + c * 32, m), y = DC(ldbf)(v1 + c * 32, m);                                \
      acc_[c][0] = DC(dpbf16)(acc_[c][0], _mm512_unpacklo_epi16(x, y), pw);                                    \
      acc_[c][1] = DC(dpbf16)(acc_[c][1], _mm512_unpackhi_epi16(x, y), pw);                                    \
    }                                                                                                          \
  } while (0)
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    DC_MR_PAIR(o, j);
    DC_MR_PAIR(e, j + 2);
  }
  if (j + 2 <= n) {
    DC_MR_PAIR(o, j);
    j += 2;
  }
#undef DC_MR_PAIR
  if (j < n) { /* the last odd key, its partner's weight 0 */
    const __m512i pw = _mm512_set1_epi32((int)Pw[j / 2]);
    const uint16_t* v0 = vb + vo[j] + hv;
    for (int c = 0; c < NB; ++c) {
      const __m512i x = DC(ldbf)(v0 + c * 32, c == NB - 1 ? mlast : (__mmask32)~0u), y = _mm512_setzero_si512();
      e[c][0] = DC(dpbf16)(e[c][0], _mm512_unpacklo_epi16(x, y), pw);
      e[c][1] = DC(dpbf16)(e[c][1], _mm512_unpackhi_epi16(x, y), pw);
    }
  }
  for (int c = 0; c < NB; ++c) {
    _mm512_storeu_ps(acc + c * 32, _mm512_add_ps(o[c][0], e[c][0]));
    _mm512_storeu_ps(acc + c * 32 + 16, _mm512_add_ps(o[c][1], e[c][1]));
  }
}


/* ---- the same without bfloat16 products: float32, float16 and bfloat16 caches in float32 arithmetic ---- */

/* 16 elements of the cache at base + off as float32 (DC(ld)); where !full only those of m's bits, zero past them */
static inline __attribute__((always_inline)) __m512 DC(mr_ld)(const void* base, int64_t off, const int dt,
                                                             const int full, __mmask16 m) {
  if (full) return (__m512)DC(ld)(base, off, dt);
  if (dt == AB_DTYPE_F32) return _mm512_maskz_loadu_ps(m, (const float*)base + off);
  const __m256i x = _mm256_maskz_loadu_epi16(m, (const uint16_t*)base + off);
  if (dt == AB_DTYPE_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  return _mm512_cvtph_ps(x);
}

/* Step 1 of a run in float32: the scores of n keys (K rows at kb + ko[i] + hk, dtype dt) against the float32 q
 * row (NV vectors, already scaled, zero past D) to s[0 .. n rounded up to 16); past n, key n - 1's again. */
static inline __attribute__((always_inline)) void DC(mr_scores_f)(const int NV, const int dt, const float* q,
                                                                 const void* kb, const int64_t* ko, int64_t hk,
                                                                 int64_t n, int tail, __mmask16 mlast, int64_t es,
                                                                 float* s) {
  __m512 qv[8];
  for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + c * 16);
  for (int64_t i = 0; i < n; i += 16) {
    __m512 a[16];
    for (int k = 0; k < 16; ++k) {
      const int64_t kr = ko[i + k < n ? i + k : n - 1] + hk;
      if (i + DC_MR_AHEAD + k < n) SYM(pf_lines)((const char*)kb + (ko[i + DC_MR_AHEAD + k] + hk) * es, NV * 16 * es, 3);
      a[k] = _mm512_mul_ps(qv[0], DC(mr_ld)(kb, kr, dt, NV > 1 || !tail, mlast));
      for (int c = 1; c < NV; ++c)
        a[k] = _mm512_fmadd_ps(qv[c], DC(mr_ld)(kb, kr + c * 16, dt, c < NV - 1 || !tail, mlast), a[k]);
    }
    _mm512_storeu_ps(s + i, DC(mr_sum16)(a));
  }
}

/* Step 3 of a run in float32: acc (NV vectors) times alpha, plus the n keys' value rows (vb + vo[i] + hv) weighted
 * by P; even and odd keys to their own accumulators, added at the end. */
static inline __attribute__((always_inline)) void DC(mr_pv_f)(const int NV, const int dt, float* acc, float alpha,
                                                             const float* P, const void* vb, const int64_t* vo,
                                                             int64_t hv, int64_t n, int tail, __mmask16 mlast) {
  __m512 o[8], e[8];
  for (int c = 0; c < NV; ++c) {
    o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), _mm512_set1_ps(alpha));
    e[c] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const __m512 p0 = _mm512_set1_ps(P[j]), p1 = _mm512_set1_ps(P[j + 1]);
    const int64_t v0 = vo[j] + hv, v1 = vo[j + 1] + hv;
    for (int c = 0; c < NV; ++c) {
      const int full = c < NV - 1 || !tail;
      o[c] = _mm512_fmadd_ps(p0, DC(mr_ld)(vb, v0 + c * 16, dt, full, mlast), o[c]);
      e[c] = _mm512_fmadd_ps(p1, DC(mr_ld)(vb, v1 + c * 16, dt, full, mlast), e[c]);
    }
  }
  if (j < n) {
    const __m512 p0 = _mm512_set1_ps(P[j]);
    for (int c = 0; c < NV; ++c)
      o[c] = _mm512_fmadd_ps(p0, DC(mr_ld)(vb, vo[j] + hv + c * 16, dt, c < NV - 1 || !tail, mlast), o[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + c * 16, _mm512_add_ps(o[c], e[c]));
}

/* One token's rows of the item's hg heads (G = 1) over keys [klo, khi) of row b, the query at position qpos:
 * the state (acc, m, l, lb) of row h in w, as DC(item) leaves it for its output.  BF: the bfloat16 products, NB
 * blocks of 32 a row (TAIL: the last one partial); else float32 arithmetic over a cache of dtype dt, NB vectors of
 * 16 a row. */
static inline __attribute__((always_inline)) void DC(mr_heads)(const int BF, const int NB, const int TAIL, const int dt,
                                                              const ab_decode_run* run, const DC(tile) * w, int64_t b,
                                                              int64_t h0, int64_t klo, int64_t khi, int64_t qpos) {
  const ab_kvcache_params* p = run->p;
  const int64_t D = p->D, dpad = run->dpad, hg = run->hg, ks2 = p->k_cache.strides[2], vs2 = p->v_cache.strides[2];
  const int64_t es = dt == AB_DTYPE_F32 ? 4 : 2;
  const void *kb = p->k_cache.data, *vb = p->v_cache.data;
  const __mmask32 mlast = D % 32 ? (__mmask32)((1u << (D % 32)) - 1) : (__mmask32)~0u;
  const __mmask16 mlast16 = D % 16 ? (__mmask16)((1u << (D % 16)) - 1) : (__mmask16)~0u;
  const float cap = (float)p->softcap;
  const int alibi = p->alibi_slopes.ndim > 0;
  int64_t ko[DC_MR_KEYS], vo[DC_MR_KEYS];
  float* s = w->S;                              /* DC_MR_KEYS scores (without BF: then the weights) */
  uint32_t* Pw = (uint32_t*)(w->S + DC_MR_KEYS); /* BF: DC_MR_KEYS / 2 pairs of weights */
  const vf lanes = DC(mr_lanes)();
  for (int64_t j = klo; j < khi;) {
    const int64_t je = j + DC_MR_KEYS < khi ? j + DC_MR_KEYS : khi, n = je - j, nv = (n + 15) / 16;
    for (int64_t x = j, xe; x < je; x = xe) DC(chunk_at)(run, b, h0, x, je, &xe, ko + (x - j), vo + (x - j));
    for (int64_t h = 0; h < hg; ++h) {
      if (w->l[h] != w->l[h]) continue; /* a NaN seen before: the row stays NaN */
      /* 1. scores */
      if (BF)
        DC(mr_scores)(NB, TAIL, run->qb + (b * p->Hq + h0 + h) * dpad, (const uint16_t*)kb, ko, h * ks2, n, mlast,
                      run->bf_scale, s);
      else
        DC(mr_scores_f)(NB, dt, run->qf + (b * p->Hq + h0 + h) * dpad, kb, ko, h * ks2, n, TAIL, mlast16, es, s);
      /* 2. the run's transforms, visibility (keys past n: -inf), max */
      vf mx = vset1(-INFINITY);
      vi nan = {0};
      for (int64_t v = 0; v < nv; ++v) {
        vf x = vload(s + v * 16);
        if (cap > 0) x = vset1(cap) * vtanh(x * vset1(1.0f / cap));
        if (alibi) {
          vf dist = lanes + vset1((float)(j + v * 16 - qpos));
          dist = vselect(dist < vset1(0.0f), -dist, dist);
          x -= vset1(w->slope[h]) * dist;
        }
        if (v == nv - 1) x = vselect(lanes < vset1((float)(n - v * 16)), x, vset1(-INFINITY));
        if (cap > 0 || alibi || v == nv - 1) vstore(s + v * 16, x);
        mx = vmax(mx, x);
        nan |= x != x;
      }
      if (vany_lane(nan)) { /* NaN in, NaN out, as the float64 reference does */
        w->l[h] = __builtin_nanf("");
        continue;
      }
      const float m_old = w->m[h], cm = vmax_lanes(mx), m_new = cm > m_old ? cm : m_old;
      if (m_new == -INFINITY) continue; /* nothing visible yet: weights 0 */
      const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
      __m512 sum = _mm512_setzero_ps(), sumb = sum;
      if (BF) /* the weights as bfloat16 pairs, as DC(p_to_bf16) leaves them, and their sum as rounded */
        for (int64_t v = 0; v < nv; v += 2) {
          const __m512 e0 = (__m512)vexp_nonpos(vload(s + v * 16) - vset1(m_new));
          const __m512 e1 =
              v + 1 < nv ? (__m512)vexp_nonpos(vload(s + v * 16 + 16) - vset1(m_new)) : _mm512_setzero_ps();
          sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
          sumb = _mm512_add_ps(sumb, DC(bf16_pairs)(e0, e1, Pw + v * 8));
        }
      else
        for (int64_t v = 0; v < nv; ++v) {
          const __m512 e0 = (__m512)vexp_nonpos(vload(s + v * 16) - vset1(m_new));
          _mm512_storeu_ps(s + v * 16, e0);
          sum = _mm512_add_ps(sum, e0);
        }
      w->l[h] = w->l[h] * alpha + _mm512_reduce_add_ps(sum);
      if (BF) w->lb[h] = w->lb[h] * alpha + _mm512_reduce_add_ps(sumb);
      w->m[h] = m_new;
      /* 3. O += P V */
      if (BF)
        DC(mr_pv)(NB, TAIL, w->acc + h * dpad, alpha, Pw, (const uint16_t*)vb, vo, h * vs2, n, mlast);
      else
        DC(mr_pv_f)(NB, dt, w->acc + h * dpad, alpha, s, vb, vo, h * vs2, n, TAIL, mlast16);
    }
    j = je;
  }
}

#define DC_MR_F(nv)                                                                  \
  case nv:                                                                           \
    if (dt == AB_DTYPE_F32)                                                          \
      DC(mr_heads)(0, nv, tail, AB_DTYPE_F32, run, w, b, h0, klo, khi, qpos);          \
    else if (dt == AB_DTYPE_BF16)                                                    \
      DC(mr_heads)(0, nv, tail, AB_DTYPE_BF16, run, w, b, h0, klo, khi, qpos);         \
    else                                                                             \
      DC(mr_heads)(0, nv, tail, AB_DTYPE_F16, run, w, b, h0, klo, khi, qpos);          \
    break;

/* DC(mr_heads) for the call's D and products (bf) over a cache of dtype dt */
static __attribute__((noinline)) void DC(mha_runs)(const ab_decode_run* run, const DC(tile) * w, int64_t b,
                                                   int64_t h0, int64_t klo, int64_t khi, int64_t qpos, const int dt,
                                                   const int bf) {
  const int64_t D = run->p->D;
  if (bf) {
    const int tail = D % 32 != 0;
    switch ((D + 31) / 32 * 2 + tail) {
      case 2: DC(mr_heads)(1, 1, 0, AB_DTYPE_BF16, run, w, b, h0, klo, khi, qpos); break;
      case 3: DC(mr_heads)(1, 1, 1, AB_DTYPE_BF16, run, w, b, h0, klo, khi, qpos); break;
      case 4: DC(mr_heads)(1, 2, 0, AB_DTYPE_BF16, run, w, b, h0, klo, khi, qpos); break;
      case 5: DC(mr_heads)(1, 2, 1, AB_DTYPE_BF16, run, w, b, h0, klo, khi, qpos); break;
      case 6: DC(mr_heads)(1, 3, 0, AB_DTYPE_BF16, run, w, b, h0, klo, khi, qpos); break;
      case 7: DC(mr_heads)(1, 3, 1, AB_DTYPE_BF16, run, w, b, h0, klo, khi, qpos); break;
      case 8: DC(mr_heads)(1, 4, 0, AB_DTYPE_BF16, run, w, b, h0, klo, khi, qpos); break;
      default: DC(mr_heads)(1, 4, 1, AB_DTYPE_BF16, run, w, b, h0, klo, khi, qpos); break;
    }
    return;
  }
  const int tail = D % 16 != 0;
  switch ((D + 15) / 16) {
    DC_MR_F(1)
    DC_MR_F(2)
    DC_MR_F(3)
    DC_MR_F(4)
    DC_MR_F(5)
    DC_MR_F(6)
    DC_MR_F(7)
    default:
    DC_MR_F(8)
  }
}
#undef DC_MR_F
#endif

/* One work item: batch row b, KV heads [h0, h0 + hg), split s; dt is the cache dtype and bf whether
 * the bfloat16 products run (constants at each call site, so the loads are specialized).  Rows of a
 * tile: r = (t - t0) * hg * G + (h - h0) * G + g. */
static inline __attribute__((always_inline)) void DC(item)(const ab_decode_run* run, int64_t b, int64_t h0,
                                                          int64_t s, const DC(tile) * w, const int dt,
                                                          const int bf) {
  const ab_kvcache_params* p = run->p;
  const int64_t Sq = p->Sq, D = p->D, G = run->G, hg = run->hg, dpad = run->dpad, HG = hg * G;
  const int64_t kv_lo = run->lo[b], kv_end = run->end[b];
  const ab_tensor *kc = &p->k_cache, *vc = &p->v_cache;
  const void *kb = kc->data, *vb = vc->data;
  const int64_t ks2 = kc->strides[2], vs2 = vc->strides[2];
  const size_t es = dt == AB_DTYPE_F32 ? 4 : 2;
  const float cap = (float)p->softcap;
  /* the value rows are asked for ahead unless the arithmetic per byte is low enough for the hardware
   * prefetchers to keep up: one query row per key (MHA) over a float32 cache, where asking only
   * crowds the fill buffers (measured, docs/benchmarks.md), except where run->values_ahead says
   * otherwise (AMD's AVX-512 CPUs, decode_cpu.c) */
  const int v_ahead = G > 1 || Sq > 1 || dt != AB_DTYPE_F32 || run->values_ahead;
  /* the next chunk's keys during step 3 (DC(kpf)) where step 3 is short against the bytes it waits
   * for: one query row per key over a 2-byte cache (bfloat16 MHA 13% faster on two cores; GQA, whose
   * step 3 has G rows of arithmetic per value row, ran 2-7% slower with it), and every cache where
   * run->keys_next says so (AMD's AVX-512 CPUs, decode_cpu.c) */
  const int k_next = (G == 1 && dt != AB_DTYPE_F32) || run->keys_next;
  const int alibi = p->alibi_slopes.ndim > 0;
  /* steps 1 and 3 on tiles ("Tiles" above; decode_cpu.c admits only one-token calls, so one tile of rows) */
  const int am = DC_AMX && bf && run->amx;
  /* every tile through the tiled products, both on tiles ("tiles of many rows" above) */
  const int amr = DC_AMX && bf && run->amx_rows;
  vf lanes[DC_NV]; /* the key index of each lane of a chunk's score vectors */
  for (int v = 0; v < DC_NV; ++v)
    for (int u = 0; u < VLEN; ++u) lanes[v][u] = (float)(v * VLEN + u);

  /* this split's share of the keys any token sees, cut at chunk multiples */
  int64_t ulo = kv_end, uhi = kv_lo;
  for (int64_t t = 0; t < Sq; ++t) {
    int64_t lo, hi;
    DC(token_keys)(p, t, kv_lo, kv_end, &lo, &hi);
    if (lo < hi) {
      ulo = lo < ulo ? lo : ulo;
      uhi = hi > uhi ? hi : uhi;
    }
  }
  const int64_t chunks = uhi > ulo ? (uhi - ulo + DC_CHUNK - 1) / DC_CHUNK : 0;
  int64_t ks = ulo + chunks * s / run->nsplit * DC_CHUNK, ke = ulo + chunks * (s + 1) / run->nsplit * DC_CHUNK;
  ke = ke < uhi ? ke : uhi;

  const int64_t tt = DC(tile_tokens)(run, HG);
  for (int64_t t0 = 0; t0 < Sq; t0 += tt) {
    const int64_t t1 = t0 + tt < Sq ? t0 + tt : Sq, nr = (t1 - t0) * HG;
    int64_t klo = ke, khi = ks;
    for (int64_t t = t0; t < t1; ++t) {
      int64_t lo, hi;
      DC(token_keys)(p, t, kv_lo, kv_end, &lo, &hi);
      lo = lo > ks ? lo : ks;
      hi = hi < ke ? hi : ke;
      w->tlo[t - t0] = lo;
      w->thi[t - t0] = hi;
      if (lo < hi) {
        klo = lo < klo ? lo : klo;
        khi = hi > khi ? hi : khi;
      }
    }
    /* the tiled products (above): rh rows per head, padded to rhp, head-major (row i of head h at
     * h * rhp + i); qt holds head h's rows as columns, qt[h * dpad * rhp + d * rhp + i] */
    const int64_t rh = (t1 - t0) * G, rpad = amr ? 16 : VLEN, rhp = (rh + rpad - 1) / rpad * rpad;
    const int tiled = amr || (!bf && rh >= DC_TILED_ROWS);
    /* step 3 by pairs (DC(ld_pair)) where run->pv_pairs says so: the accumulators by even and odd columns */
    const int eo = VLEN == 8 && dt == AB_DTYPE_BF16 && !bf && !tiled && D % 16 == 0 && run->pv_pairs;
    const int64_t nrows = tiled ? hg * rhp : nr; /* rows of state, pad rows included */
    memset(w->acc, 0, (size_t)(nrows * dpad) * sizeof(float));
#if DC_AMX
    if (am) /* each head's query rows as step 1's B tiles, head h's at qt + h * G * D / 2 words */
      for (int64_t h = 0; h < hg; ++h)
        DC(amx_q)(run->qb + ((b * Sq + t0) * p->Hq + (h0 + h) * G) * dpad, dpad, G, D,
                  (uint32_t*)w->qt + h * G * D / 2);
    if (amr) /* head h's rows as the B operands of S^T = K Q^T, at qt + h * (D / 2) * rhp words */
      for (int64_t h = 0; h < hg; ++h)
        DC(amx_qt)(run->qb + ((b * Sq + t0) * p->Hq + (h0 + h) * G) * dpad, p->Hq * dpad, dpad, G, rh, rhp, D,
                   (uint32_t*)w->qt + h * (D / 2) * rhp);
#endif
    if (tiled && !amr) {
      memset(w->qt, 0, (size_t)(hg * dpad * rhp) * sizeof(float));
      for (int64_t h = 0; h < hg; ++h)
        for (int64_t i = 0; i < rh; ++i) {
          const float* qr = run->qf + ((b * Sq + t0 + i / G) * p->Hq + (h0 + h) * G + i % G) * dpad;
          float* col = w->qt + h * dpad * rhp + i;
          for (int64_t d = 0; d < D; ++d) col[d * rhp] = qr[d];
        }
    }
    /* MHA tiles of four tokens or more (the row path's DC(token_scores)): the tile's query rows packed
     * head by head, block by block, for DC(dotp) in qt (unused by the row path otherwise): token t0 + i's
     * row of head h, elements [db * VLEN, db * VLEN + VLEN), at qt + ((h * nbk + db) * R + i) * VLEN */
    const int64_t nbk = (D + VLEN - 1) / VLEN, R = t1 - t0;
    if (!tiled && !bf && G == 1 && R >= 4)
      for (int64_t h = 0; h < hg; ++h)
        for (int64_t db = 0; db < nbk; ++db)
          for (int64_t i = 0; i < R; ++i)
            vstore(w->qt + ((h * nbk + db) * R + i) * VLEN,
                   vload(run->qf + ((b * Sq + t0 + i) * p->Hq + h0 + h) * dpad + db * VLEN));
    for (int64_t r = 0; r < nrows; ++r) {
      w->m[r] = -INFINITY;
      w->l[r] = 0.0f;
      w->lb[r] = 0.0f;
      if (alibi) {
        const ab_tensor* a = &p->alibi_slopes;
        const int64_t hq = h0 * G + (tiled ? r / rhp * G + r % rhp % G : r % HG);
        const float* sl = (const float*)a->data;
        w->slope[r] = a->ndim == 2 ? sl[b * a->strides[0] + hq * a->strides[1]] : sl[hq * a->strides[0]];
      }
    }

    /* the K and V row offsets of this chunk's keys [j, je), of the next chunk's [jn, nje) and, where
     * pages are touched ahead, of the one after [nje, fje): with run->pages_ahead, except in tiled
     * tiles, which wait on their arithmetic more than on memory (float32, 4-16 tokens against 16384
     * keys from DRAM: 1.02-1.04x the time with it; docs/benchmarks.md, "Pages ahead") */
    const int touch = run->pages_ahead && !tiled;
    int64_t offs[6][DC_CHUNK];
    int64_t *ko = offs[0], *vo = offs[1], *nko = offs[2], *nvo = offs[3], *fko = offs[4], *fvo = offs[5];
#if DC_AMX
    if (amr) { /* its own chunks, DC_AMX_BLOCK at a time */
      DC(amx_rows_keys)(run, w, rh, rhp, klo, khi, t0 + kv_end - Sq, b, h0, t0);
      klo = khi;
    }
#endif
#if VLEN == 16
    if (run->mha_runs) { /* one token, G = 1: the heads in runs of keys */
      DC(mha_runs)(run, w, b, h0, klo, khi, kv_end - 1, dt, bf);
      klo = khi;
    }
#endif
    int64_t je = klo;
    if (klo < khi) DC(chunk_at)(run, b, h0, klo, khi, &je, ko, vo);
    int64_t nje = je;
    if (je < khi) DC(chunk_at)(run, b, h0, je, khi, &nje, nko, nvo);
    for (int64_t j = klo; j < khi;) {
      /* the keys a few rows ahead and this chunk's values are asked for while the scores are
       * computed: one core's demand misses alone leave most of the memory bandwidth unused, and
       * a row of hg heads (hg * D elements every Hkv * D) is a pattern the hardware prefetchers
       * follow poorly when hg < Hkv; with pages_ahead, a line of each page of the chunk after next
       * first (DC(touch_pages)) */
      const int64_t nk = je - j, jn = je;
      int64_t fje = nje;
      if (touch && nje < khi) {
        DC(chunk_at)(run, b, h0, nje, khi, &fje, fko, fvo);
        DC(touch_pages)((const char*)kb, fko, fje - nje, hg, ks2, D, (int64_t)es);
        DC(touch_pages)((const char*)vb, fvo, fje - nje, hg, vs2, D, (int64_t)es);
      }

      if (tiled) {
        DC(tiled_chunk)(run, w, rh, rhp, j, je, ko, vo, nko, nvo, nje - jn, t0 + kv_end - Sq, dt, b, h0, t0);
      } else {
        /* 1. scores, key by key so the cache is read in its own order; rows of a token that sees no
         * key of the chunk get P = 0 */
        int64_t ta = t1, tb = t0; /* tokens that see a key of the chunk */
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t a = w->tlo[t - t0] > j ? w->tlo[t - t0] : j;
          const int64_t e = w->thi[t - t0] < je ? w->thi[t - t0] : je;
          if (a >= e) {
            memset(w->S + (t - t0) * HG * DC_CHUNK, 0, (size_t)(HG * DC_CHUNK) * sizeof(float));
            continue;
          }
          ta = t < ta ? t : ta;
          tb = t + 1;
        }
        /* MHA with four tokens or more that all see a key of the chunk: each head's tokens share its key
         * rows in step 1 (DC(token_scores): up to eight tokens' dot products per load of a key row, the
         * rows packed above, where one token's four heads each load their own) and its value rows in
         * step 3 (DC(pv) across tokens), instead of one token at a time.  Scores of keys a token does not
         * see are computed too and hidden by step 2.  On the avx2 path (AMD EPYC, Zen 3, 2 threads;
         * docs/benchmarks.md, "MHA with several tokens") 1.16-1.35x faster at 4 and 8 tokens, and the
         * packed rows 1.04-1.47x more; at 2 and 3 tokens even or slower, so those keep the heads'
         * grouping. */
        int mha_tokens = G == 1 && !bf && tb - ta >= 4;
        for (int64_t t = ta; t < tb && mha_tokens; ++t)
          mha_tokens = (w->tlo[t - t0] > j ? w->tlo[t - t0] : j) < (w->thi[t - t0] < je ? w->thi[t - t0] : je);
#if DC_AMX
        /* step 1 on tiles, head by head; whether each 16 keys' rows are one stride apart is the same for
         * every head, so it is found once per chunk.  No requests ahead: each one tried made the tiles
         * slower from DRAM (docs/decode.md, "Tiles") */
        if (am && tb > ta) {
          int64_t kst[2];
          DC(amx_key_strides)(ko, nk, kst);
          for (int64_t h = 0; h < hg; ++h)
            DC(amx_scores)((const uint16_t*)kb, ko, kst, nk, h * ks2, D, G, (const uint32_t*)w->qt + h * G * D / 2,
                           run->bf_scale, w->S + h * G * DC_CHUNK, w->kt, w->st);
        }
#endif
#if DC_BF16
        /* step 1 head by head (DC(head_scores_bf)) where run->scores_by_head says so: in a paged cache block
         * by block of the chunk, as step 3 (DC(block_end)); then token by token, each head's rows over the
         * keys it sees; the prefetches of step 1 go with the token's first pass over each head, for the keys
         * no earlier token of the tile saw; K row offsets two keys into the next chunk for them (kao) */
        const int by_head = bf && !am && run->scores_by_head && G % 4 == 0 && D <= 128;
        if (by_head) {
          int64_t kao[DC_CHUNK + DC_KEYS_AHEAD], nka = nk;
          memcpy(kao, ko, (size_t)nk * sizeof(int64_t));
          for (int64_t i = 0; i < DC_KEYS_AHEAD && i < nje - jn; ++i) kao[nka++] = nko[i];
          const char* vp = v_ahead ? (const char*)vb : NULL;
          for (int64_t j0 = 0, j1; j0 < nk; j0 = j1) {
            j1 = DC(block_end)(run, j, j0, nk);
            int64_t pa = 0, pe = 0; /* the keys of the run asked for so far, as one range */
            for (int64_t t = ta; t < tb; ++t) {
              int64_t a = (w->tlo[t - t0] > j ? w->tlo[t - t0] : j) - j;
              int64_t e = (w->thi[t - t0] < je ? w->thi[t - t0] : je) - j;
              a = a > j0 ? a : j0;
              e = e < j1 ? e : j1;
              if (a >= e) continue;
              for (int64_t h = 0; h < hg; ++h) {
                const uint16_t* qh = run->qb + ((b * Sq + t) * p->Hq + (h0 + h) * G) * dpad;
                float* sh = w->S + ((t - t0) * HG + h * G) * DC_CHUNK;
#define DC_HEAD_SCORES(n)                                                                                      \
  DC(head_scores_bf)(n, qh, dpad, G, (const uint16_t*)kb, ko, h * ks2, a, e, D, run->bf_scale, sh, vp, vo, \
                     h * vs2, run->keys_ahead ? (const char*)kb : NULL, kao, nka, pa, pe, (int64_t)es)
                switch ((D + 31) / 32) {
                  case 4: DC_HEAD_SCORES(4); break;
                  case 3: DC_HEAD_SCORES(3); break;
                  case 2: DC_HEAD_SCORES(2); break;
                  default: DC_HEAD_SCORES(1); break;
                }
#undef DC_HEAD_SCORES
              }
              pa = pe > pa ? (a < pa ? a : pa) : a;
              pe = e > pe ? e : pe;
            }
          }
        }
#else
        const int by_head = 0;
#endif
        /* the prefetches that go with key jj: one row at a time, between the dot products, so the loads
         * overlap the arithmetic */
#define DC_KEY_PF(f, jj)                                                                                   \
  DC(pf) f = {NULL, v_ahead ? (const char*)vb + vo[(jj) - j] * (int64_t)es : NULL, ks2 * (int64_t)es,       \
              vs2 * (int64_t)es, D * (int64_t)es};                                                         \
  if (run->keys_ahead && (jj) + DC_KEYS_AHEAD < je)                                                        \
    f.k = (const char*)kb + ko[(jj) + DC_KEYS_AHEAD - j] * (int64_t)es;                                     \
  else if (run->keys_ahead && (jj) + DC_KEYS_AHEAD - je < nje - jn)                                         \
    f.k = (const char*)kb + nko[(jj) + DC_KEYS_AHEAD - je] * (int64_t)es;
#ifdef DC_NK
        /* DC_NK keys at a time (DC(key_group_scores)) where each token sees all of them or none */
        const int four_keys = run->four_keys && !bf && !mha_tokens && (G == 1 || G % 4 == 0);
#endif
        for (int64_t jj = j; jj < je && !by_head && !am; ++jj) {
#ifdef DC_NK
          int four = four_keys && (jj - j) % DC_NK == 0 && jj + DC_NK <= je;
          for (int64_t t = ta; t < tb && four; ++t)
            four = jj >= w->thi[t - t0] || jj + DC_NK <= w->tlo[t - t0] ||
                   (jj >= w->tlo[t - t0] && jj + DC_NK <= w->thi[t - t0]);
          if (four) {
            DC(pf) fk[DC_NK];
            for (int k = 0; k < DC_NK; ++k) {
              DC_KEY_PF(f, jj + k)
              fk[k] = f;
            }
            const DC(pf)* fp = fk; /* with the first token that reads the keys */
            for (int64_t t = ta; t < tb; ++t) {
              if (jj >= w->thi[t - t0] || jj + DC_NK <= w->tlo[t - t0]) continue;
              DC(key_group_scores)(run->qf + ((b * Sq + t) * p->Hq + h0 * G) * dpad, dpad, hg, G, kb, ko + (jj - j),
                                   ks2, D, dt, w->S + (t - t0) * HG * DC_CHUNK + (jj - j), fp);
              fp = NULL;
            }
            jj += DC_NK - 1;
            continue;
          }
#endif
          DC_KEY_PF(f, jj)
#undef DC_KEY_PF
          const DC(pf)* fp = &f; /* with the first token that reads the key */
          if (mha_tokens) {
            DC(token_scores)(w->qt + (ta - t0) * VLEN, nbk * R * VLEN, R * VLEN, tb - ta, hg, kb, ko[jj - j], ks2, D,
                             dt, w->S + (ta - t0) * HG * DC_CHUNK + (jj - j), HG * DC_CHUNK, fp);
            continue;
          }
          for (int64_t t = ta; t < tb; ++t) {
            if (jj < w->tlo[t - t0] || jj >= w->thi[t - t0]) continue;
#if DC_BF16
            if (bf) {
              DC(key_scores_bf)(run->qb + ((b * Sq + t) * p->Hq + h0 * G) * dpad, dpad, hg, G, (const uint16_t*)kb,
                                ko[jj - j], ks2, D, run->bf_scale, w->S + (t - t0) * HG * DC_CHUNK + (jj - j), fp);
              fp = NULL;
              continue;
            }
#endif
            DC(key_scores_out)(run->qf + ((b * Sq + t) * p->Hq + h0 * G) * dpad, dpad, hg, G, kb, ko[jj - j],
                               ks2, D, dt, w->S + (t - t0) * HG * DC_CHUNK + (jj - j), fp);
            fp = NULL;
          }
        }

        /* 2. softcap, ALiBi, visibility and the online softmax, per token; with run->softmax_keys (bfloat16
         * products) in GQA, the first token's rows ask for the next chunk's key rows of the first sh heads,
         * which step 3 leaves out */
        const DC(kpf) kp = {(const char*)kb, nko, k_next && !am ? nje - jn : 0, D * (int64_t)es, (int64_t)es};
        const int64_t sh = run->softmax_keys && G > 1 && kp.n > 0 ? DC_SOFTMAX_KEYS_HEADS(hg) : 0;
        for (int64_t t = ta; t < tb; ++t) {
          const int64_t a = w->tlo[t - t0] > j ? w->tlo[t - t0] : j;
          const int64_t e = w->thi[t - t0] < je ? w->thi[t - t0] : je;
          if (a >= e) continue;
          const float dist0 = (float)(j - (t + kv_end - Sq)); /* key position - query position, lane 0 */
          const int64_t mrs = p->mask.ndim ? DC(mask_rows)(p, b, h0 * G, t, j, a - j, e - j, HG, w->mb) : 0;
          DC(softmax)(w, (t - t0) * HG, HG, w->S + (t - t0) * HG * DC_CHUNK, a - j, e - j, cap, alibi, dist0, lanes,
                      dpad, p->mask.ndim ? w->mb : NULL, mrs, p->mask.dtype == AB_DTYPE_BOOL,
                      sh && t == ta ? &kp : NULL, sh, ks2 * (int64_t)es);
        }

        /* 3. O += P V, head by head, for the tokens that saw a key (a paged cache's chunk block by
         * block, DC(block_end)); meanwhile the next chunk's key rows of each head (DC(kpf)) */
#if DC_BF16 || DC_AMX
        if (bf && tb > ta) DC(p_to_bf16)(w->S + (ta - t0) * HG * DC_CHUNK, (tb - ta) * HG, w->lb + (ta - t0) * HG);
#endif
#if DC_AMX
        if (am && tb > ta)
          for (int64_t h = 0; h < hg; ++h) {
            DC(amx_pack_v)((const uint16_t*)vb, vo, h * vs2, nk, D, w->vp);
            DC(amx_pv)(w->acc + h * G * dpad, dpad, w->S + h * G * DC_CHUNK, w->vp, D);
          }
#endif
        DC(kpf) kt = kp;
        for (int64_t h = 0; h < hg && !bf && mha_tokens; ++h, kt.base += ks2 * (int64_t)es) {
          const int64_t r = (ta - t0) * HG + h; /* token ta's row of head h; token t + 1's is HG rows on */
          DC(pv)(w->acc + r * dpad, tb - ta, HG * dpad, w->S + r * DC_CHUNK, HG * DC_CHUNK, vb, vo, h * vs2, nk, D, dt,
                 &kt, run->pv_wide, eo);
        }
        /* MHA, one token saw the chunk: key by key where run->pv_keys says so */
        const int by_keys = run->pv_keys && G == 1 && !mha_tokens && tb - ta == 1 && !eo;
        for (int64_t j0 = 0, j1; j0 < nk && !mha_tokens && !am; j0 = j1) { /* mha_tokens is never set with bf */
          j1 = DC(block_end)(run, j, j0, nk);
          DC(kpf) kq = DC(kpf_run)(kp, j0, j1);
          if (by_keys) {
            const int64_t r = (ta - t0) * HG;
#if DC_BF16
            if (bf) { /* P in bfloat16 pairs: key j0's pair j0 / 2 floats on (j0 is even) */
              DC(pv_keys_bf)(w->acc + r * dpad, hg, dpad, w->S + r * DC_CHUNK + j0 / 2, (const uint16_t*)vb, vo + j0,
                             vs2, j1 - j0, D, &kq, ks2 * (int64_t)es);
              continue;
            }
#endif
            DC(pv_keys)(w->acc + r * dpad, hg, dpad, w->S + r * DC_CHUNK + j0, vb, vo + j0, vs2, j1 - j0, D, dt, &kq,
                        ks2 * (int64_t)es);
            continue;
          }
          for (int64_t h = 0; h < hg; ++h, kq.base += ks2 * (int64_t)es)
            for (int64_t t = ta; t < tb; ++t) {
              const int64_t r = (t - t0) * HG + h * G;
              const DC(kpf)* kr = t == ta && h >= sh ? &kq : NULL; /* heads < sh: asked for in step 2 */
#if DC_BF16
              if (bf) { /* P in bfloat16 pairs (DC(p_to_bf16)): key j0's pair j0 / 2 floats on (j0 is even) */
                DC(pv_bf)(w->acc + r * dpad, G, dpad, w->S + r * DC_CHUNK + j0 / 2, (const uint16_t*)vb, vo + j0,
                          h * vs2, j1 - j0, D, kr);
                continue;
              }
#endif
              DC(pv)(w->acc + r * dpad, G, dpad, w->S + r * DC_CHUNK + j0, DC_CHUNK, vb, vo + j0, h * vs2, j1 - j0,
                     D, dt, kr, run->pv_wide, eo);
            }
        }
      }
      /* the next chunk becomes this one, and the one after (found above, or found now) the next */
      int64_t *x = ko, *y = vo;
      ko = nko;
      vo = nvo;
      nko = fko;
      nvo = fvo;
      fko = x;
      fvo = y;
      j = jn;
      je = nje;
      if (!(touch && je < khi)) {
        fje = je;
        if (je < khi) DC(chunk_at)(run, b, h0, je, khi, &fje, nko, nvo);
      }
      nje = fje;
    }

    /* this tile's rows: normalized output and lse, to the output or to this split's partials */
    for (int64_t i = 0; i < nr; ++i) {
      /* row i of the tile (token-major); r: its state (head-major in a tiled tile) */
      const int64_t t = t0 + i / HG, hq = h0 * G + i % HG;
      const int64_t r = tiled ? i % HG / G * rhp + (t - t0) * G + i % G : i;
      float* acc = w->acc + r * dpad;
      const float l = w->l[r];
      /* a row that saw a NaN score (l NaN) writes NaN, out and lse; one that saw no key, 0 and -inf; with
       * bfloat16 products the weights are those P V applied, rounded (DC(p_to_bf16)) */
      const float ln = bf && w->lb[r] > 0.0f ? w->lb[r] : l;
      const float inv = l != l ? l : ln > 0.0f ? 1.0f / ln : 0.0f;
      for (int64_t d = 0; d < dpad; d += VLEN) vstore(acc + d, vload(acc + d) * vset1(inv));
#if DC_BF16 || DC_AMX
      if (bf) DC(bf_unpermute)(acc, dpad);
#endif
#if VLEN == 8
      if (eo) DC(eo_unpermute)(acc, D);
#endif
      float lse = l != l ? l : l > 0.0f ? w->m[r] + logf(l) : -INFINITY;
      if (run->nsplit == 1) {
        float factor; /* the sink joins once the row is complete: here, or after the merge of the splits */
        lse = ab_decode_add_sink(lse, run->sink[hq], &factor);
        if (factor != 1.0f)
          for (int64_t d = 0; d < dpad; d += VLEN) vstore(acc + d, vload(acc + d) * vset1(factor));
        const ab_tensor* o = &p->out;
        ab_vec_store_row(o->data, o->dtype, ab_off4(o, b, t, hq, 0), D, o->strides[3], acc);
        ((float*)p->lse.data)[ab_off3(&p->lse, b, hq, t)] = lse;
      } else {
        float* part = run->part + (((b * run->nsplit + s) * Sq + t) * p->Hq + hq) * (dpad + 16);
        memcpy(part, acc, (size_t)D * sizeof(float));
        part[dpad] = lse;
        part[dpad + 1] = w->m[r]; /* the merge weighs the splits by l exp(m - max m): decode_cpu.c merge */
        part[dpad + 2] = l;
      }
    }
  }
}

static void DC(attend)(int64_t begin, int64_t end, void* ctx) {
  const ab_decode_run* run = (const ab_decode_run*)ctx;
  const ab_kvcache_params* p = run->p;
  const int64_t HG = run->hg * run->G, dpad = run->dpad;
  const int64_t tokens = DC(tile_tokens)(run, HG), rows = tokens * HG;
  /* rows of state with each head's padded to VLEN, or 16 on tiles (tiled); pr: one head's padded rows at most */
  const int64_t prows = rows + run->hg * 16, pr = rows + 16;
  /* keys of scores at a time: a chunk, or DC_AMX_BLOCK chunks on tiles of many rows */
  const int64_t kc = DC_AMX && run->amx_rows ? DC_AMX_BLOCK * DC_CHUNK : DC_CHUNK;
  /* kt, vp: 16 dpad floats each, both DC_AMX_BLOCK times that on tiles of many rows */
  const size_t tile_floats = DC_AMX && run->amx_rows ? (size_t)(32 * DC_AMX_BLOCK * dpad)
                             : DC_AMX && run->amx    ? (size_t)(32 * dpad)
                                                     : 0;
  const size_t floats = (size_t)(prows * (dpad + 4) + pr * kc + DC_CHUNK * dpad + 2 * kc * pr + dpad * prows +
                                 3 * pr) + tile_floats;
  char* buf = (char*)ab_scratch_alloc(floats * sizeof(float) + 2 * (size_t)tokens * sizeof(int64_t) + 64);
  if (!buf) {
    ab_par_fail(run->st, AB_ERR_NOMEM, "out of memory for the decode kernel's scratch");
    return;
  }
  DC(tile) w;
  w.acc = (float*)buf;
  w.S = w.acc + prows * dpad;
  w.m = w.S + pr * kc;
  w.l = w.m + prows;
  w.slope = w.l + prows;
  w.lb = w.slope + prows;
  w.kv = w.lb + prows;
  w.st = w.kv + DC_CHUNK * dpad;
  w.qt = w.st + kc * pr;
  w.vlo = w.qt + dpad * prows;
  w.vhi = w.vlo + pr;
  w.d0 = w.vhi + pr;
  w.mb = w.d0 + pr;
  w.kt = (uint16_t*)(w.mb + kc * pr);
  w.vp = w.kt + (DC_AMX && run->amx_rows ? DC_AMX_BLOCK : 1) * 32 * dpad;
  w.tlo = (int64_t*)(buf + ((floats * sizeof(float) + 63) & ~(size_t)63));
  w.thi = w.tlo + tokens;
  const int64_t groups = p->Hkv / run->hg;
#if DC_AMX
  if (run->amx) DC(amx_config)(run->G); /* this thread's tiles, for its share of the items */
  if (run->amx_rows) DC(amx_rows_config)();
#endif
  for (int64_t it = begin; it < end; ++it) {
    const int64_t s = it % run->nsplit, bg = it / run->nsplit;
    const int64_t b = bg / groups, h0 = bg % groups * run->hg;
    switch (run->kv_dtype) {
      case AB_DTYPE_F32: DC(item)(run, b, h0, s, &w, AB_DTYPE_F32, 0); break;
      case AB_DTYPE_BF16:
#if DC_BF16 || DC_AMX
        if (run->bf16_dot) {
          DC(item)(run, b, h0, s, &w, AB_DTYPE_BF16, 1);
          break;
        }
#endif
        DC(item)(run, b, h0, s, &w, AB_DTYPE_BF16, 0);
        break;
      default: DC(item)(run, b, h0, s, &w, AB_DTYPE_F16, 0); break;
    }
  }
#if DC_AMX
  if (run->amx || run->amx_rows) AMX_RELEASE();
#endif
  ab_scratch_free(buf);
}

const ab_decode_cpu_table DC(ab_decode_cpu) = {AB_ISA_NAME, DC(attend), DC(q_bf16), DC_AMX, VLEN == 16};
