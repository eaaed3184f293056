/* sage_cpu_impl.h -- the CPU sage kernel (SageAttention recipe: smoothed K, INT8 Q.K^T), forward
 * only, one source for every ISA.
 *
 * Included by flash_cpu_{generic,avx2,avx512}.c right after flash_cpu_impl.h, whose tiles it
 * reuses unchanged: the transposed score layout St[j][r] (key j, query row r of a chunk of rc rows
 * along the vector lanes), the per-sequence geometry (dense and packed alike), the causal/window/
 * mask/softcap masking, the online softmax and the float32 O += P V micro-kernel.  Only S = Q K^T
 * differs.  docs/sage.md has the recipe and the accuracy figures.
 *
 * Per call:
 *   1. K prepass, per (batch, KV head): the mean of K over the sequence, per channel (float32), and
 *      each row of K - mean quantized to int8, symmetric, scale sk = amax / 127 per key.  Written to
 *      the workspace the shim allocates; the caller's K is never written.  Smoothing takes the
 *      channel-wide offsets (the outliers that would otherwise set every row's amax) out of K, so
 *      the int8 grid resolves what actually differs between keys.
 *   2. Per (batch, head, chunk of rc query rows): each Q row quantized likewise, its scale sq with
 *      the softmax scale folded in, and bias[r] = scale * q_r . mean, what the smoothing took off
 *      row r's scores.
 *   3. Per block of BK keys: St[j][r] = dot_int32(Kq_j, Qq_r) * sk[j] * sq[r] + bias[r].  Softmax
 *      alone would not need bias (it shifts a whole row), but with it lse is the exact definition
 *      and softcap sees the true scores.
 *   4. Masking, online softmax and O += P V in float32 exactly as flash.  P stays float32 for every
 *      input dtype: these CPUs have no faster half-precision product, and rounding P would only
 *      lose accuracy.
 *
 * The integer dot product, by ISA (G int8 values per 32-bit lane of the packed operands):
 *   avx512 (with VNNI): G = 4, vpdpbusd (u8 x s8, sums of 4 products into s32).  K is stored as u8 =
 *     k + 128 (the sign bit flipped), so a lane sums (k + 128) q = k q + 128 q; the accumulators of
 *     query row r start at -128 * sum_d q[r][d], which cancels the excess.  No overflow:
 *     |sum| <= D * 255 * 127 < 2^31 for D < 66000.
 *   avx2: G = 2, vpmaddwd on int16 pairs (values in [-127, 127]: a pair sum cannot overflow).
 *   generic: G = 1, int32 products.
 * The three give the same int32 sums; the scores differ only in float rounding.
 */

#include "sage_cpu.h"

#if VLEN == 16
#define SG_G 4
#define SG_TARGET __attribute__((target("avx512vnni")))
typedef int8_t sg_t;
#elif VLEN == 8
#define SG_G 2
#define SG_TARGET
typedef int16_t sg_t;
#else
#define SG_G 1
#define SG_TARGET
typedef int32_t sg_t;
#endif

typedef sg_t vsg __attribute__((vector_size(VLEN * sizeof(sg_t))));

static inline vi SYM(vload_i)(const void* p) {
  vi v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline vi SYM(vset1_i)(uint32_t x) { return (vi){0} + (int32_t)x; }

/* acc + the G-way int8 dot product of each lane of a (K, broadcast) and b (Q). */
static inline __attribute__((always_inline)) SG_TARGET vi SYM(sg_dot)(vi acc, vi a, vi b) {
#if SG_G == 4
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif SG_G == 2
  return acc + (vi)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
  return acc + a * b;
#endif
}

/* VLEN 32-bit words at p, p + stride, ... (transposing Q's packed rows into lanes). */
static inline vi SYM(sg_gather)(const uint32_t* p, int32_t stride) {
#if VLEN == 16
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(stride));
  return (vi)_mm512_i32gather_epi32(idx, p, 4);
#elif VLEN == 8
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  return (vi)_mm256_i32gather_epi32((const int*)p, idx, 4);
#else
  vi v;
  for (int u = 0; u < VLEN; ++u) {
    uint32_t w = p[(int64_t)u * stride];
    memcpy((char*)&v + u * 4, &w, 4);
  }
  return v;
#endif
}

