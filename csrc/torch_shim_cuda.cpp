// torch_shim_cuda.cpp -- the ops for the CUDA dispatch key (torch_shim.h): the launchers of the CUDA
// library (libattn_backends_cuda.so, dlopen()ed on first use, csrc/ab_cuda_loader.c) on torch's
// current stream, with their workspaces from torch's caching allocator.  This file must load in a
// CPU-only torch too: nothing here links against libtorch_cuda.
#include <dlfcn.h>

#include "torch_shim.h"

namespace ab_shim {
namespace {

// The current CUDA stream, looked up at run time: a CPU-only torch has no libtorch_cuda.
void* current_cuda_stream(int32_t device_index) {
  using getter = AOTITorchError (*)(int32_t, void**);
  static getter fn = []() -> getter {
    void* lib = dlopen("libtorch_cuda.so", RTLD_NOLOAD | RTLD_LAZY);
    void* sym = lib ? dlsym(lib, "aoti_torch_get_current_cuda_stream") : nullptr;
    if (!sym) sym = dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
    return reinterpret_cast<getter>(sym);
  }();
  if (!fn) fail("this torch build has no CUDA support (aoti_torch_get_current_cuda_stream missing)");
  void* stream = nullptr;
  if (fn(device_index, &stream) != AOTI_TORCH_SUCCESS) fail("could not get the current CUDA stream");
  return stream;
}

const ab_cuda_api* cuda_api() {
  ab_error err{};
  const ab_cuda_api* api = ab_cuda_load(&err);
  if (!api) fail(err.msg);
  return api;
}

// A call the CUDA dispatch key received whose q is not a CUDA tensor (the others are): the core's
// parameter check says which input is where; a call it passes has no kernel here.
void not_on_cuda(const ab_attn_params& p, int backward, const char* kernel) {
  ab_error err{};
  check(ab_attn_params_check(&p, backward, &err), err);
  fail(std::string(kernel) + " has no " + (backward ? "backward" : "forward") + " kernel for this device");
}

// The CUDA kernels other than flash (forward and backward) take no sinks and no ALiBi (the planner
// never routes such a call to them).
void refuse_sinks_alibi(const ab_attn_params& p, Kernel kernel) {
  if (kernel != Kernel::kFlash && (p.sinks.ndim || p.alibi.ndim))
    fail(std::string(kernel_name(kernel)) + " on CUDA takes no " + (p.sinks.ndim ? "sinks" : "alibi_slopes") +
         " (the CPU kernels do)");
}

// A packed call's cu_seqlens on q's device, as the CUDA kernels read them: the caller's own device
// tensors when the op was given them (cu_seqlens_q_device, _k_device), else the host copies copied
// over as one (2, B + 1) int32 tensor (the host copies stay in the params for the checks and the grid).
struct DeviceCuSeqlens {
  std::optional<Tensor> both;
  const int32_t* q = nullptr;
  const int32_t* k = nullptr;

  DeviceCuSeqlens(const Tensor& like, const Packed* packed) {
    if (!packed) return;
    const int64_t n = packed->cu_q.size(0);
    if (packed->dev_q.has_value() || packed->dev_k.has_value()) {
      q = given(like, packed->dev_q, n, "cu_seqlens_q_device");
      k = given(like, packed->dev_k, n, "cu_seqlens_k_device");
      return;
    }
    both = empty_strided(like, {2, n}, {n, 1}, aoti_torch_dtype_int32());
    Tensor row_q = torch::stable::select(*both, 0, 0), row_k = torch::stable::select(*both, 0, 1);
    torch::stable::copy_(row_q, packed->cu_q);
    torch::stable::copy_(row_k, packed->cu_k);
    q = static_cast<const int32_t*>(both->data_ptr());
    k = q + n;
  }

