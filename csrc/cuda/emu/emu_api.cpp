// emu_api.cpp -- the launcher table of libattn_backends_cuda_emu.so: the real launchers (the same
// source as libattn_backends_cuda.so, compiled by g++ against the emulator), each wrapped so that it
// runs on copies of the caller's CPU tensors in the emulator's guarded device memory.
//
// The shim (csrc/torch_shim.cpp) calls this table for CPU tensors when ATTN_BACKENDS_CUDA_EMULATE is
// on, with an ab_cpu_pool* where a stream would go: the blocks of a launch are spread over it.  A
// wrapper copies every operand into device memory (emu_runtime.h: ending against a guard page, the
// start's alignment kept modulo 16), marks the views as CUDA, runs the launcher, and on success
// copies the outputs back.  Outputs and workspaces start as 0xff bytes (NaN), as uninitialised
// device memory would hold garbage: an element a kernel forgets to write shows up.  An operand the
// CUDA path would not hand the kernels in its own layout (the Python layer's cuda_layout copies it
// there; here the CPU tensor arrives as it is) is staged as a contiguous copy.
#include <string.h>

#include <string>
#include <initializer_list>
#include <vector>

#include "../../cpu/decode_cpu.h"
#include "../ab_cuda_internal.h"
#include "emu_runtime.h"

namespace {

// kInOut: read and written in place (the KV caches): copied in, and back element by element, so
// that the bytes between its elements (another tensor's, as in an interleaved K/V buffer) are not
// overwritten with the stale copy.
enum class Role { kIn, kOut, kInOut };

struct Staged {
  ab_tensor* view;  // the device view handed to the launcher
  ab_tensor host;   // the caller's tensor
  unsigned char* dev;
  bool packed;      // staged contiguous (the host layout is not one the kernels read)
  bool in_place;    // Role::kInOut
};

// Elements from the first to one past the last, for non-negative strides.
int64_t span_of(const ab_tensor& t) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.sizes[d] == 0) return 0;
    last += (t.sizes[d] - 1) * t.strides[d];
  }
  return last + 1;
}

int64_t numel_of(const ab_tensor& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.sizes[d];
  return n;
}

// Whether the CUDA tensor-core kernels read t in place: rows of 16 bytes (ops.cuda_layout's rule).
bool rows16(const ab_tensor& t) {
  const int last = t.ndim - 1;
  if (t.sizes[last] > 1 && t.strides[last] != 1) return false;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int d = 0; d < last; ++d)
    if (t.sizes[d] > 1 && t.strides[d] % 8 != 0) return false;
  return true;
}

// Visits every element of t in row-major index order: fn(element offset in t, linear index).
template <typename F> void for_each_element(const ab_tensor& t, F fn) {
  int64_t idx[AB_MAX_DIMS] = {0};
  const int64_t n = numel_of(t);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.strides[d];
    fn(off, i);
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (++idx[d] < t.sizes[d]) break;
      idx[d] = 0;
    }
  }
}

class Call {
 public:
  explicit Call(void* stream) { ab_emu::session_begin(static_cast<const ab_cpu_pool*>(stream)); }
  ~Call() { ab_emu::session_end(); }

  // Stages t (a view inside the params) in device memory; kernels_read_rows: flash/sage operands.
  bool tensor(ab_tensor& t, const char* name, Role role, bool kernels_read_rows, ab_error* err) {
    if (t.ndim == 0) return true;
    const ab_tensor host = t;
    t.device = AB_DEVICE_CUDA;
    t.device_index = 0;
    if (host.data == nullptr || numel_of(host) == 0) return true;
    const size_t es = ab_dtype_size(host.dtype);
    const bool pack = kernels_read_rows && !rows16(host);
    const int64_t n = pack ? numel_of(host) : span_of(host);
    const size_t rem = pack ? 0 : reinterpret_cast<uintptr_t>(host.data) % 16;
    const bool copy_in = role != Role::kOut;
    unsigned char* dev = ab_emu::device_alloc(name, (size_t)n * es, 16, rem, !copy_in, es);
    if (dev == nullptr) return ab_error_set(err, AB_ERR_NOMEM, "CUDA emulator: no memory for %s", name), false;
    if (pack) {
      int64_t st = 1;
      for (int d = t.ndim - 1; d >= 0; --d) {
        t.strides[d] = st;
        st *= t.sizes[d];
      }
      if (copy_in)
        for_each_element(host, [&](int64_t off, int64_t i) {
          memcpy(dev + i * es, static_cast<const unsigned char*>(host.data) + off * es, es);
        });
    } else if (copy_in) {
      memcpy(dev, host.data, (size_t)n * es);
    }
    t.data = dev;
    if (role != Role::kIn) outs_.push_back(Staged{&t, host, dev, pack, role == Role::kInOut});
    return true;
  }

