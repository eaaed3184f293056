// torch_shim.cpp -- the one C++ file that includes torch headers.
//
// What it does: registers the attn_backends::* ops with torch's dispatcher through the LibTorch
// stable ABI (TORCH_TARGET_VERSION 2.10, so one build runs on every torch >= 2.10), turns torch
// tensors into ab_tensor views, allocates outputs through torch's allocator, lends torch's thread
// pool and current CUDA stream to the C core, and turns a failing ab_status into a torch error.
//
// What it must not do: compute anything.  Every kernel lives in the C core or the CUDA library.
//
// Ops (schemas below; Python registers fake kernels and autograd in attn_backends/_ops.py):
//   math_fwd                     -> (out (B, Hq, Sq, Dv), lse (B, Hq, Sq))
//   flash_fwd                    -> (out, lse, stats (2, B, Hq, Sq): each row's max and log sum)
//   math_bwd, flash_bwd          -> (dq, dk, dv, dmask, dsinks); flash_bwd takes the forward's stats
//   flash_varlen_fwd / _bwd      packed sequences: out (Tq, Hq, Dv), lse (Hq, Tq), stats (2, Hq, Tq);
//                                (dq, dk, dv, dsinks)
//   Every forward and backward above takes `sinks` (Hq,) and `alibi_slopes` (Hq,) or (B, Hq) last,
//   optional (ab_attn_params); dsinks is (Hq,) like lse's dtype with sinks, else empty.  The CPU
//   kernels (math, flash) serve them, and the CUDA flash forward and backward (dsinks included); sage
//   and the other CUDA kernels refuse them.
//   sage_fwd, sage_varlen_fwd    forward only (INT8 Q.K^T); the same outputs as flash's forwards;
//                                CPU and CUDA
//   dropout_mask                 the keep-mask the kernels draw, for tests (on rng_state's device)
//   kvcache_fwd                  attention against a KV cache (flash_attn_with_kvcache): writes the
//                                new k/v into k_cache/v_cache in place -> (out (B, Sq, Hq, D), lse (B, Hq, Sq))
// The backward ops take `deterministic`: on CUDA it picks flash's atomic-free dQ kernel (the CPU
// kernels and CUDA math are deterministic always).
// With the CUDA emulation on (ATTN_BACKENDS_CUDA_EMULATE=1, docs/cuda.md), CPU tensors run the CUDA
// launchers of libattn_backends_cuda_emu.so instead of the CPU kernels: same calls, with torch's
// thread pool (an ab_cpu_pool*) where the stream would go.
#include <dlfcn.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

extern "C" {
#include "ab_core.h"
#include "ab_shim.h"
#include "cpu/decode_cpu.h"
#include "cuda/ab_cuda.h"
}

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("attn_backends: " + msg); }

void check(ab_status status, const ab_error& err) {
  if (status != AB_OK) fail(err.msg);
}

ab_dtype to_ab_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return AB_DTYPE_F32;
    case ScalarType::Half: return AB_DTYPE_F16;
    case ScalarType::BFloat16: return AB_DTYPE_BF16;
    case ScalarType::Double: return AB_DTYPE_F64;
    case ScalarType::Bool: return AB_DTYPE_BOOL;
    case ScalarType::Int: return AB_DTYPE_I32;
    case ScalarType::Long: return AB_DTYPE_I64;
    case ScalarType::Byte: return AB_DTYPE_U8;
    default: return AB_DTYPE_OTHER;
  }
}

ab_device_type to_ab_device(torch::stable::DeviceType t) {
  switch (t) {
    case torch::stable::DeviceType::CPU: return AB_DEVICE_CPU;
    case torch::stable::DeviceType::CUDA: return AB_DEVICE_CUDA;
    case torch::stable::DeviceType::MPS: return AB_DEVICE_MPS;
    default: return AB_DEVICE_OTHER;
  }
}

