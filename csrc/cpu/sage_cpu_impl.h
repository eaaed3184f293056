/* sage_cpu_impl.h -- the CPU sage kernel (SageAttention recipe: smoothed K, INT8 Q.K^T), forward
 * only, one source for every ISA.
 *
 * Included by cpu_isa_impl.h (one ISA's build) after flash_fwd_impl.h, whose tiles it reuses
 * (cpu_tiles_impl.h and the forward's chunk pieces): the transposed score layout St[j][r] (key j,
 * query row r of a chunk of rc rows along the vector lanes), the per-sequence geometry (dense and
 * packed alike), the causal/window/mask/softcap masking and the online softmax.  The two products differ.  docs/sage.md has the recipe and the
 * accuracy figures.
 *
 * Per call:
 *   1. Prepass, per (batch, KV head), into the workspace the shim allocates (the caller's K and V
 *      are never written):
 *      - mean_d of K over the sequence and the channel factors c_d = sqrt(max_j |K_jd - mean_d|)
 *        (1 for an all-zero or non-finite channel);
 *      - each row of (K - mean) / c quantized to int8, symmetric, scale sk = amax / 127 per key.
 *        Smoothing takes the channel-wide offsets (the outliers that would otherwise set every
 *        row's amax) out of K; dividing by c moves half of what is left of each channel's range
 *        into Q (SmoothQuant's balance), so a channel with 10x the others' scale no longer sets
 *        every key's int8 step alone;
 *      - V in blocks of BK keys (aligned to the sequence start) as int16 fixed point, per block and
 *        channel: sv = amax / SG_VQ, pairs of keys interleaved (the operand layout of vpdpwssd).
 *   2. Per (batch, head, chunk of rc query rows): each Q row times c, quantized likewise, its scale
 *      sq with the softmax scale folded in, and bias[r] = scale * q_r . mean, what the smoothing
 *      took off row r's scores (q . k = (q c) . ((k - mean) / c) + q . mean).
 *   3. Per block of BK keys: St[j][r] = dot_int32(Kq_j, Qq_r) * sk[j] * sq[r] + bias[r].  Softmax
 *      alone would not need bias (it shifts a whole row), but with it lse is the exact definition
 *      and softcap sees the true scores.
 *   4. Masking and the online softmax exactly as flash (float32).
 *   5. O += P V in int16 fixed point: each row's P over the block (<= 1, the running max is
 *      subtracted) scaled to [0, SG_PQ] by that row's largest P in the block, pairs of keys packed
 *      into 32-bit words, int32 sums of P_q V_q per block, then O += sum * ps[r] * sv[d] in float32.
 *      The steps are 1/4096 of the row's block maximum for P and 1/8191 of the channel's block
 *      maximum for V (rounding errors of half that): finer than bfloat16 or float16 P.V.
 *
 * The integer products, by ISA (int8 Q.K^T with G values per 32-bit lane; int16 P.V pairs):
 *   avx512 (with VNNI): G = 4, vpdpbusd (u8 x s8, sums of 4 products into s32).  K is stored as u8 =
 *     k + 128 (the sign bit flipped), so a lane sums (k + 128) q = k q + 128 q; the accumulators of
 *     query row r start at -128 * sum_d q[r][d], which cancels the excess.  No overflow:
 *     |sum| <= D * 255 * 127 < 2^31 for D < 66000.  P.V: vpdpwssd (s16 pairs into s32).
 *   avx2: G = 2, vpmaddwd on int16 pairs (values in [-127, 127]: a pair sum cannot overflow);
 *     P.V: vpmaddwd and an add.
 *   generic: G = 1, int32 products; P.V: the int16 halves of each word multiplied in int32.
 * The three give the same int32 sums; the outputs differ only in float rounding.
 * P.V cannot overflow: a block sums BK = 64 products of |P_q| <= 4096 and |V_q| <= 8191,
 * 64 * 4096 * 8191 = 2147221504 < 2^31.
 */

