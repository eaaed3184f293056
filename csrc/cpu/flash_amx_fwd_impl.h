/* flash_amx_fwd_impl.h -- the flash forward on AMX tiles: bfloat16, and float16 on AMX-FP16; the
 * forward driver the sage tile kernel shares (sage_amx_impl.h).
 *
 * Included by cpu_isa_impl.h after amx_tiles_impl.h.  Scores keep the vector kernel's transposed
 * layout, St[j][r] for key j and query row r of a chunk of AMX_RC = 32 rows, so its masking and
 * dropout pieces apply unchanged:
 *   S^T   = K Q^T      A = K rows as they are (pairs of head dims), B = Q^T packed per chunk;
 *   O^T  += V^T P^T    A = V^T with pairs of keys, packed once per key panel of AMX_NP keys,
 *                      B = P^T with pairs of keys: two rows of St rounded into one row of words;
 * so O is kept transposed too (the online softmax rescales it with the rows along the vector
 * lanes) and transposed once, at the end of the chunk.  K and V are packed once per (batch, KV
 * head) before the chunks run, and shared by the query heads of a GQA group.  A chunk's panel
 * scores (32 x 256 float32: 32 KiB) stay in L1/L2 between the tile products and the softmax; the
 * products of panel t + 1 are issued before the softmax of panel t, so the tile unit can work
 * while the vector units do the exponentials.  Softmax in float32 with a base-2 exponential; lse
 * and the row sums use P before rounding.
 */

/* ---- the online softmax of one panel ------------------------------------------------------------ */

/* Two rows of weights as one row of VNNI-2 words (lo | hi << 16, rounded to `kind`) at dst.  With
 * hw (AVX512_BF16, bfloat16 only) one vcvtne2ps2bf16 rounds both (to nearest even, as
 * AMXS(half_bits) does; it treats float32 denormals as 0, and the forward's weights are 0 or at
 * least 2^-125, never denormal) and one vpermw interleaves them; else AMXS(pair). */
#if VLEN == 16 && !defined(AB_AMX_EMULATE)
static const uint16_t AMXS(interleave)[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                              8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
#endif
static inline void AMXS(store_pairs)(uint32_t* dst, vf lo, vf hi, int kind, int hw) {
#if VLEN == 16 && !defined(AB_AMX_EMULATE)
  if (hw) {
    __m512i both; /* words 0-15: lo rounded, 16-31: hi rounded */
    __asm__("vcvtne2ps2bf16 %2, %1, %0" : "=v"(both) : "v"((__m512)hi), "v"((__m512)lo));
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_loadu_si512(AMXS(interleave)), both));
    return;
  }
#endif
  (void)hw;
  AMXS(vstore_u)(dst, AMXS(pair)(lo, hi, kind));
}

/* Over St (nb keys x AMX_RC rows): m_new = max(m, max_j S), P = 2^(S c - m_new c), l = l alpha +
 * sum_j P with alpha = 2^((m - m_new) c) written to arow; returns 1 if some alpha may differ from
 * 1.  c = log2(e) times the factor the scores still lack (c > 0).  P goes to st in place, or, with
 * pw, straight to the B operand of O^T += V^T P^T: pairs of keys rounded to `kind`
 * (AMXS(pack_keypairs)'s layout, zero up to nbp keys), so the weights are never stored as floats.
 * NaN scores reach m and l (the row is NaN at the end); a row that has seen no key keeps m = -inf
 * and weights 0.  Two chains over keys: a single running max or sum would be latency-bound. */
