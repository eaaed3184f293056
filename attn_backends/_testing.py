"""The float64 reference, the error rule and the case generator shared by tests and benchmarks.

DESIGN.md section 5: a backend passes when, for the output and every gradient,

    max|ours - ref64| <= k * max|torch_same_dtype - ref64| + floor

where ref64 is ``reference_attention`` in float64, torch_same_dtype is the same plain-ops function
run in the input dtype, k = 2 for outputs and 3 for gradients, and NaN never passes.

The reference is written independently of the kernels and of the eager backend: explicit index
arithmetic for causal and window, a keep-mask argument for dropout, and fully masked rows forced to
zero output and -inf lse.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional

import torch

FLOORS = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def visible(Sq: int, Sk: int, causal, window, device=None) -> torch.Tensor:
    """bool (Sq, Sk): key j is visible to query i under causal and window (docs/semantics.md)."""
    i = torch.arange(Sq, device=device).view(-1, 1)
    j = torch.arange(Sk, device=device).view(1, -1)
    ii = i + (Sk - Sq) if causal == "bottom_right" else i
    ok = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if causal in (True, "top_left", "bottom_right"):
        ok &= j <= ii
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= ii - left
        if right >= 0:
            ok &= j <= ii + right
    return ok


def reference_attention(q, k, v, *, causal=False, attn_mask=None, scale=None, window=None, softcap=0.0,
                        keep=None, dropout_p=0.0, dtype=torch.float64):
    """Attention from plain torch ops in ``dtype`` (float64 for ref64).

    keep: optional bool (B, Hq, Sq, Sk) dropout keep-mask; kept weights are scaled by 1/(1-p).
    Returns (out (B, Hq, Sq, Dv), lse (B, Hq, Sq)); out and lse are differentiable.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if Hkv != Hq:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    allowed = visible(Sq, Sk, causal, window, q.device).expand(B, Hq, Sq, Sk)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            s = s + attn_mask.to(dtype)
    s = torch.where(allowed, s, torch.full_like(s, -math.inf))
    dead = (s == -math.inf).all(dim=-1, keepdim=True)  # no visible key: output 0, lse -inf
    s0 = torch.where(dead, torch.zeros_like(s), s)
    m = s0.amax(dim=-1, keepdim=True).detach()
    e = torch.exp(s0 - m)
    denom = e.sum(dim=-1, keepdim=True)
    p = torch.where(dead, torch.zeros_like(e), e / denom)
    lse = torch.where(dead, torch.full_like(denom, -math.inf), m + torch.log(denom)).squeeze(-1)
    if keep is not None and dropout_p > 0:
        p = p * keep.to(dtype) / (1.0 - dropout_p)
    out = torch.einsum("bhij,bhjd->bhid", p, v)
    return out, lse


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; NaN (or NaN in only one of them) gives inf so it never passes."""
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a64.numel() == 0:
        return 0.0
    if torch.isnan(a64).any() or torch.isnan(b64).any():
        return math.inf
    both_inf = torch.isinf(a64) & torch.isinf(b64) & (a64 == b64)
    d = torch.where(both_inf, torch.zeros_like(a64), (a64 - b64).abs())
    return float(d.max())


def check_2x(name: str, ours: torch.Tensor, ref64: torch.Tensor, same_dtype: torch.Tensor, k: float,
             dtype: torch.dtype, floor: Optional[float] = None) -> None:
    """Asserts the DESIGN.md rule for one tensor, with a message that shows all three errors."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    err = max_err(ours, ref64)
    base = max_err(same_dtype, ref64)
    floor = FLOORS[dtype] if floor is None else floor
    bound = k * base + floor
    assert err <= bound, f"{name}: max|ours - ref64| = {err:.3g} > {k} * {base:.3g} + {floor:g}"


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: shapes, dtype and options (the grid tests and benchmarks share)."""

    B: int = 1
    Hq: int = 2
    Hkv: int = 2
    Sq: int = 17
    Sk: int = 17
    D: int = 40
    Dv: Optional[int] = None
    dtype: torch.dtype = torch.float32
    causal: object = False
    mask: str = "none"  # none | bool | float | bool_rows (fully masked rows) | float_rows | key_padding
    window: Optional[tuple] = None
    softcap: float = 0.0
    layout: str = "bhsd"  # bhsd | bshd (transposed view) | strided_d (last dim not contiguous)

    @property
    def dv(self) -> int:
        return self.D if self.Dv is None else self.Dv

    def __str__(self) -> str:
        parts = [f"B{self.B}", f"H{self.Hq}/{self.Hkv}", f"S{self.Sq}x{self.Sk}", f"D{self.D}"]
        if self.Dv is not None:
            parts.append(f"Dv{self.Dv}")
        parts.append(str(self.dtype).replace("torch.", ""))
        if self.causal:
            parts.append("causal" if self.causal is True else str(self.causal))
        if self.mask != "none":
            parts.append(f"mask={self.mask}")
        if self.window is not None:
            parts.append(f"win={self.window[0]},{self.window[1]}")
        if self.softcap:
            parts.append(f"cap={self.softcap:g}")
        if self.layout != "bhsd":
            parts.append(self.layout)
        return "-".join(parts)


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as t (B, H, S, D), stored in another layout."""
    if layout == "bshd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided_d":
        wide = torch.empty(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t.contiguous()


def make_inputs(case: Case, device="cpu", requires_grad: bool = False, generator=None):
    """Fresh random q, k, v and mask for a case; returns (q, k, v, attn_mask)."""
    g = generator

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=case.dtype)

    q = _layout(rnd(case.B, case.Hq, case.Sq, case.D), case.layout)
    k = _layout(rnd(case.B, case.Hkv, case.Sk, case.D), case.layout)
    v = _layout(rnd(case.B, case.Hkv, case.Sk, case.dv), case.layout)
    mask = make_mask(case, device, g)
    if requires_grad:
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
    return q, k, v, mask