#if VLEN == 16
#define SG_G 4
#define SG_ISA_NAME "avx512_vnni"
#define SG_TARGET __attribute__((target("avx512vnni")))
typedef int8_t sg_t;
#elif VLEN == 8
#define SG_G 2
#define SG_ISA_NAME AB_ISA_NAME
#define SG_TARGET
typedef int16_t sg_t;
#else
#define SG_G 1
#define SG_ISA_NAME AB_ISA_NAME
#define SG_TARGET
typedef int32_t sg_t;
#endif

#define SG_PQ 4096 /* P in [0, 1] -> [0, SG_PQ] (per row and block) */
#define SG_VQ 8191 /* V in [-amax, amax] -> [-SG_VQ, SG_VQ] (per channel and block) */

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

/* acc + the two-way int16 dot product of each 32-bit lane of a (P pair, broadcast) and b (V pair). */
static inline __attribute__((always_inline)) SG_TARGET vi SYM(sg_dot16)(vi acc, vi a, vi b) {
#if SG_G == 4
  return (vi)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif SG_G == 2
  return acc + (vi)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
  const vi alo = (vi)((vu)a << 16) >> 16, blo = (vi)((vu)b << 16) >> 16;
  return acc + alo * blo + (a >> 16) * (b >> 16);
#endif
}

/* The int16 pairs of P.V's operands from values already rounded to integers: r0 in the low half of
 * each 32-bit word, r1 in the high half; an inf or NaN becomes 0 (its scale carries the NaN). */
static inline vi SYM(sg_pair)(vf r0, vf r1) {
  const vi lo = __builtin_convertvector(vselect(r0 - r0 == 0, r0, vset1(0.0f)), vi);
  const vi hi = __builtin_convertvector(vselect(r1 - r1 == 0, r1, vset1(0.0f)), vi);
  return (lo & 0xffff) | (vi)((vu)hi << 16);
}

/* Tiny magnitudes are scaled by 2^64 before they are divided into: 127 / amax (8191 / amax for V)
 * would overflow float32 below about 4e-37 (2e-35), and the whole row (channel) would quantize to
 * garbage.  x * 2^64 <= 1 there, and 2^64 * 2^-149 (the smallest denormal) keeps the quotient finite. */
static inline float SYM(sg_pre)(float amax) { return amax < 0x1p-64f ? 0x1p64f : 1.0f; }

/* The largest |x| of x (n floats, n a multiple of VLEN); *bad is nonzero when x holds an inf or a
 * NaN.  The quantization step of a row (sg_quant_row, the AMX kernel's sg_quant). */
static inline float SYM(sg_amax)(const float* x, int64_t n, float* bad) {
  vf amax = vset1(0.0f), b = vset1(0.0f);
  for (int64_t d = 0; d < n; d += VLEN) {
    const vf v = vload(x + d);
    amax = vmax(amax, (vf)((vi)v & 0x7fffffff));
    b += v - v; /* 0 for finite values, NaN for inf and NaN */
  }
  float nan_seen = 0.0f;
  for (int u = 0; u < VLEN; ++u) nan_seen += b[u];
  *bad = nan_seen;
  return vhmax(amax);
}

/* Quantizes x (Dp floats, zero past the real dims) to q = round(x / s) in [-127, 127] with
 * s = amax / 127, stored as sg_t (with the sign bit flipped when flip: K's u8 form for vpdpbusd).
 * Returns s and writes sum_d q to *sum.  An inf or NaN in x gives s = NaN, so every score of that
 * row or key is NaN (NaN in, NaN out) and the int8 values, then meaningless, are zero. */
