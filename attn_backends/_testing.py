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


# CPU kernel paths that run tile kernels on an emulation of the instructions (csrc/cpu/ab_amx.h):
# everywhere, but slowly, so tests give them a reduced grid that still reaches every code path
EMULATED_ISAS = ("amx_emu",)


def cpu_isas() -> list:
    """The CPU kernel paths (ISAs) this machine can run, for tests that run on each: the vector
    paths, AMX tiles where the CPU has them, and the emulated tiles everywhere."""
    from . import _C

    return [isa for isa in ("generic", "avx2", "avx512", "amx", "amx_emu") if _C.cpu_isa_supported(isa)]


def decode_bf16_products(dtype, rows: int = 1) -> bool:
    """Whether the CPU decode kernel multiplies a cache of `dtype` in bfloat16 on the current path for a call of
    `rows` query rows per KV head, Sq x Hq / Hkv (csrc/cpu/decode_cpu.c, ab_kvcache_cpu_bf16_products): a
    bfloat16 cache, AVX512_BF16 on the CPU, the avx512 or amx path; on an Intel CPU at most 2 rows;
    ATTN_BACKENDS_DECODE_BF16_DOT=1 or =0 forces it."""
    import os

    from . import _C

    feats = _C.cpu_features()
    if not (dtype == torch.bfloat16 and feats.get("avx512_bf16") and _C.cpu_isa() in ("avx512", "amx")):
        return False
    forced = os.environ.get("ATTN_BACKENDS_DECODE_BF16_DOT")
    if forced in ("0", "1"):
        return forced == "1"
    return rows <= 2 or feats.get("vendor") != "GenuineIntel"


def _decode_tile_shape(dtype, D: int, borrowed: bool) -> bool:
    """What both kinds of the CPU decode kernel's tiles ask (csrc/cpu/decode_cpu.c, decode_table and tile_shape):
    a path whose kernel has tiles (amx, amx_emu, or avx512 on a CPU whose tiles are usable where `borrowed` says
    it borrows them), a bfloat16 cache, D a multiple of 32 up to 256, and neither ATTN_BACKENDS_DECODE_AMX nor
    ATTN_BACKENDS_DECODE_BF16_DOT set to 0."""
    import os

    from . import _C

    isa = _C.cpu_isa()
    path = isa in ("amx", "amx_emu") or (isa == "avx512" and _C.cpu_isa_supported("amx") and borrowed)
    return (path and dtype == torch.bfloat16 and D % 32 == 0 and D <= 256
            and os.environ.get("ATTN_BACKENDS_DECODE_AMX") != "0"
            and os.environ.get("ATTN_BACKENDS_DECODE_BF16_DOT") != "0")


def decode_tiles(dtype, G: int, D: int, Sq: int = 1) -> bool:
    """Whether the CPU decode kernel takes steps 1 and 3 of a one-token call on AMX tiles on the current path
    (csrc/cpu/decode_cpu.c, amx_tiles): _decode_tile_shape, the avx512 path borrowing only with
    ATTN_BACKENDS_DECODE_AMX=1; one query token, 2 to 16 query heads per KV head, where decode_amx_rows does not
    take it."""
    import os

    borrowed = os.environ.get("ATTN_BACKENDS_DECODE_AMX") == "1"
    return (_decode_tile_shape(dtype, D, borrowed) and Sq == 1 and 2 <= G <= 16
            and not decode_amx_rows(dtype, G, D, Sq, positions=0))  # one token: the cache's size is not asked


def decode_amx_rows(dtype, G: int, D: int, Sq: int, positions: int) -> bool:
    """Whether the CPU decode kernel takes every tile of a call through its tiled products with both products on
    AMX tiles on the current path (csrc/cpu/decode_cpu.c, amx_rows; decode_cpu_impl.h, "tiles of many rows"):
    _decode_tile_shape (the avx512 path borrows for these calls), at least 2 query tokens and 16 query rows per KV
    head (Sq x G), or 4 in GQA and 8 in MHA where a cache row holds 128 positions or more (`positions`: the dense
    cache's second size, or block_table's columns times the block size), or any call with
    ATTN_BACKENDS_DECODE_AMX_ROWS=1; none with it set to 0."""
    import os

    if not _decode_tile_shape(dtype, D, borrowed=True):
        return False
    forced = os.environ.get("ATTN_BACKENDS_DECODE_AMX_ROWS")
    if forced in ("0", "1"):
        return forced == "1"
    return Sq >= 2 and (Sq * G >= 16 or (Sq * G >= (8 if G == 1 else 4) and positions >= 128))


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
        # as distances, so that a side near 2**63 (wider than any sequence) cannot wrap ii +- side
        if left >= 0:
            ok &= j - ii >= -left
        if right >= 0:
            ok &= j - ii <= right
    return ok


