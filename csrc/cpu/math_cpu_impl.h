/* math_cpu_impl.h -- body of the math (exact reference) CPU kernel, written once for both
 * accumulation types.  math_cpu.c includes it twice: ACC = float (float16 and bfloat16 inputs) and
 * ACC = double (float32 and float64 inputs: exact to the output's rounding, and gradcheck sees float64
 * all the way through; math_cpu.c exact_in_double).
 * SFX(name) gives each copy its own symbol names; ACC_EXP is the libm exp of that precision (the
 * scores themselves, their softcap and lse are computed in double).  No include guard on purpose.
 *
 * Forward, per query row i of head h (KV head hk = h / (Hq / Hkv)):
 *   x_j = scale * q_i . k_j                       j in the causal/window range, bool mask true
 *   x_j = softcap * tanh(x_j / softcap)           if softcap > 0
 *   x_j -= slope_bh * |i + Sk - Sq - j|           with ALiBi
 *   x_j += mask_ij                                if the mask is floating
 *   lse_i = log (exp(s_h) + sum_j exp(x_j));  p_j = exp(x_j - lse_i)   (s_h: the sink, -inf without)
 *   out_i = sum_j keep_ij p_j / (1 - dropout_p) v_j
 * A row with no visible key writes out_i = 0 and lse_i = s_h (-inf without sinks).
 *
 * Backward recomputes p from the row's scores (its max and sum, as the forward did: the saved lse is
 * rounded to float32), one query row at a time, so scratch stays O(Sk):
 *   dP_j  = keep_ij / (1 - dropout_p) * dout_i . v_j
 *   delta = sum_j p_j dP_j - dlse_i               (dlse: the gradient flowing into lse, if any)
 *                                                 (the sink's p has no value: it adds no term)
 *   dS_j  = p_j (dP_j - delta)                    (= the gradient of a float mask)
 *   dx_j  = dS_j (1 - tanh^2)                     with softcap (tanh in double); then dq_i, dk_j, dv_j.
 * Work is split by (b, hk), so each KV head's dk/dv are owned by one thread: no atomics and the
 * same result on every run.
 */

static void SFX(load_row)(const void* base, ab_dtype dt, int64_t off, int64_t n, int64_t stride,
                          ACC* dst) {
  switch (dt) {
    case AB_DTYPE_F32: {
      const float* s = (const float*)base + off;
      for (int64_t x = 0; x < n; ++x) dst[x] = (ACC)s[x * stride];
      break;
    }
    case AB_DTYPE_F16: {
      const uint16_t* s = (const uint16_t*)base + off;
      for (int64_t x = 0; x < n; ++x) dst[x] = (ACC)ab_f16_to_f32(s[x * stride]);
      break;
    }
    case AB_DTYPE_BF16: {
      const uint16_t* s = (const uint16_t*)base + off;
      for (int64_t x = 0; x < n; ++x) dst[x] = (ACC)ab_bf16_to_f32(s[x * stride]);
      break;
    }
    case AB_DTYPE_F64: {
      const double* s = (const double*)base + off;
      for (int64_t x = 0; x < n; ++x) dst[x] = (ACC)s[x * stride];
      break;
    }
    default:
      for (int64_t x = 0; x < n; ++x) dst[x] = (ACC)NAN;
  }
}

static void SFX(store_row)(void* base, ab_dtype dt, int64_t off, int64_t n, int64_t stride,
                           const ACC* src) {
  switch (dt) {
    case AB_DTYPE_F32: {
      float* d = (float*)base + off;
      for (int64_t x = 0; x < n; ++x) d[x * stride] = (float)src[x];
      break;
    }
    case AB_DTYPE_F16: {
      uint16_t* d = (uint16_t*)base + off;
      for (int64_t x = 0; x < n; ++x) d[x * stride] = ab_f32_to_f16((float)src[x]);
      break;
    }
    case AB_DTYPE_BF16: {
      uint16_t* d = (uint16_t*)base + off;
      for (int64_t x = 0; x < n; ++x) d[x * stride] = ab_f32_to_bf16((float)src[x]);
      break;
    }
    case AB_DTYPE_F64: {
      double* d = (double*)base + off;
      for (int64_t x = 0; x < n; ++x) d[x * stride] = (double)src[x];
      break;
    }
    default:
      break;
  }
}

