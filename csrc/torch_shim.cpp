// torch_shim.cpp -- the shim's common part (torch_shim.h says how its three files divide the work):
// the op schemas, tensor -> view, allocation, the one parameter fill of every op.
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
//                                (dq, dk, dv, dsinks).  cu_seqlens_q/_k are the host copies (the
//                                checks and the grid read them); on CUDA the optional
//                                cu_seqlens_q_device/_k_device (the caller's tensors, int32 on q's
//                                device) are what the kernels read, else the shim copies the host ones
//                                over; the CPU kernels ignore them
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
// launchers of libattn_backends_cuda_emu.so instead of the CPU kernels (torch_shim_cpu.cpp): same
// calls, with torch's thread pool (an ab_cpu_pool*) where the stream would go.
#include "torch_shim.h"

namespace ab_shim {

namespace {

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

int pool_parallel_for(int64_t begin, int64_t end, int64_t grain, ab_range_fn fn, void* ctx) {
  return torch_parallel_for(begin, end, grain, fn, ctx) == AOTI_TORCH_SUCCESS ? 0 : -1;
}

}  // namespace

void fail(const std::string& msg) { throw std::runtime_error("attn_backends: " + msg); }

void check(ab_status status, const ab_error& err) {
  if (status != AB_OK) fail(err.msg);
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

ab_cpu_pool torch_pool() {
  uint32_t n = 1;
  if (torch_get_num_threads(&n) != AOTI_TORCH_SUCCESS || n == 0) n = 1;
  return ab_cpu_pool{pool_parallel_for, static_cast<int>(n)};
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

// dsinks (Hq,) in lse's dtype when the call has sinks, else an empty tensor.
Tensor alloc_dsinks(const Tensor& q, ab_attn_params& p) {
  std::vector<int64_t> sizes{p.sinks.ndim ? p.Hq : 0};
  Tensor dsinks = empty_strided(q, sizes, {1}, lse_dtype(q));
  if (p.sinks.ndim) p.dsinks = view_of(dsinks, "grad_sinks");
  return dsinks;
}

namespace {

// The optional sinks and ALiBi slopes (checked with the rest in ab_attn_params_check).
void read_sinks_alibi(const std::optional<Tensor>& sinks, const std::optional<Tensor>& alibi, ab_attn_params& p) {
  if (sinks.has_value()) p.sinks = view_of(*sinks, "sinks");
  if (alibi.has_value()) p.alibi = view_of(*alibi, "alibi_slopes");
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

}  // namespace

ab_attn_params make_params(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                           const Packed* packed, int64_t max_q, int64_t max_k, const std::optional<Tensor>& rng,
                           int64_t causal, double scale, int64_t wl, int64_t wr, double softcap, double dropout_p,
                           const std::optional<Tensor>& sinks, const std::optional<Tensor>& alibi) {
  ab_attn_params p{};
  if (packed) {
    if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3)
      fail("varlen q, k and v must be 3-D: (total_q, Hq, D), (total_k, Hkv, D), (total_k, Hkv, Dv)");
    const Tensor& cu_q = packed->cu_q;
    const Tensor& cu_k = packed->cu_k;
    for (const Tensor* cu : {&cu_q, &cu_k})
      if (!cu->is_cpu() || cu->scalar_type() != ScalarType::Int || cu->dim() != 1 || cu->size(0) < 1 ||
          cu->stride(0) != 1)
        fail("cu_seqlens must be contiguous CPU int32 tensors of shape (B + 1,)");
    if (cu_q.size(0) != cu_k.size(0)) fail("cu_seqlens_q and cu_seqlens_k must have the same length");
    p.B = cu_q.size(0) - 1;
    p.Hq = q.size(1);
    p.D = q.size(2);
    p.Hkv = k.size(1);
    p.Dv = v.size(2);
    p.Sq = max_q;
    p.Sk = max_k;
    p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.data_ptr());
    p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.data_ptr());
  } else {
    if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
      fail("q, k and v must be 4-D: (B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv)");
    p.B = q.size(0);
    p.Hq = q.size(1);
    p.Sq = q.size(2);
    p.D = q.size(3);
    p.Hkv = k.size(1);
    p.Sk = k.size(2);
    p.Dv = v.size(3);
  }
  p.q = view_of(q, "q");
  p.k = view_of(k, "k");
  p.v = view_of(v, "v");
  if (mask.has_value()) p.mask = mask_view(*mask, p.B, p.Hq, p.Sq, p.Sk);
  read_sinks_alibi(sinks, alibi, p);
  p.causal = static_cast<ab_causal>(causal);
  p.scale = scale;
  p.window_left = wl;
  p.window_right = wr;
  p.softcap = softcap;
  p.dropout_p = dropout_p;
  read_rng(rng, dropout_p, p);
  return p;
}

ab_kvcache_params make_kvcache_params(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                      const std::optional<Tensor>* optional, int64_t cache_seqlen, double scale,
                                      bool causal, int64_t window_left, int64_t window_right, double softcap,
                                      bool rotary_interleaved, int64_t num_splits, Tensor& out, Tensor& lse) {
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
  // in the op's order: k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
  // block_table, alibi_slopes, sinks
  ab_tensor* const views[] = {&p.k_new, &p.v_new, &p.rotary_cos, &p.rotary_sin, &p.cache_seqlens,
                              &p.cache_batch_idx, &p.cache_leftpad, &p.block_table, &p.alibi_slopes, &p.sinks};
  const char* names[] = {"k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
                         "cache_leftpad", "block_table", "alibi_slopes", "sinks"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i)
    if (optional[i].has_value()) *views[i] = view_of(*optional[i], names[i]);
  p.cache_seqlen = cache_seqlen;
  p.scale = scale;
  p.softcap = softcap;
  p.causal = causal ? 1 : 0;
  p.window_left = window_left;
  p.window_right = window_right;
  p.rotary_interleaved = rotary_interleaved ? 1 : 0;
  p.num_splits = static_cast<int32_t>(num_splits < 0 ? -1 : num_splits > 1 << 20 ? 1 << 20 : num_splits);
  std::vector<int64_t> out_sizes{p.B, p.Sq, p.Hq, p.D};
  out = empty_strided(q, out_sizes, contiguous_strides(out_sizes), aoti_dtype(q.scalar_type()));
  std::vector<int64_t> lse_sizes{p.B, p.Hq, p.Sq};
  lse = empty_strided(q, lse_sizes, contiguous_strides(lse_sizes), aoti_torch_dtype_float32());
  p.out = view_of(out, "out");
  p.lse = view_of(lse, "lse");
  return p;
}

const char* kernel_name(Kernel k) {
  return k == Kernel::kMath ? "math" : k == Kernel::kFlash ? "flash" : "sage";
}

Tensor workspace(const Tensor& like, size_t bytes) {
  return empty_strided(like, {static_cast<int64_t>(bytes)}, {1}, aoti_torch_dtype_uint8());
}

}  // namespace ab_shim