static int AMXS(softmax)(float* st, int64_t nb, float c, float* mrow, float* lrow, float* arow, uint32_t* pw,
                         int64_t nbp, int kind, int hw) {
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
    const vf mc = msafe * cv; /* S c - m c: one fused multiply-subtract per score */
    vf l0 = vload(lrow + o), l1 = vset1(0.0f), alpha = vset1(1.0f);
    if (!vall(mx == mold)) {
      alpha = AMXS(vexp2)((mold - msafe) * cv);
      l0 *= alpha;
      any = 1;
    }
    vstore(arow + o, alpha);
    vstore(mrow + o, mx);
    for (j = 0; j + 2 <= nb; j += 2) {
      const vf e0 = AMXS(vexp2)(vload(st + j * AMX_RC + o) * cv - mc);
      const vf e1 = AMXS(vexp2)(vload(st + (j + 1) * AMX_RC + o) * cv - mc);
      if (pw) {
        AMXS(store_pairs)(pw + (j / 2) * AMX_RC + o, e0, e1, kind, hw);
      } else {
        vstore(st + j * AMX_RC + o, e0);
        vstore(st + (j + 1) * AMX_RC + o, e1);
      }
      l0 += e0;
      l1 += e1;
    }
    if (j < nb) {
      const vf e = AMXS(vexp2)(vload(st + j * AMX_RC + o) * cv - mc);
      if (pw)
        AMXS(store_pairs)(pw + (j / 2) * AMX_RC + o, e, vset1(0.0f), kind, hw);
      else
        vstore(st + j * AMX_RC + o, e);
      l0 += e;
      j += 2;
    }
    if (pw)
      for (; j < nbp; j += 2) AMXS(vstore_u)(pw + (j / 2) * AMX_RC + o, (vu)vset1(0.0f));
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
  int hw_bf16;        /* round P to bfloat16 with vcvtne2ps2bf16 (AMXS(store_pairs)) */
  int prescale;       /* multiply the scores by scale before masking (softcap, float mask, scale <= 0) */
  float c;            /* the softmax's factor: log2(e), times scale unless prescaled */
  float msc;          /* the running max times msc is in natural units (for lse) */
  int qexp;           /* flash in bfloat16: Q's rows times 2**qexp when packed (AMXS(fwd_scale)) */
  double scale;       /* what multiplies the product's scores: the call's scale over 2**qexp */
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
      const int drop = p->dropout_p > 0; /* dropout scales the weights as floats before they are rounded */
      if (AMXS(softmax)(st, nb, ctx->c, mrow, lrow, arow, drop ? NULL : pw, nbp, kind, ctx->hw_bf16))
        for (int64_t d = 0; d < Dvp; ++d)
          for (int64_t v = 0; v < AMX_RC; v += VLEN)
            vstore(ot + d * AMX_RC + v, vload(ot + d * AMX_RC + v) * vload(arow + v));
      if (drop) { /* the sum l above is of the weights before dropout */
        SYM(drop_factors)(p, &s, i0, nrows, j0, nb, fd, AMX_RC);
        SYM(vmul)(st, fd, nb * AMX_RC);
        AMXS(pack_keypairs)(st, nb, nbp, kind, pw);
      }
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
    if (r < ch->nrows) {
      AMXS(row16)(&p->q, ch->s.q + (ch->i0 + r) * ch->s.q_rs, p->D, Dp, ctx->kind, r16, tmp);
      ab_bf16_row_ldexp(r16, p->D, ctx->qexp);
    } else {
      memset(r16, 0, sizeof(uint16_t) * (size_t)Dp);
    }
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
  if (ctx->prescale) AMXS(vscale)(st, nb * AMX_RC, (float)ctx->scale);
}

static const AMXS(fwd_ops) AMXS(flash_ops) = {AMXS(flash_chunk_q), AMXS(flash_score_tiles), AMXS(flash_score_finish)};

/* The packing pass before the forward's chunks (flash and sage), one item per (batch, KV head):
 * the K rows of the sequence into rows [r0, r0 + nr) of the packed layout (kv_offsets: rows past
 * the sequence's end, up to a multiple of 32, are zero), by the family's pack_k; then the V^T
 * panels in `kind`.  Scratch per worker: nk floats for pack_k (fs), then Dmax floats (ftmp) and two
 * 16-bit rows of Dvp (r16) for the panels and pack_k. */
typedef struct AMXS(pack_ctx) AMXS(pack_ctx);
struct AMXS(pack_ctx) {
  const ab_attn_params* p;
  void (*pack_k)(const AMXS(pack_ctx) * ctx, const SYM(seq) * s, int64_t b, int64_t hk, int64_t r0, int64_t nr,
                 float* fs, float* ftmp);
  const void* fam;        /* the family's state: its fwd_ctx (flash), its workspace (sage) */
  uint32_t* kp;           /* flash: where the K rows go (fam's kp) */
  const char* nomem;      /* the error when the scratch cannot be had */
  int kind;               /* 16-bit type of the V^T panels */
  int64_t Dvp, nk, Dmax;
  const int64_t* krow0;   /* (B + 1) */
  const int64_t* panel0;  /* (B + 1) */
  int64_t krows, npanels; /* per KV head */
  uint32_t* vt;
  ab_par_status st;
};

static void AMXS(pack_range)(int64_t begin, int64_t end, void* vctx) {
  AMXS(pack_ctx)* ctx = (AMXS(pack_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const int64_t Dvp = ctx->Dvp, group = p->Hq / p->Hkv;
  float* fs = (float*)ab_scratch_alloc(sizeof(float) * (size_t)(ctx->nk + ctx->Dmax) + sizeof(uint16_t) * 2 * (size_t)Dvp);
  if (!fs) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, ctx->nomem);
    return;
  }
  float* ftmp = fs + ctx->nk;
  uint16_t* r16 = (uint16_t*)(ftmp + ctx->Dmax);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p->Hkv, hk = item % p->Hkv;
    SYM(seq) s;
    SYM(seq_get)(p, b, hk * group, hk, &s);
    ctx->pack_k(ctx, &s, b, hk, hk * ctx->krows + ctx->krow0[b], ctx->krow0[b + 1] - ctx->krow0[b], fs, ftmp);
    AMXS(pack_vt)(p, &s, ctx->kind, Dvp, ctx->vt + (hk * ctx->npanels + ctx->panel0[b]) * Dvp * (AMX_NP / 2), r16,
                  ftmp);
  }
  ab_scratch_free(fs);
}

