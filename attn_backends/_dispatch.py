"""From a validated call to a kernel: pick the backend, draw the dropout seed, run it.

This is the issue-2 planner: the math kernel wherever we have one (CPU; CUDA forward), the eager
composite elsewhere.  Named backends that are not built yet fall back to math with one warning.

Per-call cost matters (benchmarks/bench_overhead.py): the common path validates with one
expression, caches the plan per (name, device type, grad, strict), and calls the op below the
autograd layer when no gradient is needed, so the Python autograd wrapper is paid only in training.
"""

from __future__ import annotations

import logging
import os

import torch

from . import _eager, _ops, _validate
from ._names import resolve

logger = logging.getLogger("attn_backends")

_SERVED = {"auto", "math", "eager"}
_warned: set = set()
_plans: dict = {}
_cuda_lib = os.path.join(os.path.dirname(__file__), "libattn_backends_cuda.so")
_math_fwd = _ops.ops.math_fwd.default
_MathFunction = _ops.MathFunction
_below_autograd = torch._C._AutoDispatchBelowAutograd
_is_compiling = torch.compiler.is_compiling
_CPU = torch.device("cpu")


def draw_rng_state() -> torch.Tensor:
    """(seed, offset) for the kernels' Philox stream, drawn from torch's default CPU generator, so
    torch.manual_seed reproduces the dropout mask."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


def _warn_once(requested: str, chosen: str, reason: str) -> None:
    key = (requested, chosen, reason)
    if key not in _warned:
        _warned.add(key)
        logger.warning("backend %r cannot serve this call (%s); using %r", requested, reason, chosen)


_cuda_devices: dict = {}


def cuda_math_ready(index: int) -> str:
    """'' when our CUDA math kernel can run on cuda:index, else why not (asked once per device)."""
    why = _cuda_devices.get(index)
    if why is None:
        if not os.path.exists(_cuda_lib):
            why = "the CUDA library was not built (no nvcc at install time)"
        else:
            from . import _C

            cc, ok, why = _C.cuda_device(index)
            if ok and cc < 80:
                ok, why = False, f"compute capability {cc // 10}.{cc % 10} < 8.0"
            why = "" if ok else why
        _cuda_devices[index] = why
    return why


def choose(name: str, device: torch.device, need_grad: bool, strict: bool) -> str:
    """'math' (our C/CUDA kernel) or 'eager' (the aten composite); cached per argument tuple."""
    device_type = device.type
    key = (name, device_type, device.index, need_grad, strict)
    chosen = _plans.get(key)
    if chosen is not None:
        return chosen
    reason = "" if name in _SERVED else f"{name} is not built in this version"
    if reason and strict:
        raise RuntimeError(f"backend {name!r} cannot serve this call: {reason}")
    if device_type == "cpu":
        chosen = "math"
    elif device_type == "cuda" and not need_grad and not cuda_math_ready(device.index or 0):
        chosen = "math"
    else:
        chosen = "eager"
        if name == "math":
            if device_type != "cuda":
                reason = f"math has no {device_type} kernel"
            elif need_grad:
                reason = "math has no CUDA backward yet"
            else:
                reason = cuda_math_ready(device.index or 0)
            if strict:
                raise RuntimeError(f"backend 'math' cannot serve this call: {reason}")
    if reason:
        _warn_once(name, chosen, reason)
    _plans[key] = chosen
    return chosen


def attention(q, k, v, backend, causal, attn_mask, dropout_p, scale, window, softcap, return_lse, strict):
    B, Hq, Sq, D, Hkv, Sk, Dv = _validate.check_qkv(q, k, v)
    causal_i = _validate.check_causal(causal)
    wl, wr = _validate.check_window(window) if window is not None else (-1, -1)
    scale_f = _validate.check_scale(scale, D)
    softcap_f = _validate.check_softcap(softcap) if softcap else 0.0
    p = _validate.check_dropout(dropout_p) if dropout_p else 0.0
    if attn_mask is not None:
        attn_mask = _validate.check_mask(attn_mask, q, B, Hq, Sq, Sk)
    name = resolve(backend) if backend is not None else "auto"
    need_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (attn_mask is not None and attn_mask.requires_grad)
    )
    chosen = choose(name, _CPU if q.is_cpu else q.device, need_grad, strict)
    if chosen == "math":
        rng = draw_rng_state() if p > 0 else None
        if need_grad:
            out, lse = _MathFunction.apply(q, k, v, attn_mask, rng, causal_i, scale_f, wl, wr, softcap_f, p)
        elif _is_compiling():
            out, lse = _math_fwd(q, k, v, attn_mask, rng, causal_i, scale_f, wl, wr, softcap_f, p)
        else:
            with _below_autograd():
                out, lse = _math_fwd(q, k, v, attn_mask, rng, causal_i, scale_f, wl, wr, softcap_f, p)
    else:
        out, lse = _eager.attention(q, k, v, attn_mask, causal_i, scale_f, wl, wr, softcap_f, p)
    return (out, lse) if return_lse else out
