/* flash_bwd_impl.h -- the CPU flash backward, one source for every ISA.
 *
 * Included by cpu_isa_impl.h after flash_fwd_impl.h.  Per (batch, KV head): K and V packed once;
 * for each query head of the group, Q and dO are packed (natural and transposed) and for each key
 * block and row chunk the kernel recomputes P from each row's max and log sum (the forward's
 * `stats`, else lse), then dV += P^T dO, dS = P (dP - delta), dK += dS^T Q, dQ += dS K.  Each item
 * owns its dK, dV and dQ rows: no atomics, bitwise the same result on every run.  The per-row set-up
 * (bwd_rows) and the dS block (bwd_ds) are shared with the AMX backward (flash_amx_bwd_impl.h).
 */

/* ---- backward ---------------------------------------------------------------------------------- */

/* ---- pieces the AMX backward shares (flash_amx_bwd_impl.h) ---------------------------------------- */

/* dO's rows of head h of sequence b: the element offset of row 0 (*base) and the row stride (*rs). */
static inline void SYM(bwd_dout_rows)(const ab_attn_params* p, int64_t b, int64_t h, int64_t* base, int64_t* rs) {
  *rs = p->cu_seqlens_q ? p->dout.strides[0] : p->dout.strides[2];
  *base = p->cu_seqlens_q ? p->cu_seqlens_q[b] * p->dout.strides[0] + h * p->dout.strides[1]
                          : b * p->dout.strides[0] + h * p->dout.strides[1];
}

/* The gradient of lse at row i of head h of sequence b (p->dlse present). */
static inline float SYM(bwd_dlse)(const ab_attn_params* p, int64_t b, int64_t h, int64_t i) {
  const int64_t off = p->cu_seqlens_q ? h * p->dlse.strides[0] + (p->cu_seqlens_q[b] + i) * p->dlse.strides[1]
                                      : b * p->dlse.strides[0] + h * p->dlse.strides[1] + i * p->dlse.strides[2];
  return ((const float*)p->dlse.data)[off];
}

/* Each row's softmax statistics and delta, for rows [0, sqp) of head h of sequence b (s): P =
 * exp((x - mx) - lsum), both parts as the forward left them in `stats`: exp(x - lse) would carry
 * lse's float32 rounding, which grows with |lse| (softcap, ALiBi, large scales) and is shared by a
 * whole row; a caller that passes lse alone gets mx = lse, lsum = 0.  Rows past Sq and rows that
 * saw no key get mx = +inf, lsum = 0, so P = 0.  delta = rowsum(dO * O) - dlse, summed in float64
 * (Dv terms of either sign, where float32 would lose digits).  dO's rows are read from don (float
 * rows of stride Dvp) when it is not NULL, else from p->dout through tmp2; tmp takes O's rows. */
static void SYM(bwd_rows)(const ab_attn_params* p, const SYM(seq) * s, int64_t b, int64_t h, int64_t Sq, int64_t sqp,
                          const float* don, int64_t Dvp, float* mx, float* lsum, float* delta, float* tmp,
                          float* tmp2) {
  const int64_t Dv = p->Dv;
  int64_t do_base, dos;
  SYM(bwd_dout_rows)(p, b, h, &do_base, &dos);
  for (int64_t i = 0; i < sqp; ++i) {
    float m = __builtin_inff(), ls = 0.0f;
    double dl = 0.0;
    if (i < Sq) {
      if (p->stats.ndim) {
        const float* st = (const float*)p->stats.data + s->st + i * s->st_rs;
        m = st[0];
        ls = st[p->stats.strides[0]];
      } else {
        m = ((const float*)p->lse.data)[s->lse + i * s->lse_rs];
      }
      if (m == -__builtin_inff()) m = __builtin_inff(), ls = 0.0f; /* dead row: P = exp(x - inf) = 0 */
      ab_vec_load_row(p->out.data, p->out.dtype, s->o + i * s->o_rs, Dv, p->out.strides[p->out.ndim - 1], tmp);
      const float* dorow = don ? don + i * Dvp : tmp2;
      if (!don)
        ab_vec_load_row(p->dout.data, p->dout.dtype, do_base + i * dos, Dv, p->dout.strides[p->dout.ndim - 1], tmp2);
      for (int64_t d = 0; d < Dv; ++d) dl += (double)tmp[d] * (double)dorow[d];
      if (p->dlse.ndim) dl -= SYM(bwd_dlse)(p, b, h, i);
    }
    mx[i] = m;
    lsum[i] = ls;
    delta[i] = (float)dl;
  }
}

