/* ab_params.c -- errors, dtype helpers and the one validation of ab_attn_params (and of
 * ab_kvcache_params, a KV-cache call's).
 *
 * Every kernel entry point calls ab_attn_params_check (a KV-cache call: ab_kvcache_params_check)
 * first, so a direct call of the torch op with inconsistent operands fails with a message naming the
 * argument instead of reading out of bounds.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#include "ab_core.h"
#include "ab_half.h"
#include "cpu/decode_cpu.h"

ab_status ab_error_set(ab_error* err, ab_status code, const char* fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
  }
  return code;
}

const char* ab_device_name(ab_device_type device) {
  switch (device) {
    case AB_DEVICE_CPU: return "cpu";
    case AB_DEVICE_CUDA: return "cuda";
    case AB_DEVICE_MPS: return "mps";
    default: return "other";
  }
}

const char* ab_causal_name(ab_causal causal) {
  switch (causal) {
    case AB_CAUSAL_NONE: return "none";
    case AB_CAUSAL_TOP_LEFT: return "top_left";
    case AB_CAUSAL_BOTTOM_RIGHT: return "bottom_right";
    default: return "unknown";
  }
}

const char* ab_dtype_name(ab_dtype dtype) {
  switch (dtype) {
    case AB_DTYPE_F32: return "float32";
    case AB_DTYPE_F16: return "float16";
    case AB_DTYPE_BF16: return "bfloat16";
    case AB_DTYPE_F64: return "float64";
    case AB_DTYPE_BOOL: return "bool";
    case AB_DTYPE_I32: return "int32";
    case AB_DTYPE_I64: return "int64";
    case AB_DTYPE_U8: return "uint8";
    default: return "unsupported dtype";
  }
}

size_t ab_dtype_size(ab_dtype dtype) {
  switch (dtype) {
    case AB_DTYPE_F32: case AB_DTYPE_I32: return 4;
    case AB_DTYPE_F16: case AB_DTYPE_BF16: return 2;
    case AB_DTYPE_F64: case AB_DTYPE_I64: return 8;
    case AB_DTYPE_BOOL: case AB_DTYPE_U8: return 1;
    default: return 0;
  }
}

int ab_dtype_is_floating(ab_dtype dtype) {
  return dtype == AB_DTYPE_F32 || dtype == AB_DTYPE_F16 || dtype == AB_DTYPE_BF16 ||
         dtype == AB_DTYPE_F64;
}

/* Checks ndim, sizes (a negative expected size matches anything) and non-negative strides. */
static ab_status check_shape(ab_error* err, const char* name, const ab_tensor* t, int ndim,
                             const int64_t* expect) {
  if (t->ndim == 0) return ab_error_set(err, AB_ERR_INVALID, "%s is missing", name);
  if (t->ndim != ndim)
    return ab_error_set(err, AB_ERR_INVALID, "%s must be %d-D, got %d-D", name, ndim, t->ndim);
  for (int d = 0; d < ndim; ++d) {
    if (expect[d] >= 0 && t->sizes[d] != expect[d])
      return ab_error_set(err, AB_ERR_INVALID,
                          "%s has size %lld in dim %d, expected %lld", name,
                          (long long)t->sizes[d], d, (long long)expect[d]);
    if (t->strides[d] < 0)
      return ab_error_set(err, AB_ERR_INVALID, "%s has a negative stride in dim %d", name, d);
  }
  return AB_OK;
}

static ab_status check_dtype(ab_error* err, const char* name, const ab_tensor* t, ab_dtype want) {
  if (t->dtype != want)
    return ab_error_set(err, AB_ERR_INVALID, "%s must be %s, got %s", name, ab_dtype_name(want),
                        ab_dtype_name(t->dtype));
  return AB_OK;
}

static ab_status check_device(ab_error* err, const char* name, const ab_tensor* t,
                              const ab_tensor* q) {
  if (t->device != q->device || t->device_index != q->device_index)
    return ab_error_set(err, AB_ERR_INVALID, "%s is on a different device than q", name);
  return AB_OK;
}

#define AB_TRY(expr)                \
  do {                              \
    ab_status s_ = (expr);          \
    if (s_ != AB_OK) return s_;     \
  } while (0)