def reference_attention(q, k, v, *, causal=False, attn_mask=None, scale=None, window=None, softcap=0.0,
                        keep=None, dropout_p=0.0, dtype=torch.float64, only_visible=False, sinks=None,
                        alibi_slopes=None):
    """Attention from plain torch ops in ``dtype`` (float64 for ref64).

    sinks: optional (Hq,) attention sinks: an extra logit per head in every row's softmax denominator
        with no value (lse includes it; a row that sees no key outputs 0 with lse = sinks[h]).
        Differentiable.
    alibi_slopes: optional (Hq,) or (B, Hq): the score of (i, j) gets -slope * |i + Sk - Sq - j|
        after softcap (flash-attn's ALiBi).

    keep: optional bool (B, Hq, Sq, Sk) dropout keep-mask; kept weights are scaled by 1/(1-p).
    only_visible: sum P.V over the keys each row may see only (score above -inf), so a NaN or inf
        value a row cannot see never reaches it (a plain matmul spreads it through 0 * NaN;
        docs/reliability.md).
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
    if alibi_slopes is not None:
        i = torch.arange(Sq, device=q.device).view(-1, 1) + (Sk - Sq)
        j = torch.arange(Sk, device=q.device).view(1, -1)
        slopes = alibi_slopes.to(dtype).expand(B, Hq).reshape(B, Hq, 1, 1)
        s = s - slopes * (i - j).abs().to(dtype)
    allowed = visible(Sq, Sk, causal, window, q.device).expand(B, Hq, Sq, Sk)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            s = s + attn_mask.to(dtype)
    s = torch.where(allowed, s, torch.full_like(s, -math.inf))
    if sinks is not None:
        # the sink is one more key per head whose value is 0: p and lse over Sk + 1 columns, the sink's dropped
        sink_col = sinks.to(dtype).view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)
        v0 = torch.cat([v, torch.zeros_like(v[:, :, :1])], dim=2)
        o, lse = reference_attention_logits(torch.cat([s, sink_col], dim=-1), v0, keep, dropout_p, only_visible)
        return o, lse
    if Sk == 0:  # no keys at all: every row is fully masked (amax needs a non-empty dim)
        out = torch.zeros(B, Hq, Sq, v.shape[-1], dtype=dtype, device=q.device) + 0 * q.sum() + 0 * v.sum()
        return out, torch.full((B, Hq, Sq), -math.inf, dtype=dtype, device=q.device)
    dead = (s == -math.inf).all(dim=-1, keepdim=True)  # no visible key: output 0, lse -inf
    s0 = torch.where(dead, torch.zeros_like(s), s)
    m = s0.amax(dim=-1, keepdim=True).detach()
    e = torch.exp(s0 - m)
    denom = e.sum(dim=-1, keepdim=True)
    p = torch.where(dead, torch.zeros_like(e), e / denom)
    lse = torch.where(dead, torch.full_like(denom, -math.inf), m + torch.log(denom)).squeeze(-1)
    if keep is not None and dropout_p > 0:
        p = p * keep.to(dtype) / (1.0 - dropout_p)
    if only_visible:
        # a score of -inf, from the mask or from the data (q or k of -inf), hides that key
        seen = s != -math.inf
        terms = p[..., None] * v[:, :, None, :, :]  # (B, Hq, Sq, Sk, Dv): small problems only
        return torch.where(seen[..., None], terms, torch.zeros_like(terms)).sum(-2), lse
    out = torch.einsum("bhij,bhjd->bhid", p, v)
    return out, lse


def reference_attention_logits(s, v, keep=None, dropout_p=0.0, only_visible=False):
    """The softmax and P V of reference_attention from finished scores s (B, Hq, Sq, n), -inf where
    hidden; v (B, Hq, n, Dv).  keep, when given, covers the first keep.shape[-1] columns (the keys; a
    sink column after them is never dropped)."""
    dead = (s == -math.inf).all(dim=-1, keepdim=True)
    s0 = torch.where(dead, torch.zeros_like(s), s)
    m = s0.amax(dim=-1, keepdim=True).detach()
    e = torch.exp(s0 - m)
    denom = e.sum(dim=-1, keepdim=True)
    p = torch.where(dead, torch.zeros_like(e), e / denom)
    lse = torch.where(dead, torch.full_like(denom, -math.inf), m + torch.log(denom)).squeeze(-1)
    if keep is not None and dropout_p > 0:
        n = keep.shape[-1]
        p = torch.cat([p[..., :n] * keep.to(p.dtype) / (1.0 - dropout_p), p[..., n:]], dim=-1)
    if only_visible:
        seen = s != -math.inf
        terms = p[..., None] * v[:, :, None, :, :]
        return torch.where(seen[..., None], terms, torch.zeros_like(terms)).sum(-2), lse
    return torch.einsum("bhij,bhjd->bhid", p, v), lse


def sage_recipe(q, k, v, *, scale=None, **opts):
    """The CUDA sage kernel's arithmetic in float64 (docs/sage.md, "CUDA"), for its tests: K's mean
    and channel factor c = sqrt(max |K - mean|) per (batch, KV head) over the sequence, Q' = Q c and
    K' = (K - mean) / c quantized to int8 per row (round half to even, scale amax / 127), scores
    sq sk (Q'q . K'q) + q . mean.  Only the 16-bit rounding of P and of the output is left out.
    Dense (B, H, S, D) inputs; opts as reference_attention's.  Returns (out, lse)."""
    q, k = q.double(), k.double()
    group = q.shape[1] // k.shape[1]
    mean = k.mean(dim=2, keepdim=True)
    c = (k - mean).abs().amax(dim=2, keepdim=True).sqrt() if k.shape[2] else torch.ones_like(mean)
    c = torch.where((c > 0) & torch.isfinite(c), c, torch.ones_like(c))

    def quant(x):
        amax = x.abs().amax(dim=-1, keepdim=True)
        s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        return torch.round(x / s), torch.where(amax > 0, s, torch.zeros_like(s))

    kq, ks = quant((k - mean) / c)
    qq, qs = quant(q * c.repeat_interleave(group, dim=1))
    bias = (q * mean.repeat_interleave(group, dim=1)).sum(-1, keepdim=True)
    # q_eff . k_eff = qs ks (qq . kq) + q . mean: the recipe's score, fed to the exact reference
    q_eff = torch.cat([qq * qs, bias], dim=-1)
    k_eff = torch.cat([kq * ks, torch.ones_like(ks)], dim=-1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return reference_attention(q_eff, k_eff, v, scale=scale, dtype=torch.float64, **opts)


def nonfinite_pattern(t: torch.Tensor) -> torch.Tensor:
    """Where t is NaN, +inf and -inf, stacked (3, *t.shape): two outputs with the same non-finite elements of
    the same kinds have equal patterns."""
    return torch.stack([torch.isnan(t), torch.isposinf(t), torch.isneginf(t)])


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


def flat_softmax_floor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gout: torch.Tensor,
                       scale: Optional[float] = None) -> float:
    """Float32 gradient floor for problems where some row's softmax does not depend on its scores:
    the row sees exactly one key, or all the keys it sees are the same vector.

    There the exact dS = P * (dP - delta) cancels to 0 (or its sum against k does), and what is
    left is rounding residue: flash (like FlashAttention-2) takes delta = rowsum(dO * O) from the
    stored output rather than summing P * dP, and any order of summation leaves a few
    eps * sum|dO| * max|v| in dS; dq and dk carry it times scale * max|k| (resp. |q|).  The floor
    is that bound, never below 1e-5."""
    f = lambda t: float(t.detach().abs().amax()) if t.numel() else 0.0
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    row = float(gout.detach().double().abs().sum(-1).amax()) if gout.numel() else 0.0
    bound = 4 * torch.finfo(torch.float32).eps * abs(scale) * max(f(q), f(k)) * row * f(v)
    return max(1e-5, bound)


