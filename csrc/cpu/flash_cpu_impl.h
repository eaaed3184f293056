/* flash_cpu_impl.h -- the CPU flash kernel (FlashAttention-2 algorithm), one source for every ISA.
 *
 * Included by flash_cpu_generic.c / _avx2.c / _avx512.c, each compiled with its ISA's flags, with
 * AB_ISA_SFX set to the suffix of the table it exports.  Vector width and tile sizes follow from
 * the ISA through ab_vec.h (VLEN) and the NV_MAX / MR choice below.
 *
 * Layout idea: scores are computed transposed, St[j][r] for key j and query row r of a chunk of
 * rc = nv * VLEN rows (nv <= NV_MAX vectors; fewer for short queries), with the query rows along
 * the vector lanes.  Then
 *   - S = Q K^T is C += A * B with A = K rows (broadcast scalars) and B = Q^T (vectors of rows);
 *   - the row max and row sum of the softmax are element-wise max/add over j (no shuffles);
 *   - O += P V is the same micro-kernel with A = P^T (broadcast, by row) and B = V rows;
 * so K and V are read in their natural (row) layout, straight from the caller's float32 tensors
 * when their last dim is contiguous, and one register-blocked micro-kernel (MR broadcast rows x
 * NV_MAX vectors) does every matrix product of the forward and the backward.
 *
 * Forward, per (batch, head, chunk of rc query rows): for each block of BK visible keys, compute
 * St, mask, online softmax (running max m, sum l, O rescaled by exp(m_old - m_new)), O += P V.
 * Extra memory is O(rc * (D + Dv + BK)) per thread, whatever Sq and Sk are.
 *
 * Backward, per (batch, KV head): K and V packed once; for each query head of the group, Q and
 * dO are packed (natural and transposed) and for each key block and row chunk the kernel
 * recomputes P from each row's max and log sum (the forward's `stats`), then dV += P^T dO,
 * dS = P (dP - delta), dK += dS^T Q, dQ += dS K.  Each
 * item owns its dK, dV and dQ rows: no atomics, bitwise the same result on every run.
 */

#include <math.h>
#include <stdatomic.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include "../ab_philox.h"
#include "ab_cpu.h"
#include "ab_vec.h"
#include "flash_cpu.h"

#if VLEN == 16
#define NV_MAX 4 /* 64-row chunks: 6 x 4 = 24 accumulators of 32 zmm */
#else
#define NV_MAX 2 /* 16 vector registers: 6 x 2 = 12 accumulators */
#endif
#define MR 6
#define RC_MAX (NV_MAX * VLEN)
#ifndef BK
#define BK 64 /* keys per block: St (BK x rc floats) stays in L1 */
#endif
#define KC 64 /* head dims per pass of S = K Q^T */
#define NDOM 16 /* the backward corrects delta's rounding on keys with P > 1 / NDOM (at most NDOM - 1) */
#define LOG_NDOM 2.7725887f

#define AB_CAT2(a, b) a##b
#define AB_CAT(a, b) AB_CAT2(a, b)
#define SYM(name) AB_CAT(name, AB_ISA_SFX)

/* ---- the micro-kernel ------------------------------------------------------------------------ */

/* C[m][v] (+)= sum_k A[m * am + k * ak] * B[k * ldb + v * VLEN] for m < M, v < NV; M and NV are
 * compile-time constants at every call site, so acc[][] lives in registers. */
static inline __attribute__((always_inline)) void SYM(mk)(const int M, const int NV, int64_t K,
                                                         const float* A, int64_t am, int64_t ak,
                                                         const float* B, int64_t ldb, float* C,
                                                         int64_t ldc, int accumulate) {
  vf acc[MR][NV_MAX];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v)
      acc[m][v] = accumulate ? vload(C + m * ldc + v * VLEN) : vset1(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    vf b[NV_MAX];
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * VLEN);
    const float* a = A + k * ak;
    for (int m = 0; m < M; ++m) {
      const vf av = vset1(a[m * am]);
      for (int v = 0; v < NV; ++v) acc[m][v] += av * b[v];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) vstore(C + m * ldc + v * VLEN, acc[m][v]);
}