/* Dot products of one vector a with rows b, b + ldb, ... (n elements each).  Short dot products
 * are latency-bound, so four rows are done together (independent chains the compiler keeps in
 * registers and vectorises); each chain keeps four partial sums, a shorter summation tree than
 * one running sum, so this is no less accurate. */
static inline ACC SFX(dot)(const ACC* restrict a, const ACC* restrict b, int64_t n) {
  ACC c[4] = {0, 0, 0, 0};
  int64_t x = 0;
  for (; x + 4 <= n; x += 4)
    for (int u = 0; u < 4; ++u) c[u] += a[x + u] * b[x + u];
  ACC t = 0;
  for (; x < n; ++x) t += a[x] * b[x];
  return ((c[0] + c[2]) + (c[1] + c[3])) + t;
}

/* One 16-byte vector of ACC (GCC/Clang vector extension: SSE2 on any x86-64, NEON on Arm). */
typedef ACC SFX(vec) __attribute__((vector_size(16)));
#define SFX_LANES ((int64_t)(16 / sizeof(ACC)))

static inline SFX(vec) SFX(vload)(const ACC* p) {
  SFX(vec) v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline ACC SFX(vsum)(SFX(vec) v) {
  ACC s = 0;
  for (int64_t u = 0; u < SFX_LANES; ++u) s += v[u];
  return s;
}

static inline void SFX(dot4)(const ACC* restrict a, const ACC* restrict b, int64_t ldb, int64_t n,
                             ACC* restrict out) {
  SFX(vec) c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
  int64_t x = 0;
  for (; x + SFX_LANES <= n; x += SFX_LANES) {
    const SFX(vec) av = SFX(vload)(a + x);
    c0 += av * SFX(vload)(b + x);
    c1 += av * SFX(vload)(b + ldb + x);
    c2 += av * SFX(vload)(b + 2 * ldb + x);
    c3 += av * SFX(vload)(b + 3 * ldb + x);
  }
  ACC t0 = SFX(vsum)(c0), t1 = SFX(vsum)(c1), t2 = SFX(vsum)(c2), t3 = SFX(vsum)(c3);
  for (; x < n; ++x) {
    t0 += a[x] * b[x];
    t1 += a[x] * b[ldb + x];
    t2 += a[x] * b[2 * ldb + x];
    t3 += a[x] * b[3 * ldb + x];
  }
  out[0] = t0;
  out[1] = t1;
  out[2] = t2;
  out[3] = t3;
}
#undef SFX_LANES

/* out[r] = a . (row r of b), r < rows, rows ldb apart. */
static inline void SFX(gemv)(const ACC* restrict a, const ACC* restrict b, int64_t ldb,
                             int64_t rows, int64_t n, ACC* restrict out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) SFX(dot4)(a, b + r * ldb, ldb, n, out + r);
  for (; r < rows; ++r) out[r] = SFX(dot)(a, b + r * ldb, n);
}

static inline void SFX(axpy)(ACC a, const ACC* restrict x, ACC* restrict y, int64_t n) {
  for (int64_t t = 0; t < n; ++t) y[t] += a * x[t];
}

static inline void SFX(store_scalar)(const ab_tensor* t, int64_t off, ACC val) {
  if (t->dtype == AB_DTYPE_F64)
    ((double*)t->data)[off] = (double)val;
  else
    ((float*)t->data)[off] = (float)val;
}

/* Loads the K and V rows of (b, hk) into contiguous accumulation-type copies: K as (Sk, D) and V
 * as (Sk, Dv), or, with v_transposed, V as (Dv, Sk) so that each output column is one dot
 * product over the keys (no read-modify-write of the output row per key). */
static void SFX(load_kv)(const ab_attn_params* p, int64_t b, int64_t hk, ACC* kc, ACC* vc,
                         int v_transposed) {
  for (int64_t j = 0; j < p->Sk; ++j)
    SFX(load_row)(p->k.data, p->k.dtype, ab_off4(&p->k, b, hk, j, 0), p->D, p->k.strides[3],
                  kc + j * p->D);
  if (v_transposed) {
    for (int64_t c = 0; c < p->Dv; ++c)
      SFX(load_row)(p->v.data, p->v.dtype, ab_off4(&p->v, b, hk, 0, c), p->Sk, p->v.strides[2],
                    vc + c * p->Sk);
  } else {
    for (int64_t j = 0; j < p->Sk; ++j)
      SFX(load_row)(p->v.data, p->v.dtype, ab_off4(&p->v, b, hk, j, 0), p->Dv, p->v.strides[3],
                    vc + j * p->Dv);
  }
}

