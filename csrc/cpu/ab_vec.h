/* ab_vec.h -- one vector type for the CPU kernels, whatever the instruction set.
 *
 * The kernels are written once against `vf` (VLEN float32 lanes, GCC/Clang vector extension) and
 * compiled once per ISA: the file including this header is built with -mavx512f... (VLEN 16),
 * -mavx2 -mfma (VLEN 8), or the baseline flags (VLEN 4: SSE2 on x86-64, NEON on Arm).  The
 * compiler maps vf arithmetic to that ISA's instructions; the few things the extension cannot say
 * (half-precision conversion) use the ISA's intrinsics when present.
 *
 * Everything here is static inline: each ISA build gets its own copy.
 */
#ifndef AB_VEC_H
#define AB_VEC_H

#include <stdint.h>
#include <string.h>

#include "../ab_core.h"
#include "../ab_half.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VLEN 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VLEN 8
#else
#define VLEN 4
#endif

#if defined(__F16C__)
#include <immintrin.h>
#endif

typedef float vf __attribute__((vector_size(VLEN * 4)));
typedef int32_t vi __attribute__((vector_size(VLEN * 4)));
typedef uint32_t vu __attribute__((vector_size(VLEN * 4)));

static inline vf vload(const float* p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void vstore(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* A broadcast.  Spelled lane by lane: `(vf){0} + x` would cost an add (x + 0.0 is not x for -0.0)
 * before the broadcast, in the micro-kernel's innermost loop. */
static inline vf vset1(float x) {
#if VLEN == 16
  return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif VLEN == 8
  return (vf){x, x, x, x, x, x, x, x};
#else
  return (vf){x, x, x, x};
#endif
}

static inline vf vselect(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }

/* VLEN 32-bit words at p, p + stride, p + 2 stride, ... (a gather where the ISA has one); the bits
 * are moved unchanged, so this serves float and integer data alike. */
static inline vi vgather_words(const void* p, int32_t stride) {
#if VLEN == 16
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(stride));
  return (vi)_mm512_i32gather_epi32(idx, p, 4);
#elif VLEN == 8
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  return (vi)_mm256_i32gather_epi32((const int*)p, idx, 4);
#else
  vi v;
  for (int u = 0; u < VLEN; ++u) memcpy((char*)&v + u * 4, (const char*)p + (int64_t)u * stride * 4, 4);
  return v;
#endif
}

/* VLEN floats at p, p + stride, p + 2 stride, ... */
static inline vf vgather(const float* p, int32_t stride) { return (vf)vgather_words(p, stride); }

#if VLEN == 8 && defined(__AVX2__)
/* t[0..7], eight rows of eight floats, transposed in place (t[k] gets element k of every row). */
static inline void ab_transpose8_ps(__m256 t[8]) {
  __m256 a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_ps(t[i], t[i + 1]);     /* r_i0 r_i+1,0 r_i1 r_i+1,1 | same at 4.. */
    a[i + 1] = _mm256_unpackhi_ps(t[i], t[i + 1]); /* elements 2, 3 | 6, 7 */
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      b[i + h] = _mm256_shuffle_ps(a[i + h], a[i + h + 2], _MM_SHUFFLE(1, 0, 1, 0));
      b[i + h + 2] = _mm256_shuffle_ps(a[i + h], a[i + h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    }
  /* b[0]: elements 0 (and 4) of rows 0-3; b[2]: 1 (5); b[1]: 2 (6); b[3]: 3 (7); b[4..7] the same of rows 4-7 */
  static const int from[4] = {0, 2, 1, 3};
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm256_permute2f128_ps(b[from[k]], b[4 + from[k]], 0x20);
    t[k + 4] = _mm256_permute2f128_ps(b[from[k]], b[4 + from[k]], 0x31);
  }
}
#endif

/* 1 if every lane of the comparison result m is true. */
static inline int vall(vi m) {
  int all = 1;
  for (int u = 0; u < VLEN; ++u) all &= m[u] != 0;
  return all;
}

/* max(a, b); with a NaN in b the result is NaN (the hardware max returns its second operand when
 * either is NaN). */
static inline vf vmax(vf a, vf b) {
#if VLEN == 16
  return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif VLEN == 8
  return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
  return vselect(a > b, a, b);
#endif
}

/* x rounded to the nearest integer, ties to even, for |x| < 2^22: adding and subtracting 1.5 * 2^23
 * leaves no fraction bits to round with. */
static inline vf vround(vf x) {
  const vf magic = vset1(12582912.0f);
  return (x + magic) - magic;
}

/* exp(x) for x in [-87.34, 88.38], ~1 ulp: x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6
 * polynomial (Cephes coefficients), 2^n built in the exponent bits.  The body of vexp and of
 * vexp_nonpos below AVX-512. */
static inline vf vexp_clamped(vf x) {
  const vf n = vround(x * vset1(1.44269504088896341f)); /* n = round(x / ln2) */
  vf r = x - n * vset1(0.693359375f);
  r = r - n * vset1(-2.12194440e-4f);
  vf p = vset1(1.9875691500e-4f);
  p = p * r + vset1(1.3981999507e-3f);
  p = p * r + vset1(8.3334519073e-3f);
  p = p * r + vset1(4.1665795894e-2f);
  p = p * r + vset1(1.6666665459e-1f);
  p = p * r + vset1(5.0000001201e-1f);
  p = p * (r * r) + r + vset1(1.0f);
  return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

/* exp(x) for float32, ~1 ulp (vexp_clamped).  exp(-inf) and anything below -87.3 give exactly 0
 * (masked scores must contribute nothing); +inf gives +inf; NaN gives NaN. */
static inline vf vexp(vf x) {
  const vf hi = vset1(88.3762626647949f), lo = vset1(-87.3365447505531f);
  const vi under = x < lo;
  const vi over = x > hi;
  const vi nan = x != x;
  vf y = vexp_clamped(vselect(over, hi, vselect(under, vset1(0.0f), x))); /* not lo: a subnormal (vexp_nonpos) */
  y = vselect(under, vset1(0.0f), y);
  y = vselect(over, vset1(__builtin_inff()), y);
  return vselect(nan, x, y);
}

#if VLEN == 16
/* 2^t in the lanes of keep, 0 in the others: 2^n * 2^f with n = round(t) by roundscale, 2^f by a
 * degree-6 polynomial on [-1/2, 1/2] (relative error < 1e-7), the 2^n scaling and the zeroing in one
 * masked scalef.  The AVX-512 body of vexp_nonpos and of the AMX kernels' base-2 exp. */
static inline __m512 ab_exp2_512(__m512 t, __mmask16 keep) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}
#endif

/* exp(x) for x <= 0 (scores minus their running max): the softmax's inner loop, so it is cheaper
 * than vexp (no overflow lanes).  Below -87.3 (and at -inf) the result is exactly 0: a tiny value
 * would turn subnormal in the P.V products, and subnormal arithmetic costs ~100x on x86.  NaN
 * stays NaN.  AVX-512 has a shorter path: 2^x = 2^n * 2^f with n = round(x log2 e) by
 * roundscale, 2^f by a degree-6 polynomial on [-1/2, 1/2] (relative error < 1e-7) and the 2^n
 * scaling, with the zeroing of tiny results, in one masked scalef. */
static inline vf vexp_nonpos(vf x) {
#if VLEN == 16
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-126.0f), _mm512_mul_ps((__m512)x, _mm512_set1_ps(1.44269504088896341f)));
  const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.9f), _CMP_GT_OQ) |
                         _mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q);
  return (vf)ab_exp2_512(t, keep);
