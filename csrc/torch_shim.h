// torch_shim.h -- what the three files of the torch shim share (the only files that include torch
// headers): torch_shim.cpp (the schemas, tensor -> view, allocation, the one parameter fill),
// torch_shim_cpu.cpp (the CPU dispatch key: the C core's kernels, or the emulated CUDA launchers) and
// torch_shim_cuda.cpp (the CUDA dispatch key: the CUDA library's launchers on torch's stream).
//
// The ops' bodies are written once, below, as templates over a device: a struct of static functions
// that runs a filled ab_attn_params (or ab_kvcache_params) on that device.  Each device file
// instantiates them with its own struct and registers them for its own dispatch key
// (register_ops<Device>), so no body asks which device it is on.
//
// What the shim must not do: compute anything.  Every kernel lives in the C core or the CUDA library.
#ifndef AB_TORCH_SHIM_H
#define AB_TORCH_SHIM_H

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

namespace ab_shim {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// ---- common helpers (torch_shim.cpp) -------------------------------------------------------------

[[noreturn]] void fail(const std::string& msg);
void check(ab_status status, const ab_error& err);
ab_tensor view_of(const Tensor& t, const char* name);
// The mask as a (B, Hq, Sq, Sk) view: dims aligned to the right, size-1 dims broadcast with stride 0.
ab_tensor mask_view(const Tensor& m, int64_t B, int64_t Hq, int64_t Sq, int64_t Sk);
// torch's intra-op pool as the core's ab_cpu_pool (torch.set_num_threads is honoured).
ab_cpu_pool torch_pool();
// The (seed, offset) pair of rng_state: read here from a CPU tensor, left in device memory (*rng_dev)
// for a CUDA one.
void read_seed(const Tensor& r, uint64_t& seed, uint64_t& offset, const int64_t** rng_dev);
// Allocation straight to at::empty_strided through the stable C shim, on like's device.
Tensor empty_strided(const Tensor& like, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                     int32_t dtype);
Tensor workspace(const Tensor& like, size_t bytes);  // uint8 (bytes,) on like's device
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes);
std::vector<int64_t> grad_strides(const Tensor& t);
std::vector<int64_t> sizes_of(const Tensor& t);
int32_t aoti_dtype(ScalarType t);
int32_t lse_dtype(const Tensor& q);
Tensor alloc_dsinks(const Tensor& q, ab_attn_params& p);

// The call's packed layout, when it has one: cu_seqlens (B + 1,) int32 on the CPU, as the op took them,
// and the caller's own copies on the device when given (cu_seqlens_q_device, _k_device: on CUDA the
// kernels read those, and nothing is copied per call).
struct Packed {
  const Tensor& cu_q;
  const Tensor& cu_k;
  const std::optional<Tensor>& dev_q;
  const std::optional<Tensor>& dev_k;
};

// The one parameter fill of every dense and packed forward and backward: shapes, the q/k/v/mask
// views, sinks and ALiBi, the options and the dropout stream.  Dense: q (B, Hq, Sq, D), k (B, Hkv, Sk,
// D), v (B, Hkv, Sk, Dv).  Packed (packed given): q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), Sq and
// Sk the longest sequences.
ab_attn_params make_params(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                           const Packed* packed, int64_t max_q, int64_t max_k, const std::optional<Tensor>& rng,
                           int64_t causal, double scale, int64_t wl, int64_t wr, double softcap, double dropout_p,
                           const std::optional<Tensor>& sinks, const std::optional<Tensor>& alibi);
// The kvcache_fwd op's views and options (decode_cpu.h), out and lse allocated.
ab_kvcache_params make_kvcache_params(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                      const std::optional<Tensor>* optional, int64_t cache_seqlen, double scale,
                                      bool causal, int64_t window_left, int64_t window_right, double softcap,
                                      bool rotary_interleaved, int64_t num_splits, Tensor& out, Tensor& lse);

enum class Kernel { kMath, kFlash, kSage };
const char* kernel_name(Kernel k);

// ---- the ops, once for every device --------------------------------------------------------------
// Device provides:
//   static void fwd(Kernel, const Tensor& q, ab_attn_params&, const Packed*);
//   static void bwd(Kernel, const Tensor& q, ab_attn_params&, const Packed*);
//   static bool stats_kept(const ab_attn_params&);  // flash's forward here writes p.stats
//   static constexpr bool kReadsStats;               // a backward's stats are handed to the kernel
//   static void dropout_mask(const Tensor& rng, uint64_t seed, uint64_t offset, const int64_t* rng_dev,
//                            double p, int64_t B, int64_t H, int64_t Sq, int64_t Sk, uint8_t* out);
//   static ab_status kvcache(const Tensor& q, const ab_kvcache_params&, ab_error&);

