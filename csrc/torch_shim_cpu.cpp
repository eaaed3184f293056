// torch_shim_cpu.cpp -- the ops for the CPU dispatch key (torch_shim.h): the C core's kernels on
// torch's thread pool, or, with the CUDA emulation on (ATTN_BACKENDS_CUDA_EMULATE=1, docs/cuda.md),
// the CUDA launchers of libattn_backends_cuda_emu.so with the pool where the stream would go.
#include "torch_shim.h"

namespace ab_shim {
namespace {

// The emulator's launcher table when the CUDA emulation is on, else NULL.  Calls with sinks or ALiBi
// run the CPU kernels unless the CUDA kernel takes them (sinks_ok: flash, forward and backward).
const ab_cuda_api* emulated(const ab_attn_params& p, bool sinks_ok) {
  if ((p.sinks.ndim || p.alibi.ndim) && !sinks_ok) return nullptr;
  return ab_cuda_emulation();
}

struct Cpu {
  // The emulated launchers take cu_seqlens as the host copies in p (packed calls).
  static void fwd(Kernel kernel, const Tensor& q, ab_attn_params& p, const Packed* packed) {
    ab_error err{};
    ab_cpu_pool pool = torch_pool();
    const int32_t* cu_q = packed ? p.cu_seqlens_q : nullptr;
    const int32_t* cu_k = packed ? p.cu_seqlens_k : nullptr;
    const ab_cuda_api* emu = emulated(p, kernel == Kernel::kFlash);
    switch (kernel) {
      case Kernel::kMath:
        check(emu ? emu->math_fwd(&p, &pool, &err) : ab_math_cpu_fwd(&p, &pool, &err), err);
        return;
      case Kernel::kFlash:
        check(emu ? emu->flash_fwd(&p, cu_q, cu_k, &pool, &err) : ab_flash_cpu_fwd(&p, &pool, &err), err);
        return;
      case Kernel::kSage:
        // its workspace (quantized K, scales, means) comes from torch's allocator for this call only;
        // the emulated launcher says how many bytes it needs when called with none
        if (emu) {
          size_t bytes = 0;
          check(emu->sage_fwd(&p, cu_q, cu_k, nullptr, &bytes, &pool, &err), err);
          if (bytes == 0) return;
          Tensor ws = workspace(q, bytes);
          check(emu->sage_fwd(&p, cu_q, cu_k, ws.data_ptr(), &bytes, &pool, &err), err);
          return;
        }
        const size_t bytes = ab_sage_cpu_workspace_size(&p);
        Tensor ws = workspace(q, bytes);
        check(ab_sage_cpu_fwd(&p, bytes ? ws.data_ptr() : nullptr, bytes, &pool, &err), err);
        return;
    }
  }

  static void bwd(Kernel kernel, const Tensor& q, ab_attn_params& p, const Packed* packed) {
    ab_error err{};
    ab_cpu_pool pool = torch_pool();
    if (kernel == Kernel::kSage) fail("sage has no backward kernel");
    if (const ab_cuda_api* emu = emulated(p, kernel == Kernel::kFlash)) {
      const size_t bytes = kernel == Kernel::kMath ? emu->math_bwd_workspace(&p) : emu->flash_bwd_workspace(&p);
      Tensor ws = workspace(q, bytes);
      void* wsp = bytes ? ws.data_ptr() : nullptr;
      check(kernel == Kernel::kMath
                ? emu->math_bwd(&p, wsp, bytes, &pool, &err)
                : emu->flash_bwd(&p, packed ? p.cu_seqlens_q : nullptr, packed ? p.cu_seqlens_k : nullptr, wsp,
                                 bytes, &pool, &err),
            err);
      return;
    }
    check(kernel == Kernel::kMath ? ab_math_cpu_bwd(&p, &pool, &err) : ab_flash_cpu_bwd(&p, &pool, &err), err);
  }

  // The CPU flash forward writes its row statistics (the emulated CUDA one does not) and the CPU
  // backward reads them.
  static bool stats_kept(const ab_attn_params& p) { return emulated(p, true) == nullptr; }
  static constexpr bool kReadsStats = true;

  static void dropout_mask(const Tensor&, uint64_t seed, uint64_t offset, const int64_t*, double dropout_p, int64_t B,
                           int64_t H, int64_t Sq, int64_t Sk, uint8_t* out) {
    ab_error err{};
    ab_cpu_pool pool = torch_pool();
    if (const ab_cuda_api* emu = ab_cuda_emulation())  // the CUDA mask kernel, emulated
      check(emu->dropout_mask(seed, offset, nullptr, dropout_p, B, H, Sq, Sk, out, &pool, &err), err);
    else
      check(ab_dropout_mask_cpu(seed, offset, dropout_p, B, H, Sq, Sk, out, &pool, &err), err);
  }

  // the CPU decode kernel (decode_cpu.h), or the CUDA one (csrc/cuda/decode.cu) under the emulation;
  // its workspace (q in float32, the split partials) comes from torch's allocator
  static ab_status kvcache(const Tensor& q, const ab_kvcache_params& p, ab_error& err) {
    ab_cpu_pool pool = torch_pool();
    if (const ab_cuda_api* emu = ab_cuda_emulation()) {
      const size_t bytes = emu->kvcache_workspace(&p);
      Tensor ws = workspace(q, bytes);
      return emu->kvcache_fwd(&p, bytes ? ws.data_ptr() : nullptr, bytes, &pool, &err);  // blocks on the pool
    }
    const size_t bytes = ab_kvcache_cpu_workspace_size(&p, pool.num_threads);
    Tensor ws = workspace(q, bytes);
    return ab_kvcache_cpu_fwd(&p, bytes ? ws.data_ptr() : nullptr, bytes, &pool, &err);
  }
};

}  // namespace
}  // namespace ab_shim

STABLE_TORCH_LIBRARY_IMPL(attn_backends, CPU, m) { ab_shim::register_ops<ab_shim::Cpu>(m); }