#else
  /* the lanes below lo (a masked score's -inf among them) compute exp(0) and are then zeroed: clamped to lo
   * they would compute 2^-126 times a value just below 1, a subnormal, and an AMD Zen 3 took ~25 cycles more
   * per vector that made one (the avx2 flash's softmax 3x slower with a random bool mask, 2026-12-07) */
  const vf lo = vset1(-87.3365447505531f);
  const vi under = x < lo;
  return vselect(under, vset1(0.0f), vexp_clamped(vselect(under, vset1(0.0f), x)));
#endif
}

/* tanh to about 1 ulp everywhere: for |x| < 0.625, x + x^3 * P(x^2) with a degree-5 polynomial
 * fitted (Chebyshev nodes, float64) to (tanh(x)/x - 1)/x^2; beyond, 1 - 2 / (exp(2x) + 1), which is
 * exact at +-inf and loses nothing to cancellation once |tanh| > 0.55.  (The exp form alone costs
 * several ulp below 0.6, which softcap multiplies by the cap: a visible score error at cap 30.) */
static inline vf vtanh(vf x) {
  vf y = x * x;
  vf p = vset1(0.00229586f);
  p = p * y + vset1(-0.00834704f);
  p = p * y + vset1(0.02177000f);
  p = p * y + vset1(-0.05395941f);
  p = p * y + vset1(0.13333304f);
  p = p * y + vset1(-0.33333333f);
  vf small = x + x * (y * p);
  vf big = vset1(1.0f) - vset1(2.0f) / (vexp(x + x) + vset1(1.0f));
  return vselect(y < vset1(0.390625f), small, big);
}