  // Raw device memory for n bytes copied from src (NULL: poisoned, a workspace).
  unsigned char* raw(const char* name, const void* src, size_t n, size_t align, ab_error* err) {
    unsigned char* dev = ab_emu::device_alloc(name, n, align, 0, src == nullptr);
    if (dev == nullptr && n > 0) ab_error_set(err, AB_ERR_NOMEM, "CUDA emulator: no memory for %s", name);
    if (dev != nullptr && src != nullptr) memcpy(dev, src, n);
    return dev;
  }

  // The launcher's status, replaced by the emulator's account of a failure (a fault names the
  // kernel, thread and offset; the launcher only saw the CUDA error); outputs copied back on success.
  ab_status finish(ab_status st, ab_error* err, bool copy_back = true) {
    const std::string why = ab_emu::session_failure();
    if (!why.empty()) return ab_error_set(err, AB_ERR_CUDA, "%s", why.c_str());
    if (st != AB_OK || !copy_back) return st;
    for (const Staged& o : outs_) {
      const size_t es = ab_dtype_size(o.host.dtype);
      if (o.packed)
        for_each_element(o.host, [&](int64_t off, int64_t i) {
          memcpy(static_cast<unsigned char*>(o.host.data) + off * es, o.dev + i * es, es);
        });
      else if (o.in_place)  // the same layout on both sides
        for_each_element(o.host, [&](int64_t off, int64_t) {
          memcpy(static_cast<unsigned char*>(o.host.data) + off * es, o.dev + off * es, es);
        });
      else
        memcpy(o.host.data, o.dev, (size_t)span_of(o.host) * es);
    }
    return AB_OK;
  }

  // The forward's and backward's operands of p (outputs by role).
  bool params(ab_attn_params& p, bool backward, bool rows, ab_error* err) {
    const Role fwd_out = backward ? Role::kIn : Role::kOut;
    return tensor(p.q, "q", Role::kIn, rows, err) && tensor(p.k, "k", Role::kIn, rows, err) &&
           tensor(p.v, "v", Role::kIn, rows, err) && tensor(p.mask, "attn_mask", Role::kIn, false, err) &&
           tensor(p.out, "out", fwd_out, rows, err) && tensor(p.lse, "lse", fwd_out, false, err) &&
           tensor(p.dout, "grad_out", Role::kIn, rows, err) && tensor(p.dlse, "grad_lse", Role::kIn, false, err) &&
           tensor(p.dq, "dq", Role::kOut, rows, err) && tensor(p.dk, "dk", Role::kOut, rows, err) &&
           tensor(p.dv, "dv", Role::kOut, rows, err) && tensor(p.dmask, "grad_mask", Role::kOut, false, err) &&
           tensor(p.sinks, "sinks", Role::kIn, false, err) && tensor(p.alibi, "alibi_slopes", Role::kIn, false, err) &&
           tensor(p.dsinks, "grad_sinks", Role::kOut, false, err);
  }

  // cu_seqlens of a packed call, as the kernels read them (B + 1 int32 each).
  bool seqlens(const ab_attn_params& p, const int32_t*& cu_q, const int32_t*& cu_k, ab_error* err) {
    if (p.cu_seqlens_q == nullptr || cu_q == nullptr || cu_k == nullptr) return true;
    const size_t n = (size_t)(p.B + 1) * sizeof(int32_t);
    cu_q = reinterpret_cast<const int32_t*>(raw("cu_seqlens_q", cu_q, n, 16, err));
    cu_k = reinterpret_cast<const int32_t*>(raw("cu_seqlens_k", cu_k, n, 16, err));
    return cu_q != nullptr && cu_k != nullptr;
  }

 private:
  std::vector<Staged> outs_;
};

const ab_cuda_api& real() { return *ab_cuda_api_get(); }

ab_status emu_device_capability(int device, int* cc, ab_error* err) {
  if (device != 0) return ab_error_set(err, AB_ERR_INVALID, "the CUDA emulator has one device, 0");
  *cc = ab_emu::device_cc();
  return AB_OK;
}

int emu_supports_cc(int cc) { return cc >= 80; }