#define MK_CASE(M_, NV_, AM_) SYM(mk)(M_, NV_, K, A, AM_, ak, B, ldb, C, ldc, accumulate)
#define MK_NV(M_, AM_)                                       \
  switch (nv) {                                              \
    case 1: MK_CASE(M_, 1, AM_); break;                      \
    case 2: MK_CASE(M_, 2, AM_); break;                      \
    case 3: MK_CASE(M_, 3 > NV_MAX ? NV_MAX : 3, AM_); break; \
    default: MK_CASE(M_, NV_MAX, AM_); break;                \
  }
#define MK_TAIL(AM_)                   \
  switch (Mtot - m) {                  \
    case 5: MK_NV(5, AM_); break;      \
    case 4: MK_NV(4, AM_); break;      \
    case 3: MK_NV(3, AM_); break;      \
    case 2: MK_NV(2, AM_); break;      \
    case 1: MK_NV(1, AM_); break;      \
    default: break;                    \
  }

/* C (Mtot x nv vectors) (+)= A (Mtot x K, strides am/ak) * B (K x nv vectors, row stride ldb).
 * am == 1 (A's rows are consecutive scalars: P^T and dS^T read by row) gets its own code, where
 * the six broadcasts are fixed offsets from one pointer: a runtime am costs the micro-kernel five
 * general registers, and with them it spills. */
static void SYM(gemm_nv)(int64_t Mtot, int nv, int64_t K, const float* A, int64_t am, int64_t ak,
                         const float* B, int64_t ldb, float* C, int64_t ldc, int accumulate) {
  int64_t m = 0;
  if (am == 1) {
    for (; m + MR <= Mtot; m += MR, A += MR, C += MR * ldc) MK_NV(MR, 1);
    MK_TAIL(1);
  } else {
    for (; m + MR <= Mtot; m += MR, A += MR * am, C += MR * ldc) MK_NV(MR, am);
    MK_TAIL(am);
  }
}

/* The same for any number of vectors along N, NV_MAX at a time. */
static void SYM(gemm)(int64_t Mtot, int64_t nvec, int64_t K, const float* A, int64_t am, int64_t ak,
                      const float* B, int64_t ldb, float* C, int64_t ldc, int accumulate) {
  for (int64_t v0 = 0; v0 < nvec; v0 += NV_MAX) {
    const int nv = (int)(nvec - v0 < NV_MAX ? nvec - v0 : NV_MAX);
    SYM(gemm_nv)(Mtot, nv, K, A, am, ak, B + v0 * VLEN, ldb, C + v0 * VLEN, ldc, accumulate);
  }
}

/* ---- per-sequence geometry (dense and packed calls alike) ------------------------------------- */

typedef struct SYM(seq) {
  int64_t Sq, Sk;           /* this sequence's lengths */
  int64_t q, k, v, o, lse;  /* element offsets of row 0 of this (batch, head) */
  int64_t q_rs, k_rs, v_rs, o_rs, lse_rs; /* row strides */
  uint64_t drop_row0;       /* dropout row index of query row 0 */
  int64_t mask;             /* offset of (b, h, 0, 0) in the mask view */
  int64_t st, st_rs;        /* stats: offset of row 0's max (its log sum is one plane further), row stride */
  float sink;               /* this head's sink logit, -inf without sinks */
  float slope;              /* this (batch, head)'s ALiBi slope, 0 without ALiBi */
} SYM(seq);

