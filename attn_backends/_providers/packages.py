"""The optional packages as runners: flash_attn, xformers, sageattention (CUDA only; imported on
first use)."""

from __future__ import annotations

import math

import torch

from .. import _eager


def _bshd(t):
    return t.transpose(1, 2)


def run_flash_attn_pkg(a):
    """flash_attn.flash_attn_func on (B, S, H, D); its causal and window are bottom-right aligned
    (the planner only routes top-left calls here when Sq == Sk, where the two agree)."""
    q, k, v, causal, scale, wl, wr, softcap, p, want_lse, det = (a.q, a.k, a.v, a.causal, a.scale, a.wl, a.wr,
                                                                  a.softcap, a.p, a.want_lse, a.det)
    import flash_attn

    res = flash_attn.flash_attn_func(
        _bshd(q), _bshd(k), _bshd(v), dropout_p=p, softmax_scale=scale, causal=causal != 0,
        window_size=(wl, wr), softcap=softcap, deterministic=det or torch.are_deterministic_algorithms_enabled(),
        return_attn_probs=want_lse)
    if want_lse:
        out, lse = res[0], res[1]
        return _bshd(out), lse
    return _bshd(res), None


def run_xformers(a):
    """xformers.ops.memory_efficient_attention on (B, S, H, D), or (B, S, G, H/G, D) for GQA."""
    q, k, v, mask, causal, scale, p = a.q, a.k, a.v, a.mask, a.causal, a.scale, a.p
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


def run_sage_pkg(a):
    """sageattention.sageattn on (B, H, S, D) ("HND" layout)."""
    import sageattention

    return sageattention.sageattn(a.q, a.k, a.v, tensor_layout="HND", is_causal=a.causal == 1, sm_scale=a.scale), None
