// sage_fwd_hdim256.cu -- sage forward kernels for padded head dim 256 (D 136..256), float16 and bfloat16.
#include "sage_fwd_kernel.cuh"

namespace ab_sage {

template ab_status sage_launch<__half, 256>(SageParams&, const ab_attn_params*, cudaStream_t, ab_error*);
template ab_status sage_launch<__nv_bfloat16, 256>(SageParams&, const ab_attn_params*, cudaStream_t, ab_error*);

}  // namespace ab_sage