// The emulated device's opt-in shared memory (its compute capability decides it, emu_device.cpp).
ab_status emu_device_smem_optin(int device, int* bytes, ab_error* err) {
  if (device != 0) return ab_error_set(err, AB_ERR_INVALID, "the CUDA emulator has one device, 0");
  return real().device_smem_optin(0, bytes, err);
}

ab_status emu_math_fwd(const ab_attn_params* p, void* stream, ab_error* err) {
  Call call(stream);
  ab_attn_params d = *p;
  if (!call.params(d, false, false, err)) return AB_ERR_NOMEM;
  return call.finish(real().math_fwd(&d, nullptr, err), err);
}

ab_status emu_flash_fwd(const ab_attn_params* p, const int32_t* cu_q, const int32_t* cu_k, void* stream,
                        ab_error* err) {
  Call call(stream);
  ab_attn_params d = *p;
  if (!call.params(d, false, true, err) || !call.seqlens(d, cu_q, cu_k, err)) return AB_ERR_NOMEM;
  return call.finish(real().flash_fwd(&d, cu_q, cu_k, nullptr, err), err);
}

ab_status emu_sage_fwd(const ab_attn_params* p, const int32_t* cu_q, const int32_t* cu_k, void* workspace,
                       size_t* workspace_bytes, void* stream, ab_error* err) {
  Call call(stream);
  ab_attn_params d = *p;
  if (!call.params(d, false, true, err) || !call.seqlens(d, cu_q, cu_k, err)) return AB_ERR_NOMEM;
  if (workspace == nullptr)  // the size query: nothing runs, nothing to copy back
    return call.finish(real().sage_fwd(&d, cu_q, cu_k, nullptr, workspace_bytes, nullptr, err), err, false);
  // the caller's workspace is host memory: the kernels get a device one of the same size
  void* ws = call.raw("workspace", nullptr, *workspace_bytes, 256, err);
  if (ws == nullptr && *workspace_bytes > 0) return AB_ERR_NOMEM;
  return call.finish(real().sage_fwd(&d, cu_q, cu_k, ws, workspace_bytes, nullptr, err), err);
}

size_t emu_math_bwd_workspace(const ab_attn_params* p) { return real().math_bwd_workspace(p); }
size_t emu_flash_bwd_workspace(const ab_attn_params* p) { return real().flash_bwd_workspace(p); }

ab_status emu_math_bwd(const ab_attn_params* p, void* workspace, size_t workspace_bytes, void* stream,
                       ab_error* err) {
  Call call(stream);
  ab_attn_params d = *p;
  if (!call.params(d, true, false, err)) return AB_ERR_NOMEM;
  void* ws = workspace ? call.raw("workspace", nullptr, workspace_bytes, 256, err) : nullptr;
  if (workspace && ws == nullptr && workspace_bytes > 0) return AB_ERR_NOMEM;
  return call.finish(real().math_bwd(&d, ws, workspace_bytes, nullptr, err), err);
}

ab_status emu_flash_bwd(const ab_attn_params* p, const int32_t* cu_q, const int32_t* cu_k, void* workspace,
                        size_t workspace_bytes, void* stream, ab_error* err) {
  Call call(stream);
  ab_attn_params d = *p;
  if (!call.params(d, true, true, err) || !call.seqlens(d, cu_q, cu_k, err)) return AB_ERR_NOMEM;
  void* ws = workspace ? call.raw("workspace", nullptr, workspace_bytes, 256, err) : nullptr;
  if (workspace && ws == nullptr && workspace_bytes > 0) return AB_ERR_NOMEM;
  return call.finish(real().flash_bwd(&d, cu_q, cu_k, ws, workspace_bytes, nullptr, err), err);
}

ab_status emu_dropout_mask(uint64_t seed, uint64_t offset, const int64_t* rng_dev, double p, int64_t B, int64_t H,
                           int64_t Sq, int64_t Sk, uint8_t* keep, void* stream, ab_error* err) {
  Call call(stream);
  const int64_t n = B > 0 && H > 0 && Sq > 0 && Sk > 0 ? B * H * Sq * Sk : 0;
  ab_tensor t = {};
  t.data = keep;
  t.dtype = AB_DTYPE_U8;
  t.ndim = 1;
  t.sizes[0] = n;
  t.strides[0] = 1;
  if (rng_dev != nullptr) rng_dev = reinterpret_cast<const int64_t*>(call.raw("rng_state", rng_dev, 16, 16, err));
  if (!call.tensor(t, "keep", Role::kOut, false, err)) return AB_ERR_NOMEM;
  return call.finish(
      real().dropout_mask(seed, offset, rng_dev, p, B, H, Sq, Sk, static_cast<uint8_t*>(t.data), nullptr, err), err);
}