/* cu_seqlens (B + 1,): starts at 0, never decreases, ends at total, each length <= max_len. */
static ab_status check_cu(ab_error* err, const char* name, const int32_t* cu, int64_t B, int64_t total,
                          int64_t max_len) {
  if (cu[0] != 0) return ab_error_set(err, AB_ERR_INVALID, "%s[0] must be 0, got %d", name, cu[0]);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = (int64_t)cu[b + 1] - cu[b];
    if (len < 0)
      return ab_error_set(err, AB_ERR_INVALID, "%s must be non-decreasing, but %s[%lld] = %d > %s[%lld] = %d",
                          name, name, (long long)b, cu[b], name, (long long)(b + 1), cu[b + 1]);
    if (len > max_len)
      return ab_error_set(err, AB_ERR_INVALID, "sequence %lld has length %lld > max_seqlen %lld (%s)",
                          (long long)b, (long long)len, (long long)max_len, name);
  }
  if (cu[B] != total)
    return ab_error_set(err, AB_ERR_INVALID, "%s[-1] = %d must equal the total number of rows, %lld", name,
                        cu[B], (long long)total);
  return AB_OK;
}

static ab_status check_options(const ab_attn_params* p, ab_error* err) {
  if (!isfinite(p->scale))
    return ab_error_set(err, AB_ERR_INVALID, "scale must be finite, got %g", p->scale);
  if (!(p->softcap >= 0.0) || !isfinite(p->softcap))
    return ab_error_set(err, AB_ERR_INVALID, "softcap must be >= 0 and finite, got %g", p->softcap);
  /* float16, bfloat16 and float32 inputs get float32 scores: a factor beyond float32's range cannot
   * be applied there */
  if (p->q.dtype != AB_DTYPE_F64 && (fabs(p->scale) > FLT_MAX || p->softcap > FLT_MAX))
    return ab_error_set(err, AB_ERR_INVALID,
                        "%s must be within float32's range (<= %g) for %s inputs, got %g",
                        fabs(p->scale) > FLT_MAX ? "scale" : "softcap", (double)FLT_MAX,
                        ab_dtype_name(p->q.dtype), fabs(p->scale) > FLT_MAX ? p->scale : p->softcap);
  if (!(p->dropout_p >= 0.0 && p->dropout_p < 1.0))
    return ab_error_set(err, AB_ERR_INVALID, "dropout_p must be in [0, 1), got %g", p->dropout_p);
  if (p->window_left < -1 || p->window_right < -1)
    return ab_error_set(err, AB_ERR_INVALID, "window values must be >= -1, got (%lld, %lld)",
                        (long long)p->window_left, (long long)p->window_right);
  if (p->causal != AB_CAUSAL_NONE && p->causal != AB_CAUSAL_TOP_LEFT &&
      p->causal != AB_CAUSAL_BOTTOM_RIGHT)
    return ab_error_set(err, AB_ERR_INVALID, "causal must be 0, 1 or 2, got %d", (int)p->causal);
  return AB_OK;
}

static double load_float(const ab_tensor* t, int64_t off) {
  switch (t->dtype) {
    case AB_DTYPE_F32: return ((const float*)t->data)[off];
    case AB_DTYPE_F64: return ((const double*)t->data)[off];
    case AB_DTYPE_F16: return ab_f16_to_f32(((const uint16_t*)t->data)[off]);
    case AB_DTYPE_BF16: return ab_bf16_to_f32(((const uint16_t*)t->data)[off]);
    default: return NAN;
  }
}

double ab_attn_sink(const ab_attn_params* p, int64_t h) {
  return p->sinks.ndim ? load_float(&p->sinks, h * p->sinks.strides[0]) : -INFINITY;
}

double ab_attn_alibi_slope(const ab_attn_params* p, int64_t b, int64_t h) {
  const ab_tensor* a = &p->alibi;
  if (!a->ndim) return 0.0;
  return a->ndim == 2 ? load_float(a, b * a->strides[0] + h * a->strides[1]) : load_float(a, h * a->strides[0]);
}

