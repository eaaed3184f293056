"""Our kernels as runners: flash (dense and packed; the direct CPU call for calls that need no
autograd), sage, math, eager.  Each takes an Attn (attn_backends/_providers/__init__.py)."""

from __future__ import annotations

import torch

from .. import _C, _eager, _ops, _planner
from . import packed

_below_autograd = torch._C._AutoDispatchBelowAutograd
_is_compiling = torch.compiler.is_compiling


def draw_rng_state(q: torch.Tensor | None = None) -> torch.Tensor:
    """(seed, offset) for the kernels' Philox stream.

    Eagerly it is drawn from torch's default CPU generator whatever the device, so torch.manual_seed
    gives the same dropout mask on CPU and CUDA.  While a CUDA graph is being captured (or
    torch.compile traces a CUDA call), a host draw would be frozen into the graph and every replay
    would drop the same elements: there it is drawn on the GPU from the device's generator, whose
    draws advance on each replay; the kernels read the pair from device memory."""
    if q is not None and q.is_cuda and (_is_compiling() or torch.cuda.is_current_stream_capturing()):
        return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=q.device)
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


def _no_grad_call(fwd_op, *args):
    """A forward op for a call that needs no gradient: below the autograd key (saving the Python
    autograd wrapper), except while torch.compile traces, which must see the op itself."""
    if _is_compiling():
        return fwd_op(*args)
    with _below_autograd():
        return fwd_op(*args)


def _untied(q, k, v):
    """q, k, v for an autograd Function under torch.compile, which refuses a tensor passed twice (dynamo's
    "duplicate tensor input": self-attention's ab.attention(x, x, x)): a repeat as a view of itself, the
    same values, its gradient flowing to the same tensor.  Eager calls take them as they are."""
    if not _is_compiling():
        return q, k, v
    return q, k.view_as(k) if k is q else k, v.view_as(v) if v is q or v is k else v


def _run_kernel(fwd_op, function, a, q, k, v, sinks):
    """One of our dense kernels: the autograd Function when a gradient is needed, else the op."""
    if a.need_grad:
        q, k, v = _untied(q, k, v)
    rng = draw_rng_state(q) if a.p > 0 else None
    args = (q, k, v, a.mask, rng, a.causal, a.scale, a.wl, a.wr, a.softcap, a.p)
    if sinks is not None or a.alibi is not None:
        args += (sinks, a.alibi)
    res = function.apply(*args, a.det) if a.need_grad else _no_grad_call(fwd_op, *args)
    return res[0], res[1]  # flash's third output, its stats, is for its backward only


def _cuda_qkv(q, k, v):
    """q, k, v as the CUDA flash and sage kernels can read them (_ops.cuda_layout copies the ones they
    cannot); CPU tensors as they are (the CPU kernels take any strides)."""
    if not q.is_cuda:
        return q, k, v
    return _ops.cuda_layout(q), _ops.cuda_layout(k), _ops.cuda_layout(v)


@torch.compiler.assume_constant_result
def _emulating() -> bool:
    """_C.cuda_emulation() as torch.compile reads it: once, at trace time (dynamo cannot trace the builtin)."""
    return bool(_C.cuda_emulation())


def _kernel_sinks(a):
    """The sinks as the flash kernels take them: float32 and contiguous for the CUDA kernels (and on the
    CPU under the CUDA emulation, which runs them), forward and backward; the CPU kernels read any dtype.
    With a gradient the cast is part of the graph, so the sinks' gradient comes back in their dtype."""
    sinks = a.sinks
    if sinks is None or (a.need_grad and not (a.q.is_cuda or _emulating())):
        return sinks
    return sinks.float().contiguous()


# ---- the CPU flash forward without the dispatcher -------------------------------------------------
# A call that needs no autograd gains nothing from the op but pays its fixed cost (the dispatcher and
# the boxed stable-ABI call, most of a small call's time: docs/benchmarks.md, "Per-call cost").  Such
# calls run the same kernel through _C.flash_fwd_cpu (csrc/ab_direct.c), which allocates the outputs
# in the op's layout: the same bits (tests/test_direct.py).  Whatever must see the op keeps it.

_C.set_tensor_api(torch.empty_strided, torch.device("cpu"),  # the dtypes in ab_dtype's order (csrc/ab_core.h)
                  (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.int32,
                   torch.int64, torch.uint8))
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_tracing_state = torch._C._get_tracing_state
_functorch_layer = torch._C._functorch.peek_interpreter_stack
_forward_ad = torch.autograd.forward_ad


def dual_level() -> bool:
    """Forward-mode AD active (torch.autograd.forward_ad.dual_level): its dual tensors are plain tensors
    that need no gradient, and the ops would drop their tangents (_dispatch.transformed)."""
    return _forward_ad._current_level >= 0


