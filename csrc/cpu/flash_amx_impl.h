/* flash_amx_impl.h -- the CPU flash kernel on AMX tiles: bfloat16 (and float16 on AMX-FP16)
 * forward, bfloat16 backward; one source for the real and the emulated build.
 *
 * Included by flash_cpu_amx.c (real tiles, AVX-512 vectors) and flash_cpu_amx_emu.c (emulated
 * tiles, the generic build's vectors), each after flash_cpu_impl.h, whose pieces it reuses: the
 * per-sequence geometry (seq_get, row_range, chunk_begin), the masking (mask_scores), the dropout
 * stream (drop_factors), the output rows (store_rows), and the whole vector kernel for the dtypes
 * this file does not put on tiles.  AB_AMX_SFX names what this file exports; docs/amx.md has the
 * design, with the reasons for the layouts below.
 *
 * Scores keep the vector kernel's transposed layout, St[j][r] for key j and query row r of a
 * chunk of AMX_RC = 32 rows, so its masking and dropout pieces apply unchanged.  Every product is
 * one shape on tiles, C (M x N float32) += A (M x K, 16-bit pairs along K) . B (K/2 pairs x N,
 * VNNI-2), with all 8 tiles configured 16 rows x 64 bytes (C: tiles 0-3, a 32 x 32 block; A: 4-5;
 * B: 6-7):
 *   S^T   = K Q^T      A = K rows as they are (pairs of head dims), B = Q^T packed per chunk;
 *   O^T  += V^T P^T    A = V^T with pairs of keys, packed once per key panel of AMX_NP keys,
 *                      B = P^T with pairs of keys: two rows of St rounded into one row of words;
 * so O is kept transposed too (the online softmax rescales it with the rows along the vector
 * lanes) and transposed once, at the end of the chunk.  K and V are packed once per (batch, KV
 * head) before the chunks run, and shared by the query heads of a GQA group.  A chunk's panel
 * scores (32 x 256 float32: 32 KiB) stay in L1/L2 between the tile products and the softmax; the
 * products of panel t + 1 are issued before the softmax of panel t, so the tile unit can work
 * while the vector units do the exponentials.
 *
 * The backward (bfloat16), per (batch, KV head) as the vector backward, in key blocks of AMX_BKB:
 *   S^T = K Q^T, dP^T = V dO^T, then (vectors) P, dS; then on tiles
 *   dV += P^T dO (A = P^T rounded, pairs of rows; B = dO packed with pairs of rows),
 *   dK += dS^T Q (likewise), dQ^T += K^T dS^T (A = K^T with pairs of keys; B = dS^T pairs of keys).
 * Each item owns its dK, dV and dQ rows: no atomics, bitwise the same result on every run.
 *
 * Precision: products of 16-bit floats are exact in float32 and summed in float32 on the tiles;
 * softmax in float32 with a base-2 exponential; P (and dS) are rounded to the input's 16-bit type
 * before their products, as every tensor-core flash kernel does; lse and the row sums use P
 * before rounding.
 *
 * Tiles are configured at the start of each worker's range (the configuration is per thread) and
 * released at its end.
 */

#include "ab_amx.h"

#define AMXS(name) AB_CAT(name, AB_AMX_SFX)

#define AMX_RC 32   /* query rows per chunk: two C tiles */
#define AMX_NP 256  /* keys per forward panel: St 32 KiB, V^T panel 256 x Dv x 2 bytes */
#define AMX_BKB 64  /* keys per backward block */
#define AMX_NVR (AMX_RC / VLEN)

enum { AMX_BF16 = 0, AMX_FP16 = 1 };

static inline int64_t AMXS(up)(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* ---- products on tiles -------------------------------------------------------------------------- */

/* C (M x N words: float32 or int32, row stride ldc bytes) (+)= A (M rows of Kw 32-bit words, stride
 * lda bytes) . B (Kw rows of N words, stride ldb bytes), in blocks of 32 x 32: two A tiles, two B
 * tiles, four C tiles.  M, N and Kw are multiples of 32, 32 and 16: every operand is padded so. */
#define AB_AMX_GEMM(NAME, DP)                                                                           \
  static void NAME(int64_t M, int64_t N, int64_t Kw, const void* A, int64_t lda, const void* B, int64_t ldb, \
                   void* C, int64_t ldc, int acc) {                                                     \
    for (int64_t m0 = 0; m0 < M; m0 += 32)                                                              \
      for (int64_t n0 = 0; n0 < N; n0 += 32) {                                                          \
        char* c0 = (char*)C + m0 * ldc + n0 * 4;                                                        \
        char* c1 = c0 + 16 * ldc;                                                                       \
        if (acc) {                                                                                      \
          AMX_LOAD(0, c0, ldc);                                                                         \
          AMX_LOAD(1, c0 + 64, ldc);                                                                    \
          AMX_LOAD(2, c1, ldc);                                                                         \
          AMX_LOAD(3, c1 + 64, ldc);                                                                    \
        } else {                                                                                        \
          AMX_ZERO(0);                                                                                  \
          AMX_ZERO(1);                                                                                  \
          AMX_ZERO(2);                                                                                  \
          AMX_ZERO(3);                                                                                  \
        }                                                                                               \
        const char* a0 = (const char*)A + m0 * lda;                                                     \
        const char* b0 = (const char*)B + n0 * 4;                                                       \
        for (int64_t k0 = 0; k0 < Kw; k0 += 16) {                                                       \
          AMX_LOAD(4, a0 + k0 * 4, lda);                                                                \
          AMX_LOAD(5, a0 + 16 * lda + k0 * 4, lda);                                                     \
          AMX_LOAD(6, b0 + k0 * ldb, ldb);                                                              \
          AMX_LOAD(7, b0 + k0 * ldb + 64, ldb);                                                         \
          DP(0, 4, 6);                                                                                  \
          DP(1, 4, 7);                                                                                  \
          DP(2, 5, 6);                                                                                  \
          DP(3, 5, 7);                                                                                  \
        }                                                                                               \
        AMX_STORE(0, c0, ldc);                                                                          \
        AMX_STORE(1, c0 + 64, ldc);                                                                     \
        AMX_STORE(2, c1, ldc);                                                                          \
        AMX_STORE(3, c1 + 64, ldc);                                                                     \
      }                                                                                                 \
  }

AB_AMX_GEMM(AMXS(gemm_bf16), AMX_DPBF16)
#if AB_AMX_HAS_FP16
AB_AMX_GEMM(AMXS(gemm_fp16), AMX_DPFP16)
#endif

/* The float product of 16-bit operands of `kind`. */
static void AMXS(gemm16)(int kind, int64_t M, int64_t N, int64_t Kw, const void* A, int64_t lda, const void* B,
                         int64_t ldb, float* C, int64_t ldc, int acc) {
#if AB_AMX_HAS_FP16
  if (kind == AMX_FP16) {
    AMXS(gemm_fp16)(M, N, Kw, A, lda, B, ldb, C, ldc, acc);
    return;
  }
#endif
  (void)kind;
  AMXS(gemm_bf16)(M, N, Kw, A, lda, B, ldb, C, ldc, acc);
}

/* ---- vector helpers ------------------------------------------------------------------------------ */

/* 2^x for x <= 0, relative error < 1e-7; exactly 0 below -125 (and at -inf), so no weight is ever
 * subnormal (subnormal products cost ~100x on x86, and the tiles flush them anyway); NaN stays
 * NaN.  The softmax folds log2(e) into its scale factor, so no exp needs its own multiply. */
static inline vf AMXS(vexp2)(vf x) {
#if VLEN == 16
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-125.0f), (__m512)x);
  const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-125.0f), _CMP_GE_OQ) |
                         _mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return (vf)_mm512_maskz_scalef_ps(keep, p, n);