size_t emu_kvcache_workspace(const ab_kvcache_params* p) {
  Call call(nullptr);  // the launcher asks the emulated device for its SM count
  ab_kvcache_params d = *p;  // the launcher reads no data here, only shapes, layouts and devices
  for (ab_tensor* t : {&d.q, &d.k_cache, &d.v_cache, &d.k_new, &d.v_new, &d.rotary_cos, &d.rotary_sin,
                       &d.cache_seqlens, &d.cache_batch_idx, &d.cache_leftpad, &d.block_table, &d.alibi_slopes,
                       &d.sinks, &d.out, &d.lse})
    if (t->ndim) t->device = AB_DEVICE_CUDA;
  return real().kvcache_workspace(&d);
}

ab_status emu_kvcache_fwd(const ab_kvcache_params* p, void* workspace, size_t workspace_bytes, void* stream,
                          ab_error* err) {
  Call call(stream);
  ab_kvcache_params d = *p;
  const struct {
    ab_tensor* t;
    const char* name;
    Role role;
  } operands[] = {{&d.q, "q", Role::kIn}, {&d.k_cache, "k_cache", Role::kInOut}, {&d.v_cache, "v_cache", Role::kInOut},
                  {&d.k_new, "k", Role::kIn}, {&d.v_new, "v", Role::kIn}, {&d.rotary_cos, "rotary_cos", Role::kIn},
                  {&d.rotary_sin, "rotary_sin", Role::kIn}, {&d.cache_seqlens, "cache_seqlens", Role::kIn},
                  {&d.cache_batch_idx, "cache_batch_idx", Role::kIn}, {&d.cache_leftpad, "cache_leftpad", Role::kIn},
                  {&d.block_table, "block_table", Role::kIn}, {&d.alibi_slopes, "alibi_slopes", Role::kIn},
                  {&d.sinks, "sinks", Role::kIn}, {&d.out, "out", Role::kOut}, {&d.lse, "lse", Role::kOut}};
  for (const auto& o : operands)
    if (!call.tensor(*o.t, o.name, o.role, false, err)) return AB_ERR_NOMEM;
  void* ws = workspace ? call.raw("workspace", nullptr, workspace_bytes, 256, err) : nullptr;
  if (workspace && ws == nullptr && workspace_bytes > 0) return AB_ERR_NOMEM;
  return call.finish(real().kvcache_fwd(&d, ws, workspace_bytes, nullptr, err), err);
}

const ab_cuda_api kEmuApi = {
    AB_CUDA_API_VERSION,     "emulated",           emu_device_capability,  emu_supports_cc,
    emu_math_fwd,            emu_flash_fwd,        emu_sage_fwd,           emu_math_bwd_workspace,
    emu_flash_bwd_workspace, emu_math_bwd,         emu_flash_bwd,          emu_dropout_mask,
    emu_kvcache_workspace,   emu_kvcache_fwd,
    emu_device_smem_optin,
};

std::string g_log;  // the last launch_log() answer, kept alive for the caller

}  // namespace

// The table the core loads (csrc/ab_cuda_loader.c) when ATTN_BACKENDS_CUDA_EMULATE is on.
extern "C" AB_EXPORT const ab_cuda_api* ab_cuda_emu_api_get(void) { return &kEmuApi; }

// For tests (ctypes): the kernels launched since the last reset, "label\tcount" lines, and the blocks
// they ran, "label\tblocks" lines (the decode launcher's split counts); the emulated
// compute capability (80, 86, 89, 90: the opt-in shared memory the launchers check); the seed of the
// warp order.
extern "C" AB_EXPORT const char* ab_cuda_emu_launch_log(void) {
  g_log = ab_emu::launch_log();
  return g_log.c_str();
}
extern "C" AB_EXPORT const char* ab_cuda_emu_launch_blocks(void) {
  g_log = ab_emu::launch_blocks();
  return g_log.c_str();
}
extern "C" AB_EXPORT void ab_cuda_emu_reset_launch_log(void) { ab_emu::reset_launch_log(); }
extern "C" AB_EXPORT void ab_cuda_emu_set_device_cc(int cc) { ab_emu::set_device_cc(cc); }
extern "C" AB_EXPORT int ab_cuda_emu_device_cc(void) { return ab_emu::device_cc(); }
extern "C" AB_EXPORT void ab_cuda_emu_set_seed(uint64_t seed) { ab_emu::set_seed(seed); }