/* The keys of a chunk of rc rows at i0 (nrows real): each row's [lo, hi), their union [*jlo, *jhi)
 * (the blocks to visit; empty: *jlo = Sk, *jhi = 0) and intersection [*all_lo, *all_hi) (blocks
 * inside it need no causal/window mask). */
static void SYM(bwd_chunk_keys)(const ab_attn_params* p, const SYM(seq) * s, int64_t i0, int64_t nrows, int64_t rc,
                                int32_t* lo, int32_t* hi, int64_t* jlo, int64_t* jhi, int64_t* all_lo,
                                int64_t* all_hi) {
  *jlo = s->Sk;
  *jhi = 0;
  *all_lo = 0;
  *all_hi = s->Sk;
  for (int64_t r = 0; r < rc; ++r) {
    int64_t l = 0, hh = 0;
    if (r < nrows) {
      SYM(row_range)(p, s, i0 + r, &l, &hh);
      if (hh > l) {
        if (l < *jlo) *jlo = l;
        if (hh > *jhi) *jhi = hh;
      }
      if (l > *all_lo) *all_lo = l;
      if (hh < *all_hi) *all_hi = hh;
    }
    lo[r] = (int32_t)l;
    hi[r] = (int32_t)hh;
  }
}

/* The heavy keys (P > 1/NDOM) of a block of nb keys at j0, for rows [0, nrows) of a chunk of rc: each row's
 * next slots (at most NDOM) get the key, its P (from P^T, st) and, with softcap, the tanh of its capped score
 * (th).  The vector and AMX backwards' delta correction (SYM(bwd_heavy_row)). */
static void SYM(bwd_heavy_keys)(const float* st, const float* th, int softcap, int64_t rc, int64_t nrows, int64_t j0,
                                int64_t nb, int32_t* ndom, int32_t* jdom, float* pdom, float* tdom) {
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t v = 0; v < rc; v += VLEN) {
      if (vall(vload(st + j * rc + v) <= vset1(1.0f / NDOM))) continue;
      for (int64_t r = v; r < v + VLEN && r < nrows; ++r)
        if (st[j * rc + r] > 1.0f / NDOM && ndom[r] < NDOM) { /* fewer than NDOM can be */
          const int64_t slot = r * NDOM + ndom[r]++;
          jdom[slot] = (int32_t)(j0 + j);
          pdom[slot] = st[j * rc + r];
          tdom[slot] = softcap ? th[j * rc + r] : 0.0f;
        }
    }
}

/* Row i's (row r of its chunk) share of the delta correction, once the chunk's keys are done: delta's error
 * e is the excess of the row's dS sum (dsum) over dlse (and a sink's share), and at each heavy key dS lacks
 * -P e, which goes into the float mask's gradient here and, times `scale` and the softcap's chain rule, to
 * cv[u] for the caller's dQ and dK (dq_i += cv k_j, dk_j += cv q_i).  Returns the row's heavy keys. */
static int SYM(bwd_heavy_row)(const ab_attn_params* p, const SYM(seq) * s, int64_t b, int64_t h, int64_t i, int64_t r,
                              float dsum, float mx, float lsum, float delta, const int32_t* ndom, const int32_t* jdom,
                              const float* pdom, const float* tdom, float scale, float* cv) {
  float e = dsum; /* delta's error: the row's dS sums to dlse, not 0, when lse has a gradient */
  if (p->dlse.ndim) e -= SYM(bwd_dlse)(p, b, h, i);
  /* with a sink the keys' dS sum to dlse + P_sink delta (the sink's own share is not a key's) */
  if (s->sink != -__builtin_inff()) e -= expf((s->sink - mx) - lsum) * delta;
  for (int32_t u = 0; u < ndom[r]; ++u) {
    const int64_t slot = r * NDOM + u, j = jdom[slot];
    const float c = -pdom[slot] * e; /* what dS at key j lacks */
    if (p->dmask.ndim)
      ((float*)p->dmask.data)[b * p->dmask.strides[0] + h * p->dmask.strides[1] + i * p->dmask.strides[2] +
                              j * p->dmask.strides[3]] += c;
    cv[u] = c * scale * (p->softcap > 0 ? 1.0f - tdom[slot] * tdom[slot] : 1.0f);
  }
  return ndom[r];
}