static void SYM(seq_get)(const ab_attn_params* p, int64_t b, int64_t h, int64_t hk, SYM(seq) * s) {
  if (p->cu_seqlens_q) {
    const int64_t q0 = p->cu_seqlens_q[b], k0 = p->cu_seqlens_k[b];
    s->Sq = p->cu_seqlens_q[b + 1] - q0;
    s->Sk = p->cu_seqlens_k[b + 1] - k0;
    s->q = q0 * p->q.strides[0] + h * p->q.strides[1];
    s->k = k0 * p->k.strides[0] + hk * p->k.strides[1];
    s->v = k0 * p->v.strides[0] + hk * p->v.strides[1];
    s->o = q0 * p->out.strides[0] + h * p->out.strides[1];
    s->lse = h * p->lse.strides[0] + q0 * p->lse.strides[1];
    s->q_rs = p->q.strides[0];
    s->k_rs = p->k.strides[0];
    s->v_rs = p->v.strides[0];
    s->o_rs = p->out.strides[0];
    s->lse_rs = p->lse.strides[1];
    s->mask = 0;
    s->st = p->stats.ndim ? h * p->stats.strides[1] + q0 * p->stats.strides[2] : 0;
    s->st_rs = p->stats.ndim ? p->stats.strides[2] : 0;
  } else {
    s->Sq = p->Sq;
    s->Sk = p->Sk;
    s->q = b * p->q.strides[0] + h * p->q.strides[1];
    s->k = b * p->k.strides[0] + hk * p->k.strides[1];
    s->v = b * p->v.strides[0] + hk * p->v.strides[1];
    s->o = b * p->out.strides[0] + h * p->out.strides[1];
    s->lse = b * p->lse.strides[0] + h * p->lse.strides[1];
    s->q_rs = p->q.strides[2];
    s->k_rs = p->k.strides[2];
    s->v_rs = p->v.strides[2];
    s->o_rs = p->out.strides[2];
    s->lse_rs = p->lse.strides[2];
    s->mask = p->mask.ndim ? b * p->mask.strides[0] + h * p->mask.strides[1] : 0;
    s->st = p->stats.ndim ? b * p->stats.strides[1] + h * p->stats.strides[2] : 0;
    s->st_rs = p->stats.ndim ? p->stats.strides[3] : 0;
  }
  /* dense: (b * Hq + h) * Sq + i; packed: the same with Sq = max_seqlen_q, so a packed call and
   * the padded dense call draw the same dropout mask */
  s->drop_row0 = (uint64_t)((b * p->Hq + h) * p->Sq);
  s->sink = (float)ab_attn_sink(p, h);
  s->slope = (float)ab_attn_alibi_slope(p, b, h);
}

/* Visible keys of query row i of a sequence: [lo, hi) from causal and window (docs/semantics.md). */
static inline void SYM(row_range)(const ab_attn_params* p, const SYM(seq) * s, int64_t i, int64_t* lo,
                                  int64_t* hi) {
  ab_key_range(p, s->Sq, s->Sk, i, lo, hi);
  if (*hi < *lo) *hi = *lo;
}

/* Loads row chunk [i0, i0 + n) of a (rows x cols) operand transposed and scaled into
 * dst (cols x rc); rows n..rc-1 of the chunk are zero.  The rows are converted into `rows`
 * (rc x cols, zero rows past n) first, then gathered a vector of rows at a time. */
static void SYM(pack_t)(const ab_tensor* t, int64_t base, int64_t rs, int64_t i0, int64_t n,
                        int64_t cols, float scale, float* dst, float* rows, int64_t rc) {
  for (int64_t r = 0; r < n; ++r)
    ab_vec_load_row(t->data, t->dtype, base + (i0 + r) * rs, cols, t->strides[t->ndim - 1], rows + r * cols);
  memset(rows + n * cols, 0, sizeof(float) * (size_t)((rc - n) * cols));
  const vf sc = vset1(scale);
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rc; r += VLEN) vstore(dst + c * rc + r, vgather(rows + r * cols + c, (int32_t)cols) * sc);
}

/* Rows [j0, j0 + n) of a (rows x cols) operand as float32 rows of width ld (zero-padded). */
static void SYM(pack_rows)(const ab_tensor* t, int64_t base, int64_t rs, int64_t j0, int64_t n,
                           int64_t cols, int64_t ld, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    ab_vec_load_row(t->data, t->dtype, base + (j0 + j) * rs, cols, t->strides[t->ndim - 1], dst + j * ld);
    for (int64_t c = cols; c < ld; ++c) dst[j * ld + c] = 0.0f;
  }
}

/* Where the softmax scale goes.  Folded into Q^T when |scale| <= 1 (the usual 1/sqrt(D)): q * scale
 * cannot overflow and S = K Q^T is then free of extra work.  A larger scale multiplies S after the
 * product instead (`post`), so q * scale never overflows where scale * q.k does not (torch scales q
 * and k by sqrt(scale); either way a score overflows only when it is beyond float32). */
static inline float SYM(q_scale)(const ab_attn_params* p) {
  return fabs(p->scale) <= 1.0 ? (float)p->scale : 1.0f;
}

static inline double SYM(post_scale)(const ab_attn_params* p) { return fabs(p->scale) <= 1.0 ? 1.0 : p->scale; }

/* Applies causal/window and a bool/float mask to St (nb x rc, keys j0..) of row chunk i0 with
 * visible ranges lo/hi (int32 per row, padded rows have lo = hi = 0); before them, the scale left
 * after the product (post, 1 for none), softcap and ALiBi. */