ab_tensor view_of(const Tensor& t, const char* name) {
  ab_tensor v{};
  const int64_t nd = t.dim();
  if (nd < 1 || nd > AB_MAX_DIMS)
    fail(std::string(name) + " must have 1 to 4 dims, got " + std::to_string(nd));
  v.ndim = static_cast<int32_t>(nd);
  for (int64_t d = 0; d < nd; ++d) {
    v.sizes[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  v.data = t.numel() ? t.data_ptr() : nullptr;
  v.dtype = to_ab_dtype(t.scalar_type());
  auto dev = t.device();
  v.device = to_ab_device(dev.type());
  v.device_index = dev.index();
  return v;
}

// The mask as a (B, Hq, Sq, Sk) view: dims aligned to the right, size-1 dims broadcast with
// stride 0, as torch broadcasting does.  Never copies.
ab_tensor mask_view(const Tensor& m, int64_t B, int64_t Hq, int64_t Sq, int64_t Sk) {
  ab_tensor src = view_of(m, "attn_mask");
  const int64_t want[4] = {B, Hq, Sq, Sk};
  ab_tensor v = src;
  v.ndim = 4;
  const int shift = 4 - src.ndim;
  for (int d = 0; d < 4; ++d) {
    const int sd = d - shift;
    const int64_t size = sd >= 0 ? src.sizes[sd] : 1;
    const int64_t stride = sd >= 0 ? src.strides[sd] : 0;
    if (size != want[d] && size != 1) {
      std::string shape = "(";
      for (int s = 0; s < src.ndim; ++s) shape += (s ? ", " : "") + std::to_string(src.sizes[s]);
      fail("attn_mask of shape " + shape + ") is not broadcastable to (B, Hq, Sq, Sk) = (" +
           std::to_string(B) + ", " + std::to_string(Hq) + ", " + std::to_string(Sq) + ", " +
           std::to_string(Sk) + ")");
    }
    v.sizes[d] = want[d];
    v.strides[d] = size == 1 ? 0 : stride;
  }
  return v;
}

int pool_parallel_for(int64_t begin, int64_t end, int64_t grain, ab_range_fn fn, void* ctx) {
  return torch_parallel_for(begin, end, grain, fn, ctx) == AOTI_TORCH_SUCCESS ? 0 : -1;
}

ab_cpu_pool torch_pool() {
  uint32_t n = 1;
  if (torch_get_num_threads(&n) != AOTI_TORCH_SUCCESS || n == 0) n = 1;
  return ab_cpu_pool{pool_parallel_for, static_cast<int>(n)};
}

// The current CUDA stream, looked up at run time: a CPU-only torch has no libtorch_cuda, and this
// file must load there.
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

// The emulator's launcher table when the CUDA emulation is on and the call is on the CPU, else NULL.
// Calls with sinks or ALiBi run the CPU kernels unless the CUDA kernel takes them (sinks_ok: the
// flash forward and backward).
const ab_cuda_api* emulated(const ab_attn_params& p, bool sinks_ok = false) {
  if ((p.sinks.ndim || p.alibi.ndim) && !sinks_ok) return nullptr;
  return p.q.device == AB_DEVICE_CPU ? ab_cuda_emulation() : nullptr;
}

// The CUDA kernels other than flash (forward and backward) take no sinks and no ALiBi (the planner
// never routes such a call to them).
void refuse_on_cuda(const ab_attn_params& p, const char* kernel) {
  if (p.q.device == AB_DEVICE_CUDA && (p.sinks.ndim || p.alibi.ndim))
    fail(std::string(kernel) + " on CUDA takes no " + (p.sinks.ndim ? "sinks" : "alibi_slopes") +
         " (the CPU kernels do)");
}

const ab_cuda_api* cuda_api() {
  ab_error err{};
  const ab_cuda_api* api = ab_cuda_load(&err);
  if (!api) fail(err.msg);
  return api;
}

// Reads the (seed, offset) pair that the Python layer drew from torch's generator: a CPU tensor
// is read here; a CUDA one (drawn on the GPU, as under CUDA graph capture, where a host value would
// be frozen into the graph) stays in device memory and the kernels read it (*rng_dev).
void read_seed(const Tensor& r, uint64_t& seed, uint64_t& offset, const int64_t** rng_dev) {
  if (r.scalar_type() != ScalarType::Long || r.dim() != 1 || r.size(0) != 2)
    fail("rng_state must be an int64 tensor of shape (2,) holding [seed, offset]");
  seed = offset = 0;
  *rng_dev = nullptr;
  if (r.is_cpu()) {
    const int64_t* d = static_cast<const int64_t*>(r.data_ptr());
    seed = static_cast<uint64_t>(d[0]);
    offset = static_cast<uint64_t>(d[r.stride(0)]);
    return;
  }
  if (r.stride(0) != 1) fail("a CUDA rng_state must be contiguous");
  *rng_dev = static_cast<const int64_t*>(r.data_ptr());
}

void read_rng(const std::optional<Tensor>& rng, double dropout_p, ab_attn_params& p) {
  p.seed = p.offset = 0;
  p.rng_dev = nullptr;
  if (!(dropout_p > 0)) return;
  if (!rng.has_value()) fail("dropout_p > 0 needs rng_state (an int64 tensor [seed, offset])");
  read_seed(*rng, p.seed, p.offset, &p.rng_dev);
  if (p.rng_dev != nullptr &&
      (p.q.device != AB_DEVICE_CUDA || rng->get_device_index() != p.q.device_index))
    fail("rng_state must be on the CPU or on the inputs' CUDA device");
}

// Allocation goes straight to at::empty_strided through the stable C shim: the by-name dispatcher
// route (torch::stable::new_empty) costs microseconds per tensor, which small calls notice.
Tensor empty_strided(const Tensor& like, const std::vector<int64_t>& sizes,
                     const std::vector<int64_t>& strides, int32_t dtype) {
  int32_t device_type = 0;
  if (aoti_torch_get_device_type(like.get(), &device_type) != AOTI_TORCH_SUCCESS)
    fail("could not read the device of an input");
  AtenTensorHandle handle = nullptr;
  if (aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                               dtype, device_type, like.get_device_index(),
                               &handle) != AOTI_TORCH_SUCCESS)
    fail("allocation failed");
  return Tensor(handle);
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t s = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = s;
    s *= sizes[d] > 1 ? sizes[d] : 1;
  }
  return strides;
}

// Gradients take their input's layout when it is dense and non-overlapping (a transposed
// (B, S, H, D) view gets a gradient with the same memory order), else the contiguous one.
// attn_backends/_ops.py:grad_strides is the same rule for the fake kernels.
std::vector<int64_t> grad_strides(const Tensor& t) {
  const int64_t nd = t.dim();
  std::vector<int64_t> sizes(nd), strides(nd);
  for (int64_t d = 0; d < nd; ++d) {
    sizes[d] = t.size(d);
    strides[d] = t.stride(d);
  }
  std::vector<int64_t> order;
  for (int64_t d = 0; d < nd; ++d)
    if (sizes[d] != 1) order.push_back(d);
  bool dense = t.numel() > 0;
  // insertion sort by stride (at most 4 dims), ties keep the outer dim outer
  for (size_t a = 1; a < order.size(); ++a)
    for (size_t b = a; b > 0 && strides[order[b]] < strides[order[b - 1]]; --b)
      std::swap(order[b], order[b - 1]);
  int64_t expect = 1;
  for (int64_t d : order) {
    if (strides[d] != expect) dense = false;
    expect *= sizes[d];
  }
  return dense ? strides : contiguous_strides(sizes);
}

std::vector<int64_t> sizes_of(const Tensor& t) {
  std::vector<int64_t> sizes(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) sizes[d] = t.size(d);
  return sizes;
}

