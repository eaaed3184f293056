"""attn_backends: one attention library for every backend name people already use.

    import attn_backends as ab
    out = ab.attention(q, k, v, causal=True)            # (B, H, S, D), like F.scaled_dot_product_attention

The public API is defined here; everything else is private (modules starting with ``_``).
Semantics shared by every backend: docs/semantics.md.  Architecture: docs/architecture.md.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch  # loads libtorch before our module registers its ops

from . import _C, _ops  # noqa: F401  (registers ops, fake kernels, autograd)
from . import _dispatch
from ._names import resolve as _resolve

__version__ = _C.__version__

__all__ = ["attention", "resolve", "__version__"]

Causal = Union[bool, str]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: Optional[str] = "auto",
    causal: Causal = False,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    strict: bool = False,
):
    """Scaled dot-product attention, served by the best backend for the call.

    Args:
        q: (B, Hq, Sq, D) query, float16 / bfloat16 / float32 / float64.  Any strides.
        k: (B, Hkv, Sk, D) keys; Hq must be a multiple of Hkv (GQA / MQA).
        v: (B, Hkv, Sk, Dv) values.
        backend: any accepted name (``"auto"``, ``"flash"``, ``"flash_attention_2"``, ``"math"``, ...),
            case-insensitive.  An unknown name raises ValueError listing the valid ones.
        causal: False, True (== "top_left": query i sees keys j <= i) or "bottom_right"
            (query i sees keys j <= i + Sk - Sq, the KV-cache convention).
        attn_mask: bool (True = may attend) or float (added to the scores), broadcastable to
            (B, Hq, Sq, Sk); combined with causal and window when both are given.
        dropout_p: probability of dropping an attention weight (kept ones are scaled by
            1 / (1 - p)); the stream comes from torch's generator (torch.manual_seed reproduces it).
        scale: multiplies q.k; default 1 / sqrt(D).
        window: None or (left, right): query i sees keys i' - left <= j <= i' + right, with
            i' = i + Sk - Sq when causal == "bottom_right" and i' = i otherwise; -1 = unbounded.
        softcap: > 0 applies softcap * tanh(score / softcap) before the mask and softmax.
        return_lse: also return lse (B, Hq, Sq), the natural log of the softmax denominator
            (float32; float64 for float64 inputs).  Rows with no visible key have lse = -inf.
        strict: raise instead of falling back when the named backend cannot serve the call.

    Returns:
        out (B, Hq, Sq, Dv) in q's dtype, or (out, lse) with return_lse=True.  A query row with no
        visible key outputs exactly 0 and gets zero gradient.
    """
    return _dispatch.attention(q, k, v, backend, causal, attn_mask, dropout_p, scale, window, softcap,
                               return_lse, strict)


def resolve(name: str) -> str:
    """The canonical backend name for any accepted name (case-insensitive, '-' == '_').

    Raises ValueError listing every valid name when ``name`` is unknown.
    """
    return _resolve(name)