/* sinks (Hq,) floating, alibi (Hq,) or (B, Hq) float32, dsinks (Hq,) like lse; on q's device. */
static ab_status check_sinks_alibi(const ab_attn_params* p, int backward, ab_error* err) {
  const int64_t hs[1] = {p->Hq};
  if (p->sinks.ndim) {
    AB_TRY(check_shape(err, "sinks", &p->sinks, 1, hs));
    AB_TRY(check_device(err, "sinks", &p->sinks, &p->q));
    if (!ab_dtype_is_floating(p->sinks.dtype))
      return ab_error_set(err, AB_ERR_INVALID, "sinks must be floating, got %s", ab_dtype_name(p->sinks.dtype));
  }
  if (p->alibi.ndim) {
    const int64_t as[2] = {p->B, p->Hq};
    if (p->alibi.ndim == 1)
      AB_TRY(check_shape(err, "alibi_slopes", &p->alibi, 1, hs));
    else if (p->alibi.ndim == 2)
      AB_TRY(check_shape(err, "alibi_slopes", &p->alibi, 2, as));
    else
      return ab_error_set(err, AB_ERR_INVALID, "alibi_slopes must be (Hq,) or (B, Hq), got %d-D", p->alibi.ndim);
    AB_TRY(check_dtype(err, "alibi_slopes", &p->alibi, AB_DTYPE_F32));
    AB_TRY(check_device(err, "alibi_slopes", &p->alibi, &p->q));
  }
  if (backward && p->dsinks.ndim) {
    if (!p->sinks.ndim) return ab_error_set(err, AB_ERR_INVALID, "grad_sinks asked for a call without sinks");
    AB_TRY(check_shape(err, "grad_sinks", &p->dsinks, 1, hs));
    AB_TRY(check_dtype(err, "grad_sinks", &p->dsinks, p->q.dtype == AB_DTYPE_F64 ? AB_DTYPE_F64 : AB_DTYPE_F32));
  }
  return AB_OK;
}

/* Packed calls: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), out (Tq, Hq, Dv), lse (Hq, Tq). */
static ab_status check_varlen(const ab_attn_params* p, int backward, ab_error* err) {
  const ab_dtype dt = p->q.dtype;
  const ab_dtype lse_dt = dt == AB_DTYPE_F64 ? AB_DTYPE_F64 : AB_DTYPE_F32;
  if (!p->cu_seqlens_k) return ab_error_set(err, AB_ERR_INVALID, "cu_seqlens_k is missing");
  /* cu_seqlens are int32: no sequence is longer, and dropout row numbers (b Hq + h) max + i stay
   * far inside 64 bits */
  if (p->Sq > INT32_MAX || p->Sk > INT32_MAX)
    return ab_error_set(err, AB_ERR_INVALID, "%s = %lld must be at most 2**31 - 1 (cu_seqlens are int32)",
                        p->Sq > INT32_MAX ? "max_seqlen_q" : "max_seqlen_k",
                        (long long)(p->Sq > INT32_MAX ? p->Sq : p->Sk));
  if (p->mask.ndim) return ab_error_set(err, AB_ERR_INVALID, "packed (varlen) calls take no attn_mask");
  const int64_t Tq = p->q.ndim == 3 ? p->q.sizes[0] : -1, Tk = p->k.ndim == 3 ? p->k.sizes[0] : -1;
  const int64_t qs[3] = {Tq, p->Hq, p->D}, ks[3] = {Tk, p->Hkv, p->D}, vs[3] = {Tk, p->Hkv, p->Dv};
  const int64_t os[3] = {Tq, p->Hq, p->Dv}, ls[2] = {p->Hq, Tq};
  AB_TRY(check_shape(err, "q", &p->q, 3, qs));
  AB_TRY(check_shape(err, "k", &p->k, 3, ks));
  AB_TRY(check_shape(err, "v", &p->v, 3, vs));
  AB_TRY(check_dtype(err, "k", &p->k, dt));
  AB_TRY(check_dtype(err, "v", &p->v, dt));
  AB_TRY(check_device(err, "k", &p->k, &p->q));
  AB_TRY(check_device(err, "v", &p->v, &p->q));
  AB_TRY(check_shape(err, "out", &p->out, 3, os));
  AB_TRY(check_dtype(err, "out", &p->out, dt));
  AB_TRY(check_shape(err, "lse", &p->lse, 2, ls));
  AB_TRY(check_dtype(err, "lse", &p->lse, lse_dt));
  if (p->stats.ndim) {
    const int64_t ss[3] = {2, p->Hq, Tq};
    AB_TRY(check_shape(err, "stats", &p->stats, 3, ss));
    AB_TRY(check_dtype(err, "stats", &p->stats, lse_dt));
  }
  AB_TRY(check_cu(err, "cu_seqlens_q", p->cu_seqlens_q, p->B, Tq, p->Sq));
  AB_TRY(check_cu(err, "cu_seqlens_k", p->cu_seqlens_k, p->B, Tk, p->Sk));
  AB_TRY(check_options(p, err));
  AB_TRY(check_sinks_alibi(p, backward, err));
  if (!backward) return AB_OK;
  AB_TRY(check_shape(err, "grad_out", &p->dout, 3, os));
  AB_TRY(check_dtype(err, "grad_out", &p->dout, dt));
  if (p->dlse.ndim) {
    AB_TRY(check_shape(err, "grad_lse", &p->dlse, 2, ls));
    AB_TRY(check_dtype(err, "grad_lse", &p->dlse, lse_dt));
  }
  AB_TRY(check_shape(err, "dq", &p->dq, 3, qs));
  AB_TRY(check_shape(err, "dk", &p->dk, 3, ks));
  AB_TRY(check_shape(err, "dv", &p->dv, 3, vs));
  AB_TRY(check_dtype(err, "dq", &p->dq, dt));
  AB_TRY(check_dtype(err, "dk", &p->dk, dt));
  AB_TRY(check_dtype(err, "dv", &p->dv, dt));
  if (p->dmask.ndim) return ab_error_set(err, AB_ERR_INVALID, "packed (varlen) calls take no attn_mask");
  return AB_OK;
}