int32_t aoti_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Double: return aoti_torch_dtype_float64();
    case ScalarType::Half: return aoti_torch_dtype_float16();
    case ScalarType::BFloat16: return aoti_torch_dtype_bfloat16();
    case ScalarType::Bool: return aoti_torch_dtype_bool();
    default: return aoti_torch_dtype_float32();
  }
}

int32_t lse_dtype(const Tensor& q) {
  return q.scalar_type() == ScalarType::Double ? aoti_torch_dtype_float64()
                                               : aoti_torch_dtype_float32();
}

// The optional sinks and ALiBi slopes (checked with the rest in ab_attn_params_check).
void read_sinks_alibi(const std::optional<Tensor>& sinks, const std::optional<Tensor>& alibi, ab_attn_params& p) {
  if (sinks.has_value()) p.sinks = view_of(*sinks, "sinks");
  if (alibi.has_value()) p.alibi = view_of(*alibi, "alibi_slopes");
}

// dsinks (Hq,) in lse's dtype when the call has sinks, else an empty tensor.
Tensor alloc_dsinks(const Tensor& q, ab_attn_params& p) {
  std::vector<int64_t> sizes{p.sinks.ndim ? p.Hq : 0};
  Tensor dsinks = empty_strided(q, sizes, {1}, lse_dtype(q));
  if (p.sinks.ndim) p.dsinks = view_of(dsinks, "grad_sinks");
  return dsinks;
}

// Fills shapes, the q/k/v/mask views and the options shared by forward and backward.
ab_attn_params make_params(const Tensor& q, const Tensor& k, const Tensor& v,
                           const std::optional<Tensor>& mask, const std::optional<Tensor>& rng,
                           int64_t causal, double scale, int64_t wl, int64_t wr, double softcap,
                           double dropout_p) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    fail("q, k and v must be 4-D: (B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv)");
  ab_attn_params p{};
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.Sq = q.size(2);
  p.D = q.size(3);
  p.Hkv = k.size(1);
  p.Sk = k.size(2);
  p.Dv = v.size(3);
  p.q = view_of(q, "q");
  p.k = view_of(k, "k");
  p.v = view_of(v, "v");
  if (mask.has_value()) p.mask = mask_view(*mask, p.B, p.Hq, p.Sq, p.Sk);
  p.causal = static_cast<ab_causal>(causal);
  p.scale = scale;
  p.window_left = wl;
  p.window_right = wr;
  p.softcap = softcap;
  p.dropout_p = dropout_p;
  read_rng(rng, dropout_p, p);
  return p;
}

enum class Kernel { kMath, kFlash, kSage };

const char* kernel_name(Kernel k) {
  return k == Kernel::kMath ? "math" : k == Kernel::kFlash ? "flash" : "sage";
}

// sage: its workspace (quantized K, scales, means) comes from torch's allocator, like the outputs,
// and lives for this call only (on CUDA the caching allocator hands it out again only after the
// work queued on this stream).  The CUDA launcher says how many bytes it needs when called with
// none.  Packed calls on CUDA pass cu_seqlens in device memory too, as for flash.
void run_sage(const Tensor& q, ab_attn_params& p, const int32_t* cu_q_dev = nullptr,
              const int32_t* cu_k_dev = nullptr) {
  ab_error err{};
  refuse_on_cuda(p, "sage");
  if (const ab_cuda_api* emu = emulated(p)) {
    ab_cpu_pool pool = torch_pool();
    size_t bytes = 0;
    check(emu->sage_fwd(&p, cu_q_dev, cu_k_dev, nullptr, &bytes, &pool, &err), err);
    if (bytes == 0) return;
    Tensor ws = empty_strided(q, {static_cast<int64_t>(bytes)}, {1}, aoti_torch_dtype_uint8());
    check(emu->sage_fwd(&p, cu_q_dev, cu_k_dev, ws.data_ptr(), &bytes, &pool, &err), err);
    return;
  }
  if (p.q.device == AB_DEVICE_CUDA) {
    const ab_cuda_api* api = cuda_api();
    torch::stable::accelerator::DeviceGuard guard(p.q.device_index);
    void* stream = current_cuda_stream(p.q.device_index);
    size_t bytes = 0;
    check(api->sage_fwd(&p, cu_q_dev, cu_k_dev, nullptr, &bytes, stream, &err), err);
    if (bytes == 0) return;  // nothing to compute
    Tensor ws = empty_strided(q, {static_cast<int64_t>(bytes)}, {1}, aoti_torch_dtype_uint8());
    check(api->sage_fwd(&p, cu_q_dev, cu_k_dev, ws.data_ptr(), &bytes, stream, &err), err);
    return;
  }
  if (p.q.device != AB_DEVICE_CPU) fail("sage has no forward kernel for this device");
  const size_t bytes = ab_sage_cpu_workspace_size(&p);
  Tensor ws = empty_strided(q, {static_cast<int64_t>(bytes)}, {1}, aoti_torch_dtype_uint8());
  ab_cpu_pool pool = torch_pool();
  check(ab_sage_cpu_fwd(&p, bytes ? ws.data_ptr() : nullptr, bytes, &pool, &err), err);
}

