// dropout.cu -- the dropout keep-mask on CUDA, for tests: the same Philox stream (ab_philox.h) the
// kernels draw inside, materialised as (B, H, Sq, Sk) uint8 (1 = kept).  The CPU twin is
// csrc/cpu/dropout_cpu.c; the two agree bit for bit for the same (seed, offset).
#include <cuda_runtime.h>
#include <stdint.h>

#include "ab_cuda_internal.h"
#include "../ab_philox.h"

namespace {

struct MaskArgs {
  uint64_t seed, offset;
  const int64_t* rng_dev;  // [seed, offset] in device memory, or NULL
  uint32_t threshold;
  int64_t rows, Sk, quads;  // quads = ceil(Sk / 4) Philox calls per row
  uint8_t* keep;
};

// One thread per (row, group of 4 keys): one Philox call gives the words of keys 4q .. 4q + 3.
__global__ void mask_kernel(const MaskArgs a) {
  uint64_t seed = a.seed, offset = a.offset;
  if (a.rng_dev != nullptr) {
    seed = (uint64_t)a.rng_dev[0];
    offset = (uint64_t)a.rng_dev[1];
  }
  const int64_t total = a.rows * a.quads;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = idx / a.quads, q = idx % a.quads;
    uint32_t w[4];
    ab_dropout_words(seed, offset, (uint64_t)row, (uint64_t)q, w);
    for (int e = 0; e < 4; ++e) {
      const int64_t j = 4 * q + e;
      if (j < a.Sk) a.keep[row * a.Sk + j] = w[e] >= a.threshold;
    }
  }
}

}  // namespace

extern "C" ab_status ab_cuda_dropout_mask(uint64_t seed, uint64_t offset, const int64_t* rng_dev, double p,
                                          int64_t B, int64_t H, int64_t Sq, int64_t Sk, uint8_t* keep,
                                          void* stream, ab_error* err) {
  if (!(p >= 0 && p < 1)) return ab_error_set(err, AB_ERR_INVALID, "dropout_p must be in [0, 1), got %g", p);
  if (B < 0 || H < 0 || Sq < 0 || Sk < 0) return ab_error_set(err, AB_ERR_INVALID, "negative size");
  MaskArgs a = {seed, offset, rng_dev, ab_dropout_threshold(p), B * H * Sq, Sk, (Sk + 3) / 4, keep};
  const int64_t total = a.rows * a.quads;
  if (total == 0) return AB_OK;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  AB_LAUNCH((unsigned)(blocks < (1 << 20) ? blocks : (1 << 20)), threads, 0, static_cast<cudaStream_t>(stream),
            mask_kernel)(a);
  return ab_cuda_check(cudaGetLastError(), "dropout_mask launch", err);
}
