/* amx_tiles_impl.h -- the tile products and the vector helpers of the AMX kernels (flash and sage):
 * one source for the real and the emulated build.
 *
 * Included by cpu_isa_impl.h when AB_AMX_SFX is set (cpu_amx.c: real tiles, AVX-512 vectors;
 * cpu_amx_emu.c: emulated tiles, the generic build's vectors), after that build's vector kernels,
 * whose pieces the tile kernels reuse.  AB_AMX_SFX names what the tile kernels export; docs/amx.md
 * has the design, with the reasons for the layouts.
 *
 * Every product is one shape on tiles, C (M x N float32) += A (M x K, 16-bit pairs along K) . B
 * (K/2 pairs x N, VNNI-2), with all 8 tiles configured 16 rows x 64 bytes (C: tiles 0-3, a 32 x 32
 * block; A: 4-5; B: 6-7).  Precision: products of 16-bit floats are exact in float32 and summed in
 * float32 on the tiles; P (and dS) are rounded to the input's 16-bit type before their products,
 * as every tensor-core flash kernel does.  Tiles are configured at the start of each worker's range
 * (the configuration is per thread) and released at its end.
 */

#include "ab_amx.h"

#define AMXS(name) AB_CAT(name, AB_AMX_SFX)

#ifndef AMX_RC
#define AMX_RC 32   /* query rows per chunk: two C tiles */
#endif
#ifndef AMX_NP
#define AMX_NP 256  /* keys per forward panel: St 32 KiB, V^T panel 256 x Dv x 2 bytes */
#endif
#define AMX_BKB 64  /* keys per backward block */
#define AMX_NVR (AMX_RC / VLEN)

enum { AMX_BF16 = 0, AMX_FP16 = 1 };

static inline int64_t AMXS(up)(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* ---- products on tiles -------------------------------------------------------------------------- */

/* C (M x N words: float32 or int32, row stride ldc bytes) (+)= A (M rows of Kw 32-bit words, stride
 * lda bytes) . B (Kw rows of N words, stride ldb bytes), in blocks of 32 x 32: two A tiles, two B
 * tiles, four C tiles.  M, N and Kw are multiples of 32, 32 and 16: every operand is padded so. */
#define AB_AMX_GEMM(NAME, DP)                                                                           \
  static void NAME(int64_t M, int64_t N, int64_t Kw, const void* A, int64_t lda, const void* B, int64_t ldb, \
                   void* C, int64_t ldc, int acc) {                                                     \
    for (int64_t m0 = 0; m0 < M; m0 += 32)                                                              \
      for (int64_t n0 = 0; n0 < N; n0 += 32) {                                                          \
        char* c0 = (char*)C + m0 * ldc + n0 * 4;                                                        \
        char* c1 = c0 + 16 * ldc;                                                                       \
        if (acc) {                                                                                      \
          AMX_LOAD(0, c0, ldc);                                                                         \
          AMX_LOAD(1, c0 + 64, ldc);                                                                    \
          AMX_LOAD(2, c1, ldc);                                                                         \
          AMX_LOAD(3, c1 + 64, ldc);                                                                    \
        } else {                                                                                        \
          AMX_ZERO(0);                                                                                  \
          AMX_ZERO(1);                                                                                  \
          AMX_ZERO(2);                                                                                  \
          AMX_ZERO(3);                                                                                  \
        }                                                                                               \
        const char* a0 = (const char*)A + m0 * lda;                                                     \
        const char* b0 = (const char*)B + n0 * 4;                                                       \
        for (int64_t k0 = 0; k0 < Kw; k0 += 16) {                                                       \
          AMX_LOAD(4, a0 + k0 * 4, lda);                                                                \
          AMX_LOAD(5, a0 + 16 * lda + k0 * 4, lda);                                                     \
          AMX_LOAD(6, b0 + k0 * ldb, ldb);                                                              \
          AMX_LOAD(7, b0 + k0 * ldb + 64, ldb);                                                         \
          DP(0, 4, 6);                                                                                  \
          DP(1, 4, 7);                                                                                  \
          DP(2, 5, 6);                                                                                  \
          DP(3, 5, 7);                                                                                  \
        }                                                                                               \
        AMX_STORE(0, c0, ldc);                                                                          \
        AMX_STORE(1, c0 + 64, ldc);                                                                     \
        AMX_STORE(2, c1, ldc);                                                                          \
        AMX_STORE(3, c1 + 64, ldc);                                                                     \
      }                                                                                                 \
  }

AB_AMX_GEMM(AMXS(gemm_bf16), AMX_DPBF16)
#if AB_AMX_HAS_FP16
AB_AMX_GEMM(AMXS(gemm_fp16), AMX_DPFP16)
#endif

/* The float product of 16-bit operands of `kind`. */
static void AMXS(gemm16)(int kind, int64_t M, int64_t N, int64_t Kw, const void* A, int64_t lda, const void* B,
                         int64_t ldb, float* C, int64_t ldc, int acc) {
#if AB_AMX_HAS_FP16
  if (kind == AMX_FP16) {
    AMXS(gemm_fp16)(M, N, Kw, A, lda, B, ldb, C, ldc, acc);
    return;
  }
#endif
  (void)kind;
  AMXS(gemm_bf16)(M, N, Kw, A, lda, B, ldb, C, ldc, acc);
}

/* ---- vector helpers ------------------------------------------------------------------------------ */

/* 2^x for x <= 0, relative error < 1e-7; exactly 0 below -125 (and at -inf), so no weight is ever
 * subnormal (subnormal products cost ~100x on x86, and the tiles flush them anyway); NaN stays
 * NaN.  The softmax folds log2(e) into its scale factor, so no exp needs its own multiply. */
static inline vf AMXS(vexp2)(vf x) {
#if VLEN == 16
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-125.0f), (__m512)x);
  const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-125.0f), _CMP_GE_OQ) |
                         _mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q);
  return (vf)ab_exp2_512(t, keep);
