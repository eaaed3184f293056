/* flash_amx_bwd_impl.h -- the flash backward on AMX tiles (bfloat16).
 *
 * Included by cpu_isa_impl.h after flash_amx_fwd_impl.h.  Per (batch, KV head) as the vector
 * backward (flash_bwd_impl.h), in key blocks of AMX_BKB:
 *   S^T = K Q^T, dP^T = V dO^T on tiles, then (vectors) P, dS with the vector backward's per-row
 *   set-up (bwd_rows: the forward's row statistics, delta) and dS block (bwd_ds); then on tiles
 *   dV += P^T dO (A = P^T rounded, pairs of rows; B = dO packed with pairs of rows),
 *   dK += dS^T Q (likewise), dQ^T += K^T dS^T (A = K^T with pairs of keys; B = dS^T pairs of keys).
 * Each item owns its dK, dV and dQ rows: no atomics, bitwise the same result on every run.
 */

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
  const int softcap = p->softcap > 0;
  const int64_t Skr = AMXS(up)(ab_rows_k(p), 32), Sqp = AMXS(up)(ab_rows_q(p), AMX_RC), nch = Sqp / AMX_RC;
  const int64_t G = AB_STAGGER; /* floats after every buffer: no two start at the same address mod 4 KiB */
  /* buffers in floats (16-bit and word buffers counted in 4-byte units) */
  const int64_t n_kp = Skr * Dp / 2, n_vp = Skr * Dvp / 2, n_kt = Dp * Skr / 2;
  const int64_t n_qt = nch * Dp / 2 * AMX_RC, n_qv = nch * AMX_RC / 2 * Dp;
  const int64_t n_dot = nch * Dvp / 2 * AMX_RC, n_dov = nch * AMX_RC / 2 * Dvp;
  const int64_t n_blk = AMX_BKB * AMX_RC;
  const size_t nfl = (size_t)(n_kp + n_vp + n_kt + Skr * Dp + Skr * Dvp + n_qt + n_qv + n_dot + n_dov
                              + nch * Dp * AMX_RC + 3 * Sqp + 4 * n_blk + 2 * n_blk / 2 + n_blk / 2
                              + AMX_RC * Dmax / 2 + AMX_RC * Dmax / 2 + 2 * Dmax + 21 * G);
  float* base = (float*)ab_scratch_alloc(sizeof(float) * nfl + sizeof(int32_t) * (3 + NDOM) * AMX_RC +
                                         sizeof(float) * (2 * NDOM + 1) * AMX_RC);
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
  float* mx = dqt + nch * Dp * AMX_RC + G;           /* per row: the max score; +inf for padding and dead rows */
  float* lsum = mx + Sqp + G;                        /* per row: log of the sum of exp(x - max) */
  float* delta = lsum + Sqp + G;
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
  int32_t* ndom = hi + AMX_RC;                        /* per row of a chunk: how many heavy keys (P > 1/NDOM) */
  int32_t* jdom = ndom + AMX_RC;                      /* (AMX_RC x NDOM) those keys, */
  float* pdom = (float*)(jdom + NDOM * AMX_RC);       /* their P */
  float* tdom = pdom + NDOM * AMX_RC;                 /* and tanh of their softcap */
  float* dsum = tdom + NDOM * AMX_RC;                 /* per row: the sum of its dS */
  /* S^T = K Q^T from Q's rows times the scale's power of two below 1, then times the rest (scale), as the
   * forward (AMXS(fwd_scale)): q.k past float32's range under a tiny scale stays finite; the same bits
   * wherever the product fit.  dK's Q is the unscaled one. */
  const int qexp = ab_bf16_scale_exp(p->scale);
  const float scale = (float)ldexp(p->scale, -qexp), log2e = 1.44269504088896341f;
  /* dS (which carries the scale) times 2**-dexp before it is rounded to bfloat16 for dK and dQ, both
   * times 2**dexp when stored: under a tiny scale dS is below bfloat16's normal range, which the tiles
   * take as 0 (dQ and dK came out 0); exact wherever the values stay normal */
  const int dexp = p->scale == 0.0 ? 0 : qexp < -126 ? -126 : qexp;
  const float dscale = (float)ldexp(p->scale, -dexp); /* the scale at that power: the heavy keys' correction */
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
      int64_t do_base, dos;
      SYM(bwd_dout_rows)(p, b, h, &do_base, &dos);
      /* this head's Q and dO, per chunk, in the two B layouts each product needs */
      for (int64_t c = 0; c * AMX_RC < Sq; ++c) {
        const int64_t i0 = c * AMX_RC, n = Sq - i0 < AMX_RC ? Sq - i0 : AMX_RC;
        AMXS(rows16)(&p->q, s.q + i0 * s.q_rs, s.q_rs, n, AMX_RC, D, Dp, rows, tmp);
        AMXS(words_rowpairs)(rows, Dp, qv + c * (AMX_RC / 2) * Dp);
        for (int64_t r = 0; r < n; ++r) ab_bf16_row_ldexp(rows + r * Dp, D, qexp); /* S's Q, as the forward's */
        AMXS(words_t)(rows, Dp, qt + c * (Dp / 2) * AMX_RC);
        AMXS(rows16)(&p->dout, do_base + i0 * dos, dos, n, AMX_RC, Dv, Dvp, rows, tmp);
        AMXS(words_t)(rows, Dvp, dot + c * (Dvp / 2) * AMX_RC);
        AMXS(words_rowpairs)(rows, Dvp, dov + c * (AMX_RC / 2) * Dvp);
      }
      /* each row's statistics (the forward's, else lse) and delta, as the vector backward */
      SYM(bwd_rows)(p, &s, b, h, Sq, sqp, NULL, Dvp, mx, lsum, delta, tmp, tmp2);
      memset(dqt, 0, sizeof(float) * (size_t)(sqp / AMX_RC * Dp * AMX_RC));
      for (int64_t i0 = 0; i0 < Sq; i0 += AMX_RC) {
        const int64_t c = i0 / AMX_RC, nrows = Sq - i0 < AMX_RC ? Sq - i0 : AMX_RC;
        int64_t jlo, jhi, all_lo, all_hi;
        /* rows whose weight sits on a few keys: delta's rounding (O read as stored, in bfloat16) taken
         * off their heavy keys' dS once the chunk is done, as the vector backward does (flash_bwd_impl.h,
         * where the reason is); without it dq came out 6x torch's error at logits near 20 */
        int heavy = 0;
        for (int64_t r = 0; r < AMX_RC; ++r) {
          ndom[r] = 0;
          dsum[r] = 0.0f;
          heavy |= r < nrows && p->stats.ndim && lsum[i0 + r] < LOG_NDOM && mx[i0 + r] < __builtin_inff();
        }
        SYM(bwd_chunk_keys)(p, &s, i0, nrows, AMX_RC, lo, hi, &jlo, &jhi, &all_lo, &all_hi);
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
          /* P^T = exp((S^T - max) - log sum) */
          for (int64_t v = 0; v < AMX_RC; v += VLEN) {
            const vf mv = vload(mx + i0 + v), lv = vload(lsum + i0 + v);
            for (int64_t j = 0; j < nb; ++j)
              vstore(st + j * AMX_RC + v, AMXS(vexp2)(((vload(st + j * AMX_RC + v) - mv) - lv) * vset1(log2e)));
          }
          if (heavy) SYM(bwd_heavy_keys)(st, th, softcap, AMX_RC, nrows, j0, nb, ndom, jdom, pdom, tdom);
          const float* pw = SYM(bwd_dropout)(p, &s, i0, nrows, j0, nb, AMX_RC, st, dpt, pd); /* the weights dV sees */
          /* dS = P (dP - delta); the float mask's gradient; softcap chain rule; scale */
          SYM(bwd_ds)(p, b, h, i0, nrows, j0, nb, AMX_RC, st, dpt, th, delta, heavy, dsum);
          for (int64_t x = 0; dexp && x < nb * AMX_RC; ++x) dpt[x] = ab_ldexpf(dpt[x], -dexp);
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
        /* the heavy keys' correction (SYM(bwd_heavy_row)), added to dQ^T and dK in float32 at the tiles' 2**-dexp */
        for (int64_t r = 0; r < nrows && heavy; ++r) {
          if (ndom[r] == 0) continue;
          const int64_t i = i0 + r;
          float cvs[NDOM];
          const int n = SYM(bwd_heavy_row)(p, &s, b, h, i, r, dsum[r], mx[i], lsum[i], delta[i], ndom, jdom, pdom,
                                           tdom, dscale, cvs);
          ab_vec_load_row(p->q.data, p->q.dtype, s.q + i * s.q_rs, D, p->q.strides[p->q.ndim - 1], tmp);
          float* dqc = dqt + c * Dp * AMX_RC + r;
          for (int u = 0; u < n; ++u) {
            const int64_t j = jdom[r * NDOM + u];
            for (int64_t d = 0; d < D; ++d) {
              union { uint32_t u; float f; } kv = {(uint32_t)kp[j * Dp + d] << 16};
              dqc[d * AMX_RC] += cvs[u] * kv.f;
              dk[j * Dp + d] += cvs[u] * tmp[d];
            }
          }
        }
        if (p->dmask.ndim) SYM(bwd_dmask_unseen)(p, b, h, i0, nrows, Sk, jlo, jhi);
      }
      for (int64_t i = 0; i < Sq; ++i) {
        const float* col = dqt + (i / AMX_RC) * Dp * AMX_RC + i % AMX_RC;
        for (int64_t d = 0; d < D; ++d) tmp[d] = dexp ? ab_ldexpf(col[d * AMX_RC], dexp) : col[d * AMX_RC];
        SYM(bwd_store_dq)(p, b, h, i, tmp);
      }
    }
    for (int64_t x = 0; dexp && x < Sk * Dp; ++x) dk[x] = ab_ldexpf(dk[x], dexp);
    SYM(bwd_store_dkdv)(p, b, hk, Sk, dk, Dp, dv, Dvp);
  }
  AMX_RELEASE();
  ab_scratch_free(base);
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
