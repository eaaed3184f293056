// flash_fwd_hdim160_192.cu -- flash forward kernels for padded head dims 160 and 192, float16 and bfloat16.
// The head dims are spread over a few files so that nvcc compiles them in parallel.
#include "flash_fwd_kernel.cuh"

namespace ab_flash {

template ab_status fwd_launch<__half, 160>(const FwdParams&, int64_t, cudaStream_t, ab_error*);
template ab_status fwd_launch<__nv_bfloat16, 160>(const FwdParams&, int64_t, cudaStream_t, ab_error*);
template ab_status fwd_launch<__half, 192>(const FwdParams&, int64_t, cudaStream_t, ab_error*);
template ab_status fwd_launch<__nv_bfloat16, 192>(const FwdParams&, int64_t, cudaStream_t, ab_error*);

}  // namespace ab_flash
