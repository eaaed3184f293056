"""Merging two partial attention results over disjoint key sets (split-KV decode, ring attention).

Each part is (out, lse): the softmax-weighted values over its keys and the natural log of its
softmax denominator.  The merge rescales both to the common denominator in float32:

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

computed around m = max(lse_a, lse_b) so nothing overflows.  A part with lse = -inf (no visible
key) weighs 0, whatever its out holds (NaN included); when both are -inf the row stays fully masked:
out 0, lse -inf.  A NaN lse makes the row's out and lse NaN (the split-KV kernels' rule); an lse of
+inf gives lse +inf, out NaN, as torch.logaddexp and the float64 reference's softmax do.
"""

from __future__ import annotations

import torch


def _check(out_a, lse_a, out_b, lse_b) -> None:
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have the same shape, got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    if out_a.dim() < 1:
        raise ValueError("out_a must have at least one dimension (the head dim last)")
    want = tuple(out_a.shape[:-1])
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != want:
            raise ValueError(f"{name} must have out's shape without its last dim, {want}, got {tuple(lse.shape)} "
                             "(for flash-attn's (B, S, H, D) outputs with (B, H, S) lse, pass lse.transpose(1, 2))")
        if not lse.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (float32), got {lse.dtype}")
    if not out_a.is_floating_point() or out_a.dtype != out_b.dtype:
        raise TypeError(f"out_a and out_b must share one floating-point dtype, got {out_a.dtype} and {out_b.dtype}")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devices) != 1:
        raise ValueError(f"out_a, lse_a, out_b and lse_b must be on one device, got {sorted(map(str, devices))}")


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """(out, lse) of attention over the union of two disjoint key sets; out in out_a's dtype, lse
    float32 (float64 when any input is float64, in either order).  Differentiable; a row neither part
    saw gets zero gradients."""
    _check(out_a, lse_a, out_b, lse_b)
    acc = torch.float64 if torch.float64 in (out_a.dtype, lse_a.dtype, lse_b.dtype) else torch.float32
    la, lb = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # both parts empty: keep exp() finite
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    seen = total != 0  # NaN too: a NaN lse gives NaN, as torch.logaddexp does, not the empty row's -inf
    safe = torch.where(seen, total, torch.ones_like(total))  # no log(0) or 1/0, whose gradients are NaN
    # a row no part saw: lse -inf, and no gradient through it (0/0 in log's backward made it NaN)
    lse = torch.where(seen, m + torch.log(safe), torch.full_like(total, float("-inf")))
    lse = torch.where(torch.isposinf(m), m, lse)  # an lse of +inf stays +inf (out is NaN: inf - inf)
    inv = torch.where(seen, 1.0 / safe, torch.zeros_like(total))
    # an empty part's (lse -inf) out is whatever its producer left (NaN from a kernel that divides 0 by 0): it
    # weighs 0, so it is taken as 0 first (0 * NaN would make the row NaN, and its gradient too); a part whose
    # weight merely underflows keeps its out, NaN included
    oa = torch.where(torch.isneginf(la).unsqueeze(-1), 0.0, out_a.to(acc))
    ob = torch.where(torch.isneginf(lb).unsqueeze(-1), 0.0, out_b.to(acc))
    out = (oa * (wa * inv).unsqueeze(-1) + ob * (wb * inv).unsqueeze(-1)).to(out_a.dtype)
    return out, lse