def check_2x(name: str, ours: torch.Tensor, ref64: torch.Tensor, same_dtype: torch.Tensor, k: float,
             dtype: torch.dtype, floor: Optional[float] = None) -> None:
    """Asserts the DESIGN.md rule for one tensor, with a message that shows all three errors."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    err = max_err(ours, ref64)
    base = max_err(same_dtype, ref64)
    floor = FLOORS[dtype] if floor is None else floor
    bound = k * base + floor
    assert err <= bound, f"{name}: max|ours - ref64| = {err:.3g} > {k} * {base:.3g} + {floor:g}"


def check_out_and_grads_2x(out: torch.Tensor, grads, inputs, g: torch.Tensor, dtype: torch.dtype,
                           **ref_opts) -> None:
    """The rule for an output (k = 2) and its gradients dq, dk, dv (k = 3) under the output
    gradient g: against reference_attention(*inputs, **ref_opts) run in float64 and in dtype."""
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    r_out, _ = reference_attention(*leaves64, **ref_opts)
    ref = torch.autograd.grad(r_out, leaves64, g.double())
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    d_out, _ = reference_attention(*leaves, dtype=dtype, **ref_opts)
    same = torch.autograd.grad(d_out, leaves, g)
    check_2x("out", out, r_out, d_out, 2, dtype)
    for name, a, r, s in zip(("dq", "dk", "dv"), grads, ref, same):
        check_2x(name, a, r, s, 3, dtype)


def out_and_grads_three_ways(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gout: torch.Tensor,
                              return_lse: bool = False, **opts):
    """One call and its gradients (dq, dk, dv) under the output gradient gout, three ways, each on
    fresh leaves: ours (``ab.attention(..., backend=backend, strict=True)``), reference_attention in
    float64 and reference_attention in q's dtype (torch's error).  Returns three (out, lse, grads);
    ours has lse None unless return_lse (the call is then made with return_lse=True)."""
    from . import attention

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    res = attention(*leaves, backend=backend, strict=True, return_lse=return_lse, **opts)
    out, lse = res if return_lse else (res, None)
    ours = (out, lse, torch.autograd.grad(out, leaves, gout))
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = reference_attention(*r, **opts)
    ref = (r_out, r_lse, torch.autograd.grad(r_out, r, gout.double()))
    d = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    d_out, d_lse = reference_attention(*d, dtype=q.dtype, **opts)
    same = (d_out, d_lse, torch.autograd.grad(d_out, d, gout))
    return ours, ref, same


def keep_mask_for_next_call(seed: int, B: int, H: int, Sq: int, Sk: int, p: float) -> torch.Tensor:
    """The dropout keep-mask (on the CPU) the next attention call draws after torch.manual_seed(seed)."""
    from . import _providers
    from ._ops import ops

    torch.manual_seed(seed)
    return ops.dropout_mask(_providers.draw_rng_state(), B, H, Sq, Sk, p)


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


def make_packed(lens_q, lens_k, Hq, Hkv, D, Dv, dtype, generator=None):
    """Random packed (varlen) inputs: q (sum lens_q, Hq, D), k, v and int32 cu_seqlens."""
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = torch.randn(Tq, Hq, D, generator=generator).to(dtype)
    k = torch.randn(Tk, Hkv, D, generator=generator).to(dtype)
    v = torch.randn(Tk, Hkv, Dv, generator=generator).to(dtype)
    cu_q = torch.tensor([0] + [sum(lens_q[:i + 1]) for i in range(len(lens_q))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(lens_k[:i + 1]) for i in range(len(lens_k))], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def varlen_reference(q, k, v, cu_q, cu_k, dtype=torch.float64, **opts):
    """reference_attention per packed sequence; returns (out (Tq, Hq, Dv), lse (Hq, Tq)).
    alibi_slopes (B, Hq) gives sequence b its row b."""
    outs, lses = [], []
    alibi = opts.pop("alibi_slopes", None)
    for b in range(cu_q.numel() - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]
        ks = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None]
        vs = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None]
        if alibi is not None:
            opts["alibi_slopes"] = alibi[b] if alibi.dim() == 2 else alibi
        o, lse = reference_attention(qs, ks, vs, dtype=dtype, **opts)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    if not outs:
        return (torch.zeros(0, q.shape[1], v.shape[2], dtype=dtype, device=q.device),
                torch.zeros(q.shape[1], 0, dtype=dtype, device=q.device))
    return torch.cat(outs), torch.cat(lses, dim=1)


# ---- leak checks (tests/test_reliability.py, benchmarks/leak_check.py) -----------------------------


def _trim() -> None:
    """Collect garbage and hand freed heap pages back, so RSS shows what is really held."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 where unavailable)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def live_tensors() -> int:
    """How many torch.Tensor objects the garbage collector can see."""
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # type(): no __class__ lookups