extern "C" ab_shim_info ab_shim_info_get(void) {
  return ab_shim_info{static_cast<uint64_t>(TORCH_FEATURE_VERSION),
                      static_cast<uint64_t>(TORCH_ABI_VERSION)};
}

extern "C" ab_cpu_pool ab_shim_cpu_pool(void) { return ab_shim::torch_pool(); }

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

/* max_seqlen of the packed ops and kvcache_fwd's cache_seqlen are SymInt: the kernels read the value (a
 * plain int here), but under torch.compile(dynamic=True) an int argument specialized the graph on each
 * distinct value (one recompile per max_seqlen, or per decode step with an int cache_seqlens;
 * FailOnRecompileLimitHit under fullgraph=True after eight); the fake kernels never read it. */
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
      "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? rng_state, int causal, float scale, "
      "int window_left, int window_right, float softcap, float dropout_p, Tensor? sinks=None, "
      "Tensor? alibi_slopes=None, Tensor? cu_seqlens_q_device=None, Tensor? cu_seqlens_k_device=None) "
      "-> (Tensor out, Tensor lse, Tensor stats)");
  m.def(
      "flash_varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? grad_lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, Tensor? rng_state, int causal, float scale, int window_left, "
      "int window_right, float softcap, float dropout_p, bool deterministic=False, Tensor? stats=None, "
      "Tensor? sinks=None, Tensor? alibi_slopes=None, Tensor? cu_seqlens_q_device=None, "
      "Tensor? cu_seqlens_k_device=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  m.def("sage_fwd" AB_DENSE_FWD_ARGS);
  m.def(
      "sage_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? rng_state, int causal, float scale, "
      "int window_left, int window_right, float softcap, float dropout_p, Tensor? sinks=None, "
      "Tensor? alibi_slopes=None, Tensor? cu_seqlens_q_device=None, Tensor? cu_seqlens_k_device=None) "
      "-> (Tensor out, Tensor lse)");
  m.def("dropout_mask(Tensor rng_state, int B, int H, int Sq, int Sk, float dropout_p) -> Tensor");
  m.def(
      "kvcache_fwd(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
      "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, SymInt cache_seqlen, "
      "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, Tensor? alibi_slopes, "
      "float scale, bool causal, int window_left, int window_right, float softcap, "
      "bool rotary_interleaved, int num_splits, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
}