ab_status ab_attn_params_check(const ab_attn_params* p, int backward, ab_error* err) {
  const ab_dtype dt = p->q.dtype;
  if (!ab_dtype_is_floating(dt))
    return ab_error_set(err, AB_ERR_INVALID,
                        "q must be float16, bfloat16, float32 or float64, got %s",
                        ab_dtype_name(dt));
  {
    /* name the size that is wrong: for packed calls Sq/Sk are the max_seqlen arguments */
    const int packed = p->cu_seqlens_q != NULL;
    const struct { const char* name; int64_t value, least; } sizes[] = {
        {"batch size", p->B, 0}, {"number of query heads", p->Hq, 0},
        {"number of key/value heads", p->Hkv, 0},
        {packed ? "max_seqlen_q" : "query sequence length", p->Sq, 0},
        {packed ? "max_seqlen_k" : "key sequence length", p->Sk, 0},
        {"head dim of q and k", p->D, 1}, {"head dim of v", p->Dv, 0}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i)
      if (sizes[i].value < sizes[i].least)
        return ab_error_set(err, AB_ERR_INVALID, "%s must be >= %lld, got %lld", sizes[i].name,
                            (long long)sizes[i].least, (long long)sizes[i].value);
  }
  if (p->Hkv == 0 ? p->Hq != 0 : p->Hq % p->Hkv != 0)
    return ab_error_set(err, AB_ERR_INVALID,
                        "number of query heads (%lld) must be a multiple of key/value heads (%lld)",
                        (long long)p->Hq, (long long)p->Hkv);
  if (p->cu_seqlens_q) return check_varlen(p, backward, err);
  const ab_dtype lse_dt = dt == AB_DTYPE_F64 ? AB_DTYPE_F64 : AB_DTYPE_F32;
  const int64_t qs[4] = {p->B, p->Hq, p->Sq, p->D};
  const int64_t ks[4] = {p->B, p->Hkv, p->Sk, p->D};
  const int64_t vs[4] = {p->B, p->Hkv, p->Sk, p->Dv};
  const int64_t os[4] = {p->B, p->Hq, p->Sq, p->Dv};
  const int64_t ls[3] = {p->B, p->Hq, p->Sq};
  const int64_t ms[4] = {p->B, p->Hq, p->Sq, p->Sk};
  AB_TRY(check_shape(err, "q", &p->q, 4, qs));
  AB_TRY(check_shape(err, "k", &p->k, 4, ks));
  AB_TRY(check_shape(err, "v", &p->v, 4, vs));
  AB_TRY(check_dtype(err, "k", &p->k, dt));
  AB_TRY(check_dtype(err, "v", &p->v, dt));
  AB_TRY(check_device(err, "k", &p->k, &p->q));
  AB_TRY(check_device(err, "v", &p->v, &p->q));
  if (p->mask.ndim) {
    AB_TRY(check_shape(err, "attn_mask", &p->mask, 4, ms));
    AB_TRY(check_device(err, "attn_mask", &p->mask, &p->q));
    if (p->mask.dtype != AB_DTYPE_BOOL && !ab_dtype_is_floating(p->mask.dtype))
      return ab_error_set(err, AB_ERR_INVALID, "attn_mask must be bool or floating, got %s",
                          ab_dtype_name(p->mask.dtype));
  }
  AB_TRY(check_shape(err, "out", &p->out, 4, os));
  AB_TRY(check_dtype(err, "out", &p->out, dt));
  AB_TRY(check_shape(err, "lse", &p->lse, 3, ls));
  AB_TRY(check_dtype(err, "lse", &p->lse, lse_dt));
  if (p->stats.ndim) {
    const int64_t ss[4] = {2, p->B, p->Hq, p->Sq};
    AB_TRY(check_shape(err, "stats", &p->stats, 4, ss));
    AB_TRY(check_dtype(err, "stats", &p->stats, lse_dt));
  }
  AB_TRY(check_options(p, err));
  AB_TRY(check_sinks_alibi(p, backward, err));
  if (!backward) return AB_OK;

  AB_TRY(check_shape(err, "grad_out", &p->dout, 4, os));
  AB_TRY(check_dtype(err, "grad_out", &p->dout, dt));
  AB_TRY(check_device(err, "grad_out", &p->dout, &p->q));
  if (p->dlse.ndim) {
    AB_TRY(check_shape(err, "grad_lse", &p->dlse, 3, ls));
    AB_TRY(check_dtype(err, "grad_lse", &p->dlse, lse_dt));
  }
  AB_TRY(check_shape(err, "dq", &p->dq, 4, qs));
  AB_TRY(check_shape(err, "dk", &p->dk, 4, ks));
  AB_TRY(check_shape(err, "dv", &p->dv, 4, vs));
  AB_TRY(check_dtype(err, "dq", &p->dq, dt));
  AB_TRY(check_dtype(err, "dk", &p->dk, dt));
  AB_TRY(check_dtype(err, "dv", &p->dv, dt));
  if (p->dmask.ndim) {
    AB_TRY(check_shape(err, "grad_mask", &p->dmask, 4, ms));
    AB_TRY(check_dtype(err, "grad_mask", &p->dmask, lse_dt));
  }
  return AB_OK;
}