/* dS^T of a block of nb keys x rc rows in place of dP^T (dpt), from P^T (st): dS = P (dP - delta),
 * each row's sum of dS added to dsum when `heavy`; the float mask's gradient (dS as it is); then
 * the softcap chain rule (th: tanh of the capped scores) and the scale. */
static void SYM(bwd_ds)(const ab_attn_params* p, int64_t b, int64_t h, int64_t i0, int64_t nrows, int64_t j0,
                        int64_t nb, int64_t rc, const float* st, float* dpt, const float* th, const float* delta,
                        int heavy, float* dsum) {
  const float scale = (float)p->scale;
  for (int64_t v = 0; v < rc; v += VLEN) {
    const vf dl = vload(delta + i0 + v);
    if (heavy) {
      vf sum = vload(dsum + v);
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t x = j * rc + v;
        const vf ds = vload(st + x) * (vload(dpt + x) - dl);
        vstore(dpt + x, ds);
        sum += ds;
      }
      vstore(dsum + v, sum);
    } else {
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t x = j * rc + v;
        vstore(dpt + x, vload(st + x) * (vload(dpt + x) - dl));
      }
    }
  }
  if (p->dmask.ndim) {
    for (int64_t j = 0; j < nb; ++j)
      for (int64_t r = 0; r < nrows; ++r) {
        const int64_t off = b * p->dmask.strides[0] + h * p->dmask.strides[1] + (i0 + r) * p->dmask.strides[2] +
                            (j0 + j) * p->dmask.strides[3];
        ((float*)p->dmask.data)[off] = dpt[j * rc + r];
      }
  }
  for (int64_t x = 0; x < nb * rc; x += VLEN) {
    vf ds = vload(dpt + x) * vset1(scale);
    if (p->softcap > 0) {
      const vf t = vload(th + x);
      ds = ds * (vset1(1.0f) - t * t);
    }
    vstore(dpt + x, ds);
  }
}

/* Dropout in the backward: the forward's decisions again (drop factors f in pd), dP of the dropped
 * weights scaled by f in place (dpt), and the weights dV sees, P * f, in pd; returns them (P itself,
 * st, without dropout). */
static const float* SYM(bwd_dropout)(const ab_attn_params* p, const SYM(seq) * s, int64_t i0, int64_t nrows, int64_t j0,
                                     int64_t nb, int64_t rc, const float* st, float* dpt, float* pd) {
  if (!(p->dropout_p > 0)) return st;
  SYM(drop_factors)(p, s, i0, nrows, j0, nb, pd, rc);
  SYM(vmul)(dpt, pd, nb * rc);
  SYM(vmul)(pd, st, nb * rc);
  return pd;
}

/* The float mask's gradient at the keys no row of the chunk sees (outside [jlo, jhi)): 0. */
static void SYM(bwd_dmask_unseen)(const ab_attn_params* p, int64_t b, int64_t h, int64_t i0, int64_t nrows, int64_t Sk,
                                  int64_t jlo, int64_t jhi) {
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t base = b * p->dmask.strides[0] + h * p->dmask.strides[1] + (i0 + r) * p->dmask.strides[2];
    for (int64_t j = 0; j < Sk; ++j)
      if (j < jlo || j >= jhi) ((float*)p->dmask.data)[base + j * p->dmask.strides[3]] = 0.0f;
  }
}

/* Row i of dQ of head h of sequence b, from the D floats at src. */
static inline void SYM(bwd_store_dq)(const ab_attn_params* p, int64_t b, int64_t h, int64_t i, const float* src) {
  const int64_t dqs = p->cu_seqlens_q ? p->dq.strides[0] : p->dq.strides[2];
  const int64_t dq_base = p->cu_seqlens_q ? p->cu_seqlens_q[b] * p->dq.strides[0] + h * p->dq.strides[1]
                                          : b * p->dq.strides[0] + h * p->dq.strides[1];
  ab_vec_store_row(p->dq.data, p->dq.dtype, dq_base + i * dqs, p->D, p->dq.strides[p->dq.ndim - 1], src);
}

