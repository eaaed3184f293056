"""The attn_backends::* torch ops: fake kernels and autograd.

The C++ shim (csrc/torch_shim.cpp) defines the schemas and the CPU/CUDA kernels when ``_C`` is
loaded.  This module adds what the stable ABI leaves to Python: fake (meta) kernels, so
torch.compile and FakeTensor can trace the ops, and autograd, so the backward is itself an op and
``torch.compile(fullgraph=True)`` traces forward and backward with no graph break.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loading it registers the ops)

ops = torch.ops.attn_backends


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """lse is float32, or float64 for float64 inputs (so gradcheck stays in float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fwd_fake(q, k, v, attn_mask, rng_state, causal, scale, window_left, window_right, softcap, dropout_p,
              sinks=None, alibi_slopes=None):
    B, Hq, Sq, _ = q.shape
    Dv = v.shape[-1]
    # the real kernel returns out laid out (B, Sq, Hq, Dv) and viewed as (B, Hq, Sq, Dv)
    out = q.new_empty((B, Sq, Hq, Dv)).transpose(1, 2)
    lse = q.new_empty((B, Hq, Sq), dtype=lse_dtype(q.dtype))
    return out, lse


def grad_strides(t: torch.Tensor):
    """The strides the kernels give a gradient (csrc/torch_shim.cpp: grad_strides): the input's
    own when it is dense and non-overlapping, else contiguous."""
    sizes, strides = list(t.shape), list(t.stride())
    order = [d for d in range(t.dim()) if sizes[d] != 1]
    # by stride, stable: an insertion sort, not sorted(), whose keys torch.compile(dynamic=True) cannot
    # sort when they are symbolic (each comparison here becomes a guard)
    for i in range(1, len(order)):
        j = i
        while j > 0 and strides[order[j]] < strides[order[j - 1]]:
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    expect, dense = 1, t.numel() > 0
    for d in order:
        if strides[d] != expect:
            dense = False
        expect *= sizes[d]
    if dense:
        return tuple(strides)
    out, s = [0] * len(sizes), 1
    for d in reversed(range(len(sizes))):
        out[d] = s
        s *= max(sizes[d], 1)
    return tuple(out)


def _empty_grad(t):
    return t.new_empty_strided(t.shape, grad_strides(t))


def _flash_fwd_fake(*args):
    out, lse = _fwd_fake(*args)
    return out, lse, lse.new_empty((2,) + tuple(lse.shape))


def _dsinks_fake(q, sinks, Hq):
    return q.new_empty((Hq if sinks is not None else 0,), dtype=lse_dtype(q.dtype))


def _bwd_fake(grad_out, q, k, v, out, lse, grad_lse, attn_mask, rng_state, causal, scale,
              window_left, window_right, softcap, dropout_p, mask_grad, deterministic=False, stats=None,
              sinks=None, alibi_slopes=None):
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    dmask = q.new_empty((B, Hq, Sq, Sk) if mask_grad else (0,), dtype=lse_dtype(q.dtype))
    return _empty_grad(q), _empty_grad(k), _empty_grad(v), dmask, _dsinks_fake(q, sinks, Hq)


# flash_fwd also returns `stats` (2, B, Hq, Sq): each row's max score and the log of its sum, lse in
# two parts, which flash's backward takes its softmax from (free of lse's float32 rounding)
torch.library.register_fake("attn_backends::math_fwd")(_fwd_fake)
torch.library.register_fake("attn_backends::flash_fwd")(_flash_fwd_fake)
for _kernel in ("math", "flash"):
    torch.library.register_fake(f"attn_backends::{_kernel}_bwd")(_bwd_fake)


def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rng_state, causal,
                     scale, window_left, window_right, softcap, dropout_p, sinks=None, alibi_slopes=None,
                     cu_seqlens_q_device=None, cu_seqlens_k_device=None):
    Tq, Hq, _ = q.shape
    out = q.new_empty((Tq, Hq, v.shape[-1]))
    lse = q.new_empty((Hq, Tq), dtype=lse_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("attn_backends::flash_varlen_fwd")
def _flash_varlen_fwd_fake(*args):
    out, lse = _varlen_fwd_fake(*args)
    return out, lse, lse.new_empty((2,) + tuple(lse.shape))


# sage is forward only: no autograd is registered for its ops, and the planner never routes a call
# that needs a gradient to it (its registry row has no backward)
torch.library.register_fake("attn_backends::sage_fwd")(_fwd_fake)
torch.library.register_fake("attn_backends::sage_varlen_fwd")(_varlen_fwd_fake)


@torch.library.register_fake("attn_backends::flash_varlen_bwd")
def _varlen_bwd_fake(grad_out, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, rng_state, causal, scale, window_left, window_right, softcap, dropout_p,
                     deterministic=False, stats=None, sinks=None, alibi_slopes=None, cu_seqlens_q_device=None,
                     cu_seqlens_k_device=None):
    return _empty_grad(q), _empty_grad(k), _empty_grad(v), _dsinks_fake(q, sinks, q.shape[1])


@torch.library.register_fake("attn_backends::dropout_mask")
def _dropout_mask_fake(rng_state, B, H, Sq, Sk, dropout_p):
    return rng_state.new_empty((B, H, Sq, Sk), dtype=torch.bool)


# KV-cache attention (decode_cpu.h): inference only, so no autograd; it writes k_cache and v_cache
# in place (the schema marks them mutated), which a fake kernel leaves alone
@torch.library.register_fake("attn_backends::kvcache_fwd")
def _kvcache_fwd_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                      cache_batch_idx, cache_leftpad, block_table, alibi_slopes, scale, causal, window_left,
                      window_right, softcap, rotary_interleaved, num_splits, sinks=None):
    B, Sq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def cuda_layout(t: torch.Tensor) -> torch.Tensor:
    """t itself when the CUDA flash and sage kernels can read it in place (16-byte rows: last dim contiguous,
    other strides multiples of 8 elements, 16-byte aligned data), else a contiguous copy.  The CPU
    kernels take any strides."""
    ok = (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
          and all(st % 8 == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))
    return t if ok else t.contiguous()


