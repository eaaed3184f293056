// ab_cuda_api.cu -- the launcher table, the library's one exported symbol.
//
// The archs list and the supported compute capabilities come from the build: setup.py writes
// ab_cuda_config.h (AB_CUDA_ARCHS, AB_CUDA_SM_LIST, AB_CUDA_PTX_SM).  The table is a constant, so
// getting it touches no CUDA state and needs no driver.
#include <cuda_runtime.h>

#include "ab_cuda_config.h"
#include "ab_cuda_internal.h"

#ifndef AB_CUDA_ARCHS
#define AB_CUDA_ARCHS "unknown"
#endif
#ifndef AB_CUDA_SM_LIST
#define AB_CUDA_SM_LIST 0
#endif
#ifndef AB_CUDA_PTX_SM
#define AB_CUDA_PTX_SM 0
#endif

namespace {

const int kCubinSms[] = {AB_CUDA_SM_LIST};

ab_status device_capability(int device, int* cc, ab_error* err) {
  int major = 0, minor = 0;
  ab_status st = ab_cuda_check(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
      "cudaDeviceGetAttribute", err);
  if (st != AB_OK) return st;
  st = ab_cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                     "cudaDeviceGetAttribute", err);
  if (st != AB_OK) return st;
  *cc = major * 10 + minor;
  return AB_OK;
}

ab_status device_smem_optin(int device, int* bytes, ab_error* err) {
  return ab_cuda_check(cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                       "cudaDeviceGetAttribute", err);
}

// A cubin runs on its own major version at an equal or higher minor (sm_80 code on 8.6); PTX
// JIT-compiles for any newer device.  Arch-specific targets (sm_90a) run only on that exact cc.
int supports_cc(int cc) {
  for (int sm : kCubinSms)
    if (sm > 0 && cc / 10 == sm / 10 && cc >= sm && (sm != 90 || cc == 90)) return 1;
  return AB_CUDA_PTX_SM > 0 && cc >= AB_CUDA_PTX_SM;
}

const ab_cuda_api kApi = {
    AB_CUDA_API_VERSION,        AB_CUDA_ARCHS,    device_capability,
    supports_cc,                ab_cuda_math_fwd, ab_cuda_flash_fwd,
    ab_cuda_sage_fwd,           ab_cuda_math_bwd_workspace, ab_cuda_flash_bwd_workspace,
    ab_cuda_math_bwd,           ab_cuda_flash_bwd, ab_cuda_dropout_mask,
    ab_cuda_kvcache_workspace,  ab_cuda_kvcache_fwd,
    device_smem_optin,
};

}  // namespace

extern "C" AB_EXPORT const ab_cuda_api* ab_cuda_api_get(void) { return &kApi; }