// flash's stats (2, ..., lse's shape): each row's max and log sum, which the CPU forward writes and
// the CPU backward reads (ab_core.h).  Where the flash kernel does not keep them (CUDA, and CPU
// tensors under the CUDA emulation) they are filled as lse = max + 0, whose values those backwards do
// not read (the CUDA flash backward reads that they are given), so that stats are always written,
// whichever backward later reads them.
template <class Device>
Tensor alloc_stats(const Tensor& q, const Tensor& lse, ab_attn_params& p) {
  std::vector<int64_t> sizes{2};
  for (int64_t d = 0; d < lse.dim(); ++d) sizes.push_back(lse.size(d));
  Tensor stats = empty_strided(q, sizes, contiguous_strides(sizes), lse_dtype(q));
  if (Device::stats_kept(p)) p.stats = view_of(stats, "stats");
  return stats;
}

inline void fill_stats_from_lse(Tensor& stats, const Tensor& lse) {
  Tensor m = torch::stable::select(stats, 0, 0), ls = torch::stable::select(stats, 0, 1);
  torch::stable::copy_(m, lse);
  torch::stable::zero_(ls);
}

// A forward, dense or packed.  Dense: out (B, Hq, Sq, Dv) stored (B, Sq, Hq, Dv) (so the usual
// out.transpose(1, 2).reshape(B, Sq, Hq * Dv) costs no copy), lse (B, Hq, Sq).  Packed: out (Tq, Hq, Dv),
// lse (Hq, Tq), as flash-attn's varlen functions.  flash also returns its stats.
template <class Device, Kernel K>
std::tuple<Tensor, Tensor, std::optional<Tensor>> fwd_impl(const Tensor& q, const Tensor& k, const Tensor& v,
                                                           const std::optional<Tensor>& mask, const Packed* packed,
                                                           int64_t max_q, int64_t max_k,
                                                           const std::optional<Tensor>& rng, int64_t causal,
                                                           double scale, int64_t wl, int64_t wr, double softcap,
                                                           double dropout_p, const std::optional<Tensor>& sinks,
                                                           const std::optional<Tensor>& alibi) {
  ab_attn_params p = make_params(q, k, v, mask, packed, max_q, max_k, rng, causal, scale, wl, wr, softcap,
                                 dropout_p, sinks, alibi);
  std::vector<int64_t> out_sizes, out_strides, lse_sizes;
  if (packed) {
    out_sizes = {q.size(0), p.Hq, p.Dv};
    out_strides = contiguous_strides(out_sizes);
    lse_sizes = {p.Hq, q.size(0)};
  } else {
    out_sizes = {p.B, p.Hq, p.Sq, p.Dv};
    std::vector<int64_t> phys = contiguous_strides({p.B, p.Sq, p.Hq, p.Dv});
    out_strides = {phys[0], phys[2], phys[1], phys[3]};
    lse_sizes = {p.B, p.Hq, p.Sq};
  }
  Tensor out = empty_strided(q, out_sizes, out_strides, aoti_dtype(q.scalar_type()));
  Tensor lse = empty_strided(q, lse_sizes, contiguous_strides(lse_sizes), lse_dtype(q));
  p.out = view_of(out, "out");
  p.lse = view_of(lse, "lse");
  std::optional<Tensor> stats;
  if constexpr (K == Kernel::kFlash) stats = alloc_stats<Device>(q, lse, p);
  Device::fwd(K, q, p, packed);
  if (stats.has_value() && p.stats.ndim == 0) fill_stats_from_lse(*stats, lse);
  return std::make_tuple(out, lse, stats);
}

template <class Device, Kernel K>
std::tuple<Tensor, Tensor> dense_fwd(const Tensor& q, const Tensor& k, const Tensor& v, std::optional<Tensor> mask,
                                     std::optional<Tensor> rng, int64_t causal, double scale, int64_t window_left,
                                     int64_t window_right, double softcap, double dropout_p,
                                     std::optional<Tensor> sinks, std::optional<Tensor> alibi) {
  auto res = fwd_impl<Device, K>(q, k, v, mask, nullptr, 0, 0, rng, causal, scale, window_left, window_right, softcap,
                                 dropout_p, sinks, alibi);
  return std::make_tuple(std::get<0>(res), std::get<1>(res));
}

template <class Device>
std::tuple<Tensor, Tensor, Tensor> flash_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                             std::optional<Tensor> mask, std::optional<Tensor> rng, int64_t causal,
                                             double scale, int64_t window_left, int64_t window_right, double softcap,
                                             double dropout_p, std::optional<Tensor> sinks,
                                             std::optional<Tensor> alibi) {
  auto res = fwd_impl<Device, Kernel::kFlash>(q, k, v, mask, nullptr, 0, 0, rng, causal, scale, window_left,
                                              window_right, softcap, dropout_p, sinks, alibi);
  return std::make_tuple(std::get<0>(res), std::get<1>(res), *std::get<2>(res));
}

