/* sage_amx_impl.h -- the CPU sage kernel on AMX tiles: INT8 Q.K^T (tdpbssd), P.V in bfloat16
 * tiles; forward only, every dtype; one source for the real and the emulated build.
 *
 * Included by cpu_isa_impl.h after flash_amx_fwd_impl.h, whose forward driver it runs (chunks of 32 rows, key panels,
 * the masking, the base-2 online softmax and O^T += V^T P^T on tiles); sage_cpu_impl.h gives the
 * recipe and its smoothing (sg_k_stats): K minus its mean over the sequence, divided by the
 * channel factors c, quantized to int8 per key; Q times c quantized per row, with the softmax
 * scale folded into its scale and q . mean added back as a per-row bias (docs/sage.md).  The
 * integer sums are the vector kernel's exactly (same int8 values, exact int32 sums), so the
 * scores are too.
 *
 * What differs from the vector kernel: the scores come from tiles (A = the int8 K rows as they
 * are, 64 dims per tile row; B = the chunk's int8 Q rows with their 4-byte groups transposed,
 * VNNI-4), and P.V runs in bfloat16 tiles, V packed to bfloat16 V^T panels (pairs of keys) by the
 * prepass.  bfloat16 rather than u8 x s8 for P.V: it keeps the accuracy of the int16 fixed point
 * of the vector kernel (P rounded to 8 significant bits, relative 2^-9, rather than 1/255 of a
 * block's largest weight), at half the tile rate of int8.
 *
 * The workspace (allocated by the shim, ab_sage_cpu_workspace_size) holds the per-sequence offsets,
 * K's means and channel factors, the int8 K rows and their scales, and the V^T panels.
 */

/* The int8 product (int32 sums) on tiles: the flash kernel's blocking, tdpbssd. */
AB_AMX_GEMM(AMXS(gemm_s8), AMX_DPBSSD)

typedef struct AMXS(sg_ws) {
  int64_t* krow0;  /* (B + 1) */
  int64_t* panel0; /* (B + 1) */
  float* mean;     /* (B, Hkv, Dq) */
  float* cf;       /* (B, Hkv, Dq) */
  int8_t* kq;      /* (Hkv, krows, Dq) */
  float* sk;       /* (Hkv, krows) */
  uint32_t* vt;    /* (Hkv, npanels, Dvp, AMX_NP / 2) words */
  int64_t Dq, Dvp, krows, npanels;
} AMXS(sg_ws);

/* Fills w's pointers into base (when not NULL); returns the bytes needed. */
static size_t AMXS(sg_layout)(const ab_attn_params* p, void* base, AMXS(sg_ws) * w) {
  w->Dq = AMXS(up)(p->D, 64);
  w->Dvp = AMXS(up)(p->Dv, 32);
  AMXS(kv_offsets)(p, NULL, NULL, &w->krows, &w->npanels);
  const size_t sizes[7] = {
      sizeof(int64_t) * (size_t)(p->B + 1),
      sizeof(int64_t) * (size_t)(p->B + 1),
      sizeof(float) * (size_t)(p->B * p->Hkv * w->Dq),
      sizeof(float) * (size_t)(p->B * p->Hkv * w->Dq),
      (size_t)(p->Hkv * w->krows * w->Dq),
      sizeof(float) * (size_t)(p->Hkv * w->krows),
      sizeof(uint32_t) * (size_t)(p->Hkv * w->npanels * w->Dvp * (AMX_NP / 2)),
  };
  void* at[7];
  const size_t total = SYM(sg_carve)(base, sizes, 7, at);
  w->krow0 = (int64_t*)at[0];
  w->panel0 = (int64_t*)at[1];
  w->mean = (float*)at[2];
  w->cf = (float*)at[3];
  w->kq = (int8_t*)at[4];
  w->sk = (float*)at[5];
  w->vt = (uint32_t*)at[6];
  return total;
}

/* x (n floats, zero past the real dims) quantized to int8, q = round(x / s) in [-127, 127] with
 * s = amax / 127 (returned): the vector kernel's sg_quant_row, with int8 out on every build.  An
 * inf or NaN gives s = NaN (NaN in, NaN out) and zero values; an all-zero row s = 0. */