static void SYM(mask_scores)(const ab_attn_params* p, const SYM(seq) * s, int64_t i0, int64_t nrows,
                             int64_t j0, int64_t nb, const int32_t* lo, const int32_t* hi, int structural,
                             float* St, float* Th, int64_t rc, double post) {
  const vf ninf = vset1(-__builtin_inff());
  if (p->softcap > 0) {
    /* softcap * tanh(post * S / softcap): the factor post / softcap is one multiply when it is a
     * normal float32, else two (a power of two, then the rest), so a softcap near float32's limits
     * neither overflows it nor turns it subnormal */
    const double f = post / p->softcap;
    int e = 0;
    frexp(f, &e);
    const int split = fabs(f) < 0x1p-120 || fabs(f) > 0x1p120;
    const vf c1 = vset1(split ? (float)ldexp(1.0, e / 2) : 1.0f);
    const vf c2 = vset1(split ? (float)(f / ldexp(1.0, e / 2)) : (float)f);
    const vf cap = vset1((float)p->softcap);
    for (int64_t x = 0; x < nb * rc; x += VLEN) {
      const vf t = split ? vtanh((vload(St + x) * c1) * c2) : vtanh(vload(St + x) * c2);
      if (Th) vstore(Th + x, t);
      vstore(St + x, cap * t);
    }
  } else if (post != 1.0) {
    const vf f = vset1((float)post);
    for (int64_t x = 0; x < nb * rc; x += VLEN) vstore(St + x, vload(St + x) * f);
  }
  if (s->slope != 0.0f) {
    /* ALiBi, -slope * |i' - j| with i' = i + Sk - Sq: the distance of lane r to key j0 is an exact
     * integer, rounded to float32 once (exact below 2^24), then stepped down key by key */
    const vf sl = vset1(s->slope);
    for (int64_t v = 0; v < rc; v += VLEN) {
      vf d0 = vset1(0.0f);
      for (int u = 0; u < VLEN; ++u) d0[u] = (float)(i0 + v + u + s->Sk - s->Sq - j0);
      for (int64_t j = 0; j < nb; ++j) {
        const vf d = d0 - vset1((float)j);
        vstore(St + j * rc + v, vload(St + j * rc + v) - sl * vselect(d < vset1(0.0f), -d, d));
      }
    }
  }
  if (p->mask.ndim) {
    const int64_t ms_i = p->mask.strides[2], ms_j = p->mask.strides[3];
    if (p->mask.dtype == AB_DTYPE_BOOL) {
      const uint8_t* m = (const uint8_t*)p->mask.data + s->mask;
      for (int64_t j = 0; j < nb; ++j)
        for (int64_t r = 0; r < nrows; ++r)
          if (!m[(i0 + r) * ms_i + (j0 + j) * ms_j]) St[j * rc + r] = -__builtin_inff();
    } else {
      for (int64_t j = 0; j < nb; ++j)
        for (int64_t r = 0; r < nrows; ++r)
          St[j * rc + r] += (float)ab_load_scalar(p->mask.data, p->mask.dtype,
                                                  s->mask + (i0 + r) * ms_i + (j0 + j) * ms_j);
    }
  }
  if (structural) {
    for (int64_t v = 0; v < rc; v += VLEN) {
      vi lov, hiv;
      memcpy(&lov, lo + v, sizeof lov);
      memcpy(&hiv, hi + v, sizeof hiv);
      for (int64_t j = 0; j < nb; ++j) {
        const vi jv = (vi){0} + (int32_t)(j0 + j);
        const vi hide = (jv < lov) | (jv >= hiv);
        vstore(St + j * rc + v, vselect(hide, ninf, vload(St + j * rc + v)));
      }
    }
  }
}

/* f[j][r] = 1 / (1 - p) where element (row i0 + r, key j0 + j) is kept, else 0 (rows past nrows: 0).
 * The decisions are the shared Philox stream (ab_philox.h), four keys per draw. */