#else
  const vi under = x < vset1(-125.0f);
  const vi nan = x != x;
  const vf t = vselect(under | nan, vset1(0.0f), x);
  const vf n = vround(t);
  const vf f = t - n; /* [-1/2, 1/2] */
  vf p = vset1(1.5403530393381609e-4f);
  p = p * f + vset1(1.3333558146428443e-3f);
  p = p * f + vset1(9.6181291076284772e-3f);
  p = p * f + vset1(5.5504108664821580e-2f);
  p = p * f + vset1(2.4022650695910071e-1f);
  p = p * f + vset1(6.9314718055994531e-1f);
  p = p * f + vset1(1.0f);
  const vf y = p * (vf)((__builtin_convertvector(n, vi) + 127) << 23); /* 2^n, n >= -125: normal */
  return vselect(nan, x, vselect(under, vset1(0.0f), y));
#endif
}

/* The 16-bit encodings of x (bfloat16 or float16, round to nearest even) in the low half of each
 * 32-bit lane; NaN stays NaN. */
static inline vu AMXS(half_bits)(vf x, int kind) {
  if (kind == AMX_BF16) {
    const vu u = (vu)x;
    const vi nan = (vi)((u & 0x7fffffffu) > 0x7f800000u);
    const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (vu)vselect(nan, (vf)((u >> 16) | 0x40u), (vf)r);
  }
#if VLEN == 16
  return (vu)_mm512_cvtepu16_epi32(_mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  vu r;
  for (int u = 0; u < VLEN; ++u) r[u] = ab_f32_to_f16(x[u]);
  return r;
#endif
}

/* Words lo | hi << 16 of the 16-bit encodings: one VNNI-2 pair per lane. */
static inline vu AMXS(pair)(vf lo, vf hi, int kind) {
  return AMXS(half_bits)(lo, kind) | (AMXS(half_bits)(hi, kind) << 16);
}

static inline void AMXS(vstore_u)(uint32_t* p, vu v) { memcpy(p, &v, sizeof v); }

/* n elements of a row of t at element offset off (last-dim stride from t) as 16-bit values of
 * `kind`, zero-padded to ld: the bits as they are when t already has that dtype, else through
 * float32 (ftmp: n floats) with round to nearest even. */
static void AMXS(row16)(const ab_tensor* t, int64_t off, int64_t n, int64_t ld, int kind, uint16_t* dst,
                        float* ftmp) {
  const int64_t s = t->strides[t->ndim - 1];
  const ab_dtype want = kind == AMX_BF16 ? AB_DTYPE_BF16 : AB_DTYPE_F16;
  if (t->dtype == want) {
    const uint16_t* src = (const uint16_t*)t->data + off;
    if (s == 1)
      memcpy(dst, src, sizeof(uint16_t) * (size_t)n);
    else
      for (int64_t x = 0; x < n; ++x) dst[x] = src[x * s];
  } else {
    ab_vec_load_row(t->data, t->dtype, off, n, s, ftmp);
    for (int64_t x = 0; x < n; ++x) dst[x] = kind == AMX_BF16 ? ab_f32_to_bf16(ftmp[x]) : ab_f32_to_f16(ftmp[x]);
  }
  if (ld > n) memset(dst + n, 0, sizeof(uint16_t) * (size_t)(ld - n));
}

/* The B operand of a product over head dims for one chunk: word (k, r) = the pair (row r, dims 2k
 * and 2k + 1) of AMX_RC rows of ld 16-bit values each, i.e. the rows' 32-bit words transposed. */
static void AMXS(words_t)(const uint16_t* rows, int64_t ld, uint32_t* dst) {
  const int64_t kw = ld / 2;
  for (int64_t r = 0; r < AMX_RC; ++r) {
    const uint32_t* w = (const uint32_t*)(const void*)(rows + r * ld);
    for (int64_t k = 0; k < kw; ++k) dst[k * AMX_RC + r] = w[k];
  }
}

/* The B operand of a product over the rows of a chunk: word (r2, d) = (row 2 r2, row 2 r2 + 1) of
 * dim d, for AMX_RC / 2 row pairs of ld 16-bit values. */
static void AMXS(words_rowpairs)(const uint16_t* rows, int64_t ld, uint32_t* dst) {
  for (int64_t r2 = 0; r2 < AMX_RC / 2; ++r2)
    for (int64_t d = 0; d < ld; ++d)
      dst[r2 * ld + d] = (uint32_t)rows[2 * r2 * ld + d] | (uint32_t)rows[(2 * r2 + 1) * ld + d] << 16;
}

/* St (nb x AMX_RC) rounded to pairs of keys: word (k, r) = (St[2k][r], St[2k + 1][r]) for keys
 * below nb, zero up to nbp keys (the B operand of O^T += V^T P^T and of dQ^T += K^T dS^T). */
static void AMXS(pack_keypairs)(const float* st, int64_t nb, int64_t nbp, int kind, uint32_t* dst) {
  for (int64_t k = 0; 2 * k < nbp; ++k)
    for (int64_t v = 0; v < AMX_RC; v += VLEN) {
      const vf lo = 2 * k < nb ? vload(st + 2 * k * AMX_RC + v) : vset1(0.0f);
      const vf hi = 2 * k + 1 < nb ? vload(st + (2 * k + 1) * AMX_RC + v) : vset1(0.0f);
      AMXS(vstore_u)(dst + k * AMX_RC + v, AMXS(pair)(lo, hi, kind));
    }
}

/* St (nb x AMX_RC) rounded to 16-bit rows, zero up to nbp rows (the A operand of dV and dK). */
static void AMXS(pack_rows16)(const float* st, int64_t nb, int64_t nbp, int kind, uint32_t* dst) {
  for (int64_t j = 0; j < nbp; ++j)
    for (int64_t v = 0; v < AMX_RC; v += 2 * VLEN) {
      /* lanes hold rows r; the pair (r, r + 1) must share a word, so even and odd lanes are split */
      uint32_t* w = dst + j * (AMX_RC / 2) + v / 2;
      if (j >= nb) {
        memset(w, 0, sizeof(uint32_t) * VLEN);
        continue;
      }
      const vu a = AMXS(half_bits)(vload(st + j * AMX_RC + v), kind);
      const vu b = AMXS(half_bits)(vload(st + j * AMX_RC + v + VLEN), kind);
      for (int u = 0; u < VLEN / 2; ++u) {
        w[u] = a[2 * u] | a[2 * u + 1] << 16;
        w[VLEN / 2 + u] = b[2 * u] | b[2 * u + 1] << 16;
      }
    }
}

/* x[0 .. n) *= s */
static void AMXS(vscale)(float* x, int64_t n, float s) {
  const vf sv = vset1(s);
  for (int64_t i = 0; i < n; i += VLEN) vstore(x + i, vload(x + i) * sv);
}

/* ---- the online softmax of one panel ------------------------------------------------------------ */

/* Over St (nb keys x AMX_RC rows): m_new = max(m, max_j S), P = 2^((S - m_new) c) in place,
 * l = l alpha + sum_j P with alpha = 2^((m - m_new) c) written to arow; returns 1 if some alpha
 * may differ from 1.  c = log2(e) times the factor the scores still lack (c > 0).  NaN scores reach
 * m and l (the row is NaN at the end); a row that has seen no key keeps m = -inf and weights 0.
 * Two chains over keys: a single running max or sum would be latency-bound. */
static int AMXS(softmax)(float* st, int64_t nb, float c, float* mrow, float* lrow, float* arow) {
  const vf cv = vset1(c), ninf = vset1(-__builtin_inff());
  int any = 0;
  for (int v = 0; v < AMX_NVR; ++v) {
    const int64_t o = (int64_t)v * VLEN;
    const vf mold = vload(mrow + o);
    vf m0 = mold, m1 = mold;
    int64_t j = 0;
    for (; j + 2 <= nb; j += 2) {
      m0 = vmax(m0, vload(st + j * AMX_RC + o));
      m1 = vmax(m1, vload(st + (j + 1) * AMX_RC + o));
    }
    if (j < nb) m0 = vmax(m0, vload(st + j * AMX_RC + o));
    const vf mx = vmax(m0, m1);
    const vf msafe = vselect(mx == ninf, vset1(0.0f), mx);
    vf l0 = vload(lrow + o), l1 = vset1(0.0f), alpha = vset1(1.0f);
    if (!vall(mx == mold)) {
      alpha = AMXS(vexp2)((mold - msafe) * cv);
      l0 *= alpha;
      any = 1;
    }
    vstore(arow + o, alpha);
    vstore(mrow + o, mx);
    for (j = 0; j + 2 <= nb; j += 2) {
      const vf e0 = AMXS(vexp2)((vload(st + j * AMX_RC + o) - msafe) * cv);
      const vf e1 = AMXS(vexp2)((vload(st + (j + 1) * AMX_RC + o) - msafe) * cv);
      vstore(st + j * AMX_RC + o, e0);
      vstore(st + (j + 1) * AMX_RC + o, e1);
      l0 += e0;
      l1 += e1;
    }
    if (j < nb) {
      const vf e = AMXS(vexp2)((vload(st + j * AMX_RC + o) - msafe) * cv);
      vstore(st + j * AMX_RC + o, e);
      l0 += e;
    }
    vstore(lrow + o, l0 + l1);
  }
  return any;
}

/* ---- forward: flash (16-bit tiles) and sage (int8 scores, sage_amx_impl.h) share the driver ---- */

typedef struct AMXS(fwd_ctx) AMXS(fwd_ctx);

/* What differs between flash and sage: the per-chunk preparation of Q, the tile products of a
 * panel's scores (issued early, see the file comment) and their completion before the softmax. */
typedef struct AMXS(fwd_ops) {
  void (*chunk_q)(const AMXS(fwd_ctx) * ctx, const SYM(chunk) * ch, uint32_t* qb, float* sq, float* bias,
                  uint16_t* r16, float* tmp);
  void (*score_tiles)(const AMXS(fwd_ctx) * ctx, const SYM(chunk) * ch, int64_t j0, int64_t nbp, const uint32_t* qb,
                      float* st);
  void (*score_finish)(const AMXS(fwd_ctx) * ctx, const SYM(chunk) * ch, int64_t j0, int64_t nb, const float* sq,
                       const float* bias, float* st);
} AMXS(fwd_ops);

struct AMXS(fwd_ctx) {
  const ab_attn_params* p;
  const AMXS(fwd_ops) * ops;
  int kind;           /* 16-bit type of the P V product (and of flash's S) */
  int prescale;       /* multiply the scores by scale before masking (softcap, float mask, scale <= 0) */
  float c;            /* the softmax's factor: log2(e), times scale unless prescaled */
  float msc;          /* the running max times msc is in natural units (for lse) */
  int64_t nchunk;     /* chunks of AMX_RC rows per (batch, head) */
  int64_t Dp, Dvp;    /* head dims padded to 32 (flash's K rows; O^T rows) */
  int64_t kw;         /* 32-bit words per packed K row: Dp / 2 (flash) or Dq / 4 (sage int8) */
  const int64_t* krow0;  /* (B + 1) first packed K row of sequence b, rows padded to 32 per sequence */
  const int64_t* panel0; /* (B + 1) first V^T panel of sequence b */
  int64_t krows, npanels; /* per KV head */
  const uint32_t* kp;  /* (Hkv, krows, kw) words */
  const uint32_t* vt;  /* (Hkv, npanels, Dvp, AMX_NP / 2) words: V^T of a panel, pairs of keys */
  const float* sk;     /* sage: (Hkv, krows) key scales */
  const float* mean;   /* sage: (B, Hkv, Dq) */
  const float* cf;     /* sage: (B, Hkv, Dq) */
  int64_t Dq;          /* sage: D padded to 64 */
  ab_par_status st;
};

/* Sequence b's lengths (dense or packed). */
static inline void AMXS(seq_lens)(const ab_attn_params* p, int64_t b, int64_t* Sq, int64_t* Sk) {
  if (p->cu_seqlens_q) {
    *Sq = p->cu_seqlens_q[b + 1] - p->cu_seqlens_q[b];
    *Sk = p->cu_seqlens_k[b + 1] - p->cu_seqlens_k[b];
  } else {
    *Sq = p->Sq;
    *Sk = p->Sk;
  }
}

/* The packed layout's per-sequence offsets: K rows (each sequence padded to 32 rows) and V^T
 * panels; fills krow0/panel0 (B + 1 each) when not NULL, returns the totals. */
static void AMXS(kv_offsets)(const ab_attn_params* p, int64_t* krow0, int64_t* panel0, int64_t* krows,
                             int64_t* npanels) {
  int64_t kr = 0, np = 0;
  for (int64_t b = 0; b < p->B; ++b) {
    int64_t sq, sk;
    AMXS(seq_lens)(p, b, &sq, &sk);
    if (krow0) krow0[b] = kr;
    if (panel0) panel0[b] = np;
    kr += AMXS(up)(sk, 32);
    np += (sk + AMX_NP - 1) / AMX_NP;
  }
  if (krow0) krow0[p->B] = kr;
  if (panel0) panel0[p->B] = np;
  *krows = kr;
  *npanels = np;
}

/* V^T panels of one (batch, KV head): word (d, k) of panel t = (V[t NP + 2k][d], V[t NP + 2k + 1][d])
 * as `kind`, zero past the sequence and past Dv.  r16: 2 x Dvp 16-bit, ftmp: Dv floats. */
static void AMXS(pack_vt)(const ab_attn_params* p, const SYM(seq) * s, int kind, int64_t Dvp, uint32_t* dst,
                          uint16_t* r16, float* ftmp) {
  const int64_t Sk = s->Sk, npan = (Sk + AMX_NP - 1) / AMX_NP, half = AMX_NP / 2;
  for (int64_t t = 0; t < npan; ++t) {
    uint32_t* pan = dst + t * Dvp * half;
    for (int64_t k = 0; k < half; ++k) {
      const int64_t j = t * AMX_NP + 2 * k;
      for (int e = 0; e < 2; ++e) {
        if (j + e < Sk)
          AMXS(row16)(&p->v, s->v + (j + e) * s->v_rs, p->Dv, Dvp, kind, r16 + e * Dvp, ftmp);
        else
          memset(r16 + e * Dvp, 0, sizeof(uint16_t) * (size_t)Dvp);
      }
      for (int64_t d = 0; d < Dvp; ++d) pan[d * half + k] = (uint32_t)r16[d] | (uint32_t)r16[Dvp + d] << 16;
    }
  }
}

static void AMXS(fwd_range)(int64_t begin, int64_t end, void* vctx) {
  AMXS(fwd_ctx)* ctx = (AMXS(fwd_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const AMXS(fwd_ops)* ops = ctx->ops;
  const int64_t Dv = p->Dv, Dvp = ctx->Dvp, half = AMX_NP / 2;
  const int64_t Dmax = AMXS(up)(p->D > Dvp ? (p->D > ctx->Dq ? p->D : ctx->Dq) : (Dvp > ctx->Dq ? Dvp : ctx->Dq), 32);
  const int kind = ctx->kind;
  const size_t nfl = (size_t)(2 * AMX_NP * AMX_RC    /* St, double-buffered */
                              + AMX_NP * AMX_RC      /* dropout factors */
                              + Dvp * AMX_RC         /* O^T */
                              + AMX_RC * Dvp         /* O rows, for the store */
                              + Dmax + 5 * AMX_RC);  /* tmp, m, l, alpha, sq, bias */
  const size_t nwords = (size_t)(ctx->kw * AMX_RC + half * AMX_RC + Dmax); /* Q^T, P pairs, 16-bit row */
  float* stb = (float*)ab_scratch_alloc(sizeof(float) * nfl + sizeof(uint32_t) * nwords + sizeof(int32_t) * 2 * AMX_RC);
  if (!stb) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "flash (amx): out of memory for the tile scratch");
    return;
  }
  float* fd = stb + 2 * AMX_NP * AMX_RC;
  float* ot = fd + AMX_NP * AMX_RC;
  float* orow = ot + Dvp * AMX_RC;
  float* tmp = orow + AMX_RC * Dvp;
  float* mrow = tmp + Dmax;
  float* lrow = mrow + AMX_RC;
  float* arow = lrow + AMX_RC;
  float* sq = arow + AMX_RC;
  float* bias = sq + AMX_RC;
  uint32_t* qb = (uint32_t*)(bias + AMX_RC);
  uint32_t* pw = qb + ctx->kw * AMX_RC;
  uint16_t* r16 = (uint16_t*)(pw + half * AMX_RC);
  int32_t* lo = (int32_t*)(r16 + 2 * Dmax);
  int32_t* hi = lo + AMX_RC;
  ab_tilecfg cfg;
  ab_tilecfg_full(&cfg);
  AMX_CONFIG(&cfg);
  for (int64_t item = begin; item < end; ++item) {
    SYM(chunk) ch;
    if (!SYM(chunk_begin)(p, item, ctx->nchunk, AMX_RC, lo, hi, mrow, lrow, &ch)) continue;
    const SYM(seq) s = ch.s;
    const int64_t i0 = ch.i0, nrows = ch.nrows, jlo = ch.jlo, jhi = ch.jhi;
    ops->chunk_q(ctx, &ch, qb, sq, bias, r16, tmp);
    memset(ot, 0, sizeof(float) * (size_t)(Dvp * AMX_RC));
    const uint32_t* vt = ctx->vt + (ch.hk * ctx->npanels + ctx->panel0[ch.b]) * Dvp * half;
    /* panels on the grid of the packed V^T (multiples of AMX_NP from key 0): keys of the first one
     * before jlo are masked like any other invisible key */
    const int64_t t0 = jlo / AMX_NP, t1 = jlo < jhi ? (jhi + AMX_NP - 1) / AMX_NP : t0;
    if (t0 < t1) ops->score_tiles(ctx, &ch, t0 * AMX_NP, AMXS(up)(jhi - t0 * AMX_NP < AMX_NP ? jhi - t0 * AMX_NP : AMX_NP, 32), qb, stb);
    for (int64_t t = t0; t < t1; ++t) {
      float* st = stb + ((t - t0) & 1) * AMX_NP * AMX_RC;
      const int64_t j0 = t * AMX_NP, nb = jhi - j0 < AMX_NP ? jhi - j0 : AMX_NP, nbp = AMXS(up)(nb, 32);
      if (t + 1 < t1) { /* the next panel's products first: the tile unit runs them during this softmax */
        const int64_t j1 = j0 + AMX_NP, nb1 = jhi - j1 < AMX_NP ? jhi - j1 : AMX_NP;
        ops->score_tiles(ctx, &ch, j1, AMXS(up)(nb1, 32), qb, stb + ((t + 1 - t0) & 1) * AMX_NP * AMX_RC);
      }
      ops->score_finish(ctx, &ch, j0, nb, sq, bias, st);
      const int structural = nrows < AMX_RC || j0 < ch.all_lo || j0 + nb > ch.all_hi;
      SYM(mask_scores)(p, &s, i0, nrows, j0, nb, lo, hi, structural, st, NULL, AMX_RC, 1.0);
      if (AMXS(softmax)(st, nb, ctx->c, mrow, lrow, arow))
        for (int64_t d = 0; d < Dvp; ++d)
          for (int64_t v = 0; v < AMX_RC; v += VLEN)
            vstore(ot + d * AMX_RC + v, vload(ot + d * AMX_RC + v) * vload(arow + v));
      if (p->dropout_p > 0) { /* the sum l above is of the weights before dropout */
        SYM(drop_factors)(p, &s, i0, nrows, j0, nb, fd, AMX_RC);
        SYM(vmul)(st, fd, nb * AMX_RC);
      }
      AMXS(pack_keypairs)(st, nb, nbp, kind, pw);
      AMXS(gemm16)(kind, Dvp, AMX_RC, nbp / 2, vt + t * Dvp * half, AMX_NP * 2, pw, AMX_RC * 4, ot, AMX_RC * 4, 1);
    }
    if (ctx->msc != 1.0f)
      for (int64_t r = 0; r < AMX_RC; ++r) mrow[r] *= ctx->msc;
    for (int64_t r = 0; r < nrows; ++r)
      for (int64_t d = 0; d < Dv; ++d) orow[r * Dvp + d] = ot[d * AMX_RC + r];
    SYM(store_rows)(p, &s, i0, nrows, orow, Dvp, mrow, lrow, tmp);
  }
  AMX_RELEASE();
  ab_scratch_free(stb);
}

/* Runs the forward items once ctx's packed K and V are in place. */
static ab_status AMXS(fwd_run)(AMXS(fwd_ctx) * ctx, const ab_cpu_pool* pool, double work) {
  ctx->nchunk = (ab_rows_q(ctx->p) + AMX_RC - 1) / AMX_RC;
  return ab_par_run(pool, ctx->p->B * ctx->p->Hq * ctx->nchunk, 1, work, AMXS(fwd_range), ctx, &ctx->st);
}

/* ---- flash forward ----------------------------------------------------------------------------- */

static void AMXS(flash_chunk_q)(const AMXS(fwd_ctx) * ctx, const SYM(chunk) * ch, uint32_t* qb, float* sq,
                                float* bias, uint16_t* r16, float* tmp) {
  const ab_attn_params* p = ctx->p;
  const int64_t Dp = ctx->Dp;
  /* a chunk's rows as 16-bit rows, then their words transposed (one row at a time: r16 holds two) */
  for (int64_t r = 0; r < AMX_RC; ++r) {
    if (r < ch->nrows)
      AMXS(row16)(&p->q, ch->s.q + (ch->i0 + r) * ch->s.q_rs, p->D, Dp, ctx->kind, r16, tmp);
    else
      memset(r16, 0, sizeof(uint16_t) * (size_t)Dp);
    const uint32_t* w = (const uint32_t*)(const void*)r16;
    for (int64_t k = 0; k < Dp / 2; ++k) qb[k * AMX_RC + r] = w[k];
  }
  (void)sq;
  (void)bias;
}

static void AMXS(flash_score_tiles)(const AMXS(fwd_ctx) * ctx, const SYM(chunk) * ch, int64_t j0, int64_t nbp,
                                    const uint32_t* qb, float* st) {
  const uint32_t* kp = ctx->kp + (ch->hk * ctx->krows + ctx->krow0[ch->b] + j0) * ctx->kw;
  AMXS(gemm16)(ctx->kind, nbp, AMX_RC, ctx->kw, kp, ctx->kw * 4, qb, AMX_RC * 4, st, AMX_RC * 4, 0);
}

static void AMXS(flash_score_finish)(const AMXS(fwd_ctx) * ctx, const SYM(chunk) * ch, int64_t j0, int64_t nb,
                                     const float* sq, const float* bias, float* st) {
  (void)ch;
  (void)j0;
  (void)sq;
  (void)bias;
  if (ctx->prescale) AMXS(vscale)(st, nb * AMX_RC, (float)ctx->p->scale);
}

static const AMXS(fwd_ops) AMXS(flash_ops) = {AMXS(flash_chunk_q), AMXS(flash_score_tiles), AMXS(flash_score_finish)};

typedef struct AMXS(pack_ctx) {
  const ab_attn_params* p;
  AMXS(fwd_ctx) * f;
  uint32_t* kp;
  uint32_t* vt;
  ab_par_status st;
} AMXS(pack_ctx);

/* Items (batch, KV head): K rows as 16-bit rows of Dp, V^T panels. */
static void AMXS(flash_pack_range)(int64_t begin, int64_t end, void* vctx) {
  AMXS(pack_ctx)* ctx = (AMXS(pack_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const AMXS(fwd_ctx)* f = ctx->f;
  const int64_t Dp = f->Dp, Dvp = f->Dvp, group = p->Hq / p->Hkv;
  const int64_t Dmax = p->D > p->Dv ? p->D : p->Dv;
  uint16_t* r16 = (uint16_t*)ab_scratch_alloc(sizeof(uint16_t) * (size_t)(2 * Dvp) + sizeof(float) * (size_t)Dmax);
  if (!r16) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "flash (amx): out of memory for packing K and V");
    return;
  }
  float* ftmp = (float*)(r16 + 2 * Dvp);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p->Hkv, hk = item % p->Hkv;
    SYM(seq) s;
    SYM(seq_get)(p, b, hk * group, hk, &s);
    const int64_t r0 = hk * f->krows + f->krow0[b], nr = f->krow0[b + 1] - f->krow0[b];
    for (int64_t j = 0; j < nr; ++j) {
      uint16_t* dst = (uint16_t*)(ctx->kp + (r0 + j) * f->kw);
      if (j < s.Sk)
        AMXS(row16)(&p->k, s.k + j * s.k_rs, p->D, Dp, f->kind, dst, ftmp);
      else
        memset(dst, 0, sizeof(uint16_t) * (size_t)Dp);
    }
    AMXS(pack_vt)(p, &s, f->kind, Dvp, ctx->vt + (hk * f->npanels + f->panel0[b]) * Dvp * (AMX_NP / 2), r16, ftmp);
  }
  ab_scratch_free(r16);
}

