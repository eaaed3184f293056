/* flash_fwd_impl.h -- the CPU flash forward (FlashAttention-2 algorithm), one source for every ISA.
 *
 * Included by cpu_isa_impl.h after cpu_tiles_impl.h, whose micro-kernel, geometry and masking it
 * runs.  Per (batch, head, chunk of rc query rows): for each block of BK visible keys, compute St,
 * mask, online softmax (running max m, sum l, O rescaled by exp(m_old - m_new)), O += P V.  Extra
 * memory is O(rc * (D + Dv + BK)) per thread, whatever Sq and Sk are, and up to KV_ROWS_BYTES more
 * for a copy of strided key and value rows (SYM(kv_rows)).  The chunk set-up, the rescaling and the
 * output rows are shared with the sage kernel (sage_cpu_impl.h) and the AMX forward
 * (flash_amx_fwd_impl.h), which differ in how S is computed.
 */

/* ---- forward ----------------------------------------------------------------------------------- */

/* One block of the online softmax over St (nb keys x rc rows, nv vectors), in place:
 * m_new = max(m, max_j S), P = exp(S - m_new), l = l * alpha + sum_j P with
 * alpha = exp(m - m_new), written to arow; returns 1 if any alpha may differ from 1 (the caller
 * rescales those output rows).  A NaN score reaches l (exp(NaN) is NaN), which marks its row at
 * the end; a row that has seen no key keeps m = -inf, its weights here are 0, and it is zeroed at
 * the end.  All nv vectors of rows, and even/odd keys, run as independent chains: a single
 * running max or sum over j would be latency-bound (4 cycles a step). */
static int SYM(online_softmax)(float* st, int64_t nb, float* mrow, float* lrow, float* arow, int nv) {
  const int64_t rc = (int64_t)nv * VLEN;
  vf mx[NR_MAX], mx2[NR_MAX], msafe[NR_MAX], ls[NR_MAX], ls2[NR_MAX];
  int any = 0;
  for (int v = 0; v < nv; ++v) mx[v] = mx2[v] = vload(mrow + v * VLEN);
  int64_t j = 0;
  for (; j + 2 <= nb; j += 2)
    for (int v = 0; v < nv; ++v) {
      mx[v] = vmax(mx[v], vload(st + j * rc + v * VLEN));
      mx2[v] = vmax(mx2[v], vload(st + (j + 1) * rc + v * VLEN));
    }
  for (; j < nb; ++j)
    for (int v = 0; v < nv; ++v) mx[v] = vmax(mx[v], vload(st + j * rc + v * VLEN));
  for (int v = 0; v < nv; ++v) {
    const vf mold = vload(mrow + v * VLEN);
    mx[v] = vmax(mx[v], mx2[v]);
    msafe[v] = vselect(mx[v] == vset1(-__builtin_inff()), vset1(0.0f), mx[v]);
    ls[v] = vload(lrow + v * VLEN);
    ls2[v] = vset1(0.0f);
    vf alpha = vset1(1.0f);
    if (!vall(mx[v] == mold)) { /* the max moved */
      alpha = vexp_nonpos(mold - msafe[v]);
      ls[v] *= alpha;
      any = 1;
    }
    vstore(arow + v * VLEN, alpha);
    vstore(mrow + v * VLEN, mx[v]);
  }
  for (j = 0; j + 2 <= nb; j += 2)
    for (int v = 0; v < nv; ++v) {
      const vf e0 = vexp_nonpos(vload(st + j * rc + v * VLEN) - msafe[v]);
      const vf e1 = vexp_nonpos(vload(st + (j + 1) * rc + v * VLEN) - msafe[v]);
      vstore(st + j * rc + v * VLEN, e0);
      vstore(st + (j + 1) * rc + v * VLEN, e1);
      ls[v] += e0;
      ls2[v] += e1;
    }
  for (; j < nb; ++j)
    for (int v = 0; v < nv; ++v) {
      const vf e = vexp_nonpos(vload(st + j * rc + v * VLEN) - msafe[v]);
      vstore(st + j * rc + v * VLEN, e);
      ls[v] += e;
    }
  for (int v = 0; v < nv; ++v) vstore(lrow + v * VLEN, ls[v] + ls2[v]);
  return any;
}

/* ---- forward pieces shared with the sage kernel (sage_cpu_impl.h), which differs only in S ------ */

