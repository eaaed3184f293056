/* ab_philox.h -- the dropout random stream, shared by the C and CUDA kernels.
 *
 * Why counter-based: the backward pass, every backend and every device must draw exactly the same
 * keep/drop decision for a given (seed, offset, element) without storing a mask.  Philox4x32-10
 * (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3") maps a 128-bit counter and a 64-bit
 * key to four 32-bit words, so any element can be drawn independently, in any order.
 *
 * The mapping (part of the contract: docs/semantics.md):
 *   row     = (b * H + h) * Sq + i        (query row; 64-bit)
 *   counter = (j / 4, row low 32, row high 32, offset low 32),  key = seed (64-bit)
 *   word    = output[j % 4]
 *   kept    = word >= threshold(p),  threshold(p) = floor(p * 2^32)
 */
#ifndef AB_PHILOX_H
#define AB_PHILOX_H

#include <stdint.h>

#if defined(__CUDACC__)
#define AB_HD static __host__ __device__ __forceinline__
#else
#define AB_HD static inline
#endif

AB_HD uint32_t ab_mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t prod = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(prod >> 32);
  return (uint32_t)prod;
}

/* out[0..3] = Philox4x32-10(ctr, key) */
AB_HD void ab_philox4x32(const uint32_t ctr_in[4], uint64_t seed, uint32_t out[4]) {
  uint32_t c0 = ctr_in[0], c1 = ctr_in[1], c2 = ctr_in[2], c3 = ctr_in[3];
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    uint32_t lo0 = ab_mulhilo32(0xD2511F53u, c0, &hi0);
    uint32_t lo1 = ab_mulhilo32(0xCD9E8D57u, c2, &hi1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

/* Words for keys 4*(j/4) .. 4*(j/4)+3 of query row `row`. */
AB_HD void ab_dropout_words(uint64_t seed, uint64_t offset, uint64_t row, uint64_t j4,
                            uint32_t out[4]) {
  uint32_t ctr[4] = {(uint32_t)j4, (uint32_t)row, (uint32_t)(row >> 32), (uint32_t)offset};
  ab_philox4x32(ctr, seed, out);
}

AB_HD uint32_t ab_dropout_threshold(double p) {
  double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 0xffffffffu : (uint32_t)t;
}

/* 1 if element (row, j) is kept. */
AB_HD int ab_dropout_keep(uint64_t seed, uint64_t offset, uint64_t row, uint64_t j,
                          uint32_t threshold) {
  uint32_t w[4];
  ab_dropout_words(seed, offset, row, j >> 2, w);
  return w[j & 3] >= threshold;
}

#endif /* AB_PHILOX_H */