static float AMXS(sg_quant)(const float* x, int64_t n, int8_t* dst) {
  float nan_seen;
  const float a = SYM(sg_amax)(x, n, &nan_seen);
  if (a == 0.0f || nan_seen != 0.0f || a != a) {
    memset(dst, 0, (size_t)n);
    return a == 0.0f && nan_seen == 0.0f ? 0.0f : __builtin_nanf("");
  }
  const float pre = SYM(sg_pre)(a);
  const vf inv = vset1(127.0f / (a * pre)), vpre = vset1(pre);
  for (int64_t d = 0; d < n; d += VLEN) {
    const vi qi = __builtin_convertvector(vround((vload(x + d) * vpre) * inv), vi);
    for (int u = 0; u < VLEN; ++u) dst[d + u] = (int8_t)qi[u];
  }
  return a / 127.0f;
}

/* The packing pass's K rows for sage: K's smoothing, every row of (K - mean) / c in int8 with its
 * scale.  fs: 4 Dq floats. */
static void AMXS(sg_pack_k)(const AMXS(pack_ctx) * ctx, const SYM(seq) * s, int64_t b, int64_t hk, int64_t r0,
                            int64_t nr, float* fs, float* ftmp) {
  const ab_attn_params* p = ctx->p;
  const AMXS(sg_ws)* w = (const AMXS(sg_ws)*)ctx->fam;
  const int64_t Dq = w->Dq;
  float* row = fs;
  float* lo = row + Dq;
  float* hi = lo + Dq;
  float* icf = hi + Dq;
  (void)ftmp;
  float* mean = w->mean + (b * p->Hkv + hk) * Dq;
  float* cf = w->cf + (b * p->Hkv + hk) * Dq;
  SYM(sg_k_stats)(p, s, Dq, mean, cf, icf, lo, hi, row);
  const int64_t ls = p->k.strides[p->k.ndim - 1];
  for (int64_t j = 0; j < nr; ++j) {
    if (j < s->Sk) {
      ab_vec_load_row(p->k.data, p->k.dtype, s->k + j * s->k_rs, p->D, ls, row);
      for (int64_t d = 0; d < Dq; d += VLEN) vstore(row + d, (vload(row + d) - vload(mean + d)) * vload(icf + d));
      w->sk[r0 + j] = AMXS(sg_quant)(row, Dq, w->kq + (r0 + j) * Dq);
    } else {
      memset(w->kq + (r0 + j) * Dq, 0, (size_t)Dq);
      w->sk[r0 + j] = 0.0f;
    }
  }
}

/* A chunk's Q rows times c, in int8 with scale sq (softmax scale folded in) and bias = scale q . mean;
 * padded rows are zero with scale 0 (and masked). */
static void AMXS(sg_chunk_q)(const AMXS(fwd_ctx) * ctx, const SYM(chunk) * ch, uint32_t* qb, float* sq, float* bias,
                             uint16_t* r16, float* tmp) {
  const ab_attn_params* p = ctx->p;
  const int64_t Dq = ctx->Dq;
  const float scale = (float)p->scale;
  const float* mean = ctx->mean + (ch->b * p->Hkv + ch->hk) * Dq;
  const float* cf = ctx->cf + (ch->b * p->Hkv + ch->hk) * Dq;
  int8_t* qrow = (int8_t*)r16;
  memset(tmp, 0, sizeof(float) * (size_t)Dq);
  for (int64_t r = 0; r < AMX_RC; ++r) {
    if (r < ch->nrows) {
      bias[r] = SYM(sg_q_row)(p, ch->s.q + (ch->i0 + r) * ch->s.q_rs, Dq, mean, cf, scale, tmp);
      sq[r] = AMXS(sg_quant)(tmp, Dq, qrow) * scale;
    } else {
      memset(qrow, 0, (size_t)Dq);
      sq[r] = bias[r] = 0.0f;
    }
    const uint32_t* w = (const uint32_t*)(const void*)qrow;
    for (int64_t g = 0; g < Dq / 4; ++g) qb[g * AMX_RC + r] = w[g];
  }
  memset(tmp, 0, sizeof(float) * (size_t)Dq); /* the padding of the next rows stays zero */
}