/* Row chunks of the forward: nv <= nv_max vectors of query rows per chunk (fewer for short queries,
 * e.g. decode, so fewer padded rows are computed), nchunk = ceil(Sq / (nv * VLEN)) chunks. */
static void SYM(fwd_chunks)(int64_t Sq, int nv_max, int* nv, int64_t* nchunk) {
  const int64_t vecs = (Sq + VLEN - 1) / VLEN;
  *nv = (int)(vecs < nv_max ? (vecs > 0 ? vecs : 1) : nv_max);
  const int64_t rc = (int64_t)*nv * VLEN;
  *nchunk = (Sq + rc - 1) / rc;
}

/* A forward work item: row chunk c of (batch b, query head h), reading KV head hk. */
typedef struct SYM(chunk) {
  SYM(seq) s;
  int64_t b, hk;
  int64_t i0, nrows;          /* rows [i0, i0 + nrows) of the sequence, nrows <= rc */
  int64_t jlo, jhi;           /* union of the rows' visible keys: the key blocks to visit */
  int64_t all_lo, all_hi;     /* their intersection: blocks inside it need no causal/window mask */
} SYM(chunk);

/* Starts work item `item` (of B * Hq * nchunk, chunk index fastest): the sequence geometry, each
 * row's visible keys [lo, hi) (empty for the padded rows), their union and intersection, and the
 * running max/sum reset.  Returns 0 when the chunk lies past this sequence's end (varlen). */
static int SYM(chunk_begin)(const ab_attn_params* p, int64_t item, int64_t nchunk, int64_t rc, int32_t* lo,
                            int32_t* hi, float* mrow, float* lrow, SYM(chunk) * ch) {
  const int64_t c = item % nchunk, bh = item / nchunk, h = bh % p->Hq;
  ch->b = bh / p->Hq;
  ch->hk = h / (p->Hq / p->Hkv);
  SYM(seq_get)(p, ch->b, h, ch->hk, &ch->s);
  ch->i0 = c * rc;
  if (ch->i0 >= ch->s.Sq) return 0;
  const int64_t i0 = ch->i0, nrows = ch->s.Sq - i0 < rc ? ch->s.Sq - i0 : rc;
  ch->nrows = nrows;
  ch->jlo = ch->s.Sk;
  ch->jhi = 0;
  for (int64_t r = 0; r < rc; ++r) {
    int64_t l = 0, hh = 0;
    if (r < nrows) SYM(row_range)(p, &ch->s, i0 + r, &l, &hh);
    lo[r] = (int32_t)l;
    hi[r] = (int32_t)hh;
    if (r < nrows && hh > l) {
      if (l < ch->jlo) ch->jlo = l;
      if (hh > ch->jhi) ch->jhi = hh;
    }
    /* a sink starts each row: max s, sum exp(s - s) = 1, no value */
    mrow[r] = ch->s.sink;
    lrow[r] = ch->s.sink == -__builtin_inff() ? 0.0f : 1.0f;
  }
  ch->all_lo = 0;
  ch->all_hi = ch->s.Sk;
  for (int64_t r = 0; r < nrows; ++r) {
    if (lo[r] > ch->all_lo) ch->all_lo = lo[r];
    if (hi[r] < ch->all_hi) ch->all_hi = hi[r];
  }
  return 1;
}

/* Multiplies the unnormalised O rows by this key block's rescale factors (online softmax). */
static void SYM(rescale_rows)(float* on, const float* arow, int64_t nrows, int64_t Dvp) {
  for (int64_t r = 0; r < nrows; ++r)
    if (arow[r] != 1.0f) {
      const vf a = vset1(arow[r]);
      for (int64_t d = 0; d < Dvp; d += VLEN) vstore(on + r * Dvp + d, vload(on + r * Dvp + d) * a);
    }
}

/* Key or value rows [j0, j0 + nb) of a (batch, head) as float32 rows for the micro-kernel, and their
 * row stride in *ld: in the range's copy of this head's rows (SYM(kv_rows)) when it has one, in place
 * when direct (float32, contiguous, a whole number of vectors wide), else packed into buf (width w). */
