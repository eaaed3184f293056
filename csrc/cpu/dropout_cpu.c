/* dropout_cpu.c -- materialises the dropout keep-mask every kernel draws on the fly.
 *
 * Only tests and debugging need it: it lets a float64 reference apply exactly the mask a kernel
 * used, so dropout outputs and gradients are checked element by element, not just statistically.
 */
#include "ab_cpu.h"
#include "../ab_philox.h"

typedef struct mask_ctx {
  uint64_t seed, offset;
  uint32_t threshold;
  int64_t Sk;
  uint8_t* keep;
} mask_ctx;

static void mask_range(int64_t begin, int64_t end, void* vctx) {
  const mask_ctx* c = (const mask_ctx*)vctx;
  for (int64_t row = begin; row < end; ++row) {
    uint8_t* out = c->keep + row * c->Sk;
    for (int64_t j4 = 0; j4 * 4 < c->Sk; ++j4) {
      uint32_t w[4];
      ab_dropout_words(c->seed, c->offset, (uint64_t)row, (uint64_t)j4, w);
      for (int t = 0; t < 4 && j4 * 4 + t < c->Sk; ++t) out[j4 * 4 + t] = w[t] >= c->threshold;
    }
  }
}

ab_status ab_dropout_mask_cpu(uint64_t seed, uint64_t offset, double p, int64_t B, int64_t H,
                              int64_t Sq, int64_t Sk, uint8_t* keep, const ab_cpu_pool* pool,
                              ab_error* err) {
  if (!(p >= 0.0 && p < 1.0))
    return ab_error_set(err, AB_ERR_INVALID, "dropout_p must be in [0, 1), got %g", p);
  if (B < 0 || H < 0 || Sq < 0 || Sk < 0)
    return ab_error_set(err, AB_ERR_INVALID, "sizes must be non-negative");
  mask_ctx c = {seed, offset, ab_dropout_threshold(p), Sk, keep};
  ab_par_status st;
  st.err = err;
  atomic_init(&st.status, AB_OK);
  if (Sk == 0) return AB_OK;
  return ab_par_run(pool, B * H * Sq, 64, 3.0 * (double)B * H * Sq * Sk, mask_range, &c, &st);
}