# each returns something false when no mode, transform or trace is active: the direct calls (direct_ok,
# the decode kernel's direct call, attention_with_kvcache's and ab.attention's fast paths) serve a call only
# when none is.  Inference mode is not one of them: it only leaves autograd out, as a call that needs no
# gradient does, so the op below autograd and the direct call do the same there (until 2026-12-07
# ab.attention left it to the op and its Python path: a decode step of a small model took 1.6x torch SDPA's
# time under torch.inference_mode(), docs/benchmarks.md "One-token MHA in runs of keys on the AMX Xeon")
read_guards = (_dispatch_modes, _function_mode, _tracing_state, _functorch_layer, dual_level)


def read_ok(*tensors) -> bool:
    """Whether a direct call that reads its inputs can serve (the decode kernel's: here and in _kvcache.py;
    inference mode allowed): not while torch.compile traces, no read_guards active, every tensor (None allowed) a
    plain torch.Tensor or a torch.nn.Parameter (a module's weights, such as GPT-OSS's sinks: Parameter
    turns __torch_function__ off and dispatches as a plain tensor)."""
    return (not _is_compiling() and not any(g() for g in read_guards)
            and all(t is None or t.__class__ is _Tensor or t.__class__ is _Parameter for t in tensors))


def direct_ok(q, k, v, mask) -> bool:
    """Whether a CPU call that needs no gradient may skip the dispatcher: not while torch.compile
    traces (first, so that dynamo folds the rest away) or a jit trace records; q, k, v and the mask
    plain torch.Tensors (a FakeTensor or any other subclass has its own dispatch); no
    TorchDispatchMode or TorchFunctionMode active (they must see the op), no functorch transform
    (vmap, grad); inference mode allowed (read_guards)."""
    return (not _is_compiling() and q.__class__ is _Tensor and k.__class__ is _Tensor and v.__class__ is _Tensor
            and (mask is None or mask.__class__ is _Tensor) and not _dispatch_modes() and not _function_mode()
            and _tracing_state() is None and _functorch_layer() is None and not dual_level())


_FLASH_OP, _MATH_OP = _ops.ops.flash_fwd.default, _ops.ops.math_fwd.default


def _run_flash(a, q, k, v, sinks):
    """The flash op (the autograd Function with a gradient)."""
    return _run_kernel(_FLASH_OP, _ops.FlashFunction, a, q, k, v, sinks)


def run_flash(a):
    """flash (dense) and flash_varlen (packed)."""
    if a.cu_q is not None:
        return _run_flash_varlen(a)
    q, k, v = a.q, a.k, a.v
    if q.is_cpu:
        if not (a.need_grad or a.p) and a.sinks is None and a.alibi is None and direct_ok(q, k, v, a.mask):
            res = _C.flash_fwd_cpu(q, k, v, a.mask, a.causal, a.scale, a.wl, a.wr, a.softcap, a.want_lse)
            if res is not None:  # None: the CUDA emulation serves CPU tensors, through the op
                return res
        res = _run_by_decode(a, sq) if (sq := _decode_tokens(a)) else None
        if res is not None:
            return res
    elif q.is_cuda:
        q, k, v = _ops.cuda_layout(q), _ops.cuda_layout(k), _ops.cuda_layout(v)
    return _run_flash(a, q, k, v, _kernel_sinks(a))


def _device_cu_seqlens(a, q):
    """On CUDA, the caller's cu_seqlens as the kernels read them (int32, contiguous, on q's device: no
    copy per call), else ().  The ops take them after sinks and alibi_slopes."""
    cu_q, cu_k = a.cu_q, a.cu_k
    if (q.is_cuda and cu_q.device == q.device and cu_k.device == q.device and cu_q.dtype == torch.int32
            and cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()):
        return (cu_q, cu_k)
    return ()


def _decode_tokens(a) -> int:
    """The query tokens of every sequence when a CPU call without a gradient goes to the decode kernel,
    else 0, for the calls that take the op (packed calls off the fast path, sinks, ALiBi): the op keeps
    the row statistics, so the CPU flash forward's own route (csrc/cpu/flash_cpu.c,
    "short queries") does not take them; its rule is asked here (_C.flash_decode_route) and the call
    goes to the decode kernel's direct call."""
    q, k, v = a.q, a.k, a.v
    # read_ok (first torch.compile, which must fold the rest away; a fake or wrapped tensor has no data to
    # read) before any call into _C
    if a.need_grad or not q.is_cpu or not read_ok(q, k, v, a.sinks, a.alibi, a.mask) or _C.cuda_emulation():
        return 0
    return _C.flash_decode_route(q, k, v, a.mask is not None, a.p, a.causal, a.wl, a.wr, a.hcu_q, a.hcu_k)