def make_mask(case: Case, device="cpu", generator=None):
    B, Hq, Sq, Sk = case.B, case.Hq, case.Sq, case.Sk
    if case.mask == "none":
        return None
    if case.mask == "key_padding":  # (B, 1, 1, Sk): the HF padding mask shape
        lengths = torch.randint(1, Sk + 1, (B,), generator=generator)
        return (torch.arange(Sk).view(1, 1, 1, Sk) < lengths.view(B, 1, 1, 1)).to(device)
    m = torch.rand(B, 1, Sq, Sk, generator=generator) > 0.3  # broadcast over heads
    if case.mask.endswith("_rows") and Sq > 1:
        m[:, :, ::3, :] = False  # every third query row sees nothing
    if case.mask.startswith("bool"):
        return m.to(device)
    bias = torch.randn(B, 1, Sq, Sk, generator=generator)
    bias = torch.where(m, bias, torch.full_like(bias, -math.inf))
    return bias.to(device=device, dtype=case.dtype if case.dtype != torch.float64 else torch.float64)


def cases(quick: bool = False) -> Iterator[Case]:
    """The test grid: odd sizes, GQA, both causal alignments, masks with fully masked rows,
    windows, softcap, non-contiguous layouts, every dtype."""
    base = [
        Case(B=1, Hq=1, Hkv=1, Sq=1, Sk=1, D=8),
        Case(B=2, Hq=4, Hkv=2, Sq=17, Sk=23, D=40, Dv=24),
        Case(B=1, Hq=3, Hkv=1, Sq=257, Sk=129, D=96),
        Case(B=1, Hq=2, Hkv=2, Sq=33, Sk=65, D=256, Dv=64),
        Case(B=2, Hq=2, Hkv=1, Sq=64, Sk=17, D=64),
    ]
    variants = [
        dict(),
        dict(causal=True),
        dict(causal="bottom_right"),
        dict(mask="bool_rows"),
        dict(mask="float_rows", causal=True),
        dict(mask="key_padding", causal="bottom_right"),
        dict(window=(5, 0)),
        dict(window=(3, 7), causal="bottom_right"),
        dict(softcap=5.0, mask="bool"),
        dict(layout="bshd"),
        dict(layout="strided_d", causal=True),
    ]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    for bi, b in enumerate(base):
        for vi, var in enumerate(variants):
            if quick and (bi + vi) % 3:
                continue
            for di, dt in enumerate(dtypes):
                if (bi + vi + di) % 2 and dt != torch.float32:
                    continue  # every variant in float32, the other dtypes on a rotating half
                yield dataclasses.replace(b, dtype=dt, **var)


def check_against_reference(case: Case, fn, *, grad: bool = True, check_lse: bool = True,
                            device="cpu", generator=None, grad_floor: Optional[float] = None) -> None:
    """Runs ``fn(q, k, v, attn_mask, case) -> (out, lse)`` on fresh inputs for ``case`` and asserts
    the 2x rule on out (k=2), lse (k=2) and, with grad, dq, dk, dv (k=3) against ref64.
    grad_floor replaces the dtype's floor for the gradients (see its callers for why)."""
    q, k, v, mask = make_inputs(case, device=device, requires_grad=grad, generator=generator)
    opts = dict(causal=case.causal, attn_mask=mask, window=case.window, softcap=case.softcap)
    out, lse = fn(q, k, v, mask, case)

    def leaves(dtype):
        return [t.detach().to(dtype).requires_grad_(grad) for t in (q, k, v)]

    q64, k64, v64 = leaves(torch.float64)
    r_out, r_lse = reference_attention(q64, k64, v64, **opts)
    qd, kd, vd = leaves(case.dtype)
    d_out, d_lse = reference_attention(qd, kd, vd, dtype=case.dtype, **opts)
    check_2x("out", out, r_out, d_out, 2, case.dtype)
    if check_lse:
        check_2x("lse", lse, r_lse, d_lse, 2, case.dtype)
    if not grad:
        return
    g = torch.randn(out.shape, generator=generator, dtype=torch.float32).to(device=out.device, dtype=out.dtype)
    ours = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.autograd.grad(r_out, (q64, k64, v64), g.to(torch.float64))
    same = torch.autograd.grad(d_out, (qd, kd, vd), g)
    for name, a, r, s in zip(("dq", "dk", "dv"), ours, ref, same):
        check_2x(name, a, r, s, 3, case.dtype, grad_floor)