static const float* SYM(block_rows)(const ab_tensor* t, int64_t base, int64_t rs, int64_t j0, int64_t nb,
                                    int64_t cols, int64_t w, int direct, const float* copy, float* buf,
                                    int64_t* ld) {
  *ld = direct && !copy ? rs : w;
  if (copy) return copy + j0 * w;
  if (direct) return (const float*)t->data + base + j0 * rs;
  SYM(pack_rows)(t, base, rs, j0, nb, cols, w, buf);
  return buf;
}

/* Key and value rows strided in memory (the (B, S, H, D) layout of a projection seen as (B, H, S, D),
 * or packed (T, H, D) rows: one row every H * D elements, a power of two in most models).  A pass over
 * them touches one page per row, which the hardware prefetchers do not follow: the flash forward read
 * such rows 1.3-3x slower than contiguous ones (docs/benchmarks.md, "Strided key rows").  So a range
 * copies a (batch, KV head)'s rows once, as float32, where several row chunks or query heads read them
 * (kv_rows), and otherwise asks for the next key block while it computes on this one (prefetch_block). */
#ifndef KV_ROWS_BYTES
#define KV_ROWS_BYTES ((int64_t)8 << 20)
#endif
typedef struct SYM(kv_rows) {
  float *k, *v;          /* by key row: (rows x D) and (rows x Dvp) floats */
  int64_t b, hk, lo, hi; /* rows [lo, hi) of (b, hk) are in place */
} SYM(kv_rows);

/* Asks for key and value rows [j0, j0 + n) into L1, every cache line of them. */
static void SYM(prefetch_block)(const ab_attn_params* p, const SYM(seq) * s, int64_t j0, int64_t n) {
  const int64_t ke = (int64_t)ab_dtype_size(p->k.dtype), ve = (int64_t)ab_dtype_size(p->v.dtype);
  const char* kb = (const char*)p->k.data + (s->k + j0 * s->k_rs) * ke;
  const char* vb = (const char*)p->v.data + (s->v + j0 * s->v_rs) * ve;
  for (int64_t r = 0; r < n; ++r) {
    SYM(pf_lines)(kb + r * s->k_rs * ke, p->D * ke, 3);
    SYM(pf_lines)(vb + r * s->v_rs * ve, p->Dv * ve, 3);
  }
}

/* Copies rows [j0, j1) of (b, hk) into r, a key block at a time, asking for the next while it copies one. */
static void SYM(kv_rows_copy)(const ab_attn_params* p, const SYM(seq) * s, int64_t j0, int64_t j1, int64_t Dvp,
                              SYM(kv_rows) * r) {
  for (int64_t j = j0; j < j1; j += BK) {
    const int64_t n = j1 - j < BK ? j1 - j : BK;
    if (j + BK < j1) SYM(prefetch_block)(p, s, j + BK, j1 - j - BK < BK ? j1 - j - BK : BK);
    SYM(pack_rows)(&p->k, s->k, s->k_rs, j, n, p->D, p->D, r->k + j * p->D);
    SYM(pack_rows)(&p->v, s->v, s->v_rs, j, n, p->Dv, Dvp, r->v + j * Dvp);
  }
}

/* Makes rows [jlo, jhi) of (b, hk) present in r, copying only those it lacks: the row chunks of a head
 * come in order, so their ranges grow (causal) or slide (window) forward. */
static void SYM(kv_rows_cover)(const ab_attn_params* p, const SYM(seq) * s, int64_t b, int64_t hk, int64_t jlo,
                               int64_t jhi, int64_t Dvp, SYM(kv_rows) * r) {
  if (r->b != b || r->hk != hk || jlo > r->hi || jhi < r->lo) {
    r->b = b, r->hk = hk;
    r->lo = r->hi = jlo;
  }
  if (jlo < r->lo) SYM(kv_rows_copy)(p, s, jlo, r->lo, Dvp, r);
  if (jhi > r->hi) SYM(kv_rows_copy)(p, s, r->hi, jhi, Dvp, r);
  if (jlo < r->lo) r->lo = jlo;
  if (jhi > r->hi) r->hi = jhi;
}

/* Writes a chunk's output rows, O / l (NaN in, NaN out, as the float64 reference does; a row with
 * no visible key gives 0 and lse -inf), through one row of scratch tmp, and their lse. */
