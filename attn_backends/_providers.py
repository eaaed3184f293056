"""How each backend is called once the planner has chosen it.

Every runner takes the validated call
    (q, k, v, attn_mask, causal, scale, window_left, window_right, softcap, dropout_p, need_grad, want_lse,
     deterministic=False)
with causal as 0/1/2 (none, top-left, bottom-right) and returns (out, lse or None).  deterministic is
the call's own request for a bitwise reproducible backward (torch's global flag is read as well).
Calls with attention sinks or ALiBi add (sinks, alibi_slopes) after deterministic; only the runners
whose registry rows serve them (math, flash, eager) take those.  The planner
only routes a call to a runner whose registry row says it can serve it exactly, so runners do not
re-check capabilities.
"""

from __future__ import annotations

import math

import torch

from . import _C, _eager, _ops

# torch's own function, captured before anyone (ab.patch_sdpa included) can replace it: the sdpa
# backends call this, so a patched F.scaled_dot_product_attention never calls itself
ORIGINAL_SDPA = torch.nn.functional.scaled_dot_product_attention
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


def _kernel(fwd_op, function):
    """Runner for one of our kernels: the autograd Function when a gradient is needed, else the op."""

    def run(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det=False, sinks=None,
            alibi=None):
        rng = draw_rng_state(q) if p > 0 else None
        args = (q, k, v, mask, rng, causal, scale, wl, wr, softcap, p)
        if sinks is not None or alibi is not None:
            args += (sinks, alibi)
        res = function.apply(*args, det) if need_grad else _no_grad_call(fwd_op, *args)
        return res[0], res[1]  # flash's third output, its stats, is for its backward only

    return run


run_math = _kernel(_ops.ops.math_fwd.default, _ops.MathFunction)
_run_flash = _kernel(_ops.ops.flash_fwd.default, _ops.FlashFunction)


def _cuda_qkv(q, k, v):
    """q, k, v as the CUDA flash and sage kernels can read them (_ops.cuda_layout copies the ones they
    cannot); CPU tensors as they are (the CPU kernels take any strides)."""
    if not q.is_cuda:
        return q, k, v
    return _ops.cuda_layout(q), _ops.cuda_layout(k), _ops.cuda_layout(v)


# ---- the CPU flash forward without the dispatcher -------------------------------------------------
# A call that needs no autograd gains nothing from the op but pays its fixed cost (the dispatcher and
# the boxed stable-ABI call, most of a small call's time: docs/benchmarks.md, "Per-call cost").  Such
# calls run the same kernel through _C.flash_fwd_cpu (csrc/ab_module.c), which allocates the outputs
# in the op's layout: the same bits (tests/test_direct.py).  Whatever must see the op keeps it.

_C.set_tensor_api(torch.empty_strided, torch.device("cpu"),  # the dtypes in ab_dtype's order (csrc/ab_core.h)
                  (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.int32,
                   torch.int64, torch.uint8))
_Tensor = torch.Tensor
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_inference_mode = torch.is_inference_mode_enabled
_tracing_state = torch._C._get_tracing_state
_functorch_layer = torch._C._functorch.peek_interpreter_stack


def direct_ok(q, k, v, mask) -> bool:
    """Whether a CPU call that needs no gradient may skip the dispatcher: not while torch.compile
    traces (first, so that dynamo folds the rest away) or a jit trace records; q, k, v and the mask
    plain torch.Tensors (a FakeTensor or any other subclass has its own dispatch); no
    TorchDispatchMode or TorchFunctionMode active (they must see the op), no functorch transform
    (vmap, grad), not in inference mode (left to the op: the direct path is kept to the plainest
    eager calls)."""
    return (not _is_compiling() and q.__class__ is _Tensor and k.__class__ is _Tensor and v.__class__ is _Tensor
            and (mask is None or mask.__class__ is _Tensor) and not _dispatch_modes() and not _function_mode()
            and not _inference_mode() and _tracing_state() is None and _functorch_layer() is None)