// Runs a forward kernel on the device of q: the C core on CPU, the CUDA library on CUDA.  Packed
// calls on CUDA also pass cu_seqlens in device memory (the host copies stay in p for the checks
// and the grid).
void run_fwd(Kernel kernel, ab_attn_params& p, const int32_t* cu_q_dev = nullptr,
             const int32_t* cu_k_dev = nullptr) {
  ab_error err{};
  if (kernel != Kernel::kFlash) refuse_on_cuda(p, kernel_name(kernel));
  if (const ab_cuda_api* emu = emulated(p, kernel == Kernel::kFlash)) {
    ab_cpu_pool pool = torch_pool();
    check(kernel == Kernel::kMath ? emu->math_fwd(&p, &pool, &err)
                                  : emu->flash_fwd(&p, cu_q_dev, cu_k_dev, &pool, &err),
          err);
  } else if (p.q.device == AB_DEVICE_CPU) {
    ab_cpu_pool pool = torch_pool();
    check(kernel == Kernel::kMath ? ab_math_cpu_fwd(&p, &pool, &err) : ab_flash_cpu_fwd(&p, &pool, &err), err);
  } else if (p.q.device == AB_DEVICE_CUDA && kernel == Kernel::kMath) {
    const ab_cuda_api* api = cuda_api();
    torch::stable::accelerator::DeviceGuard guard(p.q.device_index);
    check(api->math_fwd(&p, current_cuda_stream(p.q.device_index), &err), err);
  } else if (p.q.device == AB_DEVICE_CUDA && kernel == Kernel::kFlash) {
    const ab_cuda_api* api = cuda_api();
    torch::stable::accelerator::DeviceGuard guard(p.q.device_index);
    check(api->flash_fwd(&p, cu_q_dev, cu_k_dev, current_cuda_stream(p.q.device_index), &err), err);
  } else {
    fail(std::string(kernel_name(kernel)) + " has no forward kernel for this device");
  }
}

// Runs a backward kernel on the device of q.  On CUDA the kernel's workspace (delta per query row,
// flash's float32 dQ accumulator) comes from torch's allocator on q's device and lives for this
// call only (the caching allocator makes that cheap, and stream order keeps it safe).
void run_bwd(Kernel kernel, const Tensor& q, ab_attn_params& p, const int32_t* cu_q_dev = nullptr,
             const int32_t* cu_k_dev = nullptr) {
  ab_error err{};
  if (kernel != Kernel::kFlash) refuse_on_cuda(p, kernel_name(kernel));
  if (const ab_cuda_api* emu = emulated(p, kernel == Kernel::kFlash); emu != nullptr && kernel != Kernel::kSage) {
    ab_cpu_pool pool = torch_pool();
    const size_t bytes = kernel == Kernel::kMath ? emu->math_bwd_workspace(&p) : emu->flash_bwd_workspace(&p);
    Tensor ws = empty_strided(q, {static_cast<int64_t>(bytes)}, {1}, aoti_torch_dtype_uint8());
    void* wsp = bytes ? ws.data_ptr() : nullptr;
    check(kernel == Kernel::kMath ? emu->math_bwd(&p, wsp, bytes, &pool, &err)
                                  : emu->flash_bwd(&p, cu_q_dev, cu_k_dev, wsp, bytes, &pool, &err),
          err);
  } else if (p.q.device == AB_DEVICE_CPU) {
    ab_cpu_pool pool = torch_pool();
    check(kernel == Kernel::kMath ? ab_math_cpu_bwd(&p, &pool, &err) : ab_flash_cpu_bwd(&p, &pool, &err), err);
  } else if (p.q.device == AB_DEVICE_CUDA && kernel != Kernel::kSage) {
    const ab_cuda_api* api = cuda_api();
    torch::stable::accelerator::DeviceGuard guard(p.q.device_index);
    const size_t bytes = kernel == Kernel::kMath ? api->math_bwd_workspace(&p) : api->flash_bwd_workspace(&p);
    Tensor ws = empty_strided(q, {static_cast<int64_t>(bytes)}, {1}, aoti_torch_dtype_uint8());
    void* wsp = bytes ? ws.data_ptr() : nullptr;
    void* stream = current_cuda_stream(p.q.device_index);
    check(kernel == Kernel::kMath ? api->math_bwd(&p, wsp, bytes, stream, &err)
                                  : api->flash_bwd(&p, cu_q_dev, cu_k_dev, wsp, bytes, stream, &err),
          err);
  } else {
    fail(std::string(kernel_name(kernel)) + " has no backward kernel for this device");
  }
}

// cu_seqlens_q and _k copied to q's device as one (2, B + 1) int32 tensor: the CUDA kernels read
// them there (the host copies stay in the params for the checks and the grid).
Tensor cu_seqlens_on_device(const Tensor& q, const Tensor& cu_q, const Tensor& cu_k) {
  Tensor cu_dev = empty_strided(q, {2, cu_q.size(0)}, {cu_q.size(0), 1}, aoti_torch_dtype_int32());
  Tensor row_q = torch::stable::select(cu_dev, 0, 0), row_k = torch::stable::select(cu_dev, 0, 1);
  torch::stable::copy_(row_q, cu_q);
  torch::stable::copy_(row_k, cu_k);
  return cu_dev;
}

// flash's stats (2, ..., lse's shape): each row's max and log sum, which the CPU forward writes and
// the CPU backward reads (ab_core.h).  The CUDA forward does not compute them yet: there they are
// filled as lse = max + 0, which its backward does not read.  The same holds for CPU tensors under
// the CUDA emulation, so that stats are always written, whichever backward later reads them.
Tensor alloc_stats(const Tensor& q, const Tensor& lse, ab_attn_params& p) {
  std::vector<int64_t> sizes{2};
  for (int64_t d = 0; d < lse.dim(); ++d) sizes.push_back(lse.size(d));
  Tensor stats = empty_strided(q, sizes, contiguous_strides(sizes), lse_dtype(q));
  if (p.q.device == AB_DEVICE_CPU && emulated(p, true) == nullptr) p.stats = view_of(stats, "stats");
  return stats;
}

void fill_stats_from_lse(Tensor& stats, const Tensor& lse) {
  Tensor m = torch::stable::select(stats, 0, 0), ls = torch::stable::select(stats, 0, 1);
  torch::stable::copy_(m, lse);
  torch::stable::zero_(ls);
}

