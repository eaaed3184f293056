/* cpu_tiles_impl.h -- the vector tiles every CPU kernel family is built from, one source for every
 * ISA: the register-blocked micro-kernel and its matrix products, the per-sequence geometry (dense
 * and packed calls alike), row packing, the masking of a block of scores (causal, window, masks,
 * softcap, ALiBi) and the dropout stream's factors.
 *
 * Included first by cpu_isa_impl.h (one ISA's build of every family), with AB_ISA_SFX set to the
 * suffix of that build's symbols (SYM).  Vector width and tile sizes follow from the ISA through
 * ab_vec.h (VLEN) and the NV_MAX / MR choice below.
 *
 * Layout idea: scores are computed transposed, St[j][r] for key j and query row r of a chunk of
 * rc = nv * VLEN rows (nv <= NV_MAX vectors; fewer for short queries), with the query rows along
 * the vector lanes.  Then
 *   - S = Q K^T is C += A * B with A = K rows (broadcast scalars) and B = Q^T (vectors of rows);
 *   - the row max and row sum of the softmax are element-wise max/add over j (no shuffles);
 *   - O += P V is the same micro-kernel with A = P^T (broadcast, by row) and B = V rows;
 * so K and V are read in their natural (row) layout, straight from the caller's float32 tensors
 * when their last dim is contiguous, and one register-blocked micro-kernel (MR broadcast rows x
 * NV_MAX vectors) does every matrix product of the flash forward and backward (flash_fwd_impl.h,
 * flash_bwd_impl.h); sage (sage_cpu_impl.h) and the AMX kernels reuse the geometry and masking.
 */

#include <math.h>
#include <stdatomic.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include "../ab_philox.h"
#include "ab_cpu.h"
#include "ab_vec.h"
#include "cpu_kernels.h"

#if VLEN == 16
#define NV_MAX 4 /* 64-row chunks: 6 x 4 = 24 accumulators of 32 zmm */
#else
#define NV_MAX 2 /* 16 vector registers: 6 x 2 = 12 accumulators */
#endif
#define MR 6
#define RC_MAX (NV_MAX * VLEN)
/* Vectors of query rows per flash forward chunk: each K/V block (and, for 2-byte inputs, its
 * conversion to float32) serves NR_MAX * VLEN rows, the micro-kernel taking NV_MAX of them per pass.
 * With 16 registers (AVX2) a 16-row chunk re-read and re-converted every key block per 16 rows. */
#ifndef NR_MAX
#if VLEN == 16
#define NR_MAX NV_MAX
#else
#define NR_MAX (2 * NV_MAX)
#endif
#endif
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
 * compile-time constants at every call site, so acc[][] lives in registers.  accumulate: 0 writes
 * the sum, AB_ACC_RUN continues the running sum from C, AB_ACC_ADD sums the K products from zero and
 * then adds them to C, so that a product split into passes is a blocked sum whose rounding grows
 * with the pass length, not the whole length (S = K Q^T by KC head dims, SYM(scores_t): at D = 256
 * a running sum put lse up to 3x torch's float32 error; the backward's dQ, dK and dV, summed over
 * row chunks and key blocks, the same way).  AB_ACC_RUN serves P V, whose passes are the keys of
 * the online softmax. */
#define AB_ACC_RUN 1
#define AB_ACC_ADD 2
static inline __attribute__((always_inline)) void SYM(mk)(const int M, const int NV, int64_t K,
                                                         const float* A, int64_t am, int64_t ak,
                                                         const float* B, int64_t ldb, float* C,
                                                         int64_t ldc, int accumulate) {
  vf acc[MR][NV_MAX];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v)
      acc[m][v] = accumulate == AB_ACC_RUN ? vload(C + m * ldc + v * VLEN) : vset1(0.0f);
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
    for (int v = 0; v < NV; ++v)
      vstore(C + m * ldc + v * VLEN, accumulate == AB_ACC_ADD ? vload(C + m * ldc + v * VLEN) + acc[m][v] : acc[m][v]);
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

/* S^T = K Q^T: nb key rows at ka (row stride ka_m) against the query rows as nvec vectors of
 * columns, Q^T at qt (one row of ldq floats per head dim), into st (row stride ldst); KC head dims
 * per pass, each pass summed from zero and added to st (AB_ACC_ADD), so the slice of Q^T a pass
 * streams for every MR keys stays in L1 and the rounding grows with KC, not D.  The forward, the
 * backward's recomputation (which must reproduce the forward's bits) and the decode kernel's tiled
 * products all compute their scores here. */
static inline void SYM(scores_t)(int64_t nb, int64_t nvec, int64_t D, const float* ka, int64_t ka_m, const float* qt,
                                 int64_t ldq, float* st, int64_t ldst) {
  for (int64_t d0 = 0; d0 < D; d0 += KC)
    SYM(gemm)(nb, nvec, D - d0 < KC ? D - d0 : KC, ka + d0, ka_m, 1, qt + d0 * ldq, ldq, st, ldst,
              d0 > 0 ? AB_ACC_ADD : 0);
}