def _flash_sinks(q, sinks, need_grad):
    """sinks as the flash kernels take them: float32 and contiguous for the CUDA kernels (and on the CPU
    under the CUDA emulation, which runs them), forward and backward; the CPU kernels read any dtype.
    With a gradient the cast is part of the graph, so the sinks' gradient comes back in their dtype."""
    if need_grad and not (q.is_cuda or _C.cuda_emulation()):
        return sinks
    return sinks.float().contiguous()


def run_flash(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det=False, sinks=None,
              alibi=None):
    if q.is_cpu:
        if not (need_grad or p) and sinks is None and alibi is None and direct_ok(q, k, v, mask):
            res = _C.flash_fwd_cpu(q, k, v, mask, causal, scale, wl, wr, softcap, want_lse)
            if res is not None:  # None: the CUDA emulation serves CPU tensors, through the op
                return res
    elif q.is_cuda:
        q, k, v = _ops.cuda_layout(q), _ops.cuda_layout(k), _ops.cuda_layout(v)
    if sinks is not None:
        sinks = _flash_sinks(q, sinks, need_grad)
    return _run_flash(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det, sinks, alibi)


def run_sage(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det=False):
    """Our INT8 Q.K^T kernel (SageAttention recipe, docs/sage.md): forward only (the planner routes no
    call that needs a gradient here), no dropout."""
    q, k, v = _cuda_qkv(q, k, v)
    return _no_grad_call(_ops.ops.sage_fwd.default, q, k, v, mask, None, causal, scale, wl, wr, softcap, 0.0)


def run_eager(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det=False, sinks=None,
              alibi=None):
    """HF's eager, our way: the math kernel where this device has one, else the aten composite."""
    if q.is_cpu:
        return run_math(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det, sinks, alibi)
    if sinks is not None or alibi is not None:  # the CUDA math kernel takes neither
        return _eager.attention(q, k, v, mask, causal, scale, wl, wr, softcap, p, sinks=sinks, alibi=alibi)
    if q.is_cuda and not need_grad:
        from ._dispatch import cuda_math_ready

        if not cuda_math_ready(q.device.index):
            return run_math(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse)
    return _eager.attention(q, k, v, mask, causal, scale, wl, wr, softcap, p)


# ---- torch SDPA ----------------------------------------------------------------------------------

def _sdpa_mask(q, k, mask, causal, wl, wr):
    """(attn_mask, is_causal) for F.sdpa: its is_causal is top-left only, so bottom-right causal and
    windows become an explicit bool mask, combined with the caller's mask."""
    Sq, Sk = q.shape[2], k.shape[2]
    if mask is not None and mask.dim() < 4:  # ours broadcasts any trailing shape; F.sdpa wants 2-D+
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if causal == 1 and mask is None and wl < 0 and wr < 0:
        return None, True
    vis = _eager.visible_keys(Sq, Sk, causal, wl, wr, q.device)
    if vis is None:
        combined = mask
    elif mask is None:
        combined = vis
    elif mask.dtype == torch.bool:
        combined = mask & vis
    else:
        combined = mask.masked_fill(~vis, -math.inf)
    if combined is not None and combined.dtype != torch.bool and combined.dtype != q.dtype:
        combined = combined.to(q.dtype)  # F.sdpa wants a float mask in q's dtype
    return combined, False


def _sdpa(forced=None):
    def run(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det=False):
        attn_mask, is_causal = _sdpa_mask(q, k, mask, causal, wl, wr)
        kwargs = dict(attn_mask=attn_mask, dropout_p=p, is_causal=is_causal, scale=scale,
                      enable_gqa=q.shape[1] != k.shape[1])
        if forced is None:
            return ORIGINAL_SDPA(q, k, v, **kwargs), None
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, forced)):
            return ORIGINAL_SDPA(q, k, v, **kwargs), None

    return run


# ---- torch FlexAttention -------------------------------------------------------------------------