def leak_workloads() -> dict:
    """name -> a function making one small call of that kind (B=1 H=1 S=16 D=64 unless noted)."""
    import attn_backends as ab

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 64, generator=g) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    mask = torch.rand(1, 1, 16, 16, generator=g) > 0.3
    pq, pk, pv, cu_q, cu_k = make_packed([5, 11], [7, 9], 2, 1, 32, 32, torch.float32, g)
    ops = torch.ops.attn_backends

    def forward():
        ab.attention(q, k, v)

    def forward_backward():
        out = ab.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), out)

    def masked_dropout():
        ab.attention(qg, kg, vg, attn_mask=mask, dropout_p=0.1).sum().backward()

    def varlen():
        ab.attention_varlen(pq, pk, pv, cu_q, cu_k, 11, 9, causal=True, return_lse=True)

    def planner():
        # a cold plan every call (the cached one dropped first): the C planner with every backend's reasons
        sig = ab._dispatch.prepare(q, k, v, "flash_attention_2", "bottom_right", mask, 0.0, None, (4, 0), 0.0,
                                   True)[1]
        ab._planner._plans.pop(sig, None)
        ab._planner.build(sig)

    def explain():
        str(ab.explain(q, k, v, backend="sdpa", causal=True))

    def patched_sdpa():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def errors():
        # the error paths: Python-side validation and the C core's checks behind the op
        try:
            ab.attention(q, k, v[..., :3, :])
        except ValueError:
            pass
        try:
            ops.math_fwd(q, k, v, None, None, 3, 0.125, -1, -1, 0.0, 0.0)
        except RuntimeError:
            pass

    return dict(forward=forward, forward_backward=forward_backward, masked_dropout=masked_dropout,
                varlen=varlen, planner=planner, explain=explain, patched_sdpa=patched_sdpa, errors=errors)