// Dense forward: out (B, Hq, Sq, Dv) stored (B, Sq, Hq, Dv), lse (B, Hq, Sq); flash also returns
// its stats (2, B, Hq, Sq).
template <Kernel K>
std::tuple<Tensor, Tensor, std::optional<Tensor>> dense_fwd_impl(
    const Tensor& q, const Tensor& k, const Tensor& v, std::optional<Tensor> mask, std::optional<Tensor> rng,
    int64_t causal, double scale, int64_t window_left, int64_t window_right, double softcap, double dropout_p,
    const std::optional<Tensor>& sinks, const std::optional<Tensor>& alibi) {
  ab_attn_params p = make_params(q, k, v, mask, rng, causal, scale, window_left, window_right,
                                 softcap, dropout_p);
  read_sinks_alibi(sinks, alibi, p);
  // out is laid out (B, Sq, Hq, Dv) in memory and returned as a (B, Hq, Sq, Dv) view, so the usual
  // out.transpose(1, 2).reshape(B, Sq, Hq * Dv) that follows attention costs no copy.
  std::vector<int64_t> out_sizes{p.B, p.Hq, p.Sq, p.Dv};
  std::vector<int64_t> phys = contiguous_strides({p.B, p.Sq, p.Hq, p.Dv});
  std::vector<int64_t> out_strides{phys[0], phys[2], phys[1], phys[3]};
  Tensor out = empty_strided(q, out_sizes, out_strides, aoti_dtype(q.scalar_type()));
  std::vector<int64_t> lse_sizes{p.B, p.Hq, p.Sq};
  Tensor lse = empty_strided(q, lse_sizes, contiguous_strides(lse_sizes), lse_dtype(q));
  p.out = view_of(out, "out");
  p.lse = view_of(lse, "lse");
  std::optional<Tensor> stats;
  if constexpr (K == Kernel::kFlash) stats = alloc_stats(q, lse, p);
  if constexpr (K == Kernel::kSage)
    run_sage(q, p);
  else
    run_fwd(K, p);
  if (stats.has_value() && p.stats.ndim == 0) fill_stats_from_lse(*stats, lse);
  return std::make_tuple(out, lse, stats);
}

template <Kernel K>
std::tuple<Tensor, Tensor> dense_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                     std::optional<Tensor> mask, std::optional<Tensor> rng,
                                     int64_t causal, double scale, int64_t window_left,
                                     int64_t window_right, double softcap, double dropout_p,
                                     std::optional<Tensor> sinks, std::optional<Tensor> alibi) {
  auto res = dense_fwd_impl<K>(q, k, v, mask, rng, causal, scale, window_left, window_right, softcap, dropout_p,
                               sinks, alibi);
  return std::make_tuple(std::get<0>(res), std::get<1>(res));
}

std::tuple<Tensor, Tensor, Tensor> flash_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                             std::optional<Tensor> mask, std::optional<Tensor> rng,
                                             int64_t causal, double scale, int64_t window_left,
                                             int64_t window_right, double softcap, double dropout_p,
                                             std::optional<Tensor> sinks, std::optional<Tensor> alibi) {
  auto res = dense_fwd_impl<Kernel::kFlash>(q, k, v, mask, rng, causal, scale, window_left, window_right, softcap,
                                            dropout_p, sinks, alibi);
  return std::make_tuple(std::get<0>(res), std::get<1>(res), *std::get<2>(res));
}

// The stats a backward was handed, if any (flash only; the CPU kernel reads them).
void read_stats(const std::optional<Tensor>& stats, ab_attn_params& p) {
  if (stats.has_value() && p.q.device == AB_DEVICE_CPU) p.stats = view_of(*stats, "stats");
}

template <Kernel K>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> dense_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, std::optional<Tensor> grad_lse, std::optional<Tensor> mask,
    std::optional<Tensor> rng, int64_t causal, double scale, int64_t window_left,
    int64_t window_right, double softcap, double dropout_p, bool mask_grad, bool deterministic,
    std::optional<Tensor> stats, std::optional<Tensor> sinks, std::optional<Tensor> alibi) {
  ab_attn_params p = make_params(q, k, v, mask, rng, causal, scale, window_left, window_right,
                                 softcap, dropout_p);
  read_sinks_alibi(sinks, alibi, p);
  p.out = view_of(out, "out");
  p.lse = view_of(lse, "lse");
  read_stats(stats, p);
  p.dout = view_of(grad_out, "grad_out");
  if (grad_lse.has_value()) p.dlse = view_of(*grad_lse, "grad_lse");
  const int32_t dt = aoti_dtype(q.scalar_type());
  Tensor dq = empty_strided(q, sizes_of(q), grad_strides(q), dt);
  Tensor dk = empty_strided(k, sizes_of(k), grad_strides(k), dt);
  Tensor dv = empty_strided(v, sizes_of(v), grad_strides(v), dt);
  if (mask_grad && !(mask.has_value() && mask->scalar_type() != ScalarType::Bool))
    fail("mask_grad needs a floating attn_mask");
  std::vector<int64_t> dmask_sizes{p.B, p.Hq, p.Sq, p.Sk};
  if (!mask_grad) dmask_sizes = {0};
  Tensor dmask = empty_strided(q, dmask_sizes, contiguous_strides(dmask_sizes), lse_dtype(q));
  p.dq = view_of(dq, "dq");
  p.dk = view_of(dk, "dk");
  p.dv = view_of(dv, "dv");
  if (mask_grad) p.dmask = view_of(dmask, "grad_mask");
  Tensor dsinks = alloc_dsinks(q, p);
  p.deterministic = deterministic;
  run_bwd(K, q, p);
  return std::make_tuple(dq, dk, dv, dmask, dsinks);
}

