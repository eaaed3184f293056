// flash_fwd_hdim96_128.cu -- flash forward kernels for padded head dims 96 and 128, float16 and bfloat16.
// The head dims are spread over a few files so that nvcc compiles them in parallel.
#include "flash_fwd_kernel.cuh"

namespace ab_flash {

template ab_status fwd_launch<__half, 96>(const FwdParams&, int64_t, cudaStream_t, ab_error*);
template ab_status fwd_launch<__nv_bfloat16, 96>(const FwdParams&, int64_t, cudaStream_t, ab_error*);
template ab_status fwd_launch<__half, 128>(const FwdParams&, int64_t, cudaStream_t, ab_error*);
template ab_status fwd_launch<__nv_bfloat16, 128>(const FwdParams&, int64_t, cudaStream_t, ab_error*);

}  // namespace ab_flash