static inline float vhmax(vf v) {
  float m = v[0];
  for (int i = 1; i < VLEN; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

/* The horizontal reductions of the softmax's per-row step, by halves: log2(VLEN) dependent steps
 * where a lane-by-lane loop is a chain of VLEN - 1 (about 45 cycles of latency per row at VLEN 16; the
 * softmax was a fifth of the decode kernel's time with the cache in the L3).  vmax_lanes is vhmax for vectors
 * without NaN lanes (the caller has checked: the order of the max is then free); vsum_lanes adds
 * in a tree, so its bits differ from a lane-by-lane sum's in the last place; vany_lane is whether
 * some lane of m is nonzero. */
static inline float vmax_lanes(vf v) {
#if VLEN == 16
  return _mm512_reduce_max_ps((__m512)v);
#else
  for (int w = VLEN / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v[i] = v[i + w] > v[i] ? v[i + w] : v[i];
  return v[0];
#endif
}

static inline float vsum_lanes(vf v) {
#if VLEN == 16
  return _mm512_reduce_add_ps((__m512)v);
#elif VLEN == 8
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

static inline int vany_lane(vi m) {
#if VLEN == 16
  return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif VLEN == 8
  return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#else
  return (m[0] | m[1] | m[2] | m[3]) != 0;
#endif
}

/* Loads n (<= VLEN) elements of any dtype at stride s into a vector as float32; the rest get pad. */
static inline void ab_vec_load_row(const void* base, ab_dtype dt, int64_t off, int64_t n, int64_t s,
                                   float* dst) {
  if (n <= 0) return; /* an empty tensor's data may be NULL: no pointer into it, no memcpy from it */
  switch (dt) {
    case AB_DTYPE_F32: {
      const float* src = (const float*)base + off;
      if (s == 1)
        memcpy(dst, src, (size_t)n * sizeof(float));
      else
        for (int64_t x = 0; x < n; ++x) dst[x] = src[x * s];
      break;
    }
    case AB_DTYPE_BF16: {
      const uint16_t* src = (const uint16_t*)base + off;
      int64_t x = 0;
      /* bfloat16 is the top half of a float32: widen and shift, 16 or 8 at a time (the scalar loop
       * below is the same conversion; on AVX2 it made K/V packing a quarter of a bfloat16 forward) */
#if VLEN == 16
      if (s == 1)
        for (; x + 16 <= n; x += 16) {
          __m256i h = _mm256_loadu_si256((const __m256i*)(src + x));
          _mm512_storeu_ps(dst + x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
#elif defined(__AVX2__)
      if (s == 1)
        for (; x + 8 <= n; x += 8) {
          __m128i h = _mm_loadu_si128((const __m128i*)(src + x));
          _mm256_storeu_ps(dst + x, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
#endif
      for (; x < n; ++x) dst[x] = ab_bf16_to_f32(src[x * s]);
      break;
    }
    case AB_DTYPE_F16: {
      const uint16_t* src = (const uint16_t*)base + off;
      int64_t x = 0;
#if defined(__F16C__)
      if (s == 1)
        for (; x + 8 <= n; x += 8)
          _mm256_storeu_ps(dst + x, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + x))));
#endif
      for (; x < n; ++x) dst[x] = ab_f16_to_f32(src[x * s]);
      break;
    }
    case AB_DTYPE_F64: {
      const double* src = (const double*)base + off;
      for (int64_t x = 0; x < n; ++x) dst[x] = (float)src[x * s];
      break;
    }
    default:
      for (int64_t x = 0; x < n; ++x) dst[x] = 0.0f;
  }
}

/* Loads n values of an attn_mask at stride s as float32 as the kernels apply them: a bool mask as 0
 * (seen) or -inf (hidden), a floating one as its values (ab_vec_load_row). */
static inline void ab_vec_load_mask_row(const void* base, ab_dtype dt, int64_t off, int64_t n, int64_t s,
                                        float* dst) {
  if (dt != AB_DTYPE_BOOL) {
    ab_vec_load_row(base, dt, off, n, s, dst);
    return;
  }
  const uint8_t* m = (const uint8_t*)base + off;
  for (int64_t x = 0; x < n; ++x) dst[x] = m[x * s] ? 0.0f : -__builtin_inff();
}

/* Stores n float32 values as dtype dt at stride s (round to nearest even for the half types). */
static inline void ab_vec_store_row(void* base, ab_dtype dt, int64_t off, int64_t n, int64_t s,
                                    const float* src) {
  if (n <= 0) return; /* an empty out (Dv = 0) has no data pointer: nothing to store, nothing to offset */
  switch (dt) {
    case AB_DTYPE_F32: {
      float* d = (float*)base + off;
      if (s == 1)
        memcpy(d, src, (size_t)n * sizeof(float));
      else
        for (int64_t x = 0; x < n; ++x) d[x * s] = src[x];
      break;
    }
    case AB_DTYPE_BF16: {
      uint16_t* d = (uint16_t*)base + off;
      for (int64_t x = 0; x < n; ++x) d[x * s] = ab_f32_to_bf16(src[x]);
      break;
    }
    case AB_DTYPE_F16: {
      uint16_t* d = (uint16_t*)base + off;
      int64_t x = 0;
#if defined(__F16C__)
      if (s == 1)
        for (; x + 8 <= n; x += 8)
          _mm_storeu_si128((__m128i*)(d + x),
                           _mm256_cvtps_ph(_mm256_loadu_ps(src + x), _MM_FROUND_TO_NEAREST_INT));
#endif
      for (; x < n; ++x) d[x * s] = ab_f32_to_f16(src[x]);
      break;
    }
    case AB_DTYPE_F64: {
      double* d = (double*)base + off;
      for (int64_t x = 0; x < n; ++x) d[x * s] = (double)src[x];
      break;
    }
    default:
      break;
  }
}

#endif /* AB_VEC_H */