/* Quantizes x (Dp floats, zero past the real dims) to q = round(x / s) in [-127, 127] with
 * s = amax / 127, stored as sg_t (with the sign bit flipped when flip: K's u8 form for vpdpbusd).
 * Returns s and writes sum_d q to *sum.  An inf or NaN in x gives s = NaN, so every score of that
 * row or key is NaN (NaN in, NaN out) and the int8 values, then meaningless, are zero. */
static float SYM(sg_quant_row)(const float* x, int64_t Dp, sg_t* dst, int flip, int32_t* sum) {
  vf amax = vset1(0.0f), bad = vset1(0.0f);
  for (int64_t d = 0; d < Dp; d += VLEN) {
    const vf v = vload(x + d);
    amax = vmax(amax, (vf)((vi)v & 0x7fffffff));
    bad += v - v; /* 0 for finite values, NaN for inf and NaN */
  }
  const float a = vhmax(amax);
  float nan_seen = 0.0f;
  for (int u = 0; u < VLEN; ++u) nan_seen += bad[u];
  *sum = 0;
  if (a == 0.0f || nan_seen != 0.0f || a != a) {
    const vsg zero = {0};
    const vsg fill = flip ? zero ^ (sg_t)0x80 : zero;
    for (int64_t d = 0; d < Dp; d += VLEN) memcpy(dst + d, &fill, sizeof fill);
    return a == 0.0f && nan_seen == 0.0f ? 0.0f : __builtin_nanf("");
  }
  /* |x| * (127 / amax) <= 127 * (1 + 2 eps) < 127.5: never rounds past 127 */
  const vf inv = vset1(127.0f / a), magic = vset1(12582912.0f); /* 1.5 * 2^23: round to nearest even */
  vi s = {0};
  for (int64_t d = 0; d < Dp; d += VLEN) {
    const vf y = (vload(x + d) * inv + magic) - magic;
    const vi qi = __builtin_convertvector(y, vi);
    s += qi;
    vsg qv = __builtin_convertvector(qi, vsg);
    if (flip) qv ^= (sg_t)0x80; /* int8 q -> the bytes of u8 q + 128 */
    memcpy(dst + d, &qv, sizeof qv);
  }
  int32_t t = 0;
  for (int u = 0; u < VLEN; ++u) t += s[u];
  *sum = t;
  return a / 127.0f;
}

/* ---- the workspace: quantized K, its scales and the means ------------------------------------- */

typedef struct SYM(sg_ws) {
  uint32_t* kw;  /* (Hkv, Ktot, Dg) words: row j of K - mean as int8 (u8 under VNNI), G per word */
  float* sk;     /* (Hkv, Ktot) scale of each key row */
  float* mean;   /* (B, Hkv, Dp) mean of K over each sequence */
  int64_t Ktot;  /* B * Sk dense; total_k packed */
  int64_t Dp, Dg; /* D rounded up to a whole vector; words per row */
} SYM(sg_ws);

static size_t SYM(sg_align)(size_t n) { return (n + 63) & ~(size_t)63; }

/* Fills w's pointers into base (when not NULL); returns the bytes needed. */
static size_t SYM(sg_layout)(const ab_attn_params* p, void* base, SYM(sg_ws) * w) {
  w->Ktot = p->cu_seqlens_k ? p->k.sizes[0] : p->B * p->Sk;
  w->Dp = (p->D + VLEN - 1) / VLEN * VLEN;
  w->Dg = w->Dp / SG_G;
  const size_t kw = SYM(sg_align)(sizeof(uint32_t) * (size_t)(p->Hkv * w->Ktot * w->Dg));
  const size_t sk = SYM(sg_align)(sizeof(float) * (size_t)(p->Hkv * w->Ktot));
  const size_t mean = SYM(sg_align)(sizeof(float) * (size_t)(p->B * p->Hkv * w->Dp));
  char* c = (char*)base;
  w->kw = c ? (uint32_t*)c : NULL;
  w->sk = c ? (float*)(c + kw) : NULL;
  w->mean = c ? (float*)(c + kw + sk) : NULL;
  return kw + sk + mean;
}

/* Row index of key 0 of sequence b in the workspace. */
static inline int64_t SYM(sg_krow0)(const ab_attn_params* p, int64_t b) {
  return p->cu_seqlens_k ? p->cu_seqlens_k[b] : b * p->Sk;
}

typedef struct SYM(sg_ctx) {
  const ab_attn_params* p;
  SYM(sg_ws) w;
  int64_t nchunk;
  int nv;
  ab_par_status st;
} SYM(sg_ctx);