def deterministic_backward(ctx) -> bool:
    """Whether this backward must be bitwise reproducible: asked for in the call (deterministic=True,
    kept on ctx by the library's Function) or torch.use_deterministic_algorithms(True) now."""
    return bool(getattr(ctx, "deterministic", False)) or torch.are_deterministic_algorithms_enabled()


def _grad_out(grad_out, out, flash):
    if grad_out is None:
        return torch.zeros_like(out)
    # autograd hands over any layout (an expanded scalar has stride 0): the CUDA flash kernel reads rows
    return cuda_layout(grad_out) if flash and grad_out.is_cuda else grad_out


# ---- double backward -------------------------------------------------------------------------------
# The kernels' backward is not itself differentiable.  When autograd records the backward
# (create_graph=True, an input that requires grad), the first-order gradient is computed instead by
# the eager composite (_eager.attention, plain aten ops, the same semantics and the same dropout mask),
# whose own autograd then gives the second (and any higher) derivative.  docs/semantics.md says why.


def records_graph(*tensors) -> bool:
    """True when this backward runs under create_graph=True for something that requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def keep_mask(rng_state, B, H, Sq, Sk, dropout_p, device):
    """The kernels' dropout keep-mask for this call, or None without dropout."""
    if not dropout_p > 0:
        return None
    return ops.dropout_mask(rng_state, B, H, Sq, Sk, dropout_p).to(device)


