/* sinks_cpu.c -- the gradient of the attention sinks, shared by the math and flash backwards.
 *
 * With a sink s_h in row i's softmax denominator, lse_i = log(exp(s_h) + sum_j exp(x_ij)) and the
 * sink's weight is P_sink = exp(s_h - lse_i).  d out_i / d s_h = -P_sink out_i and d lse_i / d s_h =
 * P_sink, so
 *   d s_h = sum over rows of P_sink (dlse_i - dO_i . O_i) = -sum P_sink delta_i,
 * the same delta (dO . O - dlse) the kernels' backward uses.  It needs no score, so it is one pass
 * over out, dout and lse after the kernel, O(rows x Dv).  Work items are heads: each owns its sum,
 * accumulated in float64 in row order, so the result is the same on every run.
 */
#include "ab_cpu.h"

typedef struct sinks_ctx {
  const ab_attn_params* p;
  ab_par_status st;
} sinks_ctx;

/* Row r of a (rows, Dv) view at element offset off: dO . O in float64. */
static double row_dot(const ab_attn_params* p, int64_t o_off, int64_t g_off) {
  const ab_tensor *o = &p->out, *g = &p->dout;
  const int64_t os = o->strides[o->ndim - 1], gs = g->strides[g->ndim - 1];
  double t = 0.0;
  for (int64_t d = 0; d < p->Dv; ++d)
    t += ab_load_scalar(o->data, o->dtype, o_off + d * os) * ab_load_scalar(g->data, g->dtype, g_off + d * gs);
  return t;
}

/* The sink's weight of a row: from the forward's stats (max, log sum) when given, free of lse's
 * rounding, else from lse.  0 for a sink of -inf (no sink). */
static double sink_weight(const ab_attn_params* p, double s, int64_t lse_off, int64_t st_off) {
  if (s == -INFINITY) return 0.0;
  if (p->stats.ndim) {
    const double m = ab_load_scalar(p->stats.data, p->stats.dtype, st_off);
    const double ls = ab_load_scalar(p->stats.data, p->stats.dtype, st_off + p->stats.strides[0]);
    return exp((s - m) - ls);
  }
  return exp(s - ab_load_scalar(p->lse.data, p->lse.dtype, lse_off));
}

static void sinks_range(int64_t begin, int64_t end, void* vctx) {
  sinks_ctx* ctx = (sinks_ctx*)vctx;
  const ab_attn_params* p = ctx->p;
  for (int64_t h = begin; h < end; ++h) {
    const double s = ab_attn_sink(p, h);
    double acc = 0.0;
    if (p->cu_seqlens_q) { /* out, dout (Tq, Hq, Dv); lse (Hq, Tq); stats (2, Hq, Tq) */
      const int64_t Tq = p->cu_seqlens_q[p->B];
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t lse_off = h * p->lse.strides[0] + t * p->lse.strides[1];
        const int64_t st_off = p->stats.ndim ? h * p->stats.strides[1] + t * p->stats.strides[2] : 0;
        double delta = row_dot(p, t * p->out.strides[0] + h * p->out.strides[1],
                               t * p->dout.strides[0] + h * p->dout.strides[1]);
        if (p->dlse.ndim)
          delta -= ab_load_scalar(p->dlse.data, p->dlse.dtype, h * p->dlse.strides[0] + t * p->dlse.strides[1]);
        acc -= sink_weight(p, s, lse_off, st_off) * delta;
      }
    } else { /* out, dout (B, Hq, Sq, Dv); lse (B, Hq, Sq); stats (2, B, Hq, Sq) */
      for (int64_t b = 0; b < p->B; ++b)
        for (int64_t i = 0; i < p->Sq; ++i) {
          const int64_t st_off = p->stats.ndim ? b * p->stats.strides[1] + h * p->stats.strides[2] +
                                                     i * p->stats.strides[3]
                                               : 0;
          double delta = row_dot(p, ab_off4(&p->out, b, h, i, 0), ab_off4(&p->dout, b, h, i, 0));
          if (p->dlse.ndim) delta -= ab_load_scalar(p->dlse.data, p->dlse.dtype, ab_off3(&p->dlse, b, h, i));
          acc -= sink_weight(p, s, ab_off3(&p->lse, b, h, i), st_off) * delta;
        }
    }
    if (p->dsinks.dtype == AB_DTYPE_F64)
      ((double*)p->dsinks.data)[h * p->dsinks.strides[0]] = acc;
    else
      ((float*)p->dsinks.data)[h * p->dsinks.strides[0]] = (float)acc;
  }
}

ab_status ab_sinks_cpu_bwd(const ab_attn_params* p, const ab_cpu_pool* pool, ab_error* err) {
  sinks_ctx ctx;
  ctx.p = p;
  ctx.st.err = err;
  atomic_init(&ctx.st.status, AB_OK);
  const double work = (double)p->B * (double)p->Hq * (double)ab_rows_q(p) * (double)(p->Dv + 1);
  return ab_par_run(pool, p->Hq, 1, work, sinks_range, &ctx, &ctx.st);
}