static float SYM(sg_quant_row)(const float* x, int64_t Dp, sg_t* dst, int flip, int32_t* sum) {
  float nan_seen;
  const float a = SYM(sg_amax)(x, Dp, &nan_seen);
  *sum = 0;
  if (a == 0.0f || nan_seen != 0.0f || a != a) {
    const vsg zero = {0};
    const vsg fill = flip ? zero ^ (sg_t)0x80 : zero;
    for (int64_t d = 0; d < Dp; d += VLEN) memcpy(dst + d, &fill, sizeof fill);
    return a == 0.0f && nan_seen == 0.0f ? 0.0f : __builtin_nanf("");
  }
  /* |x| * (127 / amax) <= 127 * (1 + 2 eps) < 127.5: never rounds past 127 */
  const float pre = SYM(sg_pre)(a);
  const vf inv = vset1(127.0f / (a * pre)), vpre = vset1(pre);
  vi s = {0};
  for (int64_t d = 0; d < Dp; d += VLEN) {
    const vi qi = __builtin_convertvector(vround((vload(x + d) * vpre) * inv), vi);
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

/* ---- the workspace: quantized K and V, their scales, the means and channel factors ------------ */

typedef struct SYM(sg_ws) {
  uint32_t* kw;  /* (Hkv, Ktot, Dg) words: row j of (K - mean) / c as int8 (u8 under VNNI), G per word */
  float* sk;     /* (Hkv, Ktot) scale of each key row */
  float* mean;   /* (B, Hkv, Dp) mean of K over each sequence */
  float* cf;     /* (B, Hkv, Dp) channel factors c */
  uint32_t* vw;  /* (Hkv, Vrows, Dvp / 2) words: V blocks, word (kp, d) = int16 (V[2kp][d], V[2kp+1][d]) */
  float* sv;     /* (Hkv, Vslots, Dvp) per block and channel scale of V */
  int64_t Ktot;  /* B * Sk dense; total_k packed */
  int64_t Dp, Dg; /* D rounded up to a whole vector; words per row */
  int64_t Dvp, Vrows, Vslots;
} SYM(sg_ws);

static size_t SYM(sg_align)(size_t n) { return (n + 63) & ~(size_t)63; }

/* n buffers of sizes[i] bytes, each starting on 64 bytes, one after another from base: at[i] (NULL
 * when base is); returns the bytes they take.  The CPU and the AMX workspace layouts. */
static size_t SYM(sg_carve)(void* base, const size_t* sizes, int n, void** at) {
  size_t total = 0;
  for (int i = 0; i < n; ++i) {
    at[i] = base ? (char*)base + total : NULL;
    total += SYM(sg_align)(sizes[i]);
  }
  return total;
}

/* Fills w's pointers into base (when not NULL); returns the bytes needed.  Sequence b's V blocks
 * start at row vrow0(b) = krow0(b) + BK * b, which leaves each sequence room for whole blocks; a
 * block starting at row R keeps its scales in slot R / BK (distinct: block starts are >= BK apart). */
static size_t SYM(sg_layout)(const ab_attn_params* p, void* base, SYM(sg_ws) * w) {
  w->Ktot = p->cu_seqlens_k ? p->k.sizes[0] : p->B * p->Sk;
  w->Dp = (p->D + VLEN - 1) / VLEN * VLEN;
  w->Dg = w->Dp / SG_G;
  w->Dvp = (p->Dv + VLEN - 1) / VLEN * VLEN;
  w->Vrows = w->Ktot + BK * p->B;
  w->Vslots = w->Vrows / BK + 1;
  const size_t sizes[6] = {
      sizeof(uint32_t) * (size_t)(p->Hkv * w->Ktot * w->Dg),
      sizeof(float) * (size_t)(p->Hkv * w->Ktot),
      sizeof(float) * (size_t)(p->B * p->Hkv * w->Dp),
      sizeof(float) * (size_t)(p->B * p->Hkv * w->Dp),
      sizeof(int16_t) * (size_t)(p->Hkv * w->Vrows * w->Dvp),
      sizeof(float) * (size_t)(p->Hkv * w->Vslots * w->Dvp),
  };
  void* at[6];
  const size_t total = SYM(sg_carve)(base, sizes, 6, at);
  w->kw = (uint32_t*)at[0];
  w->sk = (float*)at[1];
  w->mean = (float*)at[2];
  w->cf = (float*)at[3];
  w->vw = (uint32_t*)at[4];
  w->sv = (float*)at[5];
  return total;
}

/* Row index of key 0 of sequence b in the workspace's K rows, and in its V rows. */
static inline int64_t SYM(sg_krow0)(const ab_attn_params* p, int64_t b) {
  return p->cu_seqlens_k ? p->cu_seqlens_k[b] : b * p->Sk;
}
static inline int64_t SYM(sg_vrow0)(const ab_attn_params* p, int64_t b) { return SYM(sg_krow0)(p, b) + BK * b; }

typedef struct SYM(sg_ctx) {
  const ab_attn_params* p;
  SYM(sg_ws) w;
  int64_t nchunk;
  int nv;
  ab_par_status st;
} SYM(sg_ctx);

/* The V blocks of one (batch, KV head): rows [t BK, t BK + BK) of the sequence, per channel
 * sv = amax / SG_VQ and q = round(v / sv), pairs of keys interleaved; rows past Sk are zero.  A
 * channel with an inf or NaN in the block gets sv = NaN (NaN out for the rows that read the block). */
static void SYM(sg_prep_v)(const ab_attn_params* p, const SYM(sg_ws) * w, const SYM(seq) * s, int64_t b,
                           int64_t hk, float* vb) {
  const int64_t Dv = p->Dv, Dvp = w->Dvp;
  for (int64_t t0 = 0; t0 < s->Sk; t0 += BK) {
    const int64_t nb = s->Sk - t0 < BK ? s->Sk - t0 : BK;
    SYM(pack_rows)(&p->v, s->v, s->v_rs, t0, nb, Dv, Dvp, vb);
    memset(vb + nb * Dvp, 0, sizeof(float) * (size_t)((BK - nb) * Dvp));
    const int64_t R = SYM(sg_vrow0)(p, b) + t0;
    uint32_t* dst = w->vw + (hk * w->Vrows + R) * (Dvp / 2);
    float* sv = w->sv + (hk * w->Vslots + R / BK) * Dvp;
    for (int64_t d = 0; d < Dvp; d += VLEN) {
      vf amax = vset1(0.0f), bad = vset1(0.0f);
      for (int64_t j = 0; j < nb; ++j) {
        const vf x = vload(vb + j * Dvp + d);
        amax = vmax(amax, (vf)((vi)x & 0x7fffffff));
        bad += x - x; /* 0 for finite values, NaN for inf and NaN */
      }
      vf inv = vset1(0.0f), pre = vset1(1.0f), scale = vset1(0.0f);
      for (int u = 0; u < VLEN; ++u) {
        const int ok = bad[u] == 0.0f && amax[u] > 0.0f;
        pre[u] = SYM(sg_pre)(amax[u]);
        inv[u] = ok ? (float)SG_VQ / (amax[u] * pre[u]) : 0.0f;
        scale[u] = bad[u] == 0.0f ? amax[u] / (float)SG_VQ : __builtin_nanf("");
      }
      vstore(sv + d, scale);
      for (int64_t kp = 0; kp < BK / 2; ++kp) {
        const vi word = SYM(sg_pair)(vround((vload(vb + 2 * kp * Dvp + d) * pre) * inv),
                                     vround((vload(vb + (2 * kp + 1) * Dvp + d) * pre) * inv));
        memcpy(dst + kp * Dvp + d, &word, sizeof word);
      }
    }
  }
}


/* Query row q (D values at element offset off of p->q) smoothed for sage: tmp[0, n) = q * c (tmp
 * must be zero past D), and the row's bias, scale * q . mean: what the smoothing of K took off its
 * scores.  The CPU and the AMX kernels' chunk set-up. */
static float SYM(sg_q_row)(const ab_attn_params* p, int64_t off, int64_t n, const float* mean, const float* cf,
                           float scale, float* tmp) {
  ab_vec_load_row(p->q.data, p->q.dtype, off, p->D, p->q.strides[p->q.ndim - 1], tmp);
  vf dot = vset1(0.0f);
  for (int64_t d = 0; d < n; d += VLEN) {
    dot += vload(tmp + d) * vload(mean + d);
    vstore(tmp + d, vload(tmp + d) * vload(cf + d));
  }
  float t = 0.0f;
  for (int u = 0; u < VLEN; ++u) t += dot[u];
  return t * scale;
}
/* K's smoothing of one sequence s (Dp floats each, zero past D): mean over the keys, channel
 * factors cf = sqrt(max_j |K_jd - mean_d|) (1 for an all-zero or non-finite channel) and icf = 1 / cf.
 * lo, hi, row: Dp floats of scratch.  Shared with the AMX sage kernel (sage_amx_impl.h). */
static void SYM(sg_k_stats)(const ab_attn_params* p, const SYM(seq) * s, int64_t Dp, float* mean, float* cf,
                            float* icf, float* lo, float* hi, float* row) {
  memset(mean, 0, sizeof(float) * (size_t)Dp);
  memset(row, 0, sizeof(float) * (size_t)Dp);
  for (int64_t d = 0; d < Dp; ++d) lo[d] = hi[d] = 0.0f;
  const int64_t ls = p->k.strides[p->k.ndim - 1];
  for (int64_t j = 0; j < s->Sk; ++j) {
    ab_vec_load_row(p->k.data, p->k.dtype, s->k + j * s->k_rs, p->D, ls, row);
    for (int64_t d = 0; d < Dp; d += VLEN) {
      const vf x = vload(row + d);
      vstore(mean + d, vload(mean + d) + x);
      vstore(hi + d, j ? vmax(vload(hi + d), x) : x);
      vstore(lo + d, j ? -vmax(-vload(lo + d), -x) : x);
    }
  }
  if (s->Sk > 0) {
    const vf inv = vset1((float)(1.0 / (double)s->Sk));
    for (int64_t d = 0; d < Dp; d += VLEN) vstore(mean + d, vload(mean + d) * inv);
  }
  for (int64_t d = 0; d < Dp; ++d) {
    const float a = fmaxf(hi[d] - mean[d], mean[d] - lo[d]);
    cf[d] = a > 0.0f && a < __builtin_inff() ? sqrtf(a) : 1.0f;
    icf[d] = 1.0f / cf[d];
  }
}

/* Prepass over items (batch, KV head): K's mean and channel factors, every row of (K - mean) / c
 * quantized, then V's blocks. */
static void SYM(sg_prep_range)(int64_t begin, int64_t end, void* vctx) {
  SYM(sg_ctx)* ctx = (SYM(sg_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const SYM(sg_ws)* w = &ctx->w;
  const int64_t D = p->D, Dp = w->Dp, Dg = w->Dg, group = p->Hq / p->Hkv;
  float* row = (float*)ab_scratch_alloc(sizeof(float) * (size_t)(4 * Dp + BK * w->Dvp));
  if (!row) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "sage: out of memory for the K and V prepass");
    return;
  }
  float* lo = row + Dp;  /* channel minimum of K */
  float* hi = lo + Dp;   /* channel maximum of K */
  float* icf = hi + Dp;  /* 1 / c */
  float* vb = icf + Dp;  /* one V block as float32 rows */
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p->Hkv, hk = item % p->Hkv;
    SYM(seq) s;
    SYM(seq_get)(p, b, hk * group, hk, &s);
    float* mean = w->mean + (b * p->Hkv + hk) * Dp;
    float* cf = w->cf + (b * p->Hkv + hk) * Dp;
    SYM(sg_k_stats)(p, &s, Dp, mean, cf, icf, lo, hi, row);
    const int64_t ls = p->k.strides[p->k.ndim - 1];
    const int64_t r0 = hk * w->Ktot + SYM(sg_krow0)(p, b);
    for (int64_t j = 0; j < s.Sk; ++j) {
      ab_vec_load_row(p->k.data, p->k.dtype, s.k + j * s.k_rs, D, ls, row);
      for (int64_t d = 0; d < Dp; d += VLEN)
        vstore(row + d, (vload(row + d) - vload(mean + d)) * vload(icf + d));
      int32_t sum;
      w->sk[r0 + j] = SYM(sg_quant_row)(row, Dp, (sg_t*)(w->kw + (r0 + j) * Dg), SG_G == 4, &sum);
    }
    SYM(sg_prep_v)(p, w, &s, b, hk, vb);
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

/* ---- O += P V in int16 fixed point ----------------------------------------------------------- */

/* C[m][v] += (sum_kp dot16(A[kp][m], B[kp][v])) * ps[m] * sv[v] for m < M rows and v < NV vectors
 * of channels; A: pairs of P (np x rc words, rows consecutive), B: pairs of V (np x ldb words). */
static inline __attribute__((always_inline)) SG_TARGET void SYM(sg_pv_mk)(const int M, const int NV, int64_t np,
                                                                         const uint32_t* A, int64_t ak,
                                                                         const uint32_t* B, int64_t ldb,
                                                                         const float* ps, const float* sv,
                                                                         float* C, int64_t ldc) {
  vi acc[MR][NV_MAX];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = (vi){0};
  for (int64_t kp = 0; kp < np; ++kp) {
    vi b[NV_MAX];
    for (int v = 0; v < NV; ++v) b[v] = SYM(vload_i)(B + kp * ldb + v * VLEN);
    for (int m = 0; m < M; ++m) {
      const vi a = SYM(vset1_i)(A[kp * ak + m]);
      for (int v = 0; v < NV; ++v) acc[m][v] = SYM(sg_dot16)(acc[m][v], a, b[v]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const vf s = vset1(ps[m]);
    for (int v = 0; v < NV; ++v)
      vstore(C + m * ldc + v * VLEN, vload(C + m * ldc + v * VLEN) +
                                         __builtin_convertvector(acc[m][v], vf) * (s * vload(sv + v * VLEN)));
  }
}

#define PV_CASE(M_, NV_) SYM(sg_pv_mk)(M_, NV_, np, A + m, rc, B, ldb, ps + m, svd, C + m * ldc, ldc)
#define PV_NV(M_)                                           \
  switch (nvd) {                                            \
    case 1: PV_CASE(M_, 1); break;                          \
    case 2: PV_CASE(M_, 2); break;                          \
    case 3: PV_CASE(M_, 3 > NV_MAX ? NV_MAX : 3); break;    \
    default: PV_CASE(M_, NV_MAX); break;                    \
  }

/* One key block's O += P V: P^T (nb x rc floats in st, each row's values <= 1) to int16 pairs in
 * pw with per-row scales ps, then the integer product with the block's V pairs vblk (scales sv). */
static SG_TARGET void SYM(sg_pv)(int64_t nb, int64_t nrows, int nv, const float* st, uint32_t* pw, float* ps,
                                 const uint32_t* vblk, const float* sv, float* on, int64_t Dvp) {
  const int64_t rc = (int64_t)nv * VLEN, np = (nb + 1) / 2, ldc = Dvp, ldb = Dvp;
  for (int v = 0; v < nv; ++v) {
    vf m4[4] = {vset1(0.0f), vset1(0.0f), vset1(0.0f), vset1(0.0f)}; /* four chains: vmaxps is latency-bound */
    for (int64_t j = 0; j < nb; ++j) m4[j & 3] = vmax(m4[j & 3], vload(st + j * rc + v * VLEN));
    const vf mx = vmax(vmax(m4[0], m4[1]), vmax(m4[2], m4[3]));
    vf inv = vset1(0.0f);
    /* A row whose largest weight in this block is below 1e-30 (its scores are > 69 below the running
     * max) is skipped: with l >= 1 its at most 64e-30 are beyond float32's reach, and 4096 / mx
     * stays finite.  A NaN weight (NaN scores) fails the test too: its row is NaN through l. */
    for (int u = 0; u < VLEN; ++u) {
      const int ok = mx[u] > 1e-30f;
      inv[u] = ok ? (float)SG_PQ / mx[u] : 0.0f;
      ps[v * VLEN + u] = ok ? mx[u] / (float)SG_PQ : 0.0f;
    }
    for (int64_t kp = 0; kp < np; ++kp) {
      const vf r1 = 2 * kp + 1 < nb ? vround(vload(st + (2 * kp + 1) * rc + v * VLEN) * inv) : vset1(0.0f);
      const vi word = SYM(sg_pair)(vround(vload(st + 2 * kp * rc + v * VLEN) * inv), r1);
      memcpy(pw + kp * rc + v * VLEN, &word, sizeof word);
    }
  }
  for (int64_t d0 = 0; d0 < Dvp; d0 += NV_MAX * VLEN) {
    const int nvd = (int)((Dvp - d0) / VLEN < NV_MAX ? (Dvp - d0) / VLEN : NV_MAX);
    const uint32_t* A = pw;
    const uint32_t* B = vblk + d0;
    const float* svd = sv + d0;
    float* C = on + d0;
    int64_t m = 0;
    for (; m + MR <= nrows; m += MR) PV_NV(MR);
    switch (nrows - m) {
      case 5: PV_NV(5); break;
      case 4: PV_NV(4); break;
      case 3: PV_NV(3); break;
      case 2: PV_NV(2); break;
      case 1: PV_NV(1); break;
      default: break;
    }
  }
}

#undef PV_NV
#undef PV_CASE

/* ---- forward ----------------------------------------------------------------------------------- */

static void SYM(sg_fwd_range)(int64_t begin, int64_t end, void* vctx) {
  SYM(sg_ctx)* ctx = (SYM(sg_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const SYM(sg_ws)* w = &ctx->w;
  const int64_t Dp = w->Dp, Dg = w->Dg, Dvp = w->Dvp;
  const int nv = ctx->nv;
  const int64_t rc = (int64_t)nv * VLEN;
  const int64_t Tmax = Dp > Dvp ? Dp : Dvp;
  const size_t nfl = (size_t)(rc * Dvp + BK * rc + Tmax + 6 * rc);
  const size_t nq = sizeof(uint32_t) * (size_t)(Dg * rc + BK / 2 * rc) + sizeof(sg_t) * (size_t)(rc * Dp);
  float* on = (float*)ab_scratch_alloc(sizeof(float) * nfl + nq + sizeof(int32_t) * 3 * (size_t)rc);
  if (!on) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "sage: out of memory for the tile scratch");
    return;
  }
  float* st = on + rc * Dvp;   /* S^T, then P^T (BK x rc) */
  float* tmp = st + BK * rc;   /* one Q row (zero-padded to Dp), then one output row */
  float* mrow = tmp + Tmax;    /* running max */
  float* lrow = mrow + rc;     /* running sum */
  float* arow = lrow + rc;     /* this block's rescale factors */
  float* sq = arow + rc;       /* Q row scales, softmax scale folded in */
  float* bias = sq + rc;       /* scale * q . mean: what the smoothing took off each row */
  float* ps = bias + rc;       /* this block's P scale per row */
  uint32_t* qp = (uint32_t*)(ps + rc);    /* packed Q^T (Dg x rc words) */
  uint32_t* pw = qp + Dg * rc;            /* P^T as int16 pairs of keys (BK / 2 x rc words) */
  sg_t* qrow = (sg_t*)(pw + BK / 2 * rc); /* quantized Q rows (rc x Dp) */
  int32_t* c0 = (int32_t*)(qrow + rc * Dp);
  int32_t* lo = c0 + rc;
  int32_t* hi = lo + rc;
  const float scale = (float)p->scale;
  for (int64_t item = begin; item < end; ++item) {
    SYM(chunk) ch;
    if (!SYM(chunk_begin)(p, item, ctx->nchunk, rc, lo, hi, mrow, lrow, &ch)) continue;
    const SYM(seq) s = ch.s;
    const int64_t b = ch.b, hk = ch.hk, i0 = ch.i0, nrows = ch.nrows, jlo = ch.jlo, jhi = ch.jhi;
    const int64_t all_lo = ch.all_lo, all_hi = ch.all_hi;
    /* quantize this chunk's Q rows times c; padded rows are zero with scale 0 (and masked below) */
    const float* mean = w->mean + (b * p->Hkv + hk) * Dp;
    const float* cf = w->cf + (b * p->Hkv + hk) * Dp;
    memset(tmp, 0, sizeof(float) * (size_t)Dp);
    for (int64_t r = 0; r < rc; ++r) {
      int32_t sum = 0;
      if (r < nrows) {
        bias[r] = SYM(sg_q_row)(p, s.q + (i0 + r) * s.q_rs, Dp, mean, cf, scale, tmp);
        sq[r] = SYM(sg_quant_row)(tmp, Dp, qrow + r * Dp, 0, &sum) * scale;
      } else {
        memset(qrow + r * Dp, 0, sizeof(sg_t) * (size_t)Dp);
        sq[r] = bias[r] = 0.0f;
      }
      c0[r] = SG_G == 4 ? -128 * sum : 0;
    }
    for (int64_t g = 0; g < Dg; ++g)
      for (int64_t r = 0; r < rc; r += VLEN) {
        const vi x = vgather_words((const uint32_t*)(qrow + r * Dp) + g, (int32_t)Dg);
        memcpy(qp + g * rc + r, &x, sizeof x);
      }
    memset(on, 0, sizeof(float) * (size_t)(nrows * Dvp));
    const int partial_rows = nrows < rc;
    const int64_t r0 = hk * w->Ktot + SYM(sg_krow0)(p, b);
    const int64_t v0 = hk * w->Vrows + SYM(sg_vrow0)(p, b);
    /* key blocks start on V's block grid (multiples of BK from the sequence start); keys before
     * jlo in the first block are masked like any other invisible key */
    for (int64_t j0 = jlo < jhi ? jlo - jlo % BK : jhi; j0 < jhi; j0 += BK) {
      const int64_t nb = jhi - j0 < BK ? jhi - j0 : BK;
      SYM(sg_qk)(nb, nv, Dg, w->kw + (r0 + j0) * Dg, qp, c0, sq, w->sk + r0 + j0, bias, st);
      const int structural = partial_rows || j0 < all_lo || j0 + nb > all_hi;
      SYM(mask_scores)(p, &s, i0, nrows, j0, nb, lo, hi, structural, st, NULL, rc, 1.0);
      if (SYM(online_softmax)(st, nb, mrow, lrow, arow, nv)) SYM(rescale_rows)(on, arow, nrows, Dvp);
      const int64_t R = v0 + j0; /* the block's first V row */
      SYM(sg_pv)(nb, nrows, nv, st, pw, ps, w->vw + R * (Dvp / 2),
                 w->sv + (hk * w->Vslots + (R - hk * w->Vrows) / BK) * Dvp, on, Dvp);
    }
    SYM(store_rows)(p, &s, i0, nrows, on, Dvp, mrow, lrow, tmp);
    memset(tmp, 0, sizeof(float) * (size_t)Dp); /* the next chunk's Q rows expect zero padding */
  }
  ab_scratch_free(on);
}

/* The entry points (cpu_isa_impl.h puts them in the table; the AMX builds, which run sage on tiles,
 * compile them unused). */
static __attribute__((unused)) size_t SYM(sage_workspace_size)(const ab_attn_params* p) {
  SYM(sg_ws) w;
  return SYM(sg_layout)(p, NULL, &w);
}

static __attribute__((unused)) ab_status SYM(sage_fwd)(const ab_attn_params* p, void* workspace, size_t bytes,
                                                       const ab_cpu_pool* pool, ab_error* err) {
  SYM(sg_ctx) ctx;
  ctx.p = p;
  ctx.st.err = err;
  atomic_init(&ctx.st.status, AB_OK);
  const size_t need = SYM(sg_layout)(p, workspace, &ctx.w);
  if (bytes < need || (need && !workspace))
    return ab_error_set(err, AB_ERR_INVALID, "sage: workspace of %zu bytes, %zu needed", bytes, need);
  /* the prepass touches each K element twice and each V element once */
  const double prep = (double)p->B * p->Hkv * ab_rows_k(p) * (double)(p->D * 8 + p->Dv * 4);
  ab_status st = ab_par_run(pool, p->B * p->Hkv, 1, prep, SYM(sg_prep_range), &ctx, &ctx.st);
  if (st != AB_OK) return st;
  const int64_t Sq = ab_rows_q(p), Sk = ab_rows_k(p);
  SYM(fwd_chunks)(Sq, NV_MAX, &ctx.nv, &ctx.nchunk);
  const double work = (double)p->B * p->Hq * Sq * Sk * (double)(p->D / 4 + p->Dv / 2);
  return ab_par_run(pool, p->B * p->Hq * ctx.nchunk, 1, work, SYM(sg_fwd_range), &ctx, &ctx.st);
}
