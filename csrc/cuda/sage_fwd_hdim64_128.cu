// sage_fwd_hdim64_128.cu -- sage forward kernels for padded head dims 64 and 128, float16 and bfloat16.
// The head dims are spread over two files so that nvcc compiles them in parallel.
#include "sage_fwd_kernel.cuh"

namespace ab_sage {

template ab_status sage_launch<__half, 64>(SageParams&, const ab_attn_params*, cudaStream_t, ab_error*);
template ab_status sage_launch<__nv_bfloat16, 64>(SageParams&, const ab_attn_params*, cudaStream_t, ab_error*);
template ab_status sage_launch<__half, 128>(SageParams&, const ab_attn_params*, cudaStream_t, ab_error*);
template ab_status sage_launch<__nv_bfloat16, 128>(SageParams&, const ab_attn_params*, cudaStream_t, ab_error*);

}  // namespace ab_sage