template <class Device>
std::tuple<Tensor, Tensor> sage_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                                           const Tensor& cu_k, int64_t max_q, int64_t max_k,
                                           std::optional<Tensor> rng, int64_t causal, double scale, int64_t wl,
                                           int64_t wr, double softcap, double dropout_p,
                                           std::optional<Tensor> sinks, std::optional<Tensor> alibi,
                                           std::optional<Tensor> cu_q_dev, std::optional<Tensor> cu_k_dev) {
  const Packed packed{cu_q, cu_k, cu_q_dev, cu_k_dev};
  auto res = fwd_impl<Device, Kernel::kSage>(q, k, v, std::nullopt, &packed, max_q, max_k, rng, causal, scale, wl,
                                             wr, softcap, dropout_p, sinks, alibi);
  return std::make_tuple(std::get<0>(res), std::get<1>(res));
}

template <class Device>
std::tuple<Tensor, Tensor, Tensor> flash_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                                                    int64_t max_k, std::optional<Tensor> rng, int64_t causal,
                                                    double scale, int64_t wl, int64_t wr, double softcap,
                                                    double dropout_p, std::optional<Tensor> sinks,
                                                    std::optional<Tensor> alibi, std::optional<Tensor> cu_q_dev,
                                                    std::optional<Tensor> cu_k_dev) {
  const Packed packed{cu_q, cu_k, cu_q_dev, cu_k_dev};
  auto res = fwd_impl<Device, Kernel::kFlash>(q, k, v, std::nullopt, &packed, max_q, max_k, rng, causal, scale, wl,
                                              wr, softcap, dropout_p, sinks, alibi);
  return std::make_tuple(std::get<0>(res), std::get<1>(res), *std::get<2>(res));
}

// A backward, dense or packed: dq, dk, dv in their inputs' layouts, dsinks (Hq,) with sinks.
template <class Device, Kernel K>
std::tuple<Tensor, Tensor, Tensor, Tensor> bwd_impl(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const std::optional<Tensor>& grad_lse, const std::optional<Tensor>& mask, const Packed* packed, int64_t max_q,
    int64_t max_k, const std::optional<Tensor>& rng, int64_t causal, double scale, int64_t wl, int64_t wr,
    double softcap, double dropout_p, bool deterministic, const std::optional<Tensor>& stats,
    const std::optional<Tensor>& sinks, const std::optional<Tensor>& alibi, ab_attn_params& p) {
  p = make_params(q, k, v, mask, packed, max_q, max_k, rng, causal, scale, wl, wr, softcap, dropout_p, sinks, alibi);
  p.out = view_of(out, "out");
  p.lse = view_of(lse, "lse");
  if (stats.has_value() && Device::kReadsStats) p.stats = view_of(*stats, "stats");
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
  return std::make_tuple(dq, dk, dv, dsinks);
}

template <class Device, Kernel K>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> dense_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, std::optional<Tensor> grad_lse, std::optional<Tensor> mask, std::optional<Tensor> rng,
    int64_t causal, double scale, int64_t window_left, int64_t window_right, double softcap, double dropout_p,
    bool mask_grad, bool deterministic, std::optional<Tensor> stats, std::optional<Tensor> sinks,
    std::optional<Tensor> alibi) {
  if (mask_grad && !(mask.has_value() && mask->scalar_type() != ScalarType::Bool))
    fail("mask_grad needs a floating attn_mask");
  ab_attn_params p;
  auto grads = bwd_impl<Device, K>(grad_out, q, k, v, out, lse, grad_lse, mask, nullptr, 0, 0, rng, causal, scale,
                                   window_left, window_right, softcap, dropout_p, deterministic, stats, sinks, alibi,
                                   p);
  std::vector<int64_t> dmask_sizes{p.B, p.Hq, p.Sq, p.Sk};
  if (!mask_grad) dmask_sizes = {0};
  Tensor dmask = empty_strided(q, dmask_sizes, contiguous_strides(dmask_sizes), lse_dtype(q));
  if (mask_grad) p.dmask = view_of(dmask, "grad_mask");
  Device::bwd(K, q, p, nullptr);
  return std::make_tuple(std::get<0>(grads), std::get<1>(grads), std::get<2>(grads), dmask, std::get<3>(grads));
}