/* The Sk rows of dK (stride Dp) and dV (stride Dvp) of KV head hk of sequence b. */
static void SYM(bwd_store_dkdv)(const ab_attn_params* p, int64_t b, int64_t hk, int64_t Sk, const float* dk, int64_t Dp,
                                const float* dv, int64_t Dvp) {
  const int64_t dks = p->cu_seqlens_k ? p->dk.strides[0] : p->dk.strides[2];
  const int64_t dvs = p->cu_seqlens_k ? p->dv.strides[0] : p->dv.strides[2];
  const int64_t k0 = p->cu_seqlens_k ? p->cu_seqlens_k[b] : 0;
  const int64_t dk_base = p->cu_seqlens_k ? k0 * p->dk.strides[0] + hk * p->dk.strides[1]
                                          : b * p->dk.strides[0] + hk * p->dk.strides[1];
  const int64_t dv_base = p->cu_seqlens_k ? k0 * p->dv.strides[0] + hk * p->dv.strides[1]
                                          : b * p->dv.strides[0] + hk * p->dv.strides[1];
  for (int64_t j = 0; j < Sk; ++j) {
    ab_vec_store_row(p->dk.data, p->dk.dtype, dk_base + j * dks, p->D, p->dk.strides[p->dk.ndim - 1], dk + j * Dp);
    ab_vec_store_row(p->dv.data, p->dv.dtype, dv_base + j * dvs, p->Dv, p->dv.strides[p->dv.ndim - 1], dv + j * Dvp);
  }
}

/* ---- the vector backward ------------------------------------------------------------------------- */

typedef struct SYM(bwd_ctx) {
  const ab_attn_params* p;
  ab_par_status st;
} SYM(bwd_ctx);