// Packed (varlen) calls: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), cu_seqlens int32 (B + 1,)
// on the CPU.  out (Tq, Hq, Dv), lse (Hq, Tq), as flash-attn's varlen functions.
ab_attn_params make_varlen_params(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                                  int64_t max_k, const std::optional<Tensor>& rng, int64_t causal,
                                  double scale, int64_t wl, int64_t wr, double softcap,
                                  double dropout_p) {
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3)
    fail("varlen q, k and v must be 3-D: (total_q, Hq, D), (total_k, Hkv, D), (total_k, Hkv, Dv)");
  for (const Tensor* cu : {&cu_q, &cu_k})
    if (!cu->is_cpu() || cu->scalar_type() != ScalarType::Int || cu->dim() != 1 || cu->size(0) < 1 ||
        cu->stride(0) != 1)
      fail("cu_seqlens must be contiguous CPU int32 tensors of shape (B + 1,)");
  if (cu_q.size(0) != cu_k.size(0)) fail("cu_seqlens_q and cu_seqlens_k must have the same length");
  ab_attn_params p{};
  p.B = cu_q.size(0) - 1;
  p.Hq = q.size(1);
  p.D = q.size(2);
  p.Hkv = k.size(1);
  p.Dv = v.size(2);
  p.Sq = max_q;
  p.Sk = max_k;
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.data_ptr());
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.data_ptr());
  p.q = view_of(q, "q");
  p.k = view_of(k, "k");
  p.v = view_of(v, "v");
  p.causal = static_cast<ab_causal>(causal);
  p.scale = scale;
  p.window_left = wl;
  p.window_right = wr;
  p.softcap = softcap;
  p.dropout_p = dropout_p;
  read_rng(rng, dropout_p, p);
  return p;
}

template <Kernel K>
std::tuple<Tensor, Tensor, std::optional<Tensor>> varlen_fwd_impl(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
    int64_t max_k, std::optional<Tensor> rng, int64_t causal, double scale, int64_t wl, int64_t wr, double softcap,
    double dropout_p, const std::optional<Tensor>& sinks, const std::optional<Tensor>& alibi) {
  ab_attn_params p = make_varlen_params(q, k, v, cu_q, cu_k, max_q, max_k, rng, causal, scale, wl, wr,
                                        softcap, dropout_p);
  read_sinks_alibi(sinks, alibi, p);
  std::vector<int64_t> out_sizes{q.size(0), p.Hq, p.Dv};
  Tensor out = empty_strided(q, out_sizes, contiguous_strides(out_sizes), aoti_dtype(q.scalar_type()));
  std::vector<int64_t> lse_sizes{p.Hq, q.size(0)};
  Tensor lse = empty_strided(q, lse_sizes, contiguous_strides(lse_sizes), lse_dtype(q));
  p.out = view_of(out, "out");
  p.lse = view_of(lse, "lse");
  std::optional<Tensor> stats;
  if constexpr (K == Kernel::kFlash) stats = alloc_stats(q, lse, p);
  if (p.q.device == AB_DEVICE_CUDA) {
    Tensor cu_dev = cu_seqlens_on_device(q, cu_q, cu_k);
    const int32_t* base = static_cast<const int32_t*>(cu_dev.data_ptr());
    if constexpr (K == Kernel::kSage)
      run_sage(q, p, base, base + cu_q.size(0));
    else
      run_fwd(K, p, base, base + cu_q.size(0));
  } else if constexpr (K == Kernel::kSage) {
    run_sage(q, p, p.cu_seqlens_q, p.cu_seqlens_k);  // the emulator takes the host copies
  } else {
    run_fwd(K, p, p.cu_seqlens_q, p.cu_seqlens_k);
  }
  if (stats.has_value() && p.stats.ndim == 0) fill_stats_from_lse(*stats, lse);
  return std::make_tuple(out, lse, stats);
}

std::tuple<Tensor, Tensor> sage_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                                           const Tensor& cu_k, int64_t max_q, int64_t max_k,
                                           std::optional<Tensor> rng, int64_t causal, double scale, int64_t wl,
                                           int64_t wr, double softcap, double dropout_p,
                                           std::optional<Tensor> sinks, std::optional<Tensor> alibi) {
  auto res = varlen_fwd_impl<Kernel::kSage>(q, k, v, cu_q, cu_k, max_q, max_k, rng, causal, scale, wl, wr, softcap,
                                            dropout_p, sinks, alibi);
  return std::make_tuple(std::get<0>(res), std::get<1>(res));
}

std::tuple<Tensor, Tensor, Tensor> flash_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                                                    int64_t max_k, std::optional<Tensor> rng, int64_t causal,
                                                    double scale, int64_t wl, int64_t wr, double softcap,
                                                    double dropout_p, std::optional<Tensor> sinks,
                                                    std::optional<Tensor> alibi) {
  auto res = varlen_fwd_impl<Kernel::kFlash>(q, k, v, cu_q, cu_k, max_q, max_k, rng, causal, scale, wl, wr,
                                             softcap, dropout_p, sinks, alibi);
  return std::make_tuple(std::get<0>(res), std::get<1>(res), *std::get<2>(res));
}

std::tuple<Tensor, Tensor, Tensor, Tensor> flash_varlen_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, std::optional<Tensor> grad_lse, const Tensor& cu_q, const Tensor& cu_k,
    int64_t max_q, int64_t max_k, std::optional<Tensor> rng, int64_t causal, double scale,
    int64_t wl, int64_t wr, double softcap, double dropout_p, bool deterministic, std::optional<Tensor> stats,
    std::optional<Tensor> sinks, std::optional<Tensor> alibi) {
  ab_attn_params p = make_varlen_params(q, k, v, cu_q, cu_k, max_q, max_k, rng, causal, scale, wl, wr,
                                        softcap, dropout_p);
  read_sinks_alibi(sinks, alibi, p);
  p.out = view_of(out, "out");
  p.lse = view_of(lse, "lse");
  read_stats(stats, p);
  p.dout = view_of(grad_out, "grad_out");
  if (grad_lse.has_value()) p.dlse = view_of(*grad_lse, "grad_lse");
  const int32_t dt = aoti_dtype(q.scalar_type());
  Tensor dq = empty_strided(q, sizes_of(q), grad_strides(q), dt);
  Tensor dk = empty_strided(k, sizes_of(k), grad_strides(k), dt);
  Tensor dv = empty_strided(v, sizes_of(v), grad_strides(v), dt);
  p.dq = view_of(dq, "dq");
  p.dk = view_of(dk, "dk");
  p.dv = view_of(dv, "dv");
  Tensor dsinks = alloc_dsinks(q, p);
  p.deterministic = deterministic;
  if (p.q.device == AB_DEVICE_CUDA) {
    Tensor cu_dev = cu_seqlens_on_device(q, cu_q, cu_k);
    const int32_t* base = static_cast<const int32_t*>(cu_dev.data_ptr());
    run_bwd(Kernel::kFlash, q, p, base, base + cu_q.size(0));
  } else {
    run_bwd(Kernel::kFlash, q, p, p.cu_seqlens_q, p.cu_seqlens_k);  // the emulator takes the host copies
  }
  return std::make_tuple(dq, dk, dv, dsinks);
}