def _differentiable_grads(outputs, grads, inputs):
    """d outputs / d inputs against grads, recorded for a further derivative (None where unused)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
                                     allow_unused=True) if pairs and wanted else ())
    return [next(found) if t is not None and t.requires_grad else None for t in inputs]


def composite_backward(q, k, v, attn_mask, rng_state, args, grad_out, grad_lse, sinks=None, alibi=None):
    """(dq, dk, dv, dmask, dsinks) of a dense call through the eager composite, differentiable."""
    from . import _eager

    causal, scale, wl, wr, softcap, dropout_p = args
    keep = keep_mask(rng_state, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dropout_p, q.device)
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool or attn_mask.requires_grad \
        else attn_mask.detach()
    out, lse = _eager.attention(q, k, v, mask, causal, scale, wl, wr, softcap, dropout_p, keep=keep, sinks=sinks,
                                alibi=alibi)
    return _differentiable_grads((out, lse), (grad_out, grad_lse),
                                 (q, k, v, mask if mask is not None and mask.dtype != torch.bool else None, sinks))


def composite_varlen_backward(q, k, v, cu_q, cu_k, max_q, max_k, rng_state, opts, grad_out, grad_lse, sinks=None,
                              alibi=None):
    """(dq, dk, dv, dsinks) of a packed call: padded to (B, H, max_seqlen, D) (the rows its dropout
    numbers), the eager composite, unpadded."""
    from . import _eager, _varlen

    causal, scale, wl, wr, softcap, dropout_p = opts
    len_q, len_k = (cu[1:].long() - cu[:-1].long() for cu in (cu_q.cpu(), cu_k.cpu()))
    qd, kd, vd = _varlen.pad(q, len_q, max_q), _varlen.pad(k, len_k, max_k), _varlen.pad(v, len_k, max_k)
    mask = _varlen.padded_mask(len_q, len_k, max_q, max_k, causal, wl, wr, q.device)
    if alibi is not None:
        mask = _varlen.alibi_mask(mask, alibi, len_q, len_k, max_q, max_k, q.shape[1], _eager_acc(q))
    keep = keep_mask(rng_state, len_q.numel(), q.shape[1], max_q, max_k, dropout_p, q.device)
    out, lse = _eager.attention(qd, kd, vd, mask, 0, scale, -1, -1, softcap, dropout_p, keep=keep, sinks=sinks)
    out, lse = _varlen.unpad(out, len_q), _varlen.unpad_lse(lse, len_q)
    return _differentiable_grads((out, lse), (grad_out, grad_lse), (q, k, v, sinks))


def _eager_acc(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _sinks_alibi(extra):
    """(sinks, alibi_slopes) from the optional inputs after an op's fixed ones (absent: None)."""
    extra = tuple(extra) + (None, None)
    return extra[0], extra[1]


def _dsinks(ctx, dsinks, sinks, index):
    """The sinks' gradient in their dtype, when asked for (the kernels give it in lse's dtype)."""
    return dsinks.to(sinks.dtype) if sinks is not None and ctx.needs_input_grad[index] else None


def _make_autograd(bwd_op, flash=False):
    """setup_context and backward for a forward op with the math_fwd argument list."""

    def setup_context(ctx, inputs, output):
        q, k, v, attn_mask, rng_state, causal, scale, wl, wr, softcap, dropout_p, *extra = inputs
        sinks, alibi = _sinks_alibi(extra)
        out, lse = output[0], output[1]
        stats = output[2] if flash else None
        ctx.set_materialize_grads(False)
        if flash:
            ctx.mark_non_differentiable(stats)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, rng_state, stats, sinks, alibi)
        ctx.args = (causal, scale, wl, wr, softcap, dropout_p)
        ctx.n_inputs = len(inputs)
        ctx.mask_grad = bool(
            attn_mask is not None and attn_mask.dtype != torch.bool and ctx.needs_input_grad[3]
        )

    def backward(ctx, grad_out, grad_lse, grad_stats=None):
        q, k, v, out, lse, attn_mask, rng_state, stats, sinks, alibi = ctx.saved_tensors
        rest = [None] * (ctx.n_inputs - 4)  # rng_state ... dropout_p, then sinks (index 11) and alibi
        if records_graph(q, k, v, attn_mask, sinks, grad_out, grad_lse):
            dq, dk, dv, dmask, dsinks = composite_backward(q, k, v, attn_mask, rng_state, ctx.args, grad_out, grad_lse,
                                                           sinks, alibi)
            if sinks is not None:
                rest[7] = dsinks
            return (dq, dk, dv, dmask, *rest)
        grad_out = _grad_out(grad_out, out, flash)
        dq, dk, dv, dmask, dsinks = bwd_op(
            grad_out, q, k, v, out, lse, grad_lse, attn_mask, rng_state, *ctx.args, ctx.mask_grad,
            deterministic_backward(ctx), stats, sinks, alibi
        )
        if ctx.mask_grad:
            # the kernel writes the gradient at (B, Hq, Sq, Sk); a broadcast mask gets the sum
            dmask = dmask.sum_to_size(attn_mask.shape).to(attn_mask.dtype)
        else:
            dmask = None
        if sinks is not None:
            rest[7] = _dsinks(ctx, dsinks, sinks, 11)
        return (dq, dk, dv, dmask, *rest)

    return setup_context, backward


