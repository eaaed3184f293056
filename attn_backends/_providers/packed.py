"""A packed (varlen) call served by a dense runner: pad each sequence to the longest, one bool mask
per sequence (its lengths, causal and window as the varlen kernels align them, ALiBi as a float mask),
run dense, unpad."""

from __future__ import annotations

import torch

from .. import _varlen


def padded(dense):
    """A runner for packed calls from a dense runner (both take an Attn)."""

    def run(a):
        len_q, len_k, max_q, max_k = a.len_q, a.len_k, a.max_q, a.max_k
        q = a.q
        mask = _varlen.padded_mask(len_q, len_k, max_q, max_k, a.causal, a.wl, a.wr, q.device)
        if a.alibi is not None:  # per sequence, as the varlen kernel aligns it: a float mask after padding
            mask = _varlen.alibi_mask(mask, a.alibi, len_q, len_k, max_q, max_k, q.shape[1],
                                      torch.float64 if q.dtype == torch.float64 else torch.float32)
        dense_call = a._replace(q=_varlen.pad(q, len_q, max_q), k=_varlen.pad(a.k, len_k, max_k),
                                v=_varlen.pad(a.v, len_k, max_k), mask=mask, causal=0, wl=-1, wr=-1, alibi=None,
                                cu_q=None, cu_k=None, hcu_q=None, hcu_k=None, len_q=None, len_k=None, max_q=0,
                                max_k=0)
        out, lse = dense(dense_call)
        return _varlen.unpad(out, len_q), (_varlen.unpad_lse(lse, len_q) if lse is not None else None)

    return run