Tensor dropout_mask(const Tensor& rng, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                    double dropout_p) {
  uint64_t seed = 0, offset = 0;
  const int64_t* rng_dev = nullptr;
  read_seed(rng, seed, offset, &rng_dev);
  if (B < 0 || H < 0 || Sq < 0 || Sk < 0) fail("dropout_mask sizes must be non-negative");
  std::vector<int64_t> shape{B, H, Sq, Sk};
  Tensor keep = empty_strided(rng, shape, contiguous_strides(shape), aoti_torch_dtype_bool());
  uint8_t* out = static_cast<uint8_t*>(keep.numel() ? keep.data_ptr() : nullptr);
  ab_error err{};
  const ab_cuda_api* emu = rng.is_cpu() ? ab_cuda_emulation() : nullptr;
  if (emu != nullptr) {  // the CUDA mask kernel, emulated
    ab_cpu_pool pool = torch_pool();
    check(emu->dropout_mask(seed, offset, nullptr, dropout_p, B, H, Sq, Sk, out, &pool, &err), err);
  } else if (rng.is_cpu()) {  // the mask lives where rng_state does
    ab_cpu_pool pool = torch_pool();
    check(ab_dropout_mask_cpu(seed, offset, dropout_p, B, H, Sq, Sk, out, &pool, &err), err);
  } else {
    const ab_cuda_api* api = cuda_api();
    const int32_t device = rng.get_device_index();
    torch::stable::accelerator::DeviceGuard guard(device);
    check(api->dropout_mask(seed, offset, rng_dev, dropout_p, B, H, Sq, Sk, out, current_cuda_stream(device), &err),
          err);
  }
  return keep;
}

// KV-cache attention: q (B, Sq, Hq, D), a dense or paged cache written in place when k and v are
// given (decode_cpu.h).  cache_seqlen stands for every row when cache_seqlens is None (-1: the whole
// cache).  out is (B, Sq, Hq, D) contiguous, lse (B, Hq, Sq) float32; the workspace (q in float32,
// the split partials) comes from torch's allocator for this call only.  CUDA tensors run the CUDA
// decode kernel (csrc/cuda/decode.cu), and so do CPU tensors under the CUDA emulation.
std::tuple<Tensor, Tensor> kvcache_fwd(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                       std::optional<Tensor> k, std::optional<Tensor> v,
                                       std::optional<Tensor> rotary_cos, std::optional<Tensor> rotary_sin,
                                       std::optional<Tensor> cache_seqlens, int64_t cache_seqlen,
                                       std::optional<Tensor> cache_batch_idx, std::optional<Tensor> cache_leftpad,
                                       std::optional<Tensor> block_table, std::optional<Tensor> alibi_slopes,
                                       double scale, bool causal, int64_t window_left, int64_t window_right,
                                       double softcap, bool rotary_interleaved, int64_t num_splits,
                                       std::optional<Tensor> sinks) {
  if (q.dim() != 4 || k_cache.dim() != 4)
    fail("q must be (B, Sq, Hq, D) and k_cache (B_cache, S_cache, Hkv, D) or (num_blocks, block_size, Hkv, D)");
  ab_kvcache_params p{};
  p.B = q.size(0);
  p.Sq = q.size(1);
  p.Hq = q.size(2);
  p.D = q.size(3);
  p.Hkv = k_cache.size(2);
  p.q = view_of(q, "q");
  p.k_cache = view_of(k_cache, "k_cache");
  p.v_cache = view_of(v_cache, "v_cache");
  const std::pair<const std::optional<Tensor>*, ab_tensor*> optional[] = {
      {&k, &p.k_new}, {&v, &p.v_new}, {&rotary_cos, &p.rotary_cos}, {&rotary_sin, &p.rotary_sin},
      {&cache_seqlens, &p.cache_seqlens}, {&cache_batch_idx, &p.cache_batch_idx},
      {&cache_leftpad, &p.cache_leftpad}, {&block_table, &p.block_table}, {&alibi_slopes, &p.alibi_slopes},
      {&sinks, &p.sinks}};
  const char* names[] = {"k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
                         "cache_leftpad", "block_table", "alibi_slopes", "sinks"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i)
    if (optional[i].first->has_value()) *optional[i].second = view_of(**optional[i].first, names[i]);
  p.cache_seqlen = cache_seqlen;
  p.scale = scale;
  p.softcap = softcap;
  p.causal = causal ? 1 : 0;
  p.window_left = window_left;
  p.window_right = window_right;
  p.rotary_interleaved = rotary_interleaved ? 1 : 0;
  p.num_splits = static_cast<int32_t>(num_splits < 0 ? -1 : num_splits > 1 << 20 ? 1 << 20 : num_splits);
  std::vector<int64_t> out_sizes{p.B, p.Sq, p.Hq, p.D};
  Tensor out = empty_strided(q, out_sizes, contiguous_strides(out_sizes), aoti_dtype(q.scalar_type()));
  std::vector<int64_t> lse_sizes{p.B, p.Hq, p.Sq};
  Tensor lse = empty_strided(q, lse_sizes, contiguous_strides(lse_sizes), aoti_torch_dtype_float32());
  p.out = view_of(out, "out");
  p.lse = view_of(lse, "lse");
  ab_cpu_pool pool = torch_pool();
  ab_error err{};
  ab_status status;
  const ab_cuda_api* emu = p.q.device == AB_DEVICE_CPU ? ab_cuda_emulation() : nullptr;
  if (emu != nullptr || p.q.device == AB_DEVICE_CUDA) {
    const ab_cuda_api* api = emu != nullptr ? emu : cuda_api();
    std::optional<torch::stable::accelerator::DeviceGuard> guard;
    void* stream = &pool;  // the emulator spreads its blocks over torch's threads
    if (emu == nullptr) {
      guard.emplace(p.q.device_index);
      stream = current_cuda_stream(p.q.device_index);
    }
    const size_t bytes = api->kvcache_workspace(&p);
    Tensor ws = empty_strided(q, {static_cast<int64_t>(bytes)}, {1}, aoti_torch_dtype_uint8());
    status = api->kvcache_fwd(&p, bytes ? ws.data_ptr() : nullptr, bytes, stream, &err);
  } else if (p.q.device == AB_DEVICE_CPU) {
    const size_t bytes = ab_kvcache_cpu_workspace_size(&p, pool.num_threads);
    Tensor ws = empty_strided(q, {static_cast<int64_t>(bytes)}, {1}, aoti_torch_dtype_uint8());
    status = ab_kvcache_cpu_fwd(&p, bytes ? ws.data_ptr() : nullptr, bytes, &pool, &err);
  } else {
    fail("kvcache_fwd has CPU and CUDA kernels only");
  }
  // a bad argument (a sequence length past the cache, a block that does not exist, ...) is tagged so
  // that attn_backends/_kvcache.py can raise it as a ValueError, like its own checks
  if (status == AB_ERR_INVALID) fail(std::string("invalid argument: ") + err.msg);
  check(status, err);
  return std::make_tuple(out, lse);
}

}  // namespace

