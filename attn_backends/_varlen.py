"""Packed (varlen) sequences, as in flash-attn: checks of cu_seqlens on the host, and the padding
that lets every dense backend serve a packed call exactly.

Padding: sequence b's rows go to batch b of a (B, H, max_seqlen, D) tensor; one bool mask per
batch, (B, 1, max_seqlen_q, max_seqlen_k), encodes the key lengths and the causal/window
alignment of that sequence (bottom-right causal is per sequence: Sk_b - Sq_b, which one dense
offset cannot express).  The dense kernels number dropout rows (b * Hq + h) * max_seqlen_q + i,
exactly as the varlen kernel does, so a padded call draws the same dropout mask.
"""

from __future__ import annotations

import torch

from . import _validate


def check_qkv(q, k, v):
    """q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv): returns (Tq, Hq, D, Tk, Hkv, Dv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t, want in (("q", q, "(total_q, Hq, D)"), ("k", k, "(total_k, Hkv, D)"), ("v", v, "(total_k, Hkv, Dv)")):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D {want} for packed sequences, got shape {tuple(t.shape)}")
    if q.dtype not in _validate.FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on the same device, got {q.device}, {k.device} and {v.device}")
    Tq, Hq, D = q.shape
    Tk, Hkv, Dk = k.shape
    Tv, Hv, Dv = v.shape
    if Tv != Tk:
        raise ValueError(f"k and v must have the same number of rows, got {Tk} and {Tv}")
    if Hv != Hkv:
        raise ValueError(f"k and v must have the same number of heads, got {Hkv} and {Hv}")
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim, got {D} and {Dk}")
    if D < 1:
        raise ValueError("the head dim of q and k must be at least 1")
    if (Hq % Hkv != 0) if Hkv else Hq != 0:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the number of key/value heads ({Hkv})")
    return Tq, Hq, D, Tk, Hkv, Dv


# cu_seqlens are int32, so no sequence is longer than this: a larger max_seqlen bounds nothing real
MAX_SEQLEN = 2**31 - 1


def traced_cu_seqlens(cu_q, cu_k, max_q, max_k, device=None):
    """What can be checked of cu_seqlens without reading their values (types, dtypes, shapes, devices;
    max_seqlen as non-negative ints), as torch.compile traces it: no value is read on the host (that would
    break the graph), so the lengths are not known and max_seqlen stays the caller's bound, as flash-attn
    takes it; the kernel's op checks the values in C when it runs (csrc/ab_params.c, check_cu).  Eager
    calls go on to check_cu_seqlens' checks of the values.  Returns (the cu_seqlens as the op takes them:
    contiguous int32 on the CPU, batch, max_q, max_k)."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32 (as in flash-attn), got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be 1-D of length batch + 1, got shape {tuple(cu.shape)}")
        if cu.device.type == "meta" or (device is not None and cu.device.type != "cpu" and cu.device != device):
            raise ValueError(f"{name} must be on the CPU or on q's device ({device}), got a tensor on {cu.device}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got lengths "
                         f"{cu_q.numel()} and {cu_k.numel()}")
    maxima = []
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        try:
            m = _validate.as_int(m, name)
        except TypeError:
            raise ValueError(f"{name} must be a non-negative int, got {m!r}") from None
        if m < 0:
            raise ValueError(f"{name} must be a non-negative int, got {m!r}")
        if m > MAX_SEQLEN:
            raise ValueError(f"{name} = {m} is larger than any sequence int32 cu_seqlens can describe; it must be "
                             f"at most 2**31 - 1 (it is an upper bound of the sequence lengths)")
        maxima.append(m)
    host_q = cu_q.detach().to("cpu").contiguous()
    host_k = cu_k.detach().to("cpu").contiguous()
    return host_q, host_k, cu_q.shape[0] - 1, *maxima


def check_cu_seqlens(cu_q, cu_k, max_q, max_k, Tq, Tk, device=None):
    """Validates cu_seqlens on the host; returns (host int32 copies, batch, lengths q, lengths k).

    cu_seqlens may live on the CPU or on q's device (they are copied to the host once, by
    traced_cu_seqlens, whose checks come first)."""
    host_q, host_k, B, max_q, max_k = traced_cu_seqlens(cu_q, cu_k, max_q, max_k, device)
    lens = []
    for name, cu, total, mx in (("cu_seqlens_q", host_q, Tq, max_q), ("cu_seqlens_k", host_k, Tk, max_k)):
        if cu.numel() <= _LIST_CHECK:
            lens.append(_check_cu_list(name, cu.tolist(), total, mx))
            continue
        if int(cu[0]) != 0:
            raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
        d = cu[1:].long() - cu[:-1].long()
        if (d < 0).any():
            b = int((d < 0).nonzero()[0])
            raise ValueError(f"{name} must be non-decreasing, but {name}[{b}] = {int(cu[b])} > "
                             f"{name}[{b + 1}] = {int(cu[b + 1])}")
        if int(cu[-1]) != total:
            raise ValueError(f"{name}[-1] = {int(cu[-1])} must equal the number of packed rows, {total}")
        if d.numel() and int(d.max()) > mx:
            b = int(d.argmax())
            raise ValueError(f"sequence {b} has {int(d[b])} rows in {name}, more than "
                             f"max_seqlen_{name[-1]} = {mx}")
        lens.append(d)
    return host_q, host_k, B, lens[0], lens[1]