def leak_check(name, calls: int, warmup: int = 200, checkpoints: int = 1) -> dict:
    """Runs ``calls`` calls of workload ``name`` (a leak_workloads() key, or any callable) after
    ``warmup`` ones; returns the RSS (bytes) before and at each checkpoint, the live tensor count
    before and after, and the time taken."""
    import time

    import attn_backends as ab

    fn = leak_workloads()[name] if isinstance(name, str) else name
    ctx = ab.patched_sdpa("flash") if name == "patched_sdpa" else _null()
    with ctx:
        for _ in range(warmup):
            fn()
        _trim()
        rss = [rss_bytes()]
        tensors = [live_tensors()]
        t0 = time.perf_counter()
        per = max(1, calls // checkpoints)
        done = 0
        while done < calls:
            n = min(per, calls - done)
            for _ in range(n):
                fn()
            done += n
            _trim()
            rss.append(rss_bytes())
        seconds = time.perf_counter() - t0
        tensors.append(live_tensors())
    return dict(name=getattr(name, "__name__", name), calls=calls, seconds=seconds, rss=rss, tensors=tensors,
                rss_growth=rss[-1] - rss[0], tensor_growth=tensors[-1] - tensors[0])


def _null():
    import contextlib

    return contextlib.nullcontext()


def continuous_batching_config(page_size: int, **kw):
    """transformers' ContinuousBatchingConfig for tests and benchmarks across its versions: the page
    size is `page_size` (5.24) or `block_size` (5.17); options an older version lacks are dropped
    (`auto_switch_to_flash`: a version without it never switches)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kw["page_size" if "page_size" in names else "block_size"] = page_size
    return ContinuousBatchingConfig(**{k: v for k, v in kw.items() if k in names or k != "auto_switch_to_flash"})