/* ---- KV-cache calls (attention_with_kvcache) ------------------------------------------------------
 * Their own shape helper: its messages name the layout a tensor must have, as the Python layer's do. */

static int kv_paged(const ab_kvcache_params* p) { return p->block_table.ndim > 0; }

static ab_status want_shape(ab_error* err, const char* name, const ab_tensor* t, int ndim,
                            const int64_t* want, const char* layout) {
  int ok = t->ndim == ndim;
  for (int d = 0; ok && d < ndim; ++d) ok = (want[d] < 0 || t->sizes[d] == want[d]) && t->strides[d] >= 0;
  if (ok) return AB_OK;
  char got[96] = "";
  size_t n = 0;
  for (int d = 0; d < t->ndim && n < sizeof got; ++d)
    n += (size_t)snprintf(got + n, sizeof got - n, "%s%lld", d ? ", " : "", (long long)t->sizes[d]);
  return ab_error_set(err, AB_ERR_INVALID, "%s must be %s (non-negative strides), got shape (%s)", name,
                      layout, got);
}

static ab_status want_dtype(ab_error* err, const char* name, const ab_tensor* t, ab_dtype dt) {
  if (t->dtype == dt) return AB_OK;
  return ab_error_set(err, AB_ERR_INVALID, "%s must be %s like q, got %s", name, ab_dtype_name(dt),
                      ab_dtype_name(t->dtype));
}

static ab_status want_index(ab_error* err, const char* name, const ab_tensor* t) {
  if (t->dtype == AB_DTYPE_I32 || t->dtype == AB_DTYPE_I64) return AB_OK;
  return ab_error_set(err, AB_ERR_INVALID, "%s must be int32 (or int64), got %s", name, ab_dtype_name(t->dtype));
}

static const char* kernel_name(ab_device_type device) { return device == AB_DEVICE_CUDA ? "CUDA" : "CPU"; }

static ab_status want_device(ab_error* err, const char* name, const ab_tensor* t, ab_device_type device) {
  if (t->ndim == 0 || t->device == device) return AB_OK;
  return ab_error_set(err, AB_ERR_INVALID, "%s must be a %s tensor for the %s decode kernel", name,
                      kernel_name(device), kernel_name(device));
}

