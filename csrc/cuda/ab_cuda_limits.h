/* ab_cuda_limits.h -- what the CUDA tensor-core kernels (flash forward, flash backward, sage forward)
 * can serve, as numbers: their launchers' head-dim rule and the shared memory each kernel config
 * needs per block.
 *
 * Plain C, included by the launchers (flash_fwd.cu, flash_bwd.cu, sage_fwd.cu, which check every
 * call with ab_cuda_kernel_why_not) and by the core (ab_cuda_loader.c: the planner's answer for
 * these families, with the device's queried shared memory), so that both apply one rule.  Each
 * launcher checks the tables below against its tile table (flash_fwd.cuh, flash_bwd.cuh,
 * sage_fwd.cuh) with static_assert: a tile change not made here fails the build.
 */
#ifndef AB_CUDA_LIMITS_H
#define AB_CUDA_LIMITS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* D and Dv: multiples of 8 (rows of 16 bytes for cp.async), at most 256; each is padded up to the
 * next head dim a family has kernels for. */
#define AB_CUDA_HEAD_DIM_MULTIPLE 8
#define AB_CUDA_MAX_HEAD_DIM 256

typedef enum ab_cuda_family {
  AB_CUDA_FLASH_FWD = 0,
  AB_CUDA_FLASH_BWD = 1,
  AB_CUDA_SAGE_FWD = 2,
  AB_CUDA_FAMILY_COUNT = 3
} ab_cuda_family;

/* Per family, ascending: the padded head dims that have kernels and the shared memory, in bytes
 * per block, of the largest config at that head dim (the forward's without dropout). */
typedef struct ab_cuda_config {
  int head_dim;
  int smem;
} ab_cuda_config;

#define AB_CUDA_FLASH_FWD_CONFIGS                                                                \
  {32, 20480}, {64, 36864}, {96, 53248}, {128, 69632}, {160, 64512}, {192, 76800}, {224, 89088}, \
      {256, 101376}
#define AB_CUDA_FLASH_BWD_CONFIGS {64, 55808}, {128, 88576}, {192, 121344}, {256, 154112}
#define AB_CUDA_SAGE_FWD_CONFIGS {64, 25856}, {128, 34816}, {256, 69376}

static inline const char* ab_cuda_family_name(ab_cuda_family f) {
  return f == AB_CUDA_FLASH_FWD ? "flash" : f == AB_CUDA_FLASH_BWD ? "flash backward" : "sage";
}

/* The config that serves head dims D and Dv (padded to the first head dim >= both), or NULL. */
static inline const ab_cuda_config* ab_cuda_config_for(ab_cuda_family f, int64_t D, int64_t Dv) {
  static const ab_cuda_config fwd[] = {AB_CUDA_FLASH_FWD_CONFIGS};
  static const ab_cuda_config bwd[] = {AB_CUDA_FLASH_BWD_CONFIGS};
  static const ab_cuda_config sage[] = {AB_CUDA_SAGE_FWD_CONFIGS};
  const ab_cuda_config* c = f == AB_CUDA_FLASH_FWD ? fwd : f == AB_CUDA_FLASH_BWD ? bwd : sage;
  const size_t n = f == AB_CUDA_FLASH_FWD   ? sizeof fwd / sizeof *c
                   : f == AB_CUDA_FLASH_BWD ? sizeof bwd / sizeof *c
                                            : sizeof sage / sizeof *c;
  const int64_t dmax = D > Dv ? D : Dv;
  for (size_t i = 0; i < n; ++i)
    if (c[i].head_dim >= dmax) return &c[i];
  return NULL;
}

/* Why family f cannot serve head dims D and Dv on a device that gives a block smem_optin bytes of
 * shared memory (0: not known, not checked; the launch checks the device itself): written into why,
 * 1 returned; 0 (why "") when it can. */
static inline int ab_cuda_kernel_why_not(ab_cuda_family f, int64_t D, int64_t Dv, int64_t smem_optin, char* why,
                                         size_t n) {
  const char* who = ab_cuda_family_name(f);
  why[0] = 0;
  if (D < 1 || Dv < 1 || D % AB_CUDA_HEAD_DIM_MULTIPLE || Dv % AB_CUDA_HEAD_DIM_MULTIPLE ||
      D > AB_CUDA_MAX_HEAD_DIM || Dv > AB_CUDA_MAX_HEAD_DIM) {
    snprintf(why, n, "%s on CUDA takes head dims that are multiples of %d up to %d, got D=%lld Dv=%lld", who,
             AB_CUDA_HEAD_DIM_MULTIPLE, AB_CUDA_MAX_HEAD_DIM, (long long)D, (long long)Dv);
    return 1;
  }
  const ab_cuda_config* c = ab_cuda_config_for(f, D, Dv);
  if (!c) {
    snprintf(why, n, "%s on CUDA: no kernel for head dims D=%lld Dv=%lld", who, (long long)D, (long long)Dv);
    return 1;
  }
  if (smem_optin > 0 && c->smem > smem_optin) {
    snprintf(why, n,
             "%s on CUDA: head dim %d needs %d bytes of shared memory per block, this device allows %lld", who,
             c->head_dim, c->smem, (long long)smem_optin);
    return 1;
  }
  return 0;
}

#endif /* AB_CUDA_LIMITS_H */