static void SYM(store_rows)(const ab_attn_params* p, const SYM(seq) * s, int64_t i0, int64_t nrows,
                            const float* on, int64_t Dvp, const float* mrow, const float* lrow, float* tmp) {
  const int64_t Dv = p->Dv;
  for (int64_t r = 0; r < nrows; ++r) {
    const float l = lrow[r], m = mrow[r];
    float lse, logl = 0.0f;
    if (l != l || m != m) {
      for (int64_t d = 0; d < Dv; ++d) tmp[d] = __builtin_nanf("");
      lse = logl = __builtin_nanf("");
    } else if (m == -__builtin_inff()) {
      for (int64_t d = 0; d < Dv; ++d) tmp[d] = 0.0f;
      lse = -__builtin_inff();
    } else {
      const float inv = 1.0f / l;
      for (int64_t d = 0; d < Dv; ++d) tmp[d] = on[r * Dvp + d] * inv;
      logl = logf(l);
      lse = m + logl;
    }
    ab_vec_store_row(p->out.data, p->out.dtype, s->o + (i0 + r) * s->o_rs, Dv,
                     p->out.strides[p->out.ndim - 1], tmp);
    ((float*)p->lse.data)[s->lse + (i0 + r) * s->lse_rs] = lse;
    if (p->stats.ndim) { /* lse in its two parts (-inf and 0 for a row that sees no key) */
      float* st = (float*)p->stats.data + s->st + (i0 + r) * s->st_rs;
      st[0] = lse != lse ? lse : m;
      st[p->stats.strides[0]] = logl;
    }
  }
}

typedef struct SYM(fwd_ctx) {
  const ab_attn_params* p;
  int64_t nchunk; /* row chunks per (batch, head): ceil(max Sq / rc) */
  int nv;         /* vectors of rows per chunk, rc = nv * VLEN */
  int strided;     /* key or value rows not contiguous (the same for every sequence and head) */
  int64_t kv_rows; /* rows of SYM(kv_rows) per thread, 0 for none */
  ab_par_status st;
} SYM(fwd_ctx);