#else
  const vi under = x < vset1(-125.0f);
  const vi nan = x != x;
  const vf t = vselect(under | nan, vset1(0.0f), x);
  const vf n = vround(t);
  const vf f = t - n; /* [-1/2, 1/2] */
  vf p = vset1(1.5403530393381609e-4f);
  p = p * f + vset1(1.3333558146428443e-3f);
  p = p * f + vset1(9.6181291076284772e-3f);
  p = p * f + vset1(5.5504108664821580e-2f);
  p = p * f + vset1(2.4022650695910071e-1f);
  p = p * f + vset1(6.9314718055994531e-1f);
  p = p * f + vset1(1.0f);
  const vf y = p * (vf)((__builtin_convertvector(n, vi) + 127) << 23); /* 2^n, n >= -125: normal */
  return vselect(nan, x, vselect(under, vset1(0.0f), y));
#endif
}

/* The 16-bit encodings of x (bfloat16 or float16, round to nearest even) in the low half of each
 * 32-bit lane; NaN stays NaN. */
static inline vu AMXS(half_bits)(vf x, int kind) {
  if (kind == AMX_BF16) {
    const vu u = (vu)x;
    const vi nan = (vi)((u & 0x7fffffffu) > 0x7f800000u);
    const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (vu)vselect(nan, (vf)((u >> 16) | 0x40u), (vf)r);
  }
#if VLEN == 16
  return (vu)_mm512_cvtepu16_epi32(_mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  vu r;
  for (int u = 0; u < VLEN; ++u) r[u] = ab_f32_to_f16(x[u]);
  return r;
#endif
}

/* Words lo | hi << 16 of the 16-bit encodings: one VNNI-2 pair per lane. */
static inline vu AMXS(pair)(vf lo, vf hi, int kind) {
  return AMXS(half_bits)(lo, kind) | (AMXS(half_bits)(hi, kind) << 16);
}

static inline void AMXS(vstore_u)(uint32_t* p, vu v) { memcpy(p, &v, sizeof v); }

/* n elements of a row of t at element offset off (last-dim stride from t) as 16-bit values of
 * `kind`, zero-padded to ld: the bits as they are when t already has that dtype, else through
 * float32 (ftmp: n floats) with round to nearest even. */
static void AMXS(row16)(const ab_tensor* t, int64_t off, int64_t n, int64_t ld, int kind, uint16_t* dst,
                        float* ftmp) {
  const int64_t s = t->strides[t->ndim - 1];
  const ab_dtype want = kind == AMX_BF16 ? AB_DTYPE_BF16 : AB_DTYPE_F16;
  if (t->dtype == want) {
    const uint16_t* src = (const uint16_t*)t->data + off;
    if (s == 1)
      memcpy(dst, src, sizeof(uint16_t) * (size_t)n);
    else
      for (int64_t x = 0; x < n; ++x) dst[x] = src[x * s];
  } else {
    ab_vec_load_row(t->data, t->dtype, off, n, s, ftmp);
    for (int64_t x = 0; x < n; ++x) dst[x] = kind == AMX_BF16 ? ab_f32_to_bf16(ftmp[x]) : ab_f32_to_f16(ftmp[x]);
  }
  if (ld > n) memset(dst + n, 0, sizeof(uint16_t) * (size_t)(ld - n));
}

/* The B operand of a product over head dims for one chunk: word (k, r) = the pair (row r, dims 2k
 * and 2k + 1) of AMX_RC rows of ld 16-bit values each, i.e. the rows' 32-bit words transposed. */
static void AMXS(words_t)(const uint16_t* rows, int64_t ld, uint32_t* dst) {
  const int64_t kw = ld / 2;
  for (int64_t r = 0; r < AMX_RC; ++r) {
    const uint32_t* w = (const uint32_t*)(const void*)(rows + r * ld);
    for (int64_t k = 0; k < kw; ++k) dst[k * AMX_RC + r] = w[k];
  }
}

/* The B operand of a product over the rows of a chunk: word (r2, d) = (row 2 r2, row 2 r2 + 1) of
 * dim d, for AMX_RC / 2 row pairs of ld 16-bit values. */
static void AMXS(words_rowpairs)(const uint16_t* rows, int64_t ld, uint32_t* dst) {
  for (int64_t r2 = 0; r2 < AMX_RC / 2; ++r2)
    for (int64_t d = 0; d < ld; ++d)
      dst[r2 * ld + d] = (uint32_t)rows[2 * r2 * ld + d] | (uint32_t)rows[(2 * r2 + 1) * ld + d] << 16;
}

/* St (nb x AMX_RC) rounded to pairs of keys: word (k, r) = (St[2k][r], St[2k + 1][r]) for keys
 * below nb, zero up to nbp keys (the B operand of O^T += V^T P^T and of dQ^T += K^T dS^T). */
static void AMXS(pack_keypairs)(const float* st, int64_t nb, int64_t nbp, int kind, uint32_t* dst) {
  for (int64_t k = 0; 2 * k < nbp; ++k)
    for (int64_t v = 0; v < AMX_RC; v += VLEN) {
      const vf lo = 2 * k < nb ? vload(st + 2 * k * AMX_RC + v) : vset1(0.0f);
      const vf hi = 2 * k + 1 < nb ? vload(st + (2 * k + 1) * AMX_RC + v) : vset1(0.0f);
      AMXS(vstore_u)(dst + k * AMX_RC + v, AMXS(pair)(lo, hi, kind));
    }
}

/* St (nb x AMX_RC) rounded to 16-bit rows, zero up to nbp rows (the A operand of dV and dK). */
static void AMXS(pack_rows16)(const float* st, int64_t nb, int64_t nbp, int kind, uint32_t* dst) {
  for (int64_t j = 0; j < nbp; ++j)
    for (int64_t v = 0; v < AMX_RC; v += 2 * VLEN) {
      /* lanes hold rows r; the pair (r, r + 1) must share a word, so even and odd lanes are split */
      uint32_t* w = dst + j * (AMX_RC / 2) + v / 2;
      if (j >= nb) {
        memset(w, 0, sizeof(uint32_t) * VLEN);
        continue;
      }
      const vu a = AMXS(half_bits)(vload(st + j * AMX_RC + v), kind);
      const vu b = AMXS(half_bits)(vload(st + j * AMX_RC + v + VLEN), kind);
      for (int u = 0; u < VLEN / 2; ++u) {
        w[u] = a[2 * u] | a[2 * u + 1] << 16;
        w[VLEN / 2 + u] = b[2 * u] | b[2 * u + 1] << 16;
      }
    }
}

/* x[0 .. n) *= s */
static void AMXS(vscale)(float* x, int64_t n, float s) {
  const vf sv = vset1(s);
  for (int64_t i = 0; i < n; i += VLEN) vstore(x + i, vload(x + i) * sv);
}