/* One line at x, locality as SYM(pf_lines) takes it. */
static inline __attribute__((always_inline)) void SYM(pf_line)(uintptr_t x, const int locality) {
  if (locality == 3)
    __builtin_prefetch((const void*)x, 0, 3);
  else
    __builtin_prefetch((const void*)x, 0, 2);
}

/* Prefetches every cache line of `bytes` bytes from row (the first line too when row is not aligned
 * to one): into L1 with locality 3, into L2 with 2 (a compile-time constant at every call site).  Four
 * lines a turn: the decode kernel asks for each 256-byte row it will read (D = 128 in 16 bits), and one
 * line a turn cost step 1 at G = 4 about 1.8 ns per key and KV head against 0.6-0.9 unrolled, its loop
 * alone 8.5-9 (benchmarks/decode_step1_rate.c, an Intel Xeon with AMX, 2026-12-07). */
static inline __attribute__((always_inline)) void SYM(pf_lines)(const char* row, int64_t bytes, const int locality) {
  const uintptr_t first = (uintptr_t)row & ~(uintptr_t)63, last = (uintptr_t)row + (uintptr_t)bytes;
  uintptr_t x = first;
  for (; x + 192 < last; x += 256)
    for (int i = 0; i < 4; ++i) SYM(pf_line)(x + 64 * (uintptr_t)i, locality);
  for (; x < last; x += 64) SYM(pf_line)(x, locality);
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
    /* each row's values of the block converted to float32 at once, in their own order (a row of keys is
     * contiguous in the masks models pass; ab_vec_load_row), into rows (rc x n on the stack, n <= BK keys
     * at a time), then applied a vector of rows at a time, gathered across the rows: a bool mask as -inf
     * where it is false (a select, so a NaN score it hides is hidden), a float one added.  Measured on
     * an AMD Zen 4 (docs/benchmarks.md, "Masked long queries"): 0.82-1.00x the time of reading the
     * values row by row into St's columns, and that 0.77-0.90x a value at a time through a switch. */
    const int64_t ms_i = p->mask.strides[2], ms_j = p->mask.strides[3];
    const int is_bool = p->mask.dtype == AB_DTYPE_BOOL;
    float rows[rc * (nb < BK ? (nb > 0 ? nb : 1) : BK)];
#if VLEN == 8 && defined(__AVX2__)
    /* AVX2: eight keys of eight rows at a time, transposed in registers, instead of a gather of eight values
     * (which took about as long as the block's softmax on an AMD Zen 3); a float32 mask with contiguous keys
     * read in place, not copied to rows first (the copy was most of what was left, 2026-12-07,
     * docs/benchmarks.md "Masked calls on an AVX2 CPU").  The same values reach the same scores: the same bits. */
    static const float zeros8[8] = {0};
    const int direct = p->mask.dtype == AB_DTYPE_F32 && ms_j == 1;
    const float* mf = (const float*)p->mask.data + s->mask + i0 * ms_i + j0;
#endif
    for (int64_t jb = 0; jb < nb; jb += BK) {
      const int64_t n = nb - jb < BK ? nb - jb : BK;
      int64_t j = 0;
#if VLEN == 8 && defined(__AVX2__)
      if (direct) {
        for (; j + 8 <= n; j += 8)
          for (int64_t v = 0; v < rc; v += 8) {
            __m256 t[8];
            for (int u = 0; u < 8; ++u)
              t[u] = _mm256_loadu_ps(v + u < nrows ? mf + (v + u) * ms_i + jb + j : zeros8);
            ab_transpose8_ps(t);
            for (int u = 0; u < 8; ++u) vstore(St + (jb + j + u) * rc + v, vload(St + (jb + j + u) * rc + v) + (vf)t[u]);
          }
        for (; j < n; ++j)
          for (int64_t r = 0; r < nrows; ++r) St[(jb + j) * rc + r] += mf[r * ms_i + jb + j];
        continue;
      }
#endif
      for (int64_t r = 0; r < nrows; ++r)
        ab_vec_load_mask_row(p->mask.data, p->mask.dtype, s->mask + (i0 + r) * ms_i + (j0 + jb) * ms_j, n, ms_j,
                             rows + r * n);
      memset(rows + nrows * n, 0, sizeof(float) * (size_t)((rc - nrows) * n));
#if VLEN == 8 && defined(__AVX2__)
      for (; j + 8 <= n; j += 8)
        for (int64_t v = 0; v < rc; v += 8) {
          __m256 t[8];
          for (int u = 0; u < 8; ++u) t[u] = _mm256_loadu_ps(rows + (v + u) * n + j);
          ab_transpose8_ps(t);
          for (int u = 0; u < 8; ++u) {
            float* sj = St + (jb + j + u) * rc + v;
            const vf m = (vf)t[u];
            vstore(sj, is_bool ? vselect(m < vset1(0.0f), m, vload(sj)) : vload(sj) + m);
          }
        }
#endif
      for (; j < n; ++j) {
        float* sj = St + (jb + j) * rc;
        for (int64_t v = 0; v < rc; v += VLEN) {
          const vf m = vgather(rows + v * n + j, (int32_t)n);
          vstore(sj + v, is_bool ? vselect(m < vset1(0.0f), m, vload(sj + v)) : vload(sj + v) + m);
        }
      }
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
