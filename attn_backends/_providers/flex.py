"""torch's FlexAttention as a runner: our semantics (masks, causal alignments, window, softcap, lse)
as a score_mod."""

from __future__ import annotations

import math

import torch


def run_flex(a):
    from torch.nn.attention import flex_attention as fa

    q, k, v, mask, causal, scale, wl, wr, softcap, want_lse = (a.q, a.k, a.v, a.mask, a.causal, a.scale, a.wl, a.wr,
                                                               a.softcap, a.want_lse)

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