static void SYM(fwd_range)(int64_t begin, int64_t end, void* vctx) {
  SYM(fwd_ctx)* ctx = (SYM(fwd_ctx)*)vctx;
  const ab_attn_params* p = ctx->p;
  const int64_t D = p->D, Dv = p->Dv;
  const int64_t Dmax = D > Dv ? D : Dv;
  const int nv = ctx->nv;
  const int64_t rc = (int64_t)nv * VLEN;
  const int k_direct = p->k.dtype == AB_DTYPE_F32 && p->k.strides[p->k.ndim - 1] == 1;
  const double post = SYM(post_scale)(p);
  const int64_t Dvp = (Dv + VLEN - 1) / VLEN * VLEN;
  /* V rows are read in place when float32, contiguous and a whole number of vectors wide */
  const int v_direct = p->v.dtype == AB_DTYPE_F32 && p->v.strides[p->v.ndim - 1] == 1 && Dv == Dvp;
  const size_t nfl = (size_t)(D * rc + rc * Dvp + 2 * BK * rc + BK * D + BK * Dvp + rc * Dmax + 5 * rc +
                               ctx->kv_rows * (D + Dvp));
  float* qt = (float*)ab_scratch_alloc(sizeof(float) * nfl + sizeof(int32_t) * 2 * rc);
  if (!qt) {
    ab_par_fail(&ctx->st, AB_ERR_NOMEM, "flash: out of memory for the tile scratch");
    return;
  }
  float* on = qt + D * rc;     /* O rows (rc x Dvp), unnormalised */
  float* st = on + rc * Dvp;   /* S^T, then P^T (BK x rc) */
  float* fd = st + BK * rc;    /* dropout factors (BK x rc) */
  float* kp = fd + BK * rc;    /* K block as float32 rows, when not read in place */
  float* vp = kp + BK * D;     /* V block likewise, rows zero-padded to Dvp */
  float* tmp = vp + BK * Dvp;  /* rc rows of Q, then one output row */
  float* mrow = tmp + rc * Dmax; /* running max */
  float* lrow = mrow + rc;     /* running sum */
  float* arow = lrow + rc;     /* this block's rescale factors */
  SYM(kv_rows) rows = {arow + rc, arow + rc + ctx->kv_rows * D, -1, -1, 0, 0};
  int32_t* lo = (int32_t*)(rows.v + ctx->kv_rows * Dvp);
  int32_t* hi = lo + rc;
  for (int64_t item = begin; item < end; ++item) {
    SYM(chunk) ch;
    if (!SYM(chunk_begin)(p, item, ctx->nchunk, rc, lo, hi, mrow, lrow, &ch)) continue;
    const SYM(seq) s = ch.s;
    const int64_t i0 = ch.i0, nrows = ch.nrows, jlo = ch.jlo, jhi = ch.jhi, all_lo = ch.all_lo, all_hi = ch.all_hi;
    const int copied = ctx->kv_rows > 0 && jhi > jlo; /* kv_rows > 0 only for strided rows */
    if (copied) SYM(kv_rows_cover)(p, &s, ch.b, ch.hk, jlo, jhi, Dvp, &rows);
    SYM(pack_t)(&p->q, s.q, s.q_rs, i0, nrows, D, SYM(q_scale)(p), qt, tmp, rc);
    memset(on, 0, sizeof(float) * (size_t)(nrows * Dvp));
    const int partial_rows = nrows < rc;
    for (int64_t j0 = jlo; j0 < jhi; j0 += BK) {
      const int64_t nb = jhi - j0 < BK ? jhi - j0 : BK;
      if (ctx->strided && !copied && j0 + BK < jhi) /* the next block, while this one computes */
        SYM(prefetch_block)(p, &s, j0 + BK, jhi - j0 - BK < BK ? jhi - j0 - BK : BK);
      int64_t ka_m, va_k;
      const float* ka =
          SYM(block_rows)(&p->k, s.k, s.k_rs, j0, nb, D, D, k_direct, copied ? rows.k : NULL, kp, &ka_m);
      SYM(scores_t)(nb, nv, D, ka, ka_m, qt, rc, st, rc); /* S^T = K Q^T, the scale folded into Q^T */
      const int structural = partial_rows || j0 < all_lo || j0 + nb > all_hi;
      SYM(mask_scores)(p, &s, i0, nrows, j0, nb, lo, hi, structural, st, NULL, rc, post);
      if (SYM(online_softmax)(st, nb, mrow, lrow, arow, nv)) SYM(rescale_rows)(on, arow, nrows, Dvp);
      if (p->dropout_p > 0) { /* the sum l above is of the weights before dropout */
        SYM(drop_factors)(p, &s, i0, nrows, j0, nb, fd, rc);
        SYM(vmul)(st, fd, nb * rc);
      }
      /* O += P V: A = P^T (BK x rc) read by row (broadcasts), B = the block's V rows */
      const float* va =
          SYM(block_rows)(&p->v, s.v, s.v_rs, j0, nb, Dv, Dvp, v_direct, copied ? rows.v : NULL, vp, &va_k);
      SYM(gemm)(nrows, Dvp / VLEN, nb, st, 1, rc, va, va_k, on, Dvp, AB_ACC_RUN);
    }
    SYM(store_rows)(p, &s, i0, nrows, on, Dvp, mrow, lrow, tmp);
  }
  ab_scratch_free(qt);
}

static ab_status SYM(flash_fwd)(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  SYM(fwd_ctx) ctx;
  ctx.p = p;
  ctx.st.err = err;
  atomic_init(&ctx.st.status, AB_OK);
  const int64_t Sq = ab_rows_q(p), Sk = ab_rows_k(p);
  SYM(fwd_chunks)(Sq, NR_MAX, &ctx.nv, &ctx.nchunk);
  /* a copy of strided key and value rows where more than one row chunk or query head reads them, up
   * to KV_ROWS_BYTES a thread (longer keys are read in place, with prefetches) */
  const int64_t Dvp = (p->Dv + VLEN - 1) / VLEN * VLEN;
  ctx.strided = 0;
  if (p->B > 0 && p->Hq > 0) {
    SYM(seq) s0;
    SYM(seq_get)(p, 0, 0, 0, &s0);
    ctx.strided = s0.k_rs != p->D || s0.v_rs != p->Dv;
  }
  const int reread = ctx.strided && (ctx.nchunk > 1 || p->Hq > p->Hkv);
  ctx.kv_rows = reread && Sk * (p->D + Dvp) * (int64_t)sizeof(float) <= KV_ROWS_BYTES ? Sk : 0;
  const double work = (double)p->B * p->Hq * Sq * Sk * (double)(p->D + p->Dv);
  return ab_par_run(pool, p->B * p->Hq * ctx.nchunk, 1, work, SYM(fwd_range), &ctx, &ctx.st);
}