/* q.k of one row pair in double: the ACC dot product overflowed (|q.k| beyond float32 while
 * scale * q.k is not: large q and k, scale < 1) or met inf - inf. */
static double SFX(dot64)(const ACC* a, const ACC* b, int64_t n) {
  double t = 0;
  for (int64_t x = 0; x < n; ++x) t += (double)a[x] * (double)b[x];
  return t;
}

/* Score from the raw q.k: scale, then softcap (keeping its derivative 1 - tanh^2), in double: a score is
 * finite whenever scale * q.k is (as with torch's sqrt(scale)-scaled q and k, and past float32's range
 * too), x / softcap neither overflows nor turns subnormal on the way, and no rounding to float32 is
 * added to what torch's float32 computation rounds. */
static inline double SFX(score)(const ab_attn_params* p, double raw, ACC* dcap) {
  const double x = raw * p->scale;
  if (p->softcap > 0) {
    const double t = tanh(x / p->softcap);
    *dcap = (ACC)(1.0 - t * t); /* from the double tanh: near saturation 1 - t^2 of a float t is noise */
    return p->softcap * t;
  }
  return x;
}

/* The raw q.k of key j: the ACC dot product, or its double recomputation where that one is not
 * finite (only an input that is itself inf or NaN keeps it so). */
static inline double SFX(raw)(ACC dot, const ACC* qrow, const ACC* krow, int64_t D) {
  return isfinite(dot) ? (double)dot : SFX(dot64)(qrow, krow, D);
}

/* Scores x_j (double) of row (b, h, i) for keys [lo, hi) from the raw dot products, masked keys
 * -inf; dcap_j the softcap's derivative (0 when hidden).  Returns the row max: -inf when no key is visible,
 * NaN when a score is NaN (NaN in, NaN out, as in the float64 reference).  The forward and the
 * backward share it, so the backward's softmax is bitwise the forward's.  Scores stay in double
 * through x - max: with large logits (softcap 50, ALiBi biases) a float32 score would lose the
 * digits that set p (torch's float32 loses them too; the reference need not). */
static double SFX(row_scores)(const ab_attn_params* p, int64_t b, int64_t h, int64_t i, int64_t lo, int64_t hi,
                              const ACC* raw, const ACC* qrow, const ACC* kc, double* x, ACC* dcap) {
  const int bool_mask = ab_mask_is_bool(p), float_mask = ab_mask_is_float(p);
  const double slope = ab_attn_alibi_slope(p, b, h), ii = (double)(i + p->Sk - p->Sq);
  double m = -INFINITY;
  int has_nan = 0;
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t moff = (bool_mask || float_mask) ? ab_off4(&p->mask, b, h, i, j) : 0;
    dcap[j] = 0;
    if (bool_mask && !((const uint8_t*)p->mask.data)[moff]) {
      x[j] = -INFINITY;
      continue;
    }
    double xj = SFX(score)(p, SFX(raw)(raw[j], qrow, kc + j * p->D, p->D), dcap + j);
    if (slope != 0.0) xj -= slope * fabs(ii - (double)j);
    if (float_mask) xj += ab_load_scalar(p->mask.data, p->mask.dtype, moff);
    x[j] = xj;
    if (xj > m) m = xj;
    if (xj != xj) has_nan = 1;
  }
  return has_nan ? NAN : m;
}

/* e_j = exp(x_j - m) for keys [lo, hi); returns their sum l plus the sink's exp(sink - m)
 * (p_j = e_j / l). */
static ACC SFX(row_exp)(const double* x, double m, int64_t lo, int64_t hi, ACC* e, double sink) {
  ACC l = sink == -INFINITY ? (ACC)0 : ACC_EXP((ACC)(sink - m));
  for (int64_t j = lo; j < hi; ++j) {
    e[j] = ACC_EXP((ACC)(x[j] - m));
    l += e[j];
  }
  return l;
}

