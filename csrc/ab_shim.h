/* ab_shim.h -- the C face of csrc/torch_shim.cpp, the only file that includes torch headers.
 *
 * The shim registers the attn_backends::* ops with torch's dispatcher when the module's shared
 * object is loaded (static registration through torch's stable ABI).  This header exposes what the
 * CPython module reports about that build, and torch's thread pool for the module's direct call of
 * the CPU flash forward; the core below never calls it.
 */
#ifndef AB_SHIM_H
#define AB_SHIM_H

#include <stdint.h>

#include "ab_core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ab_shim_info {
  uint64_t torch_target_version; /* TORCH_TARGET_VERSION: oldest torch this build runs on */
  uint64_t torch_abi_version;    /* the headers' TORCH_ABI_VERSION the shim was compiled with */
} ab_shim_info;

ab_shim_info ab_shim_info_get(void);

/* torch's intra-op thread pool as the core's ab_cpu_pool (torch.set_num_threads is honoured): the
 * pool the ops run the CPU kernels on, lent to the CPython module's direct call of the CPU flash
 * forward (ab_module.c) so that both give the same work split and the same results. */
ab_cpu_pool ab_shim_cpu_pool(void);

#ifdef __cplusplus
}
#endif

#endif /* AB_SHIM_H */
