"""The eager composite: attention from plain aten ops, for devices without our kernels (MPS, XPU,
anything else torch runs on).

Same semantics as the kernels (docs/semantics.md): float32 (float64 for float64 inputs) scores and
softmax, masks combined with causal and window, softcap, GQA, fully masked rows giving exactly 0
output, -inf lse and zero gradient (never NaN).  Autograd comes from the aten ops themselves.
Dropout uses torch's own dropout on the device: same distribution as the kernels' Philox stream,
not the same mask; given `keep` (the kernels' mask, _ops.keep_mask) it applies that one instead.
Memory is O(Sq x Sk) per head, as in HF's eager attention.

It is also how our kernels' backward is differentiated (_ops.py: double backward): its autograd is
that of plain aten ops, to any order.
"""

from __future__ import annotations

import torch


def visible_keys(Sq: int, Sk: int, causal: int, window_left: int, window_right: int, device,
                 bottom_right: bool = False) -> torch.Tensor | None:
    """bool (Sq, Sk): which keys causal and window let each query see, or None when all.  Queries sit
    bottom-right (i + Sk - Sq) with causal 2, or with bottom_right (flash-attn's window without causal)."""
    if causal == 0 and window_left < 0 and window_right < 0:
        return None
    i = torch.arange(Sq, device=device).unsqueeze(1)
    if causal == 2 or bottom_right:
        i = i + (Sk - Sq)  # bottom-right alignment
    j = torch.arange(Sk, device=device).unsqueeze(0)
    ok = torch.ones((Sq, Sk), dtype=torch.bool, device=device)
    if causal:
        ok = ok & (j <= i)
    if window_left >= 0:
        ok = ok & (j >= i - window_left)
    if window_right >= 0:
        ok = ok & (j <= i + window_right)
    return ok


def alibi_bias(slopes: torch.Tensor, B: int, Hq: int, Sq: int, Sk: int, dtype) -> torch.Tensor:
    """(B, Hq, Sq, Sk) ALiBi bias -slope * |i + Sk - Sq - j| (flash-attn's definition) from slopes
    (Hq,) or (B, Hq)."""
    i = torch.arange(Sq, device=slopes.device).view(Sq, 1) + (Sk - Sq)
    j = torch.arange(Sk, device=slopes.device).view(1, Sk)
    dist = (i - j).abs().to(dtype)
    return -slopes.to(dtype).expand(B, Hq).reshape(B, Hq, 1, 1) * dist


def attention(q, k, v, attn_mask, causal: int, scale: float, window_left: int, window_right: int,
              softcap: float, dropout_p: float, keep: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              alibi: torch.Tensor | None = None):
    """Returns (out (B, Hq, Sq, Dv) in q's dtype, lse (B, Hq, Sq) float32 / float64).

    keep: optional bool (B, Hq, Sq, Sk) dropout keep-mask, applied instead of a fresh draw.
    sinks: optional (Hq,) logits that join each row's softmax denominator (no value); autograd
        reaches them.  alibi: optional (Hq,) or (B, Hq) ALiBi slopes (alibi_bias)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    Hq, Sq = q.shape[1], q.shape[2]
    Hkv, Sk = k.shape[1], k.shape[2]
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    if Hkv != Hq and Hkv > 0:
        kf = kf.repeat_interleave(Hq // Hkv, dim=1)
        vf = vf.repeat_interleave(Hq // Hkv, dim=1)
    # the scale goes where it cannot overflow: into q when it shrinks (a q.k beyond float32 that the scale
    # brings back in range stays finite, as with torch's sqrt(scale) on q and k), onto q.k when it grows
    if abs(scale) <= 1:
        s = torch.matmul(qf * scale, kf.transpose(-2, -1))
    else:
        s = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        s = s + alibi_bias(alibi, q.shape[0], Hq, Sq, Sk, acc)
    visible = visible_keys(Sq, Sk, causal, window_left, window_right, q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = attn_mask if visible is None else visible & attn_mask
        else:
            s = s + attn_mask.to(acc)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # the sink as one more key with no value: its column is dropped after the softmax
        col = sinks.to(acc).view(1, Hq, 1, 1).expand(s.shape[0], Hq, Sq, 1)
        s = torch.cat([s, col], dim=-1)
        Sk = Sk + 1
    # A row with no visible key would give softmax 0/0: compute it on zeros, then force 0, so that
    # neither the output nor the gradient sees a NaN.
    if Sk > 0:
        dead = (s == float("-inf")).all(dim=-1, keepdim=True)
    else:
        dead = torch.ones(s.shape[:-1] + (1,), dtype=torch.bool, device=s.device)
    s_safe = s.masked_fill(dead, 0.0)
    p = torch.softmax(s_safe, dim=-1).masked_fill(dead, 0.0)
    lse = torch.logsumexp(s_safe, dim=-1).masked_fill(dead.squeeze(-1), float("-inf"))
    if sinks is not None:
        p = p[..., :-1]
    if dropout_p > 0 and keep is not None:
        p = p * keep.to(device=p.device, dtype=p.dtype) / (1.0 - dropout_p)
    elif dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)
    out = torch.matmul(p, vf).to(q.dtype)
    return out, lse