# cu_seqlens up to this length are checked as one list of Python ints (one host read instead of about
# ten small tensor ops, which cost a short decode call tens of microseconds); longer ones with tensor ops
_LIST_CHECK = 4096


def _check_cu_list(name, cu, total, mx):
    """check_cu_seqlens's checks of one host cu_seqlens, as a list; the same errors.  -> the lengths."""
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0]}")
    d = [b - a for a, b in zip(cu, cu[1:])]
    if d and min(d) < 0:
        b = next(i for i, x in enumerate(d) if x < 0)
        raise ValueError(f"{name} must be non-decreasing, but {name}[{b}] = {cu[b]} > {name}[{b + 1}] = {cu[b + 1]}")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] = {cu[-1]} must equal the number of packed rows, {total}")
    if d and max(d) > mx:
        b = d.index(max(d))
        raise ValueError(f"sequence {b} has {d[b]} rows in {name}, more than max_seqlen_{name[-1]} = {mx}")
    return torch.tensor(d, dtype=torch.long)


def longest(lens: torch.Tensor) -> int:
    """The longest sequence (0 for an empty batch)."""
    return int(lens.max()) if lens.numel() else 0


def _index(lens: torch.Tensor, max_len: int, device) -> tuple:
    """(batch index, position) of every packed row."""
    b = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum())) - starts[b]
    return b.to(device), pos.to(device)


def pad(x: torch.Tensor, lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """(total, H, D) -> (B, H, max_len, D), zeros past each sequence (differentiable)."""
    B = lens.numel()
    b, pos = _index(lens, max_len, x.device)
    out = x.new_zeros((B, max_len) + tuple(x.shape[1:]))
    out = out.index_put((b, pos), x)
    return out.transpose(1, 2)


def unpad(y: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """(B, H, max_len, D) -> (total, H, D)."""
    b, pos = _index(lens, y.shape[2], y.device)
    return y.transpose(1, 2)[b, pos]


def unpad_lse(lse: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """(B, H, max_len) -> (H, total), flash-attn's varlen lse layout."""
    b, pos = _index(lens, lse.shape[2], lse.device)
    return lse.permute(0, 2, 1)[b, pos].transpose(0, 1)


def padded_mask(len_q, len_k, max_q, max_k, causal: int, wl: int, wr: int, device) -> torch.Tensor:
    """bool (B, 1, max_q, max_k): key j visible to query i of sequence b (lengths, causal, window,
    aligned per sequence as docs/semantics.md says)."""
    i = torch.arange(max_q).view(1, -1, 1)
    j = torch.arange(max_k).view(1, 1, -1)
    lq = len_q.view(-1, 1, 1)
    lk = len_k.view(-1, 1, 1)
    ii = i + (lk - lq) if causal == 2 else i.expand(lq.shape[0], -1, -1)
    ok = (j < lk) & (i < lq)
    if causal:
        ok &= j <= ii
    if wl >= 0:
        ok &= j >= ii - wl
    if wr >= 0:
        ok &= j <= ii + wr
    return ok.unsqueeze(1).to(device)


def alibi_mask(visible, slopes, len_q, len_k, max_q, max_k, Hq: int, dtype) -> torch.Tensor:
    """A padded call's float mask (B, Hq, max_q, max_k): ALiBi's -slope * |i + Sk_b - Sq_b - j|, aligned
    per sequence as the varlen kernel does (one dense offset cannot express it), -inf where ``visible``
    (padded_mask's bool) hides the key."""
    B = len_q.numel()
    i = torch.arange(max_q).view(1, -1, 1) + (len_k - len_q).view(-1, 1, 1)
    j = torch.arange(max_k).view(1, 1, -1)
    dist = (i - j).abs().to(device=slopes.device, dtype=dtype).unsqueeze(1)  # (B, 1, max_q, max_k)
    bias = -slopes.to(dtype).expand(B, Hq).reshape(B, Hq, 1, 1) * dist
    return bias.masked_fill(~visible.to(bias.device), float("-inf"))