/* K prepass over items (batch, KV head): the mean, then every row of K - mean quantized. */
static void SYM(sg_prep_range)(int64_t begin, int64_t end, void* vctx) {
  SYM(sg_ctx)* ctx = (SYM(sg_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const SYM(sg_ws)* w = &ctx->w;
  const int64_t D = p->D, Dp = w->Dp, Dg = w->Dg, group = p->Hq / p->Hkv;
  float* row = (float*)ab_scratch_alloc(sizeof(float) * (size_t)Dp);
  if (!row) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "sage: out of memory for the K prepass");
    return;
  }
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p->Hkv, hk = item % p->Hkv;
    SYM(seq) s;
    SYM(seq_get)(p, b, hk * group, hk, &s);
    float* mean = w->mean + (b * p->Hkv + hk) * Dp;
    memset(mean, 0, sizeof(float) * (size_t)Dp);
    memset(row, 0, sizeof(float) * (size_t)Dp);
    const int64_t ls = p->k.strides[p->k.ndim - 1];
    for (int64_t j = 0; j < s.Sk; ++j) {
      ab_vec_load_row(p->k.data, p->k.dtype, s.k + j * s.k_rs, D, ls, row);
      for (int64_t d = 0; d < Dp; d += VLEN) vstore(mean + d, vload(mean + d) + vload(row + d));
    }
    if (s.Sk > 0) {
      const vf inv = vset1((float)(1.0 / (double)s.Sk));
      for (int64_t d = 0; d < Dp; d += VLEN) vstore(mean + d, vload(mean + d) * inv);
    }
    const int64_t r0 = hk * w->Ktot + SYM(sg_krow0)(p, b);
    for (int64_t j = 0; j < s.Sk; ++j) {
      ab_vec_load_row(p->k.data, p->k.dtype, s.k + j * s.k_rs, D, ls, row);
      for (int64_t d = 0; d < Dp; d += VLEN) vstore(row + d, vload(row + d) - vload(mean + d));
      int32_t sum;
      w->sk[r0 + j] = SYM(sg_quant_row)(row, Dp, (sg_t*)(w->kw + (r0 + j) * Dg), SG_G == 4, &sum);
    }
  }
  ab_scratch_free(row);
}

/* ---- S^T = K Q^T in int8, dequantized --------------------------------------------------------- */

/* C[m][v] = dot(A row m, B lane block v) * sk[m] * sq[v] + bias[v] for m < M keys and v < NV vectors
 * of query rows; A: M rows of Dg words (stride am), B: (Dg x rc) words, lanes = rows; the
 * accumulators start from c0 (VNNI's -128 * rowsum(q)). */