static void SYM(drop_factors)(const ab_attn_params* p, const SYM(seq) * s, int64_t i0, int64_t nrows,
                              int64_t j0, int64_t nb, float* f, int64_t rc) {
  const uint32_t thr = ab_dropout_threshold(p->dropout_p);
  const float rdrop = (float)(1.0 / (1.0 - p->dropout_p));
  memset(f, 0, sizeof(float) * (size_t)(nb * rc));
  for (int64_t r = 0; r < nrows; ++r) {
    const uint64_t row = s->drop_row0 + (uint64_t)(i0 + r);
    uint32_t w[4];
    int64_t blk = -1;
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t jj = j0 + j;
      if ((jj >> 2) != blk) {
        blk = jj >> 2;
        ab_dropout_words(p->seed, p->offset, row, (uint64_t)blk, w);
      }
      f[j * rc + r] = w[jj & 3] >= thr ? rdrop : 0.0f;
    }
  }
}

static void SYM(vmul)(float* x, const float* f, int64_t n) {
  for (int64_t i = 0; i < n; i += VLEN) vstore(x + i, vload(x + i) * vload(f + i));
}

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
  vf mx[NV_MAX], mx2[NV_MAX], msafe[NV_MAX], ls[NV_MAX], ls2[NV_MAX];
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

/* Row chunks of the forward: nv vectors of query rows per chunk (fewer for short queries, e.g.
 * decode, so fewer padded rows are computed), nchunk = ceil(Sq / (nv * VLEN)) chunks. */
