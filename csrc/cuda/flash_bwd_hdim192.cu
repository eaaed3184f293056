// flash_bwd_hdim192.cu -- flash backward kernels for padded head dim 192, float16 and bfloat16.
// One head dim per file so that nvcc compiles them in parallel.
#include "flash_bwd_kernel.cuh"

namespace ab_flash {

template ab_status bwd_launch<__half, 192>(const BwdParams&, int64_t, int64_t, int64_t, cudaStream_t, ab_error*);
template ab_status bwd_launch<__nv_bfloat16, 192>(const BwdParams&, int64_t, int64_t, int64_t, cudaStream_t, ab_error*);

}  // namespace ab_flash