template <class Device>
std::tuple<Tensor, Tensor, Tensor, Tensor> flash_varlen_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, std::optional<Tensor> grad_lse, const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
    int64_t max_k, std::optional<Tensor> rng, int64_t causal, double scale, int64_t wl, int64_t wr, double softcap,
    double dropout_p, bool deterministic, std::optional<Tensor> stats, std::optional<Tensor> sinks,
    std::optional<Tensor> alibi, std::optional<Tensor> cu_q_dev, std::optional<Tensor> cu_k_dev) {
  const Packed packed{cu_q, cu_k, cu_q_dev, cu_k_dev};
  ab_attn_params p;
  auto grads = bwd_impl<Device, Kernel::kFlash>(grad_out, q, k, v, out, lse, grad_lse, std::nullopt, &packed, max_q,
                                                max_k, rng, causal, scale, wl, wr, softcap, dropout_p,
                                                deterministic, stats, sinks, alibi, p);
  Device::bwd(Kernel::kFlash, q, p, &packed);
  return grads;
}

template <class Device>
Tensor dropout_mask(const Tensor& rng, int64_t B, int64_t H, int64_t Sq, int64_t Sk, double dropout_p) {
  uint64_t seed = 0, offset = 0;
  const int64_t* rng_dev = nullptr;
  read_seed(rng, seed, offset, &rng_dev);
  if (B < 0 || H < 0 || Sq < 0 || Sk < 0) fail("dropout_mask sizes must be non-negative");
  std::vector<int64_t> shape{B, H, Sq, Sk};
  Tensor keep = empty_strided(rng, shape, contiguous_strides(shape), aoti_torch_dtype_bool());  // where rng is
  uint8_t* out = static_cast<uint8_t*>(keep.numel() ? keep.data_ptr() : nullptr);
  Device::dropout_mask(rng, seed, offset, rng_dev, dropout_p, B, H, Sq, Sk, out);
  return keep;
}

// KV-cache attention: q (B, Sq, Hq, D), a dense or paged cache written in place when k and v are
// given (decode_cpu.h).  cache_seqlen stands for every row when cache_seqlens is None (-1: the whole
// cache).  out is (B, Sq, Hq, D) contiguous, lse (B, Hq, Sq) float32; the workspace comes from
// torch's allocator for this call only.
template <class Device>
std::tuple<Tensor, Tensor> kvcache_fwd(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                       std::optional<Tensor> k, std::optional<Tensor> v,
                                       std::optional<Tensor> rotary_cos, std::optional<Tensor> rotary_sin,
                                       std::optional<Tensor> cache_seqlens, int64_t cache_seqlen,
                                       std::optional<Tensor> cache_batch_idx, std::optional<Tensor> cache_leftpad,
                                       std::optional<Tensor> block_table, std::optional<Tensor> alibi_slopes,
                                       double scale, bool causal, int64_t window_left, int64_t window_right,
                                       double softcap, bool rotary_interleaved, int64_t num_splits,
                                       std::optional<Tensor> sinks) {
  const std::optional<Tensor> optional[] = {k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                            cache_leftpad, block_table, alibi_slopes, sinks};
  Tensor out, lse;
  const ab_kvcache_params p =
      make_kvcache_params(q, k_cache, v_cache, optional, cache_seqlen, scale, causal, window_left, window_right,
                          softcap, rotary_interleaved, num_splits, out, lse);
  ab_error err{};
  const ab_status status = Device::kvcache(q, p, err);
  // a bad argument (a sequence length past the cache, a block that does not exist, ...) is tagged so
  // that attn_backends/_kvcache.py can raise it as a ValueError, like its own checks
  if (status == AB_ERR_INVALID) fail(std::string("invalid argument: ") + err.msg);
  check(status, err);
  return std::make_tuple(out, lse);
}

// Every op's implementation for one dispatch key.
template <class Device>
void register_ops(torch::stable::detail::StableLibrary& m) {
  m.impl("math_fwd", TORCH_BOX((&dense_fwd<Device, Kernel::kMath>)));
  m.impl("math_bwd", TORCH_BOX((&dense_bwd<Device, Kernel::kMath>)));
  m.impl("flash_fwd", TORCH_BOX(&flash_fwd<Device>));
  m.impl("flash_bwd", TORCH_BOX((&dense_bwd<Device, Kernel::kFlash>)));
  m.impl("flash_varlen_fwd", TORCH_BOX(&flash_varlen_fwd<Device>));
  m.impl("flash_varlen_bwd", TORCH_BOX(&flash_varlen_bwd<Device>));
  m.impl("sage_fwd", TORCH_BOX((&dense_fwd<Device, Kernel::kSage>)));
  m.impl("sage_varlen_fwd", TORCH_BOX(&sage_varlen_fwd<Device>));
  m.impl("dropout_mask", TORCH_BOX(&dropout_mask<Device>));
  m.impl("kvcache_fwd", TORCH_BOX(&kvcache_fwd<Device>));
}

}  // namespace ab_shim

#endif  // AB_TORCH_SHIM_H