extern "C" ab_shim_info ab_shim_info_get(void) {
  return ab_shim_info{static_cast<uint64_t>(TORCH_FEATURE_VERSION),
                      static_cast<uint64_t>(TORCH_ABI_VERSION)};
}

extern "C" ab_cpu_pool ab_shim_cpu_pool(void) { return torch_pool(); }

#define AB_DENSE_FWD_ARGS                                                                  \
  "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? rng_state, int causal, float scale, " \
  "int window_left, int window_right, float softcap, float dropout_p, Tensor? sinks=None, "        \
  "Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse)"
#define AB_DENSE_BWD_ARGS                                                                      \
  "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_lse, "      \
  "Tensor? attn_mask, Tensor? rng_state, int causal, float scale, int window_left, "               \
  "int window_right, float softcap, float dropout_p, bool mask_grad, bool deterministic=False, "     \
  "Tensor? stats=None, Tensor? sinks=None, Tensor? alibi_slopes=None) "                             \
  "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dmask, Tensor dsinks)"

STABLE_TORCH_LIBRARY(attn_backends, m) {
  m.def("math_fwd" AB_DENSE_FWD_ARGS);
  m.def("math_bwd" AB_DENSE_BWD_ARGS);
  m.def(
      "flash_fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? rng_state, int causal, float scale, "
      "int window_left, int window_right, float softcap, float dropout_p, Tensor? sinks=None, "
      "Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse, Tensor stats)");
  m.def("flash_bwd" AB_DENSE_BWD_ARGS);
  m.def(
      "flash_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, Tensor? rng_state, int causal, float scale, "
      "int window_left, int window_right, float softcap, float dropout_p, Tensor? sinks=None, "
      "Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse, Tensor stats)");
  m.def(
      "flash_varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? grad_lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, Tensor? rng_state, int causal, float scale, int window_left, "
      "int window_right, float softcap, float dropout_p, bool deterministic=False, Tensor? stats=None, "
      "Tensor? sinks=None, Tensor? alibi_slopes=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  m.def("sage_fwd" AB_DENSE_FWD_ARGS);
  m.def(
      "sage_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, Tensor? rng_state, int causal, float scale, "
      "int window_left, int window_right, float softcap, float dropout_p, Tensor? sinks=None, "
      "Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse)");
  m.def("dropout_mask(Tensor rng_state, int B, int H, int Sq, int Sk, float dropout_p) -> Tensor");
  m.def(
      "kvcache_fwd(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
      "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, int cache_seqlen, "
      "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, Tensor? alibi_slopes, "
      "float scale, bool causal, int window_left, int window_right, float softcap, "
      "bool rotary_interleaved, int num_splits, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
}

namespace {

// CPU and CUDA register the same functions: each dispatches on the tensors' device itself.
void impl_ops(torch::stable::detail::StableLibrary& m) {
  m.impl("math_fwd", TORCH_BOX(&dense_fwd<Kernel::kMath>));
  m.impl("math_bwd", TORCH_BOX(&dense_bwd<Kernel::kMath>));
  m.impl("flash_fwd", TORCH_BOX(&flash_fwd));
  m.impl("flash_bwd", TORCH_BOX(&dense_bwd<Kernel::kFlash>));
  m.impl("flash_varlen_fwd", TORCH_BOX(&flash_varlen_fwd));
  m.impl("flash_varlen_bwd", TORCH_BOX(&flash_varlen_bwd));
  m.impl("sage_fwd", TORCH_BOX(&dense_fwd<Kernel::kSage>));
  m.impl("sage_varlen_fwd", TORCH_BOX(&sage_varlen_fwd));
  m.impl("dropout_mask", TORCH_BOX(&dropout_mask));
  m.impl("kvcache_fwd", TORCH_BOX(&kvcache_fwd));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(attn_backends, CPU, m) { impl_ops(m); }

STABLE_TORCH_LIBRARY_IMPL(attn_backends, CUDA, m) { impl_ops(m); }