/* The scale and the softmax factor: fold scale into the exponential's factor when the masking
 * does not need true scores (no softcap, no float mask) and scale > 0 keeps -inf and the max. */
static void AMXS(fwd_scale)(const ab_attn_params* p, AMXS(fwd_ctx) * ctx, int scores_scaled) {
  const float log2e = 1.44269504088896341f;
  ctx->prescale = !scores_scaled && (p->softcap > 0 || ab_mask_is_float(p) || !(p->scale > 0));
  const int folded = !scores_scaled && !ctx->prescale;
  ctx->c = folded ? (float)(p->scale * 1.4426950408889634) : log2e;
  ctx->msc = folded ? (float)p->scale : 1.0f;
}

static ab_status AMXS(flash_fwd_tiles)(const ab_attn_params* p, int kind, const ab_cpu_pool* pool, ab_error* err) {
  AMXS(fwd_ctx) ctx;
  memset(&ctx, 0, sizeof ctx);
  ctx.p = p;
  ctx.ops = &AMXS(flash_ops);
  ctx.kind = kind;
  ctx.st.err = err;
  atomic_init(&ctx.st.status, AB_OK);
  AMXS(fwd_scale)(p, &ctx, 0);
  ctx.Dp = AMXS(up)(p->D, 32);
  ctx.Dvp = AMXS(up)(p->Dv, 32);
  ctx.kw = ctx.Dp / 2;
  int64_t krows, npanels;
  AMXS(kv_offsets)(p, NULL, NULL, &krows, &npanels);
  ctx.krows = krows;
  ctx.npanels = npanels;
  const size_t offs = sizeof(int64_t) * (size_t)(2 * (p->B + 1));
  const size_t kbytes = sizeof(uint32_t) * (size_t)(p->Hkv * krows * ctx.kw);
  const size_t vbytes = sizeof(uint32_t) * (size_t)(p->Hkv * npanels * ctx.Dvp * (AMX_NP / 2));
  char* buf = (char*)aligned_alloc(64, (offs + kbytes + vbytes + 63 * 3) / 64 * 64 + 64);
  if (!buf) return ab_error_set(err, AB_ERR_NOMEM, "flash (amx): out of memory for packed K and V (%zu bytes)",
                                kbytes + vbytes);
  int64_t* krow0 = (int64_t*)buf;
  int64_t* panel0 = krow0 + p->B + 1;
  uint32_t* kp = (uint32_t*)(buf + (offs + 63) / 64 * 64);
  uint32_t* vt = (uint32_t*)((char*)kp + (kbytes + 63) / 64 * 64);
  AMXS(kv_offsets)(p, krow0, panel0, &krows, &npanels);
  ctx.krow0 = krow0;
  ctx.panel0 = panel0;
  ctx.kp = kp;
  ctx.vt = vt;
  AMXS(pack_ctx) pc = {p, &ctx, kp, vt, {0}};
  pc.st.err = err;
  atomic_init(&pc.st.status, AB_OK);
  const double pack = (double)p->B * p->Hkv * p->Sk * (double)(p->D + p->Dv) * 4;
  ab_status st = ab_par_run(pool, p->B * p->Hkv, 1, pack, AMXS(flash_pack_range), &pc, &pc.st);
  if (st == AB_OK) {
    const double work = (double)p->B * p->Hq * ab_rows_q(p) * ab_rows_k(p) * (double)(p->D + p->Dv);
    st = AMXS(fwd_run)(&ctx, pool, work);
  }
  free(buf);
  return st;
}