static void AMXS(sg_score_tiles)(const AMXS(fwd_ctx) * ctx, const SYM(chunk) * ch, int64_t j0, int64_t nbp,
                                 const uint32_t* qb, float* st) {
  const uint32_t* kq = ctx->kp + (ch->hk * ctx->krows + ctx->krow0[ch->b] + j0) * ctx->kw;
  AMXS(gemm_s8)(nbp, AMX_RC, ctx->kw, kq, ctx->kw * 4, qb, AMX_RC * 4, st, AMX_RC * 4, 0);
}

/* The int32 sums the tiles left in st, dequantized in place: S = sum * sk[j] * sq[r] + bias[r]. */
static void AMXS(sg_score_finish)(const AMXS(fwd_ctx) * ctx, const SYM(chunk) * ch, int64_t j0, int64_t nb,
                                  const float* sq, const float* bias, float* st) {
  const float* sk = ctx->sk + ch->hk * ctx->krows + ctx->krow0[ch->b] + j0;
  for (int64_t j = 0; j < nb; ++j) {
    const vf s = vset1(sk[j]);
    for (int64_t v = 0; v < AMX_RC; v += VLEN) {
      vi acc;
      memcpy(&acc, st + j * AMX_RC + v, sizeof acc);
      vstore(st + j * AMX_RC + v, __builtin_convertvector(acc, vf) * (vload(sq + v) * s) + vload(bias + v));
    }
  }
}

static const AMXS(fwd_ops) AMXS(sg_ops) = {AMXS(sg_chunk_q), AMXS(sg_score_tiles), AMXS(sg_score_finish)};

static size_t AMXS(sage_workspace_size)(const ab_attn_params* p) {
  AMXS(sg_ws) w;
  return AMXS(sg_layout)(p, NULL, &w);
}

static ab_status AMXS(sage_fwd)(const ab_attn_params* p, void* workspace, size_t bytes, const ab_cpu_pool* pool,
                                ab_error* err) {
  AMXS(sg_ws) w;
  const size_t need = AMXS(sg_layout)(p, workspace, &w);
  if (bytes < need || (need && !workspace))
    return ab_error_set(err, AB_ERR_INVALID, "sage: workspace of %zu bytes, %zu needed", bytes, need);
  AMXS(kv_offsets)(p, w.krow0, w.panel0, &w.krows, &w.npanels);
  AMXS(pack_ctx) pc = {.p = p, .pack_k = AMXS(sg_pack_k), .fam = &w, .kind = AMX_BF16, .Dvp = w.Dvp, .nk = 4 * w.Dq,
                       .nomem = "sage (amx): out of memory for the K and V prepass", .Dmax = w.Dq > w.Dvp ? w.Dq : w.Dvp,
                       .krow0 = w.krow0, .panel0 = w.panel0, .krows = w.krows, .npanels = w.npanels, .vt = w.vt};
  const double pw = (double)p->B * p->Hkv * p->Sk * (double)(p->D * 8 + p->Dv * 4);
  ab_status st = AMXS(pack_run)(&pc, pool, pw, err);
  if (st != AB_OK) return st;
  AMXS(fwd_ctx) ctx;
  AMXS(fwd_init)(&ctx, p, &AMXS(sg_ops), AMX_BF16, 1, err);
  ctx.Dp = w.Dq;
  ctx.Dq = w.Dq;
  ctx.Dvp = w.Dvp;
  ctx.kw = w.Dq / 4;
  ctx.krow0 = w.krow0;
  ctx.panel0 = w.panel0;
  ctx.krows = w.krows;
  ctx.npanels = w.npanels;
  ctx.kp = (const uint32_t*)(const void*)w.kq;
  ctx.vt = w.vt;
  ctx.sk = w.sk;
  ctx.mean = w.mean;
  ctx.cf = w.cf;
  const double work = (double)p->B * p->Hq * ab_rows_q(p) * ab_rows_k(p) * (double)(p->D / 4 + p->Dv / 2);
  return AMXS(fwd_run)(&ctx, pool, work);
}
