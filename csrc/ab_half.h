/* ab_half.h -- float16 / bfloat16 <-> float32 conversions for the C kernels.
 *
 * Plain integer code, so the generic path needs no compiler extension; the ISA paths use the
 * hardware instructions instead.  Rounding is to nearest, ties to even, as torch's casts do.
 */
#ifndef AB_HALF_H
#define AB_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float ab_bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint32_t ab_f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float ab_bf16_to_f32(uint16_t h) { return ab_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t ab_f32_to_bf16(float f) {
  uint32_t x = ab_f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

static inline float ab_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    /* zero or subnormal: mant * 2^-24 is exact in float32 */
    float f = (float)mant * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  if (exp == 31) return ab_bits_to_f32(sign | 0x7f800000u | (mant << 13));
  return ab_bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t ab_f32_to_f16(float f) {
  uint32_t x = ab_f32_to_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
  if (ax < 0x38800000u) {
    /* below 2^-14: the result is subnormal, mant = round(|f| * 2^24) (1024 is the smallest normal) */
    return (uint16_t)(sign | (uint16_t)lrintf(ab_bits_to_f32(ax) * 16777216.0f));
  }
  uint32_t h = (ax >> 13) - (112u << 10);
  uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

/* The exponent e of the power of two below 1 in a softmax scale (2**e, e <= 0; the scale's own exponent
 * where it is below 1), by which the kernels that multiply bfloat16 q by k (the decode kernel's bfloat16
 * products, the AMX flash kernel) multiply q before the product, the score then times scale / 2**e: q.k
 * stays within float32's range wherever the scaled score does (q near 1e10, k near 1e30 under a scale of
 * 1e-39 overflowed the unscaled product), and where nothing leaves the normal range the bits are those of
 * the unscaled product times the scale.  A scale of 1 or more keeps e = 0 (q times it could overflow where
 * the score does not); a scale of 0 gives -400, which makes a finite q 0, so q.k is 0, not inf times 0. */
static inline int ab_bf16_scale_exp(double scale) {
  if (scale == 0.0) return -400;
  int x = 0;
  frexp(scale, &x); /* |scale| = f * 2**x, f in [0.5, 1) */
  return x - 1 < 0 ? x - 1 : 0;
}

/* x times 2**e, ldexpf's result: within float32's normal exponents (-126 <= e <= 127) a multiply by the
 * exact power of two, which rounds once as ldexpf does (also inf, NaN, overflow and subnormal results), so
 * the bits are the same; the library's ldexpf, called per element of q's rows, took about 18 us of a 30 us
 * small bfloat16 decode call (4096 elements, a Zen 4; docs/benchmarks.md). */
static inline float ab_ldexpf(float x, int e) {
  if (e >= -126 && e <= 127) {
    float f;
    const uint32_t b = (uint32_t)(e + 127) << 23;
    memcpy(&f, &b, sizeof f);
    return x * f;
  }
  return ldexpf(x, e);
}

/* n bfloat16 values times 2**e, in place (exact wherever the results stay normal). */
static inline void ab_bf16_row_ldexp(uint16_t* v, int64_t n, int e) {
  for (int64_t i = 0; e && i < n; ++i) v[i] = ab_f32_to_bf16(ab_ldexpf(ab_bf16_to_f32(v[i]), e));
}

#endif /* AB_HALF_H */