def _run_by_decode(a, sq):
    """The call on the decode kernel's direct call (_C.kvcache_fwd_cpu, the kernel attention_with_kvcache
    runs), or None where that refuses it; only for the calls _decode_tokens passed (no torch.compile,
    jit trace, dispatch or function mode, functorch transform or tensor subclass: those keep the flash
    op).  Dense: the (B, S, H, D) views, and the mask as it is.  Packed: sequence b's queries are batch
    row b, its keys cache row 0 from cu_seqlens_k[b] (cache_leftpad) to cu_seqlens_k[b + 1]
    (cache_seqlens)."""
    q, k, v = a.q, a.k, a.v
    if a.cu_q is None:
        res = _C.kvcache_fwd_cpu(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, None, None,
                                 -1, None, None, None, a.alibi, a.scale, a.causal != 0, a.wl, a.wr, a.softcap, True, 0,
                                 a.sinks, a.mask)
        return None if res is None else (res[0].transpose(1, 2), res[1])
    B = a.hcu_q.numel() - 1
    res = _C.kvcache_fwd_cpu(q.unflatten(0, (B, sq)), k[None], v[None], None, None, None, None, a.hcu_k[1:], -1,
                             torch.zeros(B, dtype=torch.int32), a.hcu_k[:-1], None, a.alibi, a.scale, a.causal != 0,
                             a.wl, a.wr, a.softcap, True, 0, a.sinks)
    # lse (Hq, Tq) contiguous, as the flash_varlen op and the packed fast path (csrc/ab_direct.c) give it
    return None if res is None else (res[0].flatten(0, 1), res[1].transpose(0, 1).flatten(1).contiguous())


def _run_flash_varlen(a):
    res = _run_by_decode(a, sq) if (sq := _decode_tokens(a)) else None
    if res is not None:
        return res
    rng = draw_rng_state(a.q) if a.p > 0 else None
    q, k, v = _cuda_qkv(a.q, a.k, a.v)
    sinks = _kernel_sinks(a)
    args = (q, k, v, a.hcu_q, a.hcu_k, a.max_q, a.max_k, rng, a.causal, a.scale, a.wl, a.wr, a.softcap, a.p)
    device_cu = _device_cu_seqlens(a, q)
    if sinks is not None or a.alibi is not None or device_cu:
        args += (sinks, a.alibi, *device_cu)
    if a.need_grad:
        res = _ops.FlashVarlenFunction.apply(*_untied(q, k, v), *args[3:], a.det)
    else:
        res = _no_grad_call(_ops.ops.flash_varlen_fwd.default, *args)
    return res[0], res[1]


def run_sage(a):
    """Our INT8 Q.K^T kernel (SageAttention recipe, docs/sage.md), dense or packed: forward only (the
    planner routes no call that needs a gradient here), no dropout."""
    q, k, v = _cuda_qkv(a.q, a.k, a.v)
    if a.cu_q is not None:
        device_cu = _device_cu_seqlens(a, q)
        return _no_grad_call(_ops.ops.sage_varlen_fwd.default, q, k, v, a.hcu_q, a.hcu_k, a.max_q, a.max_k, None,
                             a.causal, a.scale, a.wl, a.wr, a.softcap, 0.0, *((None, None, *device_cu) if device_cu
                                                                             else ()))
    return _no_grad_call(_ops.ops.sage_fwd.default, q, k, v, a.mask, None, a.causal, a.scale, a.wl, a.wr,
                         a.softcap, 0.0)


def _run_math_dense(a):
    return _run_kernel(_MATH_OP, _ops.MathFunction, a, a.q, a.k, a.v, a.sinks)


_run_math_packed = packed.padded(_run_math_dense)


def run_math(a):
    """Our exact reference kernel; a packed call padded to a dense one."""
    return _run_math_dense(a) if a.cu_q is None else _run_math_packed(a)


def _run_composite_dense(a):
    return _eager.attention(a.q, a.k, a.v, a.mask, a.causal, a.scale, a.wl, a.wr, a.softcap, a.p, sinks=a.sinks,
                            alibi=a.alibi)


def _run_eager_dense(a):
    """HF's eager, our way: the math kernel where this device has one, else the aten composite."""
    q = a.q
    if q.is_cpu:
        return _run_math_dense(a)
    if a.sinks is not None or a.alibi is not None:  # the CUDA math kernel takes neither
        return _run_composite_dense(a)
    if q.is_cuda and not a.need_grad:
        if not _planner.cuda_math_ready(q.device.index):
            return _run_math_dense(a)
    return _run_composite_dense(a)


_run_eager_packed = packed.padded(_run_eager_dense)
_run_composite_packed = packed.padded(_run_composite_dense)


def run_composite(a):
    """The aten composite (_eager.attention) on every device, the kernels left out: what forward-mode AD and
    functorch's transforms run (_dispatch.transformed), since they differentiate and batch plain ops only."""
    return _run_composite_dense(a) if a.cu_q is None else _run_composite_packed(a)


def run_eager(a):
    return _run_eager_dense(a) if a.cu_q is None else _run_eager_packed(a)