/* Whether two positions of a view may share memory: its dims of size > 1 in order of stride, each stride
 * must pass the furthest element the smaller ones reach (a zero stride fails; _kvcache.overlaps_itself,
 * the same rule).  A cache written in place must not: a write would land on other positions too. */
static int overlaps_itself(const ab_tensor* t) {
  int64_t st[AB_MAX_DIMS], n[AB_MAX_DIMS];
  int k = 0;
  for (int d = 0; d < t->ndim; ++d) {
    if (t->sizes[d] <= 1) continue;
    int i = k++;
    for (; i > 0 && st[i - 1] > t->strides[d]; --i) { /* insertion by stride */
      st[i] = st[i - 1];
      n[i] = n[i - 1];
    }
    st[i] = t->strides[d];
    n[i] = t->sizes[d];
  }
  int64_t reach = 0;
  for (int i = 0; i < k; ++i) {
    if (st[i] <= reach) return 1;
    reach += st[i] * (n[i] - 1);
  }
  return 0;
}

/* The decode kernels' one check of a KV-cache call (decode_cpu.h) for a device's kernel (CPU or CUDA):
 * shapes, dtypes, devices and options, everything but the values of the index tensors, which the
 * kernels check where they read them.  A direct call of the kvcache_fwd op reaches the kernels with
 * whatever the caller gave it: no size the kernels read by may disagree with a tensor's own. */