static void SYM(fwd_chunks)(int64_t Sq, int* nv, int64_t* nchunk) {
  const int64_t vecs = (Sq + VLEN - 1) / VLEN;
  *nv = (int)(vecs < NV_MAX ? (vecs > 0 ? vecs : 1) : NV_MAX);
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

/* O += P V for the real rows of a chunk: A = P^T (BK x rc) read by row (broadcasts), B = the key
 * block's V rows, read in place when v_direct, else packed to float32 in vp. */
static void SYM(accum_pv)(const ab_attn_params* p, const SYM(seq) * s, int v_direct, int64_t j0, int64_t nb,
                          int64_t nrows, int64_t rc, const float* st, float* vp, float* on, int64_t Dvp) {
  const float* va;
  int64_t va_k;
  if (v_direct) {
    va = (const float*)p->v.data + s->v + j0 * s->v_rs;
    va_k = s->v_rs;
  } else {
    SYM(pack_rows)(&p->v, s->v, s->v_rs, j0, nb, p->Dv, Dvp, vp);
    va = vp;
    va_k = Dvp;
  }
  SYM(gemm)(nrows, Dvp / VLEN, nb, st, 1, rc, va, va_k, on, Dvp, 1);
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
  const size_t nfl = (size_t)(D * rc + rc * Dvp + 2 * BK * rc + BK * D + BK * Dvp + rc * Dmax + 5 * rc);
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
  int32_t* lo = (int32_t*)(arow + rc);
  int32_t* hi = lo + rc;
  for (int64_t item = begin; item < end; ++item) {
    SYM(chunk) ch;
    if (!SYM(chunk_begin)(p, item, ctx->nchunk, rc, lo, hi, mrow, lrow, &ch)) continue;
    const SYM(seq) s = ch.s;
    const int64_t i0 = ch.i0, nrows = ch.nrows, jlo = ch.jlo, jhi = ch.jhi, all_lo = ch.all_lo, all_hi = ch.all_hi;
    SYM(pack_t)(&p->q, s.q, s.q_rs, i0, nrows, D, SYM(q_scale)(p), qt, tmp, rc);
    memset(on, 0, sizeof(float) * (size_t)(nrows * Dvp));
    const int partial_rows = nrows < rc;
    for (int64_t j0 = jlo; j0 < jhi; j0 += BK) {
      const int64_t nb = jhi - j0 < BK ? jhi - j0 : BK;
      const float* ka;
      int64_t ka_m;
      if (k_direct) {
        ka = (const float*)p->k.data + s.k + j0 * s.k_rs;
        ka_m = s.k_rs;
      } else {
        SYM(pack_rows)(&p->k, s.k, s.k_rs, j0, nb, D, D, kp);
        ka = kp;
        ka_m = D;
      }
      /* S^T = K Q^T (scale folded into Q^T), KC dims at a time so the slice of Q^T the micro-kernel
       * streams for every 6 keys (KC x rc floats) stays in L1 */
      for (int64_t d0 = 0; d0 < D; d0 += KC)
        SYM(gemm_nv)(nb, nv, D - d0 < KC ? D - d0 : KC, ka + d0, ka_m, 1, qt + d0 * rc, rc, st, rc, d0 > 0);
      const int structural = partial_rows || j0 < all_lo || j0 + nb > all_hi;
      SYM(mask_scores)(p, &s, i0, nrows, j0, nb, lo, hi, structural, st, NULL, rc, post);
      if (SYM(online_softmax)(st, nb, mrow, lrow, arow, nv)) SYM(rescale_rows)(on, arow, nrows, Dvp);
      if (p->dropout_p > 0) { /* the sum l above is of the weights before dropout */
        SYM(drop_factors)(p, &s, i0, nrows, j0, nb, fd, rc);
        SYM(vmul)(st, fd, nb * rc);
      }
      SYM(accum_pv)(p, &s, v_direct, j0, nb, nrows, rc, st, vp, on, Dvp);
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
  SYM(fwd_chunks)(Sq, &ctx.nv, &ctx.nchunk);
  const double work = (double)p->B * p->Hq * Sq * Sk * (double)(p->D + p->Dv);
  return ab_par_run(pool, p->B * p->Hq * ctx.nchunk, 1, work, SYM(fwd_range), &ctx, &ctx.st);
}

/* ---- backward ---------------------------------------------------------------------------------- */

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
      const int64_t dos = p->cu_seqlens_q ? p->dout.strides[0] : p->dout.strides[2];
      const int64_t do_base = p->cu_seqlens_q ? p->cu_seqlens_q[b] * p->dout.strides[0] + h * p->dout.strides[1]
                                              : b * p->dout.strides[0] + h * p->dout.strides[1];
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
      for (int64_t i = 0; i < sqp; ++i) {
        float m = __builtin_inff(), ls = 0.0f;
        double dl = 0.0; /* a float64 sum: Dv terms of either sign, where float32 would lose digits */
        if (i < Sq) {
          /* P = exp((x - max) - log sum), both parts as the forward left them: exp(x - lse) would
           * carry lse's float32 rounding, which grows with |lse| (softcap, ALiBi, large scales) and
           * is shared by a whole row */
          if (p->stats.ndim) {
            const float* st = (const float*)p->stats.data + s.st + i * s.st_rs;
            m = st[0];
            ls = st[p->stats.strides[0]];
          } else {
            m = ((const float*)p->lse.data)[s.lse + i * s.lse_rs];
          }
          if (m == -__builtin_inff()) m = __builtin_inff(), ls = 0.0f; /* dead row: P = exp(x - inf) = 0 */
          ab_vec_load_row(p->out.data, p->out.dtype, s.o + i * s.o_rs, Dv, p->out.strides[p->out.ndim - 1], tmp);
          for (int64_t d = 0; d < Dv; ++d) dl += (double)tmp[d] * (double)don[i * Dvp + d];
          if (p->dlse.ndim) {
            const int64_t off = p->cu_seqlens_q
                                    ? h * p->dlse.strides[0] + (p->cu_seqlens_q[b] + i) * p->dlse.strides[1]
                                    : b * p->dlse.strides[0] + h * p->dlse.strides[1] + i * p->dlse.strides[2];
            dl -= ((const float*)p->dlse.data)[off];
          }
        }
        mx[i] = m;
        lsum[i] = ls;
        delta[i] = (float)dl;
      }
      memset(dq, 0, sizeof(float) * (size_t)(sqp * Dp));
      for (int64_t i0 = 0; i0 < Sq; i0 += rc) {
        const int64_t nrows = Sq - i0 < rc ? Sq - i0 : rc;
        int64_t jlo = Sk, jhi = 0, all_lo = 0, all_hi = Sk;
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
        for (int64_t r = 0; r < rc; ++r) {
          int64_t l = 0, hh = 0;
          if (r < nrows) {
            SYM(row_range)(p, &s, i0 + r, &l, &hh);
            if (hh > l) {
              if (l < jlo) jlo = l;
              if (hh > jhi) jhi = hh;
            }
            if (l > all_lo) all_lo = l;
            if (hh < all_hi) all_hi = hh;
          }
          lo[r] = (int32_t)l;
          hi[r] = (int32_t)hh;
        }
        for (int64_t j0 = jlo; j0 < jhi; j0 += BK) {
          const int64_t nb = jhi - j0 < BK ? jhi - j0 : BK;
          /* recompute S^T (bitwise as the forward did) and P^T = exp((S^T - max) - log sum) */
          SYM(gemm_nv)(nb, nv, D, kp + j0 * Dp, Dp, 1, qt + i0 * Dp, rc, st, rc, 0);
          const int structural = nrows < rc || j0 < all_lo || j0 + nb > all_hi;
          SYM(mask_scores)(p, &s, i0, nrows, j0, nb, lo, hi, structural, st, softcap ? th : NULL, rc, post);
          for (int64_t v = 0; v < rc; v += VLEN) {
            const vf mv = vload(mx + i0 + v), lv = vload(lsum + i0 + v);
            for (int64_t j = 0; j < nb; ++j)
              vstore(st + j * rc + v, vexp_nonpos((vload(st + j * rc + v) - mv) - lv));
          }
          if (heavy)
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
          /* dP^T = V dO^T */
          SYM(gemm_nv)(nb, nv, Dv, vp + j0 * Dvp, Dvp, 1, dot + i0 * Dvp, rc, dpt, rc, 0);
          const float* pw = st; /* the weights dV sees: P, or P after dropout */
          if (p->dropout_p > 0) {
            /* the forward's decisions again: dV sees P * f, and dP (of the dropped weights) * f */
            SYM(drop_factors)(p, &s, i0, nrows, j0, nb, pd, rc);
            SYM(vmul)(dpt, pd, nb * rc);
            SYM(vmul)(pd, st, nb * rc);
            pw = pd;
          }
          /* dS = P (dP - delta); the float mask's gradient; softcap chain rule; scale */
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
          if (want_dmask) {
            for (int64_t j = 0; j < nb; ++j)
              for (int64_t r = 0; r < nrows; ++r) {
                const int64_t off = b * p->dmask.strides[0] + h * p->dmask.strides[1] +
                                    (i0 + r) * p->dmask.strides[2] + (j0 + j) * p->dmask.strides[3];
                ((float*)p->dmask.data)[off] = dpt[j * rc + r];
              }
          }
          for (int64_t x = 0; x < nb * rc; x += VLEN) {
            vf ds = vload(dpt + x) * vset1(scale);
            if (softcap) {
              const vf t = vload(th + x);
              ds = ds * (vset1(1.0f) - t * t);
            }
            vstore(dpt + x, ds);
          }
          /* dV += P^T dO, dK += dS^T Q, dQ += dS K */
          SYM(gemm)(nb, Dvp / VLEN, rc, pw, rc, 1, don + i0 * Dvp, Dvp, dv + j0 * Dvp, Dvp, 1);
          SYM(gemm)(nb, Dp / VLEN, rc, dpt, rc, 1, qn + i0 * Dp, Dp, dk + j0 * Dp, Dp, 1);
          SYM(gemm)(nrows, Dp / VLEN, nb, dpt, 1, rc, kp + j0 * Dp, Dp, dq + i0 * Dp, Dp, 1);
        }
        for (int64_t r = 0; r < nrows && heavy; ++r) {
          if (ndom[r] == 0) continue;
          const int64_t i = i0 + r;
          float e = dsum[r]; /* delta's error: the row's dS sums to dlse, not 0, when lse has a gradient */
          if (p->dlse.ndim)
            e -= ((const float*)p->dlse.data)[p->cu_seqlens_q
                                                  ? h * p->dlse.strides[0] + (p->cu_seqlens_q[b] + i) * p->dlse.strides[1]
                                                  : b * p->dlse.strides[0] + h * p->dlse.strides[1] + i * p->dlse.strides[2]];
          /* with a sink the keys' dS sum to dlse + P_sink delta (the sink's own share is not a key's) */
          if (s.sink != -__builtin_inff()) e -= expf((s.sink - mx[i]) - lsum[i]) * delta[i];
          for (int32_t u = 0; u < ndom[r]; ++u) {
            const int64_t slot = r * NDOM + u, j = jdom[slot];
            const float c = -pdom[slot] * e; /* what dS at key j lacks */
            if (want_dmask)
              ((float*)p->dmask.data)[b * p->dmask.strides[0] + h * p->dmask.strides[1] + i * p->dmask.strides[2] +
                                      j * p->dmask.strides[3]] += c;
            const vf cv = vset1(c * scale * (softcap ? 1.0f - tdom[slot] * tdom[slot] : 1.0f));
            for (int64_t d = 0; d < Dp; d += VLEN) {
              vstore(dq + i * Dp + d, vload(dq + i * Dp + d) + cv * vload(kp + j * Dp + d));
              vstore(dk + j * Dp + d, vload(dk + j * Dp + d) + cv * vload(qn + i * Dp + d));
            }
          }
        }
        if (want_dmask) { /* keys no row of the chunk sees get gradient 0 */
          for (int64_t r = 0; r < nrows; ++r) {
            const int64_t base = b * p->dmask.strides[0] + h * p->dmask.strides[1] + (i0 + r) * p->dmask.strides[2];
            for (int64_t j = 0; j < Sk; ++j)
              if (j < jlo || j >= jhi) ((float*)p->dmask.data)[base + j * p->dmask.strides[3]] = 0.0f;
          }
        }
      }
      const int64_t dqs = p->cu_seqlens_q ? p->dq.strides[0] : p->dq.strides[2];
      const int64_t dq_base = p->cu_seqlens_q ? p->cu_seqlens_q[b] * p->dq.strides[0] + h * p->dq.strides[1]
                                              : b * p->dq.strides[0] + h * p->dq.strides[1];
      for (int64_t i = 0; i < Sq; ++i)
        ab_vec_store_row(p->dq.data, p->dq.dtype, dq_base + i * dqs, D, p->dq.strides[p->dq.ndim - 1], dq + i * Dp);
    }
    const int64_t dks = p->cu_seqlens_k ? p->dk.strides[0] : p->dk.strides[2];
    const int64_t dvs = p->cu_seqlens_k ? p->dv.strides[0] : p->dv.strides[2];
    const int64_t k0 = p->cu_seqlens_k ? p->cu_seqlens_k[b] : 0;
    const int64_t dk_base = p->cu_seqlens_k ? k0 * p->dk.strides[0] + hk * p->dk.strides[1]
                                            : b * p->dk.strides[0] + hk * p->dk.strides[1];
    const int64_t dv_base = p->cu_seqlens_k ? k0 * p->dv.strides[0] + hk * p->dv.strides[1]
                                            : b * p->dv.strides[0] + hk * p->dv.strides[1];
    for (int64_t j = 0; j < Sk; ++j) {
      ab_vec_store_row(p->dk.data, p->dk.dtype, dk_base + j * dks, D, p->dk.strides[p->dk.ndim - 1], dk + j * Dp);
      ab_vec_store_row(p->dv.data, p->dv.dtype, dv_base + j * dvs, Dv, p->dv.strides[p->dv.ndim - 1], dv + j * Dvp);
    }
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

/* ---- the FMA peak of this ISA path (benchmarks report kernels as a fraction of it) -------------- */

/* Float32 FMAs per second on the calling thread: 12 independent vector chains (enough to cover
 * the FMA latency on every x86 core), timed for about `seconds`. */
#if defined(__x86_64__) || defined(__i386__)
#define AB_KEEP(x) __asm__ volatile("" : "+x"(x)) /* the chain stays a register, unoptimised */
#elif defined(__aarch64__)
#define AB_KEEP(x) __asm__ volatile("" : "+w"(x))
#else
#define AB_KEEP(x) ((void)0)
#endif
#define AB_FMA12(op) op(c0) op(c1) op(c2) op(c3) op(c4) op(c5) op(c6) op(c7) op(c8) op(c9) op(c10) op(c11)
#define AB_STEP(x) x = x * a + b; AB_KEEP(x);

static double SYM(fma_rate)(double seconds) {
  const vf a = vset1(0.99999f), b = vset1(1e-6f);
  vf c0 = a, c1 = b, c2 = a, c3 = b, c4 = a, c5 = b, c6 = a, c7 = b, c8 = a, c9 = b, c10 = a, c11 = b;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  double elapsed = 0.0;
  int64_t iters = 0;
  while (elapsed < seconds) {
    for (int it = 0; it < 100000; ++it) {
      AB_FMA12(AB_STEP)
    }
    iters += 100000;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    elapsed = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  }
  const float sink = c0[0] + c1[0] + c2[0] + c3[0] + c4[0] + c5[0] + c6[0] + c7[0] + c8[0] + c9[0] + c10[0] + c11[0];
  return sink == 12345.0f ? 0.0 : 2.0 * 12 * VLEN * (double)iters / elapsed;
}
#undef AB_STEP
#undef AB_FMA12
#undef AB_KEEP

const ab_flash_cpu_table AB_CAT(ab_flash_cpu, AB_ISA_SFX) = {AB_ISA_NAME, SYM(flash_fwd), SYM(flash_bwd),
                                                           SYM(fma_rate)};