def run_flex(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det=False):
    from torch.nn.attention import flex_attention as fa

    B, Hq, Sq = q.shape[0], q.shape[1], q.shape[2]
    Sk = k.shape[2]
    if q.numel() == 0 or Sk == 0:
        # flex_attention indexes the mask and reduces over keys, which fails on empty shapes; the
        # answer is known: no keys means zeros and lse -inf (DESIGN.md section 4), kept in the graph
        out = q.new_zeros(B, Hq, Sq, v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
        return out, (q.new_full((B, Hq, Sq), -math.inf, dtype=torch.float32) if want_lse else None)
    shift = Sk - Sq if causal == 2 else 0
    full = mask.expand(B, Hq, Sq, Sk) if mask is not None else None

    def score_mod(score, b, h, qi, kj):
        if softcap > 0:
            score = softcap * torch.tanh(score / softcap)
        ok = None
        if full is not None:
            if full.dtype == torch.bool:
                ok = full[b, h, qi, kj]
            else:
                score = score + full[b, h, qi, kj].to(score.dtype)
        ii = qi + shift
        for cond in ((kj <= ii) if causal else None, (kj >= ii - wl) if wl >= 0 else None,
                     (kj <= ii + wr) if wr >= 0 else None):
            if cond is not None:
                ok = cond if ok is None else ok & cond
        return score if ok is None else torch.where(ok, score, -math.inf)

    kwargs = dict(score_mod=score_mod, scale=scale, enable_gqa=Hq != k.shape[1])
    if not want_lse:
        return fa.flex_attention(q, k, v, **kwargs), None
    if hasattr(fa, "AuxRequest"):
        out, aux = fa.flex_attention(q, k, v, return_aux=fa.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return fa.flex_attention(q, k, v, return_lse=True, **kwargs)


# ---- optional packages ---------------------------------------------------------------------------

def _bshd(t):
    return t.transpose(1, 2)


def run_flash_attn_pkg(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det=False):
    """flash_attn.flash_attn_func on (B, S, H, D); its causal and window are bottom-right aligned
    (the planner only routes top-left calls here when Sq == Sk, where the two agree)."""
    import flash_attn

    res = flash_attn.flash_attn_func(
        _bshd(q), _bshd(k), _bshd(v), dropout_p=p, softmax_scale=scale, causal=causal != 0,
        window_size=(wl, wr), softcap=softcap, deterministic=det or torch.are_deterministic_algorithms_enabled(),
        return_attn_probs=want_lse)
    if want_lse:
        out, lse = res[0], res[1]
        return _bshd(out), lse
    return _bshd(res), None


def run_xformers(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det=False):
    """xformers.ops.memory_efficient_attention on (B, S, H, D), or (B, S, G, H/G, D) for GQA."""
    from xformers.ops import fmha, memory_efficient_attention

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if causal and mask is None:
        bias = fmha.attn_bias.LowerTriangularMask() if causal == 1 else fmha.attn_bias.LowerTriangularFromBottomRightMask()
    elif mask is None:
        bias = None
    else:
        vis = _eager.visible_keys(Sq, Sk, causal, -1, -1, q.device)
        add = mask if mask.dtype != torch.bool else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
        if vis is not None:
            add = add.masked_fill(~vis, -math.inf)
        # xformers wants the bias's last dim padded to a multiple of 8 in memory
        pad = (Sk + 7) // 8 * 8
        store = torch.zeros(B, Hq, Sq, pad, dtype=q.dtype, device=q.device)
        store[..., :Sk] = add.to(q.dtype)
        bias = store[..., :Sk]
    qs, ks, vs = _bshd(q), _bshd(k), _bshd(v)
    if Hq != Hkv:
        g = Hq // Hkv
        qs = qs.reshape(B, Sq, Hkv, g, D)
        ks = ks.unsqueeze(3).expand(B, Sk, Hkv, g, D)
        vs = vs.unsqueeze(3).expand(B, Sk, Hkv, g, v.shape[-1])
        if isinstance(bias, torch.Tensor):
            bias = bias.reshape(B, Hkv, g, Sq, Sk)
    out = memory_efficient_attention(qs, ks, vs, attn_bias=bias, p=p, scale=scale)
    return out.reshape(B, Sq, Hq, v.shape[-1]).transpose(1, 2), None


def run_sage_pkg(q, k, v, mask, causal, scale, wl, wr, softcap, p, need_grad, want_lse, det=False):
    """sageattention.sageattn on (B, H, S, D) ("HND" layout)."""
    import sageattention

    return sageattention.sageattn(q, k, v, tensor_layout="HND", is_causal=causal == 1, sm_scale=scale), None


RUNNERS = {
    "flash": run_flash,
    "sage": run_sage,
    "math": run_math,
    "eager": run_eager,
    "sdpa": _sdpa(),
    "_native_flash": _sdpa("FLASH_ATTENTION"),
    "_native_efficient": _sdpa("EFFICIENT_ATTENTION"),
    "_native_cudnn": _sdpa("CUDNN_ATTENTION"),
    "_native_math": _sdpa("MATH"),
    "flex": run_flex,
    "flash_attn_pkg": run_flash_attn_pkg,
    "xformers": run_xformers,
    "sageattention_pkg": run_sage_pkg,
}


# ---- packed (varlen) calls ---------------------------------------------------------------------
# Every varlen runner takes (q, k, v, cu_q, cu_k, host_cu_q, host_cu_k, len_q, len_k, max_q, max_k,
# causal, scale, wl, wr, softcap, p, need_grad, want_lse, deterministic=False) and returns
# (out (Tq, Hq, Dv), lse (Hq, Tq)).

def run_flash_varlen(q, k, v, cu_q, cu_k, hcu_q, hcu_k, len_q, len_k, max_q, max_k, causal, scale, wl, wr,
                     softcap, p, need_grad, want_lse, det=False, sinks=None, alibi=None):
    rng = draw_rng_state(q) if p > 0 else None
    q, k, v = _cuda_qkv(q, k, v)
    if sinks is not None:
        sinks = _flash_sinks(q, sinks, need_grad)
    args = (q, k, v, hcu_q, hcu_k, max_q, max_k, rng, causal, scale, wl, wr, softcap, p)
    if sinks is not None or alibi is not None:
        args += (sinks, alibi)
    if need_grad:
        res = _ops.FlashVarlenFunction.apply(*args, det)
    else:
        res = _no_grad_call(_ops.ops.flash_varlen_fwd.default, *args)
    return res[0], res[1]


def run_sage_varlen(q, k, v, cu_q, cu_k, hcu_q, hcu_k, len_q, len_k, max_q, max_k, causal, scale, wl, wr,
                    softcap, p, need_grad, want_lse, det=False):
    q, k, v = _cuda_qkv(q, k, v)
    return _no_grad_call(_ops.ops.sage_varlen_fwd.default, q, k, v, hcu_q, hcu_k, max_q, max_k, None, causal,
                         scale, wl, wr, softcap, 0.0)


def _padded(dense):
    """A varlen runner from a dense one: pad, one bool mask per sequence, unpad."""
    from . import _varlen

    def run(q, k, v, cu_q, cu_k, hcu_q, hcu_k, len_q, len_k, max_q, max_k, causal, scale, wl, wr, softcap, p,
            need_grad, want_lse, det=False, sinks=None, alibi=None):
        qd, kd, vd = _varlen.pad(q, len_q, max_q), _varlen.pad(k, len_k, max_k), _varlen.pad(v, len_k, max_k)
        mask = _varlen.padded_mask(len_q, len_k, max_q, max_k, causal, wl, wr, q.device)
        if alibi is not None:  # per sequence, as the varlen kernel aligns it: a float mask after padding
            mask = _varlen.alibi_mask(mask, alibi, len_q, len_k, max_q, max_k, q.shape[1],
                                      torch.float64 if q.dtype == torch.float64 else torch.float32)
        extra = (sinks,) if sinks is not None else ()
        out, lse = dense(qd, kd, vd, mask, 0, scale, -1, -1, softcap, p, need_grad, want_lse, det, *extra)
        return _varlen.unpad(out, len_q), (_varlen.unpad_lse(lse, len_q) if lse is not None else None)

    return run


VARLEN_RUNNERS = {
    "flash_varlen": run_flash_varlen,
    "sage": run_sage_varlen,
    "math": _padded(run_math),
    "eager": _padded(run_eager),
}