/* Dropout decisions of one row, four keys per Philox call. */
typedef struct SFX(drop_row) {
  uint64_t row;
  int64_t blk;
  uint32_t words[4];
  uint32_t threshold;
} SFX(drop_row);

static inline int SFX(kept)(const ab_attn_params* p, SFX(drop_row) * d, int64_t j) {
  if ((j >> 2) != d->blk) {
    d->blk = j >> 2;
    ab_dropout_words(p->seed, p->offset, d->row, (uint64_t)d->blk, d->words);
  }
  return d->words[j & 3] >= d->threshold;
}

typedef struct SFX(fwd_ctx) {
  const ab_attn_params* p;
  int64_t nblk, rows_per_item;
  ab_par_status st;
} SFX(fwd_ctx);

static void SFX(fwd_range)(int64_t begin, int64_t end, void* vctx) {
  SFX(fwd_ctx)* ctx = (SFX(fwd_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const int64_t D = p->D, Dv = p->Dv, Sk = p->Sk, group = p->Hq / p->Hkv;
  const int has_drop = p->dropout_p > 0;
  const ACC rdrop = (ACC)(1.0 / (1.0 - p->dropout_p));
  double* xs = (double*)ab_scratch_alloc(sizeof(double) * (size_t)Sk +
                                         sizeof(ACC) * (size_t)(Sk * D + Sk * Dv + 2 * Sk + D + Dv));
  if (!xs) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "math: out of memory for the K/V scratch");
    return;
  }
  ACC* kc = (ACC*)(xs + Sk); /* xs: the row's scores */
  ACC* vc = kc + Sk * D;
  ACC* s = vc + Sk * Dv;
  ACC* th = s + Sk;
  ACC* qrow = th + Sk;
  ACC* orow = qrow + D;
  int64_t cur_b = -1, cur_hk = -1;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t blk = item % ctx->nblk, bh = item / ctx->nblk;
    const int64_t h = bh % p->Hq, b = bh / p->Hq, hk = h / group;
    if (b != cur_b || hk != cur_hk) {
      SFX(load_kv)(p, b, hk, kc, vc, 1);
      cur_b = b;
      cur_hk = hk;
    }
    const int64_t i0 = blk * ctx->rows_per_item;
    const int64_t i1 = i0 + ctx->rows_per_item < p->Sq ? i0 + ctx->rows_per_item : p->Sq;
    const double sink = ab_attn_sink(p, h);
    for (int64_t i = i0; i < i1; ++i) {
      int64_t lo, hi;
      ab_row_key_range(p, i, &lo, &hi);
      if (hi < lo) hi = lo;
      SFX(load_row)(p->q.data, p->q.dtype, ab_off4(&p->q, b, h, i, 0), D, p->q.strides[3], qrow);
      if (hi > lo) SFX(gemv)(qrow, kc + lo * D, D, hi - lo, D, s + lo);
      const double m0 = SFX(row_scores)(p, b, h, i, lo, hi, s, qrow, kc, xs, th);
      const double m = sink > m0 ? sink : m0; /* NaN stays NaN */
      for (int64_t c = 0; c < Dv; ++c) orow[c] = 0;
      ACC lse;
      if (m != m) {
        /* NaN in, NaN out, as the float64 reference does */
        for (int64_t c = 0; c < Dv; ++c) orow[c] = (ACC)NAN;
        lse = (ACC)NAN;
      } else if (m == -INFINITY) {
        lse = (ACC)-INFINITY; /* no visible key: out stays 0 */
      } else {
        const ACC l = SFX(row_exp)(xs, m, lo, hi, s, sink); /* no visible key but a sink: out 0, lse = sink */
        const ACC inv = (ACC)1 / l;
        lse = (ACC)(m + log((double)l));
        SFX(drop_row) dr = {(uint64_t)((b * p->Hq + h) * p->Sq + i), -1, {0, 0, 0, 0},
                            ab_dropout_threshold(p->dropout_p)};
        for (int64_t j = lo; j < hi; ++j) {
          s[j] *= inv;
          if (has_drop) s[j] = SFX(kept)(p, &dr, j) ? s[j] * rdrop : 0;
        }
        SFX(gemv)(s + lo, vc + lo, Sk, Dv, hi - lo, orow);
      }
      SFX(store_row)(p->out.data, p->out.dtype, ab_off4(&p->out, b, h, i, 0), Dv,
                     p->out.strides[3], orow);
      SFX(store_scalar)(&p->lse, ab_off3(&p->lse, b, h, i), lse);
    }
  }
  ab_scratch_free(xs);
}