/* Runs the packing pass (work: its multiply-adds' worth, for the pool's threshold). */
static ab_status AMXS(pack_run)(AMXS(pack_ctx) * ctx, const ab_cpu_pool* pool, double work, ab_error* err) {
  ctx->st.err = err;
  atomic_init(&ctx->st.status, AB_OK);
  return ab_par_run(pool, ctx->p->B * ctx->p->Hkv, 1, work, AMXS(pack_range), ctx, &ctx->st);
}

/* flash: K rows as 16-bit rows of Dp. */
static void AMXS(flash_pack_k)(const AMXS(pack_ctx) * ctx, const SYM(seq) * s, int64_t b, int64_t hk, int64_t r0,
                               int64_t nr, float* fs, float* ftmp) {
  const AMXS(fwd_ctx)* f = (const AMXS(fwd_ctx)*)ctx->fam;
  const ab_attn_params* p = ctx->p;
  (void)b;
  (void)hk;
  (void)fs;
  for (int64_t j = 0; j < nr; ++j) {
    uint16_t* dst = (uint16_t*)(ctx->kp + (r0 + j) * f->kw);
    if (j < s->Sk)
      AMXS(row16)(&p->k, s->k + j * s->k_rs, p->D, f->Dp, f->kind, dst, ftmp);
    else
      memset(dst, 0, sizeof(uint16_t) * (size_t)f->Dp);
  }
}

/* The scale and the softmax factor: fold scale into the exponential's factor when the masking
 * does not need true scores (no softcap, no float mask) and scale > 0 keeps -inf and the max.
 * Flash in bfloat16 multiplies Q's rows by the scale's power of two below 1 when it packs them (exact
 * wherever the result stays normal) and the scores by the rest, so that q.k stays within float32's range
 * wherever the scaled score does (q near 1e10, k near 1e30 and a scale of 1e-39 made NaN rows); the same
 * bits wherever the product fit, as the decode kernel does (ab_half.h, ab_bf16_scale_exp).  A scale of 0 makes
 * Q 0.  The backward (flash_amx_bwd_impl.h) multiplies S's Q the same way. */
static void AMXS(fwd_scale)(const ab_attn_params* p, AMXS(fwd_ctx) * ctx, int scores_scaled) {
  const float log2e = 1.44269504088896341f;
  ctx->qexp = !scores_scaled && ctx->kind == AMX_BF16 ? ab_bf16_scale_exp(p->scale) : 0;
  ctx->scale = ldexp(p->scale, -ctx->qexp);
  ctx->prescale = !scores_scaled && (p->softcap > 0 || ab_mask_is_float(p) || !(p->scale > 0));
  const int folded = !scores_scaled && !ctx->prescale;
  ctx->c = folded ? (float)(ctx->scale * 1.4426950408889634) : log2e;
  ctx->msc = folded ? (float)ctx->scale : 1.0f;
}

/* A forward's context before its layout is filled in: the call, the family's ops, the 16-bit type of
 * P V, the scale (scores_scaled: the family's scores already carry it). */
static void AMXS(fwd_init)(AMXS(fwd_ctx) * ctx, const ab_attn_params* p, const AMXS(fwd_ops) * ops, int kind,
                           int scores_scaled, ab_error* err) {
  memset(ctx, 0, sizeof *ctx);
  ctx->p = p;
  ctx->ops = ops;
  ctx->kind = kind;
#if VLEN == 16 && !defined(AB_AMX_EMULATE)
  ctx->hw_bf16 = kind == AMX_BF16 && ab_cpu_features_get()->avx512_bf16;
#endif
  ctx->st.err = err;
  atomic_init(&ctx->st.status, AB_OK);
  AMXS(fwd_scale)(p, ctx, scores_scaled);
}

static ab_status AMXS(flash_fwd_tiles)(const ab_attn_params* p, int kind, const ab_cpu_pool* pool, ab_error* err) {
  AMXS(fwd_ctx) ctx;
  AMXS(fwd_init)(&ctx, p, &AMXS(flash_ops), kind, 0, err);
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
  AMXS(pack_ctx) pc = {.p = p, .pack_k = AMXS(flash_pack_k), .fam = &ctx, .kp = kp, .kind = kind, .Dvp = ctx.Dvp,
                       .nomem = "flash (amx): out of memory for packing K and V", .Dmax = p->D > p->Dv ? p->D : p->Dv,
                       .krow0 = krow0, .panel0 = panel0, .krows = krows, .npanels = npanels, .vt = vt};
  const double pack = (double)p->B * p->Hkv * p->Sk * (double)(p->D + p->Dv) * 4;
  ab_status st = AMXS(pack_run)(&pc, pool, pack, err);
  if (st == AB_OK) {
    const double work = (double)p->B * p->Hq * ab_rows_q(p) * ab_rows_k(p) * (double)(p->D + p->Dv);
    st = AMXS(fwd_run)(&ctx, pool, work);
  }
  free(buf);
  return st;
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