/* ---- backward (bfloat16) --------------------------------------------------------------------------- */

typedef struct AMXS(bwd_ctx) {
  const ab_attn_params* p;
  ab_par_status st;
} AMXS(bwd_ctx);

/* 16-bit rows of a (rows x cols) operand, rows [0, n) of the sequence, zero rows up to np. */
static void AMXS(rows16)(const ab_tensor* t, int64_t base, int64_t rs, int64_t n, int64_t np, int64_t cols,
                         int64_t ld, uint16_t* dst, float* ftmp) {
  for (int64_t j = 0; j < np; ++j) {
    if (j < n)
      AMXS(row16)(t, base + j * rs, cols, ld, AMX_BF16, dst + j * ld, ftmp);
    else
      memset(dst + j * ld, 0, sizeof(uint16_t) * (size_t)ld);
  }
}

static void AMXS(bwd_range)(int64_t begin, int64_t end, void* vctx) {
  AMXS(bwd_ctx)* ctx = (AMXS(bwd_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const int64_t D = p->D, Dv = p->Dv, group = p->Hq / p->Hkv;
  const int64_t Dp = AMXS(up)(D, 32), Dvp = AMXS(up)(Dv, 32), Dmax = Dp > Dvp ? Dp : Dvp;
  const int want_dmask = p->dmask.ndim > 0, softcap = p->softcap > 0;
  const int64_t Skr = AMXS(up)(ab_rows_k(p), 32), Sqp = AMXS(up)(ab_rows_q(p), AMX_RC), nch = Sqp / AMX_RC;
  const int64_t G = AB_STAGGER; /* floats after every buffer: no two start at the same address mod 4 KiB */
  /* buffers in floats (16-bit and word buffers counted in 4-byte units) */
  const int64_t n_kp = Skr * Dp / 2, n_vp = Skr * Dvp / 2, n_kt = Dp * Skr / 2;
  const int64_t n_qt = nch * Dp / 2 * AMX_RC, n_qv = nch * AMX_RC / 2 * Dp;
  const int64_t n_dot = nch * Dvp / 2 * AMX_RC, n_dov = nch * AMX_RC / 2 * Dvp;
  const int64_t n_blk = AMX_BKB * AMX_RC;
  const size_t nfl = (size_t)(n_kp + n_vp + n_kt + Skr * Dp + Skr * Dvp + n_qt + n_qv + n_dot + n_dov
                              + nch * Dp * AMX_RC + 2 * Sqp + 4 * n_blk + 2 * n_blk / 2 + n_blk / 2
                              + AMX_RC * Dmax / 2 + AMX_RC * Dmax / 2 + 2 * Dmax + 20 * G);
  float* base = (float*)ab_scratch_alloc(sizeof(float) * nfl + sizeof(int32_t) * 2 * AMX_RC);
  if (!base) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "flash (amx): out of memory for the backward scratch");
    return;
  }
  uint16_t* kp = (uint16_t*)base;                    /* K rows, 16-bit (Skr x Dp) */
  uint16_t* vp = (uint16_t*)(base + n_kp + G);       /* V rows (Skr x Dvp) */
  uint32_t* kt = (uint32_t*)(base + n_kp + n_vp + 2 * G); /* K^T, pairs of keys (Dp x Skr / 2) */
  float* dk = (float*)(kt + n_kt + G);               /* (Skr x Dp) */
  float* dv = dk + Skr * Dp + G;                     /* (Skr x Dvp) */
  uint32_t* qt = (uint32_t*)(dv + Skr * Dvp + G);    /* per chunk: Q^T, pairs of dims (Dp / 2 x RC) */
  uint32_t* qv = qt + n_qt + G;                      /* per chunk: Q, pairs of rows (RC / 2 x Dp) */
  uint32_t* dot = qv + n_qv + G;                     /* per chunk: dO^T, pairs of dims (Dvp / 2 x RC) */
  uint32_t* dov = dot + n_dot + G;                   /* per chunk: dO, pairs of rows (RC / 2 x Dvp) */
  float* dqt = (float*)(dov + n_dov + G);            /* per chunk: dQ^T (Dp x RC) */
  float* lse = dqt + nch * Dp * AMX_RC + G;          /* per row; +inf for padding and dead rows: P = 0 */
  float* delta = lse + Sqp + G;
  float* st = delta + Sqp + G;                       /* S^T, then P^T (BKB x RC) */
  float* dpt = st + n_blk + G;                       /* dP^T, then dS^T */
  float* pd = dpt + n_blk + G;                       /* dropout factors, then P^T after dropout */
  float* th = pd + n_blk + G;                        /* tanh of the softcap */
  uint32_t* pa = (uint32_t*)(th + n_blk + G);        /* P^T rounded (BKB rows of RC) */
  uint32_t* sa = pa + n_blk / 2 + G;                 /* dS^T rounded */
  uint32_t* sb = sa + n_blk / 2 + G;                 /* dS^T, pairs of keys (BKB / 2 x RC) */
  uint16_t* rows = (uint16_t*)(sb + n_blk / 2 + G);  /* a chunk's 16-bit rows (RC x Dmax) */
  float* tmp = (float*)(rows + AMX_RC * Dmax) + G;
  float* tmp2 = tmp + Dmax;
  int32_t* lo = (int32_t*)(tmp2 + Dmax + G);
  int32_t* hi = lo + AMX_RC;
  const float scale = (float)p->scale, log2e = 1.44269504088896341f;
  ab_tilecfg cfg;
  ab_tilecfg_full(&cfg);
  AMX_CONFIG(&cfg);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p->Hkv, hk = item % p->Hkv;
    SYM(seq) s0;
    SYM(seq_get)(p, b, hk * group, hk, &s0);
    const int64_t Sk = s0.Sk, Sq = s0.Sq, skr = AMXS(up)(Sk, 32);
    AMXS(rows16)(&p->k, s0.k, s0.k_rs, Sk, skr, D, Dp, kp, tmp);
    AMXS(rows16)(&p->v, s0.v, s0.v_rs, Sk, skr, Dv, Dvp, vp, tmp);
    for (int64_t k2 = 0; k2 < skr / 2; ++k2)
      for (int64_t d = 0; d < Dp; ++d)
        kt[d * (Skr / 2) + k2] = (uint32_t)kp[2 * k2 * Dp + d] | (uint32_t)kp[(2 * k2 + 1) * Dp + d] << 16;
    memset(dk, 0, sizeof(float) * (size_t)(skr * Dp));
    memset(dv, 0, sizeof(float) * (size_t)(skr * Dvp));
    const int64_t sqp = AMXS(up)(Sq, AMX_RC);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      SYM(seq) s;
      SYM(seq_get)(p, b, h, hk, &s);
      const int64_t dos = p->cu_seqlens_q ? p->dout.strides[0] : p->dout.strides[2];
      const int64_t do_base = p->cu_seqlens_q ? p->cu_seqlens_q[b] * p->dout.strides[0] + h * p->dout.strides[1]
                                              : b * p->dout.strides[0] + h * p->dout.strides[1];
      /* this head's Q and dO, per chunk, in the two B layouts each product needs */
      for (int64_t c = 0; c * AMX_RC < Sq; ++c) {
        const int64_t i0 = c * AMX_RC, n = Sq - i0 < AMX_RC ? Sq - i0 : AMX_RC;
        AMXS(rows16)(&p->q, s.q + i0 * s.q_rs, s.q_rs, n, AMX_RC, D, Dp, rows, tmp);
        AMXS(words_t)(rows, Dp, qt + c * (Dp / 2) * AMX_RC);
        AMXS(words_rowpairs)(rows, Dp, qv + c * (AMX_RC / 2) * Dp);
        AMXS(rows16)(&p->dout, do_base + i0 * dos, dos, n, AMX_RC, Dv, Dvp, rows, tmp);
        AMXS(words_t)(rows, Dvp, dot + c * (Dvp / 2) * AMX_RC);
        AMXS(words_rowpairs)(rows, Dvp, dov + c * (AMX_RC / 2) * Dvp);
      }
      /* lse and delta = rowsum(dO * O) - dlse, as the vector backward */
      for (int64_t i = 0; i < sqp; ++i) {
        float l = __builtin_inff();
        double dl = 0.0; /* a float64 sum: Dv terms of either sign, where float32 would lose digits */
        if (i < Sq) {
          l = ((const float*)p->lse.data)[s.lse + i * s.lse_rs];
          if (l == -__builtin_inff()) l = __builtin_inff(); /* dead row: P = 2^(x - inf) = 0 */
          ab_vec_load_row(p->out.data, p->out.dtype, s.o + i * s.o_rs, Dv, p->out.strides[p->out.ndim - 1], tmp);
          ab_vec_load_row(p->dout.data, p->dout.dtype, do_base + i * dos, Dv, p->dout.strides[p->dout.ndim - 1], tmp2);
          for (int64_t d = 0; d < Dv; ++d) dl += (double)tmp[d] * (double)tmp2[d];
          if (p->dlse.ndim) {
            const int64_t off = p->cu_seqlens_q
                                    ? h * p->dlse.strides[0] + (p->cu_seqlens_q[b] + i) * p->dlse.strides[1]
                                    : b * p->dlse.strides[0] + h * p->dlse.strides[1] + i * p->dlse.strides[2];
            dl -= ((const float*)p->dlse.data)[off];
          }
        }
        lse[i] = l;
        delta[i] = (float)dl;
      }
      memset(dqt, 0, sizeof(float) * (size_t)(sqp / AMX_RC * Dp * AMX_RC));
      for (int64_t i0 = 0; i0 < Sq; i0 += AMX_RC) {
        const int64_t c = i0 / AMX_RC, nrows = Sq - i0 < AMX_RC ? Sq - i0 : AMX_RC;
        int64_t jlo = Sk, jhi = 0, all_lo = 0, all_hi = Sk;
        for (int64_t r = 0; r < AMX_RC; ++r) {
          int64_t l = 0, hh = 0;
          if (r < nrows) {
            SYM(row_range)(p, &s, i0 + r, &l, &hh);
            if (hh > l) {
              if (l < jlo) jlo = l;
              if (hh > jhi) jhi = hh;
            }
            if (l > all_lo) all_lo = l;
            if (hh < all_hi) all_hi = hh;
          }
          lo[r] = (int32_t)l;
          hi[r] = (int32_t)hh;
        }
        /* key blocks start on a multiple of 32 (pairs of keys and whole tiles of K^T); the keys
         * before jlo in the first one are masked like any other invisible key */
        for (int64_t j0 = jlo < jhi ? jlo - jlo % 32 : jhi; j0 < jhi; j0 += AMX_BKB) {
          const int64_t nb = jhi - j0 < AMX_BKB ? jhi - j0 : AMX_BKB, nbp = AMXS(up)(nb, 32);
          /* S^T = K Q^T and dP^T = V dO^T on tiles */
          AMXS(gemm_bf16)(nbp, AMX_RC, Dp / 2, kp + j0 * Dp, Dp * 2, qt + c * (Dp / 2) * AMX_RC, AMX_RC * 4, st,
                          AMX_RC * 4, 0);
          AMXS(gemm_bf16)(nbp, AMX_RC, Dvp / 2, vp + j0 * Dvp, Dvp * 2, dot + c * (Dvp / 2) * AMX_RC, AMX_RC * 4,
                          dpt, AMX_RC * 4, 0);
          AMXS(vscale)(st, nb * AMX_RC, scale);
          const int structural = nrows < AMX_RC || j0 < all_lo || j0 + nb > all_hi;
          SYM(mask_scores)(p, &s, i0, nrows, j0, nb, lo, hi, structural, st, softcap ? th : NULL, AMX_RC, 1.0);
          /* P^T = exp(S^T - lse) */
          for (int64_t v = 0; v < AMX_RC; v += VLEN) {
            const vf lv = vload(lse + i0 + v);
            for (int64_t j = 0; j < nb; ++j)
              vstore(st + j * AMX_RC + v, AMXS(vexp2)((vload(st + j * AMX_RC + v) - lv) * vset1(log2e)));
          }
          const float* pw = st; /* the weights dV sees: P, or P after dropout */
          if (p->dropout_p > 0) {
            /* the forward's decisions again: dV sees P * f, and dP (of the dropped weights) * f */
            SYM(drop_factors)(p, &s, i0, nrows, j0, nb, pd, AMX_RC);
            SYM(vmul)(dpt, pd, nb * AMX_RC);
            SYM(vmul)(pd, st, nb * AMX_RC);
            pw = pd;
          }
          /* dS = P (dP - delta); the float mask's gradient; softcap chain rule; scale */
          for (int64_t v = 0; v < AMX_RC; v += VLEN) {
            const vf dl = vload(delta + i0 + v);
            for (int64_t j = 0; j < nb; ++j) {
              const int64_t x = j * AMX_RC + v;
              vstore(dpt + x, vload(st + x) * (vload(dpt + x) - dl));
            }
          }
          if (want_dmask) {
            for (int64_t j = 0; j < nb; ++j)
              for (int64_t r = 0; r < nrows; ++r) {
                const int64_t off = b * p->dmask.strides[0] + h * p->dmask.strides[1] +
                                    (i0 + r) * p->dmask.strides[2] + (j0 + j) * p->dmask.strides[3];
                ((float*)p->dmask.data)[off] = dpt[j * AMX_RC + r];
              }
          }
          for (int64_t x = 0; x < nb * AMX_RC; x += VLEN) {
            vf ds = vload(dpt + x) * vset1(scale);
            if (softcap) {
              const vf t = vload(th + x);
              ds = ds * (vset1(1.0f) - t * t);
            }
            vstore(dpt + x, ds);
          }
          /* dV += P^T dO, dK += dS^T Q, dQ^T += K^T dS^T on tiles */
          AMXS(pack_rows16)(pw, nb, nbp, AMX_BF16, pa);
          AMXS(pack_rows16)(dpt, nb, nbp, AMX_BF16, sa);
          AMXS(pack_keypairs)(dpt, nb, nbp, AMX_BF16, sb);
          AMXS(gemm_bf16)(nbp, Dvp, AMX_RC / 2, pa, AMX_RC * 2, dov + c * (AMX_RC / 2) * Dvp, Dvp * 4, dv + j0 * Dvp,
                          Dvp * 4, 1);
          AMXS(gemm_bf16)(nbp, Dp, AMX_RC / 2, sa, AMX_RC * 2, qv + c * (AMX_RC / 2) * Dp, Dp * 4, dk + j0 * Dp, Dp * 4,
                          1);
          AMXS(gemm_bf16)(Dp, AMX_RC, nbp / 2, kt + j0 / 2, (Skr / 2) * 4, sb, AMX_RC * 4, dqt + c * Dp * AMX_RC,
                          AMX_RC * 4, 1);
        }
        if (want_dmask) { /* keys no row of the chunk sees get gradient 0 */
          for (int64_t r = 0; r < nrows; ++r) {
            const int64_t bo = b * p->dmask.strides[0] + h * p->dmask.strides[1] + (i0 + r) * p->dmask.strides[2];
            for (int64_t j = 0; j < Sk; ++j)
              if (j < jlo || j >= jhi) ((float*)p->dmask.data)[bo + j * p->dmask.strides[3]] = 0.0f;
          }
        }
      }
      const int64_t dqs = p->cu_seqlens_q ? p->dq.strides[0] : p->dq.strides[2];
      const int64_t dq_base = p->cu_seqlens_q ? p->cu_seqlens_q[b] * p->dq.strides[0] + h * p->dq.strides[1]
                                              : b * p->dq.strides[0] + h * p->dq.strides[1];
      for (int64_t i = 0; i < Sq; ++i) {
        const float* col = dqt + (i / AMX_RC) * Dp * AMX_RC + i % AMX_RC;
        for (int64_t d = 0; d < D; ++d) tmp[d] = col[d * AMX_RC];
        ab_vec_store_row(p->dq.data, p->dq.dtype, dq_base + i * dqs, D, p->dq.strides[p->dq.ndim - 1], tmp);
      }
    }
    const int64_t dks = p->cu_seqlens_k ? p->dk.strides[0] : p->dk.strides[2];
    const int64_t dvs = p->cu_seqlens_k ? p->dv.strides[0] : p->dv.strides[2];
    const int64_t k0 = p->cu_seqlens_k ? p->cu_seqlens_k[b] : 0;
    const int64_t dk_base = p->cu_seqlens_k ? k0 * p->dk.strides[0] + hk * p->dk.strides[1]
                                            : b * p->dk.strides[0] + hk * p->dk.strides[1];
    const int64_t dv_base = p->cu_seqlens_k ? k0 * p->dv.strides[0] + hk * p->dv.strides[1]
                                            : b * p->dv.strides[0] + hk * p->dv.strides[1];
    for (int64_t j = 0; j < Sk; ++j) {
      ab_vec_store_row(p->dk.data, p->dk.dtype, dk_base + j * dks, D, p->dk.strides[p->dk.ndim - 1], dk + j * Dp);
      ab_vec_store_row(p->dv.data, p->dv.dtype, dv_base + j * dvs, Dv, p->dv.strides[p->dv.ndim - 1], dv + j * Dvp);
    }
  }
  AMX_RELEASE();
  ab_scratch_free(base);
}