static ab_status SFX(math_fwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  SFX(fwd_ctx) ctx;
  ctx.p = p;
  ctx.st.err = err;
  atomic_init(&ctx.st.status, AB_OK);
  /* Enough row blocks per (b, h) to keep every thread busy, but at least 16 rows per block so the
   * K/V conversion is amortised. */
  const int64_t nthreads = pool && pool->num_threads > 0 ? pool->num_threads : 1;
  const int64_t heads = p->B * p->Hq;
  int64_t blocks = heads >= 4 * nthreads ? 1 : (4 * nthreads + heads - 1) / heads;
  int64_t rows = (p->Sq + blocks - 1) / blocks;
  if (rows < 16) rows = 16;
  ctx.rows_per_item = rows;
  ctx.nblk = (p->Sq + rows - 1) / rows;
  const double work = (double)heads * (double)p->Sq * (double)p->Sk * (double)(p->D + p->Dv);
  return ab_par_run(pool, heads * ctx.nblk, 1, work, SFX(fwd_range), &ctx, &ctx.st);
}

typedef struct SFX(bwd_ctx) {
  const ab_attn_params* p;
  ab_par_status st;
} SFX(bwd_ctx);

static void SFX(bwd_range)(int64_t begin, int64_t end, void* vctx) {
  SFX(bwd_ctx)* ctx = (SFX(bwd_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const int64_t D = p->D, Dv = p->Dv, Sk = p->Sk, group = p->Hq / p->Hkv;
  const int has_drop = p->dropout_p > 0, want_dmask = p->dmask.ndim > 0;
  const ACC rdrop = (ACC)(1.0 / (1.0 - p->dropout_p));
  const ACC scale = (ACC)p->scale;
  const size_t n = (size_t)(3 * Sk * D + 2 * Sk * Dv + 4 * Sk + 2 * D + Dv);
  double* xs = (double*)ab_scratch_alloc(sizeof(double) * (size_t)Sk + sizeof(ACC) * n);
  if (!xs) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "math: out of memory for the backward scratch");
    return;
  }
  ACC* kc = (ACC*)(xs + Sk); /* xs: the row's scores */
  ACC* kt = kc + Sk * D;   /* K transposed (D, Sk): dq_i = K^T dx is then one gemv */
  ACC* vc = kt + Sk * D;
  ACC* dkc = vc + Sk * Dv;
  ACC* dvc = dkc + Sk * D;
  ACC* pr = dvc + Sk * Dv; /* raw q.k, then p_j */
  ACC* dp = pr + Sk;       /* dout.v_j, then dP_j, then dx_j */
  ACC* pd = dp + Sk;       /* p_j after dropout, for dv */
  ACC* th = pd + Sk;       /* the softcap's derivative 1 - tanh^2(scale raw / softcap) */
  ACC* qrow = th + Sk;
  ACC* dqrow = qrow + D;
  ACC* dorow = dqrow + D;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p->Hkv, hk = item % p->Hkv;
    SFX(load_kv)(p, b, hk, kc, vc, 0);
    for (int64_t j = 0; j < Sk; ++j)
      for (int64_t c = 0; c < D; ++c) kt[c * Sk + j] = kc[j * D + c];
    memset(dkc, 0, sizeof(ACC) * (size_t)(Sk * D + Sk * Dv));
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const double sink = ab_attn_sink(p, h);
      for (int64_t i = 0; i < p->Sq; ++i) {
        int64_t lo, hi;
        ab_row_key_range(p, i, &lo, &hi);
        if (hi < lo) hi = lo;
        SFX(load_row)(p->q.data, p->q.dtype, ab_off4(&p->q, b, h, i, 0), D, p->q.strides[3], qrow);
        SFX(load_row)(p->dout.data, p->dout.dtype, ab_off4(&p->dout, b, h, i, 0), Dv,
                      p->dout.strides[3], dorow);
        const ACC dlse_i =
            p->dlse.ndim ? (ACC)ab_load_scalar(p->dlse.data, p->dlse.dtype, ab_off3(&p->dlse, b, h, i))
                         : 0;
        SFX(drop_row) dr = {(uint64_t)((b * p->Hq + h) * p->Sq + i), -1, {0, 0, 0, 0},
                            ab_dropout_threshold(p->dropout_p)};
        if (hi > lo) {
          SFX(gemv)(qrow, kc + lo * D, D, hi - lo, D, pr + lo);
          SFX(gemv)(dorow, vc + lo * Dv, Dv, hi - lo, Dv, dp + lo);
        }
        /* The row's softmax again, from its scores, bitwise as the forward computed it (max m, then
         * exp(x - m) / l), rather than exp(x - lse): lse is rounded to float32, an error that grows
         * with |lse| and that every p of the row shares (large logits: softcap, ALiBi biases). */
        const double m0 = SFX(row_scores)(p, b, h, i, lo, hi, pr, qrow, kc, xs, th);
        const double m = sink > m0 ? sink : m0;
        if (m0 == -INFINITY) lo = hi = 0; /* no visible key (all weight on the sink, if any): zero gradient */
        const ACC inv = (ACC)1 / SFX(row_exp)(xs, m, lo, hi, pr, sink);
        ACC delta = 0;
        for (int64_t j = lo; j < hi; ++j) {
          const ACC pj = pr[j] * inv;
          const int keep = xs[j] == -INFINITY ? 0 : has_drop ? SFX(kept)(p, &dr, j) : 1;
          pr[j] = pj;
          dp[j] = keep ? dp[j] * rdrop : 0; /* a hidden key's value never reaches delta, even as 0 * NaN */
          pd[j] = keep ? pj * rdrop : 0;
          delta += pj * dp[j];
        }
        delta -= dlse_i;
        for (int64_t j = lo; j < hi; ++j) {
          ACC dx = pr[j] * (dp[j] - delta); /* dS_j, the gradient of a float mask */
          if (want_dmask) SFX(store_scalar)(&p->dmask, ab_off4(&p->dmask, b, h, i, j), dx);
          if (p->softcap > 0) dx *= th[j];
          dp[j] = pr[j] == 0 ? 0 : dx * scale; /* masked or underflowed keys contribute nothing */
        }
        if (want_dmask)
          for (int64_t j = 0; j < Sk; ++j)
            if (j < lo || j >= hi) SFX(store_scalar)(&p->dmask, ab_off4(&p->dmask, b, h, i, j), 0);
        if (hi > lo) {
          SFX(gemv)(dp + lo, kt + lo, Sk, D, hi - lo, dqrow);
        } else {
          for (int64_t c = 0; c < D; ++c) dqrow[c] = 0;
        }
        for (int64_t j = lo; j < hi; ++j) {
          if (dp[j] != 0) SFX(axpy)(dp[j], qrow, dkc + j * D, D);
          if (pd[j] != 0) SFX(axpy)(pd[j], dorow, dvc + j * Dv, Dv);
        }
        SFX(store_row)(p->dq.data, p->dq.dtype, ab_off4(&p->dq, b, h, i, 0), D, p->dq.strides[3],
                       dqrow);
      }
    }
    for (int64_t j = 0; j < Sk; ++j) {
      SFX(store_row)(p->dk.data, p->dk.dtype, ab_off4(&p->dk, b, hk, j, 0), D, p->dk.strides[3],
                     dkc + j * D);
      SFX(store_row)(p->dv.data, p->dv.dtype, ab_off4(&p->dv, b, hk, j, 0), Dv, p->dv.strides[3],
                     dvc + j * Dv);
    }
  }
  ab_scratch_free(xs);
}

static ab_status SFX(math_bwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  SFX(bwd_ctx) ctx;
  ctx.p = p;
  ctx.st.err = err;
  atomic_init(&ctx.st.status, AB_OK);
  const double work = 2.0 * (double)p->B * (double)p->Hq * (double)p->Sq * (double)p->Sk *
                      (double)(p->D + p->Dv);
  return ab_par_run(pool, p->B * p->Hkv, 1, work, SFX(bwd_range), &ctx, &ctx.st);
}