ab_status ab_kvcache_params_check(const ab_kvcache_params* p, ab_device_type device, ab_error* err) {
  const ab_dtype dt = p->q.dtype;
  if (dt != AB_DTYPE_F32 && dt != AB_DTYPE_F16 && dt != AB_DTYPE_BF16)
    return ab_error_set(err, AB_ERR_UNSUPPORTED, "the %s decode kernel takes float16, bfloat16 or float32 q, got %s",
                        kernel_name(device), ab_dtype_name(dt));
  if (p->B < 0 || p->Sq < 0 || p->Hq < 0 || p->Hkv < 1 || p->D < 1)
    return ab_error_set(err, AB_ERR_INVALID, "sizes must be B, Sq, Hq >= 0 and Hkv, D >= 1");
  if (p->Hq % p->Hkv)
    return ab_error_set(err, AB_ERR_INVALID,
                        "the number of query heads (%lld) must be a multiple of the cache's key/value heads (%lld)",
                        (long long)p->Hq, (long long)p->Hkv);
  const int64_t qs[4] = {p->B, p->Sq, p->Hq, p->D};
  AB_TRY(want_shape(err, "q", &p->q, 4, qs, "(B, Sq, Hq, D)"));
  const int64_t cs[4] = {-1, -1, p->Hkv, p->D};
  const char* cache_layout = kv_paged(p) ? "(num_blocks, block_size, Hkv, D)" : "(B_cache, S_cache, Hkv, D)";
  AB_TRY(want_shape(err, "k_cache", &p->k_cache, 4, cs, cache_layout));
  const int64_t vs[4] = {p->k_cache.sizes[0], p->k_cache.sizes[1], p->Hkv, p->D};
  AB_TRY(want_shape(err, "v_cache", &p->v_cache, 4, vs, "k_cache's shape"));
  AB_TRY(want_dtype(err, "k_cache", &p->k_cache, dt));
  AB_TRY(want_dtype(err, "v_cache", &p->v_cache, dt));
  if (p->k_cache.strides[3] != 1 || p->v_cache.strides[3] != 1)
    return ab_error_set(err, AB_ERR_INVALID, "k_cache and v_cache must have a contiguous last dimension");
  if ((p->k_new.ndim > 0) != (p->v_new.ndim > 0))
    return ab_error_set(err, AB_ERR_INVALID, "k and v must be given together");
  if (p->k_new.ndim) {
    const int64_t ns[4] = {p->B, -1, p->Hkv, p->D};
    AB_TRY(want_shape(err, "k", &p->k_new, 4, ns, "(B, Sk_new, Hkv, D)"));
    const int64_t nv[4] = {p->B, p->k_new.sizes[1], p->Hkv, p->D};
    AB_TRY(want_shape(err, "v", &p->v_new, 4, nv, "k's shape"));
    AB_TRY(want_dtype(err, "k", &p->k_new, dt));
    AB_TRY(want_dtype(err, "v", &p->v_new, dt));
    if (!p->cache_seqlens.ndim && p->cache_seqlen < 0)
      return ab_error_set(err, AB_ERR_INVALID, "cache_seqlens is required when k and v are given (where to write them)");
    /* an expanded cache (a zero stride over several rows, positions or heads) is one memory for many
     * positions: a write there would land in all of them, so it is refused as torch refuses such writes */
    const ab_tensor* caches[2] = {&p->k_cache, &p->v_cache};
    for (int c = 0; c < 2 && p->k_new.sizes[1] > 0; ++c) {
      for (int d = 0; d < 3; ++d)
        if (caches[c]->strides[d] == 0 && caches[c]->sizes[d] > 1)
          return ab_error_set(err, AB_ERR_INVALID,
                              "%s is written in place (k and v are given) but has a zero stride in dim %d: an "
                              "expanded view, whose positions share memory; pass a cache that owns its memory",
                              c ? "v_cache" : "k_cache", d);
      if (overlaps_itself(caches[c]))
        return ab_error_set(err, AB_ERR_INVALID,
                            "%s is written in place (k and v are given) but its strides make positions share "
                            "memory (an overlapping view); pass a cache that owns its memory",
                            c ? "v_cache" : "k_cache");
    }
  }
  if ((p->rotary_cos.ndim > 0) != (p->rotary_sin.ndim > 0))
    return ab_error_set(err, AB_ERR_INVALID, "rotary_cos and rotary_sin must be given together");
  if (p->rotary_cos.ndim) {
    if (!p->k_new.ndim)
      return ab_error_set(err, AB_ERR_INVALID, "rotary_cos and rotary_sin need the new k and v to rotate");
    const int64_t rs[2] = {-1, -1};
    AB_TRY(want_shape(err, "rotary_cos", &p->rotary_cos, 2, rs, "(seqlen_ro, rotary_dim / 2)"));
    const int64_t ss[2] = {p->rotary_cos.sizes[0], p->rotary_cos.sizes[1]};
    AB_TRY(want_shape(err, "rotary_sin", &p->rotary_sin, 2, ss, "rotary_cos's shape"));
    if (p->rotary_cos.sizes[1] < 1 || 2 * p->rotary_cos.sizes[1] > p->D)
      return ab_error_set(err, AB_ERR_INVALID, "rotary_dim = 2 * rotary_cos.shape[1] = %lld must be in [2, D = %lld]",
                          (long long)(2 * p->rotary_cos.sizes[1]), (long long)p->D);
    if (!ab_dtype_is_floating(p->rotary_cos.dtype) || !ab_dtype_is_floating(p->rotary_sin.dtype))
      return ab_error_set(err, AB_ERR_INVALID, "rotary_cos and rotary_sin must be floating point");
  }
  if (p->mask.ndim) {
    if (device != AB_DEVICE_CPU) return ab_error_set(err, AB_ERR_INVALID, "a mask is the CPU decode kernel's only");
    if (kv_paged(p) || p->k_new.ndim || p->cache_batch_idx.ndim)
      return ab_error_set(err, AB_ERR_INVALID, "a mask applies to a dense cache without new keys or cache_batch_idx");
    const int64_t ms[4] = {p->B, p->Hq, p->Sq, p->k_cache.sizes[1]};
    AB_TRY(want_shape(err, "attn_mask", &p->mask, 4, ms, "(B, Hq, Sq, S_cache) after broadcasting"));
    if (p->mask.dtype != AB_DTYPE_BOOL && !ab_dtype_is_floating(p->mask.dtype))
      return ab_error_set(err, AB_ERR_INVALID, "attn_mask must be bool or floating, got %s",
                          ab_dtype_name(p->mask.dtype));
  }
  const int64_t bsz[1] = {p->B};
  if (p->cache_seqlens.ndim) {
    AB_TRY(want_shape(err, "cache_seqlens", &p->cache_seqlens, 1, bsz, "(B,)"));
    AB_TRY(want_index(err, "cache_seqlens", &p->cache_seqlens));
  } else if (p->cache_seqlen < -1) {
    return ab_error_set(err, AB_ERR_INVALID, "cache_seqlens must be >= 0, got %lld", (long long)p->cache_seqlen);
  }
  if (p->cache_batch_idx.ndim) {
    if (kv_paged(p))
      return ab_error_set(err, AB_ERR_INVALID, "cache_batch_idx does not apply to a paged cache (block_table maps the rows)");
    AB_TRY(want_shape(err, "cache_batch_idx", &p->cache_batch_idx, 1, bsz, "(B,)"));
    AB_TRY(want_index(err, "cache_batch_idx", &p->cache_batch_idx));
  } else if (!kv_paged(p) && p->k_cache.sizes[0] < p->B) {
    return ab_error_set(err, AB_ERR_INVALID,
                        "k_cache has %lld rows for a batch of %lld: give cache_batch_idx to map batch rows to cache rows",
                        (long long)p->k_cache.sizes[0], (long long)p->B);
  }
  if (p->cache_leftpad.ndim) {
    AB_TRY(want_shape(err, "cache_leftpad", &p->cache_leftpad, 1, bsz, "(B,)"));
    AB_TRY(want_index(err, "cache_leftpad", &p->cache_leftpad));
  }
  if (kv_paged(p)) {
    const int64_t bt[2] = {p->B, -1};
    AB_TRY(want_shape(err, "block_table", &p->block_table, 2, bt, "(B, max_blocks)"));
    AB_TRY(want_index(err, "block_table", &p->block_table));
    if (p->k_cache.sizes[1] < 1) return ab_error_set(err, AB_ERR_INVALID, "a paged cache needs block_size >= 1");
  }
  if (p->alibi_slopes.ndim) {
    const int64_t a1[1] = {p->Hq}, a2[2] = {p->B, p->Hq};
    if (p->alibi_slopes.ndim == 1)
      AB_TRY(want_shape(err, "alibi_slopes", &p->alibi_slopes, 1, a1, "(Hq,) or (B, Hq)"));
    else
      AB_TRY(want_shape(err, "alibi_slopes", &p->alibi_slopes, 2, a2, "(Hq,) or (B, Hq)"));
    if (p->alibi_slopes.dtype != AB_DTYPE_F32)
      return ab_error_set(err, AB_ERR_INVALID, "alibi_slopes must be float32, got %s",
                          ab_dtype_name(p->alibi_slopes.dtype));
  }
  if (p->sinks.ndim) {
    const int64_t hs[1] = {p->Hq};
    AB_TRY(want_shape(err, "sinks", &p->sinks, 1, hs, "(Hq,)"));
    if (!ab_dtype_is_floating(p->sinks.dtype))
      return ab_error_set(err, AB_ERR_INVALID, "sinks must be floating, got %s", ab_dtype_name(p->sinks.dtype));
  }
  const ab_tensor* all[] = {&p->q, &p->k_cache, &p->v_cache, &p->k_new, &p->v_new, &p->rotary_cos,
                            &p->rotary_sin, &p->cache_seqlens, &p->cache_batch_idx, &p->cache_leftpad,
                            &p->block_table, &p->alibi_slopes, &p->sinks, &p->out, &p->lse};
  const char* names[] = {"q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                         "cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes", "sinks", "out", "lse"};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) AB_TRY(want_device(err, names[i], all[i], device));
  AB_TRY(want_shape(err, "out", &p->out, 4, qs, "(B, Sq, Hq, D)"));
  AB_TRY(want_dtype(err, "out", &p->out, dt));
  const int64_t ls[3] = {p->B, p->Hq, p->Sq};
  AB_TRY(want_shape(err, "lse", &p->lse, 3, ls, "(B, Hq, Sq)"));
  if (p->lse.dtype != AB_DTYPE_F32) return ab_error_set(err, AB_ERR_INVALID, "lse must be float32");
  if (!isfinite(p->scale)) return ab_error_set(err, AB_ERR_INVALID, "softmax_scale must be finite, got %g", p->scale);
  if (!(p->softcap >= 0.0) || !isfinite(p->softcap))
    return ab_error_set(err, AB_ERR_INVALID, "softcap must be >= 0 and finite, got %g", p->softcap);
  if (p->window_left < -1 || p->window_right < -1)
    return ab_error_set(err, AB_ERR_INVALID, "window_size values must be >= -1, got (%lld, %lld)",
                        (long long)p->window_left, (long long)p->window_right);
  if (p->num_splits < 0) return ab_error_set(err, AB_ERR_INVALID, "num_splits must be >= 0, got %d", p->num_splits);
  return AB_OK;
}