/* ---- the table: bfloat16 (and float16 on AMX-FP16) on tiles, the rest on the vector kernel ---- */

/* float16 runs on tiles where the instruction exists: always when emulated; on real tiles when
 * the CPU has AMX-FP16 and this build could emit it. */
static int AMXS(fp16_tiles)(void) {
#if defined(AB_AMX_EMULATE)
  return 1;
#elif AB_AMX_HAS_FP16
  return ab_cpu_features_get()->amx_fp16;
#else
  return 0;
#endif
}

/* Sinks and ALiBi run on the vector kernel: the tile kernels' softmax takes its scale in the
 * exponent (AMXS(fwd_scale)), where an additive bias per (row, key) has no place yet. */
static ab_status AMXS(flash_fwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  if (p->sinks.ndim || p->alibi.ndim) return SYM(flash_fwd)(p, pool, err);
  if (p->q.dtype == AB_DTYPE_BF16) return AMXS(flash_fwd_tiles)(p, AMX_BF16, pool, err);
  if (p->q.dtype == AB_DTYPE_F16 && AMXS(fp16_tiles)()) return AMXS(flash_fwd_tiles)(p, AMX_FP16, pool, err);
  return SYM(flash_fwd)(p, pool, err);
}

static ab_status AMXS(flash_bwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  if (p->q.dtype != AB_DTYPE_BF16 || p->sinks.ndim || p->alibi.ndim) return SYM(flash_bwd)(p, pool, err);
  AMXS(bwd_ctx) ctx;
  ctx.p = p;
  ctx.st.err = err;
  atomic_init(&ctx.st.status, AB_OK);
  const double work = 2.5 * (double)p->B * p->Hq * ab_rows_q(p) * ab_rows_k(p) * (double)(p->D + p->Dv);
  return ab_par_run(pool, p->B * p->Hkv, 1, work, AMXS(bwd_range), &ctx, &ctx.st);
}

const ab_flash_cpu_table AB_CAT(ab_flash_cpu, AB_AMX_SFX) = {AB_AMX_NAME, AMXS(flash_fwd), AMXS(flash_bwd),
                                                            SYM(fma_rate)};