for _kernel in ("math", "flash"):
    _setup, _backward = _make_autograd(getattr(ops, f"{_kernel}_bwd").default, _kernel == "flash")
    torch.library.register_autograd(f"attn_backends::{_kernel}_fwd", _backward, setup_context=_setup)


def _make_varlen_autograd(bwd_op, flash=True):
    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, rng_state, causal, scale, wl, wr, softcap, dropout_p, *extra = inputs
        sinks, alibi = _sinks_alibi(extra)
        ctx.cu_device = tuple(extra[2:4])  # the caller's cu_seqlens on the device, for the CUDA kernels
        out, lse, stats = output
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(stats)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, stats, sinks, alibi)
        ctx.args = (max_q, max_k)
        ctx.opts = (causal, scale, wl, wr, softcap, dropout_p)
        ctx.n_inputs = len(inputs)

    def backward(ctx, grad_out, grad_lse, grad_stats=None):
        q, k, v, out, lse, cu_q, cu_k, rng_state, stats, sinks, alibi = ctx.saved_tensors
        rest = [None] * (ctx.n_inputs - 3)  # cu_seqlens_q ... dropout_p, then sinks (index 14) and alibi
        if records_graph(q, k, v, sinks, grad_out, grad_lse):
            dq, dk, dv, dsinks = composite_varlen_backward(q, k, v, cu_q, cu_k, *ctx.args, rng_state, ctx.opts,
                                                           grad_out, grad_lse, sinks, alibi)
            if sinks is not None:
                rest[11] = dsinks
            return (dq, dk, dv, *rest)
        grad_out = _grad_out(grad_out, out, False)  # None where only lse reaches the loss
        dq, dk, dv, dsinks = bwd_op(grad_out, q, k, v, out, lse, grad_lse, cu_q, cu_k, *ctx.args, rng_state,
                                    *ctx.opts, deterministic_backward(ctx), stats, sinks, alibi, *ctx.cu_device)
        if sinks is not None:
            rest[11] = _dsinks(ctx, dsinks, sinks, 14)
        return (dq, dk, dv, *rest)

    return setup_context, backward


_setup, _backward = _make_varlen_autograd(ops.flash_varlen_bwd.default)
torch.library.register_autograd("attn_backends::flash_varlen_fwd", _backward, setup_context=_setup)


_below_autograd = torch._C._AutoDispatchBelowAutograd
_is_compiling = torch.compiler.is_compiling


def kernel_function(fwd_op, bwd_op, make_autograd=_make_autograd, flash=False):
    """A torch.autograd.Function running fwd_op / bwd_op, for the library's own hot path.

    register_autograd above makes direct torch.ops calls differentiable (and is what opcheck
    checks), but its generic wrapper costs ~100 us a call.  This Function computes the same
    gradients with a few microseconds of Python, and torch.compile traces it just as well.
    apply takes the op's arguments and then one more, `deterministic` (the call's request for a
    bitwise reproducible backward).
    """
    setup_context, backward = make_autograd(bwd_op, flash)

    # forward takes ctx (no separate setup_context): Function.apply then skips binding the
    # arguments to the signature with inspect, which alone costs ~100 us per call.
    class KernelFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            inputs, ctx.deterministic = inputs[:-1], inputs[-1]
            if _is_compiling():
                output = fwd_op(*inputs)
            else:
                with _below_autograd():
                    output = fwd_op(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, grad_out, grad_lse, grad_stats=None):
            return (*backward(ctx, grad_out, grad_lse), None)

    KernelFunction.__name__ = KernelFunction.__qualname__ = f"{fwd_op.name().split('::')[-1].split('.')[0]}_function"
    return KernelFunction


MathFunction = kernel_function(ops.math_fwd.default, ops.math_bwd.default)
FlashFunction = kernel_function(ops.flash_fwd.default, ops.flash_bwd.default, flash=True)
FlashVarlenFunction = kernel_function(ops.flash_varlen_fwd.default, ops.flash_varlen_bwd.default,
                                      _make_varlen_autograd, flash=True)