  // The caller's device copy: int32, contiguous, (B + 1,) like the host copy, on q's device.  Its
  // values are the host copy's (the Python layer made that copy from it); they are not read back here.
  static const int32_t* given(const Tensor& like, const std::optional<Tensor>& t, int64_t n, const char* name) {
    if (!t.has_value() || t->is_cpu() || t->get_device_index() != like.get_device_index() ||
        t->scalar_type() != ScalarType::Int || t->dim() != 1 || t->size(0) != n || t->stride(0) != 1)
      fail(std::string(name) + " must be given with its pair, as a contiguous int32 tensor of shape (B + 1,) on "
           "q's device");
    return static_cast<const int32_t*>(t->data_ptr());
  }
};

struct Cuda {
  static void fwd(Kernel kernel, const Tensor& q, ab_attn_params& p, const Packed* packed) {
    if (p.q.device != AB_DEVICE_CUDA) not_on_cuda(p, 0, kernel_name(kernel));
    refuse_sinks_alibi(p, kernel);
    ab_error err{};
    const ab_cuda_api* api = cuda_api();
    torch::stable::accelerator::DeviceGuard guard(p.q.device_index);
    void* stream = current_cuda_stream(p.q.device_index);
    const DeviceCuSeqlens cu(q, packed);
    switch (kernel) {
      case Kernel::kMath:
        check(api->math_fwd(&p, stream, &err), err);
        return;
      case Kernel::kFlash:
        check(api->flash_fwd(&p, cu.q, cu.k, stream, &err), err);
        return;
      case Kernel::kSage: {
        // its workspace (quantized K, scales, means) lives for this call only: the caching allocator
        // hands it out again only after the work queued on this stream; the launcher says how many
        // bytes it needs when called with none
        size_t bytes = 0;
        check(api->sage_fwd(&p, cu.q, cu.k, nullptr, &bytes, stream, &err), err);
        if (bytes == 0) return;  // nothing to compute
        Tensor ws = workspace(q, bytes);
        check(api->sage_fwd(&p, cu.q, cu.k, ws.data_ptr(), &bytes, stream, &err), err);
        return;
      }
    }
  }

  // The workspace (delta per query row, flash's float32 dQ accumulator) comes from torch's allocator
  // on q's device and lives for this call only.
  static void bwd(Kernel kernel, const Tensor& q, ab_attn_params& p, const Packed* packed) {
    if (p.q.device != AB_DEVICE_CUDA || kernel == Kernel::kSage) not_on_cuda(p, 1, kernel_name(kernel));
    refuse_sinks_alibi(p, kernel);
    ab_error err{};
    const ab_cuda_api* api = cuda_api();
    torch::stable::accelerator::DeviceGuard guard(p.q.device_index);
    const DeviceCuSeqlens cu(q, packed);
    const size_t bytes = kernel == Kernel::kMath ? api->math_bwd_workspace(&p) : api->flash_bwd_workspace(&p);
    Tensor ws = workspace(q, bytes);
    void* wsp = bytes ? ws.data_ptr() : nullptr;
    void* stream = current_cuda_stream(p.q.device_index);
    check(kernel == Kernel::kMath ? api->math_bwd(&p, wsp, bytes, stream, &err)
                                  : api->flash_bwd(&p, cu.q, cu.k, wsp, bytes, stream, &err),
          err);
  }

  // The CUDA flash forward does not write the row statistics yet (alloc_stats fills them from lse).  Its
  // backward is handed them all the same: it reads only whether they are there (the forward's own
  // stats: the call's keys are its rows' whole, so delta is summed from the keys; flash_bwd.cu).
  static bool stats_kept(const ab_attn_params&) { return false; }
  static constexpr bool kReadsStats = true;

  static void dropout_mask(const Tensor& rng, uint64_t seed, uint64_t offset, const int64_t* rng_dev,
                           double dropout_p, int64_t B, int64_t H, int64_t Sq, int64_t Sk, uint8_t* out) {
    ab_error err{};
    const ab_cuda_api* api = cuda_api();
    const int32_t device = rng.get_device_index();
    torch::stable::accelerator::DeviceGuard guard(device);
    check(api->dropout_mask(seed, offset, rng_dev, dropout_p, B, H, Sq, Sk, out, current_cuda_stream(device), &err),
          err);
  }

  // the CUDA decode kernel (csrc/cuda/decode.cu); its workspace from torch's allocator
  static ab_status kvcache(const Tensor& q, const ab_kvcache_params& p, ab_error& err) {
    if (p.q.device != AB_DEVICE_CUDA) fail("kvcache_fwd has CPU and CUDA kernels only");
    const ab_cuda_api* api = cuda_api();
    torch::stable::accelerator::DeviceGuard guard(p.q.device_index);
    void* stream = current_cuda_stream(p.q.device_index);
    const size_t bytes = api->kvcache_workspace(&p);
    Tensor ws = workspace(q, bytes);
    return api->kvcache_fwd(&p, bytes ? ws.data_ptr() : nullptr, bytes, stream, &err);
  }
};

}  // namespace
}  // namespace ab_shim

STABLE_TORCH_LIBRARY_IMPL(attn_backends, CUDA, m) { ab_shim::register_ops<ab_shim::Cuda>(m); }