static inline __attribute__((always_inline)) SG_TARGET void SYM(sg_mk)(const int M, const int NV, int64_t Dg,
                                                                      const uint32_t* A, int64_t am,
                                                                      const uint32_t* B, int64_t ldb,
                                                                      const int32_t* c0, const float* sq,
                                                                      const float* sk, const float* bias, float* C) {
  vi acc[MR][NV_MAX];
  for (int v = 0; v < NV; ++v) {
    const vi c = SYM(vload_i)(c0 + v * VLEN);
    for (int m = 0; m < M; ++m) acc[m][v] = c;
  }
  for (int64_t g = 0; g < Dg; ++g) {
    vi b[NV_MAX];
    for (int v = 0; v < NV; ++v) b[v] = SYM(vload_i)(B + g * ldb + v * VLEN);
    for (int m = 0; m < M; ++m) {
      const vi a = SYM(vset1_i)(A[m * am + g]);
      for (int v = 0; v < NV; ++v) acc[m][v] = SYM(sg_dot)(acc[m][v], a, b[v]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const vf s = vset1(sk[m]);
    for (int v = 0; v < NV; ++v)
      vstore(C + m * ldb + v * VLEN,
             __builtin_convertvector(acc[m][v], vf) * (vload(sq + v * VLEN) * s) + vload(bias + v * VLEN));
  }
}

#define SG_CASE(M_, NV_) SYM(sg_mk)(M_, NV_, Dg, A + m * Dg, Dg, B, rc, c0, sq, sk + m, bias, C + m * rc)
#define SG_NV(M_)                                           \
  switch (nv) {                                             \
    case 1: SG_CASE(M_, 1); break;                          \
    case 2: SG_CASE(M_, 2); break;                          \
    case 3: SG_CASE(M_, 3 > NV_MAX ? NV_MAX : 3); break;    \
    default: SG_CASE(M_, NV_MAX); break;                    \
  }

/* St (nb keys x rc rows) for one key block: A = the block's quantized K rows, B = packed Q^T. */
static SG_TARGET void SYM(sg_qk)(int64_t nb, int nv, int64_t Dg, const uint32_t* A, const uint32_t* B,
                                 const int32_t* c0, const float* sq, const float* sk, const float* bias,
                                 float* C) {
  const int64_t rc = (int64_t)nv * VLEN;
  int64_t m = 0;
  for (; m + MR <= nb; m += MR) SG_NV(MR);
  switch (nb - m) {
    case 5: SG_NV(5); break;
    case 4: SG_NV(4); break;
    case 3: SG_NV(3); break;
    case 2: SG_NV(2); break;
    case 1: SG_NV(1); break;
    default: break;
  }
}

#undef SG_NV
#undef SG_CASE

/* ---- forward ----------------------------------------------------------------------------------- */

static void SYM(sg_fwd_range)(int64_t begin, int64_t end, void* vctx) {
  SYM(sg_ctx)* ctx = (SYM(sg_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const SYM(sg_ws)* w = &ctx->w;
  const int64_t D = p->D, Dv = p->Dv, group = p->Hq / p->Hkv, Dp = w->Dp, Dg = w->Dg;
  const int nv = ctx->nv;
  const int64_t rc = (int64_t)nv * VLEN;
  const int64_t Dvp = (Dv + VLEN - 1) / VLEN * VLEN;
  const int64_t Tmax = Dp > Dvp ? Dp : Dvp;
  /* V rows are read in place when float32, contiguous and a whole number of vectors wide */
  const int v_direct = p->v.dtype == AB_DTYPE_F32 && p->v.strides[p->v.ndim - 1] == 1 && Dv == Dvp;
  const size_t nfl = (size_t)(rc * Dvp + BK * rc + BK * Dvp + Tmax + 6 * rc);
  const size_t nq = sizeof(uint32_t) * (size_t)(Dg * rc) + sizeof(sg_t) * (size_t)(rc * Dp);
  float* on = (float*)ab_scratch_alloc(sizeof(float) * nfl + nq + sizeof(int32_t) * 3 * (size_t)rc);
  if (!on) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "sage: out of memory for the tile scratch");
    return;
  }
  float* st = on + rc * Dvp;   /* S^T, then P^T (BK x rc) */
  float* vp = st + BK * rc;    /* V block as float32 rows, when not read in place */
  float* tmp = vp + BK * Dvp;  /* one Q row (zero-padded to Dp), then one output row */
  float* mrow = tmp + Tmax;    /* running max */
  float* lrow = mrow + rc;     /* running sum */
  float* arow = lrow + rc;     /* this block's rescale factors */
  float* sq = arow + rc;       /* Q row scales, softmax scale folded in */
  float* bias = sq + rc;       /* scale * q . mean: what the smoothing took off each row */
  float* spare = bias + rc;    /* keeps the float region a whole number of vectors */
  uint32_t* qp = (uint32_t*)(spare + rc); /* packed Q^T (Dg x rc words) */
  sg_t* qrow = (sg_t*)(qp + Dg * rc);     /* quantized Q rows (rc x Dp) */
  int32_t* c0 = (int32_t*)(qrow + rc * Dp);
  int32_t* lo = c0 + rc;
  int32_t* hi = lo + rc;
  const float scale = (float)p->scale;
  const int64_t qls = p->q.strides[p->q.ndim - 1];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t c = item % ctx->nchunk, bh = item / ctx->nchunk;
    const int64_t h = bh % p->Hq, b = bh / p->Hq, hk = h / group;
    SYM(seq) s;
    SYM(seq_get)(p, b, h, hk, &s);
    const int64_t i0 = c * rc;
    if (i0 >= s.Sq) continue;
    const int64_t nrows = s.Sq - i0 < rc ? s.Sq - i0 : rc;
    int64_t jlo, jhi, all_lo, all_hi;
    SYM(chunk_ranges)(p, &s, i0, nrows, rc, lo, hi, mrow, lrow, &jlo, &jhi, &all_lo, &all_hi);
    /* quantize this chunk's Q rows; padded rows are zero with scale 0 (and masked below) */
    const float* mean = w->mean + (b * p->Hkv + hk) * Dp;
    memset(tmp, 0, sizeof(float) * (size_t)Dp);
    for (int64_t r = 0; r < rc; ++r) {
      int32_t sum = 0;
      if (r < nrows) {
        ab_vec_load_row(p->q.data, p->q.dtype, s.q + (i0 + r) * s.q_rs, D, qls, tmp);
        sq[r] = SYM(sg_quant_row)(tmp, Dp, qrow + r * Dp, 0, &sum) * scale;
        vf dot = vset1(0.0f);
        for (int64_t d = 0; d < Dp; d += VLEN) dot += vload(tmp + d) * vload(mean + d);
        float t = 0.0f;
        for (int u = 0; u < VLEN; ++u) t += dot[u];
        bias[r] = t * scale;
      } else {
        memset(qrow + r * Dp, 0, sizeof(sg_t) * (size_t)Dp);
        sq[r] = bias[r] = 0.0f;
      }
      c0[r] = SG_G == 4 ? -128 * sum : 0;
    }
    for (int64_t g = 0; g < Dg; ++g)
      for (int64_t r = 0; r < rc; r += VLEN) {
        const vi x = SYM(sg_gather)((const uint32_t*)(qrow + r * Dp) + g, (int32_t)Dg);
        memcpy(qp + g * rc + r, &x, sizeof x);
      }
    memset(on, 0, sizeof(float) * (size_t)(nrows * Dvp));
    const int partial_rows = nrows < rc;
    const int64_t r0 = hk * w->Ktot + SYM(sg_krow0)(p, b);
    for (int64_t j0 = jlo; j0 < jhi; j0 += BK) {
      const int64_t nb = jhi - j0 < BK ? jhi - j0 : BK;
      SYM(sg_qk)(nb, nv, Dg, w->kw + (r0 + j0) * Dg, qp, c0, sq, w->sk + r0 + j0, bias, st);
      const int structural = partial_rows || j0 < all_lo || j0 + nb > all_hi;
      SYM(mask_scores)(p, &s, i0, nrows, j0, nb, lo, hi, structural, st, NULL, rc);
      if (SYM(online_softmax)(st, nb, mrow, lrow, arow, nv)) SYM(rescale_rows)(on, arow, nrows, Dvp);
      SYM(accum_pv)(p, &s, v_direct, j0, nb, nrows, rc, st, vp, on, Dvp); /* float32 P.V */
    }
    SYM(store_rows)(p, &s, i0, nrows, on, Dvp, mrow, lrow, tmp);
    memset(tmp, 0, sizeof(float) * (size_t)Dp); /* the next chunk's Q rows expect zero padding */
  }
  ab_scratch_free(on);
}

static size_t SYM(sage_workspace_size)(const ab_attn_params* p) {
  SYM(sg_ws) w;
  return SYM(sg_layout)(p, NULL, &w);
}

static ab_status SYM(sage_fwd)(const ab_attn_params* p, void* workspace, size_t bytes, const ab_cpu_pool* pool,
                               ab_error* err) {
  SYM(sg_ctx) ctx;
  ctx.p = p;
  ctx.st.err = err;
  atomic_init(&ctx.st.status, AB_OK);
  const size_t need = SYM(sg_layout)(p, workspace, &ctx.w);
  if (bytes < need || (need && !workspace))
    return ab_error_set(err, AB_ERR_INVALID, "sage: workspace of %zu bytes, %zu needed", bytes, need);
  /* the prepass touches each K element twice; the products below touch it rc times */
  const double prep = (double)p->B * p->Hkv * p->Sk * (double)p->D * 8.0;
  ab_status st = ab_par_run(pool, p->B * p->Hkv, 1, prep, SYM(sg_prep_range), &ctx, &ctx.st);
  if (st != AB_OK) return st;
  SYM(fwd_chunks)(p->Sq, &ctx.nv, &ctx.nchunk);
  const double work = (double)p->B * p->Hq * p->Sq * p->Sk * (double)(p->D / 4 + p->Dv);
  return ab_par_run(pool, p->B * p->Hq * ctx.nchunk, 1, work, SYM(sg_fwd_range), &ctx, &ctx.st);
}

const ab_sage_cpu_table AB_CAT(ab_sage_cpu, AB_ISA_SFX) = {
#if SG_G == 4
    "avx512_vnni",
#else
    AB_ISA_NAME,
#endif
    SYM(sage_workspace_size), SYM(sage_fwd)};
