"""Autocast as torch applies it to F.scaled_dot_product_attention, for our entry points that stand in for it
(``ab.sdpa`` and the patch, HF transformers' attention functions): torch lists sdpa as a lower-precision op
on CPU and CUDA, so under autocast its floating arguments are cast to autocast's dtype before the call."""

from __future__ import annotations

import torch


def autocast_dtype(query):
    """The dtype autocast gives F.sdpa's floating arguments here, or None when it is off for query's device."""
    if not isinstance(query, torch.Tensor):
        return None
    dev = query.device.type
    if not torch.amp.is_autocast_available(dev):
        return None  # a device autocast does not know (meta): F.sdpa casts nothing there, and asking raises
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def autocast_cast(t, dtype, dev):
    """As autocast's cast: floating tensors on its device other than float64 to its dtype; the rest as is."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.device.type == dev:
        return t.to(dtype)
    return t