static void SYM(bwd_range)(int64_t begin, int64_t end, void* vctx) {
  SYM(bwd_ctx)* ctx = (SYM(bwd_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const int64_t D = p->D, Dv = p->Dv, group = p->Hq / p->Hkv;
  const int64_t Dp = (D + VLEN - 1) / VLEN * VLEN, Dvp = (Dv + VLEN - 1) / VLEN * VLEN;
  const int want_dmask = p->dmask.ndim > 0, softcap = p->softcap > 0;
  const int nv = NV_MAX;
  const int64_t rc = RC_MAX;
  const int64_t Sqp = (ab_rows_q(p) + rc - 1) / rc * rc, Skm = ab_rows_k(p); /* the longest sequences */
  const int64_t G = AB_STAGGER; /* after every buffer: no two start at the same address mod 4 KiB */
  const size_t nfl = (size_t)(Skm * Dp + Skm * Dvp + Skm * Dp + Skm * Dvp  /* K, V, dK, dV */
                              + Sqp * Dp + Dp * Sqp + Sqp * Dvp + Dvp * Sqp /* Q, Q^T, dO, dO^T */
                              + Sqp * Dp + 3 * Sqp                          /* dQ, max, log sum, delta */
                              + 4 * BK * rc + (Dp > Dvp ? Dp : Dvp) * 2 + 18 * G);
  float* kp = (float*)ab_scratch_alloc(sizeof(float) * nfl + sizeof(int32_t) * (3 + NDOM) * rc +
                                       sizeof(float) * (2 * NDOM + 1) * rc);
  if (!kp) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "flash: out of memory for the backward scratch");
    return;
  }
  float* vp = kp + Skm * Dp + G;
  float* dk = vp + Skm * Dvp + G;
  float* dv = dk + Skm * Dp + G;
  float* qn = dv + Skm * Dvp + G;   /* Q rows (Sqp x Dp), unscaled */
  float* qt = qn + Sqp * Dp + G;    /* Q^T by row chunk: (Sqp / rc) x (Dp x rc), scaled */
  float* don = qt + Dp * Sqp + G;   /* dO rows (Sqp x Dvp) */
  float* dot = don + Sqp * Dvp + G; /* dO^T by row chunk: (Sqp / rc) x (Dvp x rc) */
  float* dq = dot + Dvp * Sqp + G;  /* dQ rows (Sqp x Dp) */
  float* mx = dq + Sqp * Dp + G;    /* per row: the max score; +inf for padding and dead rows so P = 0 */
  float* lsum = mx + Sqp + G;       /* per row: log of the sum of exp(x - max) */
  float* delta = lsum + Sqp + G;
  float* st = delta + Sqp + G;      /* S^T then P^T (BK x rc) */
  float* dpt = st + BK * rc + G;    /* dP^T then dS^T */
  float* pd = dpt + BK * rc + G;    /* dropout factors, then P^T after dropout */
  float* th = pd + BK * rc + G;     /* tanh of the softcap */
  float* tmp = th + BK * rc + G;
  float* tmp2 = tmp + (Dp > Dvp ? Dp : Dvp) + G;
  int32_t* lo = (int32_t*)(tmp2 + (Dp > Dvp ? Dp : Dvp) + G);
  int32_t* hi = lo + rc;
  int32_t* ndom = hi + rc;                 /* per row of a chunk: how many heavy keys (P > 1/NDOM) */
  int32_t* jdom = ndom + rc;               /* (rc x NDOM) those keys, */
  float* pdom = (float*)(jdom + NDOM * rc); /* their P */
  float* tdom = pdom + NDOM * rc;          /* and tanh of their softcap */
  float* dsum = tdom + NDOM * rc;          /* per row: the sum of its dS */
  const float scale = (float)p->scale, qscale = SYM(q_scale)(p);
  const double post = SYM(post_scale)(p);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p->Hkv, hk = item % p->Hkv;
    SYM(seq) s0;
    SYM(seq_get)(p, b, hk * group, hk, &s0);
    const int64_t Sk = s0.Sk, Sq = s0.Sq;
    SYM(pack_rows)(&p->k, s0.k, s0.k_rs, 0, Sk, D, Dp, kp);
    SYM(pack_rows)(&p->v, s0.v, s0.v_rs, 0, Sk, Dv, Dvp, vp);
    memset(dk, 0, sizeof(float) * (size_t)(Sk * Dp));
    memset(dv, 0, sizeof(float) * (size_t)(Sk * Dvp));
    const int64_t sqp = (Sq + rc - 1) / rc * rc;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      SYM(seq) s;
      SYM(seq_get)(p, b, h, hk, &s);
      /* this head's Q, dO (natural and transposed), lse and delta = rowsum(dO * O) - dlse */
      SYM(pack_rows)(&p->q, s.q, s.q_rs, 0, Sq, D, Dp, qn);
      memset(qn + Sq * Dp, 0, sizeof(float) * (size_t)((sqp - Sq) * Dp));
      int64_t do_base, dos;
      SYM(bwd_dout_rows)(p, b, h, &do_base, &dos);
      SYM(pack_rows)(&p->dout, do_base, dos, 0, Sq, Dv, Dvp, don);
      memset(don + Sq * Dvp, 0, sizeof(float) * (size_t)((sqp - Sq) * Dvp));
      /* transposed copies chunk by chunk, so the micro-kernel's operand is contiguous (a
       * (D x Sq) layout would put every row of the operand on its own page) */
      for (int64_t i = 0; i < sqp; ++i) {
        float* qtc = qt + (i / rc) * Dp * rc + i % rc;
        float* dotc = dot + (i / rc) * Dvp * rc + i % rc;
        for (int64_t d = 0; d < Dp; ++d) qtc[d * rc] = qn[i * Dp + d] * qscale;
        for (int64_t d = 0; d < Dvp; ++d) dotc[d * rc] = don[i * Dvp + d];
      }
      SYM(bwd_rows)(p, &s, b, h, Sq, sqp, don, Dvp, mx, lsum, delta, tmp, tmp2);
      memset(dq, 0, sizeof(float) * (size_t)(sqp * Dp));
      for (int64_t i0 = 0; i0 < Sq; i0 += rc) {
        const int64_t nrows = Sq - i0 < rc ? Sq - i0 : rc;
        int64_t jlo, jhi, all_lo, all_hi;
        /* Rows whose weight sits on a few keys (some P > 1/NDOM: the log sum < log NDOM).  delta =
         * rowsum(dO * O) reads O as stored, rounded to the output dtype, and at a heavy key dS is a
         * difference dP - delta of two nearly equal values: O's rounding (2^-11 relative in float16,
         * 2^-24 in float32) is then most of the result, where a softmax that sums P dP (torch's, our
         * math) is exact, saturated rows above all.  The rounding's effect is measured (a row's dS
         * must sum to dlse: the excess e is delta's error) and, once the chunk is done, P e is taken
         * off the heavy keys' dS; on the light ones it is below e / NDOM, no larger than the rounding
         * of the many terms such a row sums.  Only with the forward's stats: they say the call's keys
         * are the whole row (a caller that passes lse alone, as the ring of attn_backends/_ring.py
         * does for each block of keys, gets each block's exact share dS = P (dP - delta) instead). */
        int heavy = 0;
        for (int64_t r = 0; r < nrows; ++r) {
          ndom[r] = 0;
          dsum[r] = 0.0f;
          heavy |= p->stats.ndim && lsum[i0 + r] < LOG_NDOM && mx[i0 + r] < __builtin_inff();
        }
        SYM(bwd_chunk_keys)(p, &s, i0, nrows, rc, lo, hi, &jlo, &jhi, &all_lo, &all_hi);
        for (int64_t j0 = jlo; j0 < jhi; j0 += BK) {
          const int64_t nb = jhi - j0 < BK ? jhi - j0 : BK;
          /* recompute S^T (bitwise as the forward did: the same SYM(scores_t)) and
           * P^T = exp((S^T - max) - log sum) */
          SYM(scores_t)(nb, nv, D, kp + j0 * Dp, Dp, qt + i0 * Dp, rc, st, rc);
          const int structural = nrows < rc || j0 < all_lo || j0 + nb > all_hi;
          SYM(mask_scores)(p, &s, i0, nrows, j0, nb, lo, hi, structural, st, softcap ? th : NULL, rc, post);
          for (int64_t v = 0; v < rc; v += VLEN) {
            const vf mv = vload(mx + i0 + v), lv = vload(lsum + i0 + v);
            for (int64_t j = 0; j < nb; ++j)
              vstore(st + j * rc + v, vexp_nonpos((vload(st + j * rc + v) - mv) - lv));
          }
          if (heavy) SYM(bwd_heavy_keys)(st, th, softcap, rc, nrows, j0, nb, ndom, jdom, pdom, tdom);
          /* dP^T = V dO^T */
          SYM(gemm_nv)(nb, nv, Dv, vp + j0 * Dvp, Dvp, 1, dot + i0 * Dvp, rc, dpt, rc, 0);
          const float* pw = SYM(bwd_dropout)(p, &s, i0, nrows, j0, nb, rc, st, dpt, pd); /* the weights dV sees */
          /* dS = P (dP - delta); the float mask's gradient; softcap chain rule; scale */
          SYM(bwd_ds)(p, b, h, i0, nrows, j0, nb, rc, st, dpt, th, delta, heavy, dsum);
          /* dV += P^T dO, dK += dS^T Q, dQ += dS K */
          SYM(gemm)(nb, Dvp / VLEN, rc, pw, rc, 1, don + i0 * Dvp, Dvp, dv + j0 * Dvp, Dvp, AB_ACC_ADD);
          SYM(gemm)(nb, Dp / VLEN, rc, dpt, rc, 1, qn + i0 * Dp, Dp, dk + j0 * Dp, Dp, AB_ACC_ADD);
          SYM(gemm)(nrows, Dp / VLEN, nb, dpt, 1, rc, kp + j0 * Dp, Dp, dq + i0 * Dp, Dp, AB_ACC_ADD);
        }
        for (int64_t r = 0; r < nrows && heavy; ++r) {
          if (ndom[r] == 0) continue;
          const int64_t i = i0 + r;
          float cvs[NDOM];
          const int n = SYM(bwd_heavy_row)(p, &s, b, h, i, r, dsum[r], mx[i], lsum[i], delta[i], ndom, jdom, pdom,
                                           tdom, scale, cvs);
          for (int u = 0; u < n; ++u) {
            const int64_t j = jdom[r * NDOM + u];
            const vf cv = vset1(cvs[u]);
            for (int64_t d = 0; d < Dp; d += VLEN) {
              vstore(dq + i * Dp + d, vload(dq + i * Dp + d) + cv * vload(kp + j * Dp + d));
              vstore(dk + j * Dp + d, vload(dk + j * Dp + d) + cv * vload(qn + i * Dp + d));
            }
          }
        }
        if (want_dmask) SYM(bwd_dmask_unseen)(p, b, h, i0, nrows, Sk, jlo, jhi);
      }
      for (int64_t i = 0; i < Sq; ++i) SYM(bwd_store_dq)(p, b, h, i, dq + i * Dp);
    }
    SYM(bwd_store_dkdv)(p, b, hk, Sk, dk, Dp, dv, Dvp);
  }
  ab_scratch_free(kp);
}

static ab_status SYM(flash_bwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  SYM(bwd_ctx) ctx;
  ctx.p = p;
  ctx.st.err = err;
  atomic_init(&ctx.st.status, AB_OK);
  const double work = 2.5 * (double)p->B * p->Hq * ab_rows_q(p) * ab_rows_k(p) * (double)(p->D + p->Dv);
  return ab_par_run(pool, p->B * p->Hkv, 1, work, SYM(bwd_range), &ctx, &ctx.st);
}
