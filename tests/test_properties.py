"""Property-based tests (hypothesis): random problems against the float64 reference.

Every drawn problem (shape, strides, dtype, mask, causal mode, window, softcap, scale, backend,
gradient or not) must satisfy the DESIGN.md section 5 rule against ref64.  Also: NaN and inf in the
inputs reach exactly the rows the reference says (docs/reliability.md), huge float16 logits never
overflow to NaN, and packed (varlen) problems with empty sequences.

The profile in conftest.py is derandomized, so CI runs the same examples every time;
ATTN_BACKENDS_FUZZ_EXAMPLES raises the count and ATTN_BACKENDS_FUZZ_RANDOM=1 explores new ones.
"""

import math

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

import attn_backends as ab
from attn_backends._testing import (FLOORS, check_2x, flat_softmax_floor, make_packed, max_err, reference_attention,
                                    varlen_reference, visible)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
BACKENDS = ["auto", "math", "flash", "eager", "sdpa", "flex"]
LAYOUTS = ["contiguous", "bshd", "strided_d", "offset", "expand_batch", "expand_seq"]


def _amax(t):
    t = t.detach()[torch.isfinite(t.detach())]
    return float(t.abs().max()) if t.numel() else 0.0


def make(shape, layout, dtype, g):
    """A tensor of ``shape`` (B, H, S, D) stored in ``layout``: every stride pattern a caller can hand us."""
    B, H, S, D = shape

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dtype)

    if layout == "bshd":
        return rnd(B, S, H, D).transpose(1, 2)
    if layout == "strided_d":
        return rnd(B, H, S, 2 * D)[..., ::2]
    if layout == "offset":
        n = B * H * S * D
        return rnd(n + 13)[13:].view(shape)
    if layout == "expand_batch":
        return rnd(1, H, S, D).expand(shape)  # batch stride 0
    if layout == "expand_seq":
        return rnd(B, H, 1, D).expand(shape)  # sequence stride 0: every row the same
    return rnd(*shape)


@st.composite
def problems(draw):
    dims = st.integers
    B = draw(st.sampled_from([1, 1, 2, 3, 0]))
    Hkv = draw(dims(1, 3))
    Hq = Hkv * draw(dims(1, 3))
    Sq = draw(st.one_of(st.just(1), dims(0, 40), dims(60, 140)))
    Sk = draw(st.one_of(st.just(1), dims(0, 40), dims(60, 140)))
    D = draw(st.one_of(dims(1, 24), st.sampled_from([32, 40, 64, 96, 128, 160, 256])))
    Dv = draw(st.one_of(st.just(D), dims(1, 72)))
    dtype = draw(st.sampled_from(DTYPES))
    causal = draw(st.sampled_from([False, True, "bottom_right"]))
    window = draw(st.one_of(st.none(), st.tuples(dims(-1, 9), dims(-1, 9))))
    mask = draw(st.sampled_from(["none", "none", "bool", "float", "bool_rows", "float_rows", "key_padding",
                                 "keys_only", "per_head"]))
    return dict(
        B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=Dv, dtype=dtype, causal=causal, window=window, mask=mask,
        softcap=draw(st.sampled_from([0.0, 0.0, 2.5, 30.0])),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        layouts=[draw(st.sampled_from(LAYOUTS)) for _ in range(3)],
        backend=draw(st.sampled_from(BACKENDS)),
        grad=draw(st.booleans()),
        return_lse=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_mask(kind, B, Hq, Sq, Sk, dtype, g):
    """Masks of every accepted shape: full, broadcast over heads, keys only, per head."""
    if kind == "none":
        return None
    if kind == "key_padding":
        lengths = torch.randint(0, Sk + 1, (B,), generator=g)
        return torch.arange(Sk).view(1, 1, 1, Sk) < lengths.view(B, 1, 1, 1)
    if kind == "keys_only":
        return torch.rand(Sk, generator=g) > 0.4  # (Sk,): broadcast over everything else
    if kind == "per_head":
        return torch.rand(1, Hq, Sq, Sk, generator=g) > 0.3
    keep = torch.rand(B, 1, Sq, Sk, generator=g) > 0.3
    if kind.endswith("_rows") and Sq:
        keep[:, :, ::3] = False  # fully masked rows
    if kind.startswith("bool"):
        return keep
    bias = torch.randn(B, 1, Sq, Sk, generator=g)
    return torch.where(keep, bias, torch.full_like(bias, -math.inf)).to(dtype)


def allowed(p, mask):
    """bool (B, Hq, Sq, Sk): what each query row may see."""
    ok = visible(p["Sq"], p["Sk"], p["causal"], p["window"]).expand(p["B"], p["Hq"], p["Sq"], p["Sk"])
    if mask is not None:
        ok = ok & (mask if mask.dtype == torch.bool else mask > -math.inf)
    return ok


@given(problems())
def test_random_problems_match_reference(p):
    note(str(p))
    g = torch.Generator().manual_seed(p["seed"])
    dtype = p["dtype"]
    q = make((p["B"], p["Hq"], p["Sq"], p["D"]), p["layouts"][0], dtype, g)
    k = make((p["B"], p["Hkv"], p["Sk"], p["D"]), p["layouts"][1], dtype, g)
    v = make((p["B"], p["Hkv"], p["Sk"], p["Dv"]), p["layouts"][2], dtype, g)
    mask = make_mask(p["mask"], p["B"], p["Hq"], p["Sq"], p["Sk"], dtype, g)
    opts = dict(causal=p["causal"], attn_mask=mask, window=p["window"], softcap=p["softcap"], scale=p["scale"])
    q0, k0, v0 = (t.clone() for t in (q, k, v))
    leaves = [t.detach().requires_grad_(p["grad"]) for t in (q, k, v)]
    kwargs = dict(opts, backend=p["backend"], return_lse=p["return_lse"])
    plan = ab.explain(*leaves, **kwargs)
    res = ab.attention(*leaves, **kwargs)
    out, lse = res if p["return_lse"] else (res, None)

    # the caller's tensors are untouched, the output is fresh
    for before, after in zip((q0, k0, v0), leaves):
        assert torch.equal(before, after)
    assert out.shape == (p["B"], p["Hq"], p["Sq"], p["Dv"]) and out.dtype == dtype

    ref = [t.detach().double().requires_grad_(p["grad"]) for t in (q, k, v)]
    same = [t.detach().clone().requires_grad_(p["grad"]) for t in (q, k, v)]
    r_out, r_lse = reference_attention(*ref, **opts)
    d_out, d_lse = reference_attention(*same, dtype=dtype, **opts)
    # the floor is for unit-variance logits; a score's rounding error grows with its size, so with
    # randn inputs the floor grows with the logits' standard deviation, scale * sqrt(D), beyond 1
    # (a decode-sized problem with scale 1 and D 160 has logits of ~13: flash sums Q.K along D in one
    # lane, like a GEMM micro-kernel, and lands a few 1e-6 away where torch's gemv lands 1e-7)
    eff = p["D"] ** -0.5 if p["scale"] is None else p["scale"]
    grow = max(1.0, eff * p["D"] ** 0.5)
    check_2x("out", out, r_out, d_out, 2, dtype, FLOORS[dtype] * grow)
    if lse is not None:
        check_2x("lse", lse, r_lse, d_lse, 2, dtype, FLOORS[dtype] * grow * max(1.0, _amax(r_lse)))
    if p["grad"] and out.numel():
        gout = torch.randn(out.shape, generator=g).to(dtype)
        ours = torch.autograd.grad(out, leaves, gout)
        r = torch.autograd.grad(r_out, ref, gout.double(), allow_unused=True)
        s = torch.autograd.grad(d_out, same, gout, allow_unused=True)
        seen = allowed(p, mask).sum(-1)
        flat = dtype == torch.float32 and (bool((seen == 1).any()) or p["layouts"][1] == "expand_seq")
        for name, a, rr, ss, leaf in zip(("dq", "dk", "dv"), ours, r, s, ref):
            rr = torch.zeros_like(leaf) if rr is None else rr
            ss = torch.zeros_like(leaf, dtype=dtype) if ss is None else ss
            # gradients here reach ~10 and sum terms that cancel (sum_j dS_ij = 0): the floor,
            # set for values of order 1, is taken relative to the largest exact gradient
            floor = FLOORS[dtype] * grow * max(1.0, _amax(rr))
            if flat:
                floor = max(floor, flat_softmax_floor(q, k, v, gout, p["scale"]))
            check_2x(name, a, rr, ss, 3, dtype, floor)


# ---- NaN and inf -------------------------------------------------------------------------------


def pattern(t):
    return torch.stack([torch.isnan(t), torch.isposinf(t), torch.isneginf(t)])


@given(
    st.integers(1, 2), st.integers(1, 2), st.integers(1, 70), st.integers(1, 70), st.integers(1, 40),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    st.sampled_from([False, True, "bottom_right"]),
    st.sampled_from(["none", "bool", "bool_rows"]),
    st.sampled_from([0.0, 5.0]),
    st.sampled_from(["auto", "math", "flash", "eager"]),  # ours; "sdpa" gives what torch gives
    st.lists(st.tuples(st.sampled_from("qkv"), st.sampled_from([math.nan, math.inf, -math.inf]),
                       st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True)),
             min_size=1, max_size=3),
    st.integers(0, 2**31 - 1),
)
def test_nan_and_inf_reach_the_rows_that_see_them(B, H, Sq, Sk, D, dtype, causal, mask_kind, softcap, backend,
                                                  spots, seed):
    """NaN / inf in the inputs (docs/reliability.md): every output element that is non-finite in the
    reference restricted to what each row sees (only_visible) is non-finite in ours, of the same
    kind (NaN, +inf, -inf); ours may add non-finite elements only where a plain P.V (the reference,
    torch) has them too, i.e. a non-finite value spreading through 0 * NaN to a row of the same head
    that does not see it; every other element is finite and passes the 2x rule."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, H, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Sk, D, generator=g).to(dtype)
    mask = make_mask(mask_kind, B, H, Sq, Sk, dtype, g)
    t = {"q": q, "k": k, "v": v}
    for which, val, fr, fd in spots:
        rows = Sq if which == "q" else Sk
        t[which][int(fr * B) % B, int(fr * 7) % H, int(fr * rows), int(fd * D)] = val
    note(f"spots={spots}")
    opts = dict(causal=causal, attn_mask=mask, softcap=softcap)
    out = ab.attention(q, k, v, backend=backend, **opts)
    strict64, _ = reference_attention(q, k, v, only_visible=True, **opts)
    strictd, _ = reference_attention(q, k, v, dtype=dtype, only_visible=True, **opts)
    spread64, _ = reference_attention(q, k, v, **opts)

    po, ps = pattern(out), pattern(strict64)
    must = ps.any(0)
    # same kind as the reference, except that a NaN the row cannot see may still reach it through
    # 0 * NaN in P.V (unspecified, as in a plain matmul) and win over an inf it does see
    same_kind = (po == ps).all(0) | (torch.isnan(out) & torch.isnan(spread64))
    assert bool(same_kind[must].all()), "a non-finite element of the reference differs in ours"
    extra = po.any(0) & ~must
    assert bool((~torch.isfinite(spread64))[extra].all()), "a non-finite value reached an element it cannot"
    fin = ~po.any(0) & ~must
    zero = torch.zeros((), dtype=torch.float64)
    check_2x("finite part of out", torch.where(fin, out.double(), zero), torch.where(fin, strict64, zero),
             torch.where(fin, strictd.double(), zero), 2, dtype, FLOORS[dtype])


# ---- huge logits in float16 ----------------------------------------------------------------------


@given(st.integers(1, 40), st.integers(1, 90), st.sampled_from([16, 40, 64, 128]),
       st.floats(30.0, 250.0), st.sampled_from([False, True]), st.sampled_from(["auto", "math", "flash", "eager"]),
       st.sampled_from([torch.float16, torch.bfloat16]), st.integers(0, 2**31 - 1))
def test_huge_logits_do_not_overflow(Sq, Sk, D, magnitude, causal, backend, dtype, seed):
    """q.k far beyond float16's 65504: the scores are computed in float32, so nothing overflows;
    the result is as close to ref64 as torch computing in float32 from the same inputs."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, 2, Sq, D, generator=g) * magnitude).to(dtype)
    k = (torch.randn(1, 2, Sk, D, generator=g) * magnitude).to(dtype)
    v = torch.randn(1, 2, Sk, D, generator=g).to(dtype)
    out, lse = ab.attention(q, k, v, causal=causal, backend=backend, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse[lse > -math.inf]).all()
    r64, l64 = reference_attention(q, k, v, causal=causal)
    r32, l32 = reference_attention(q, k, v, causal=causal, dtype=torch.float32)
    # a score's float32 rounding error is about eps * scale * sum_d |q_d k_d| (the scores here reach
    # 1e5 and are summed along D in whatever order the kernel uses); it moves lse by as much and
    # out by at most that times max|v|; on top, rounding the result to the input dtype
    qa, ka = q.double().abs(), k.double().abs()
    # (probabilistic bound for a sum of D terms: sqrt(D) * eps * scale * sum|q_d k_d|, scale = 1/sqrt(D))
    score_err = torch.finfo(torch.float32).eps * float(torch.einsum("bhid,bhjd->bhij", qa, ka).amax())
    out_floor = FLOORS[dtype] + max_err(r64.to(dtype), r64) + score_err * float(v.abs().amax())
    check_2x("out", out, r64, r32, 2, dtype, out_floor)
    check_2x("lse", lse, l64, l32, 2, dtype, FLOORS[dtype] + score_err)


# ---- packed sequences ---------------------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=0, max_size=5),
       st.integers(1, 2), st.integers(1, 2), st.sampled_from([8, 33, 64]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       st.sampled_from([False, True, "bottom_right"]),
       st.one_of(st.none(), st.tuples(st.integers(-1, 6), st.integers(-1, 6))),
       st.sampled_from(["auto", "flash_varlen", "math", "eager"]), st.integers(0, 3), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_random_packed_problems_match_reference(lens, Hkv, group, D, dtype, causal, window, backend, slack, grad,
                                                seed):
    lens_q = [a for a, _ in lens]
    lens_k = [b for _, b in lens]
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, Hkv * group, Hkv, D, D, dtype, g)
    max_q, max_k = max(lens_q, default=0) + slack, max(lens_k, default=0) + slack  # bounds, not exact
    leaves = [t.requires_grad_(grad) for t in (q, k, v)]
    out, lse = ab.attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, backend=backend, causal=causal,
                                   window=window, return_lse=True)
    ref = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    same = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    r_out, r_lse = varlen_reference(*ref, cu_q, cu_k, causal=causal, window=window)
    d_out, d_lse = varlen_reference(*same, cu_q, cu_k, dtype=dtype, causal=causal, window=window)
    check_2x("out", out, r_out, d_out, 2, dtype)
    check_2x("lse", lse, r_lse, d_lse, 2, dtype)
    if grad and out.numel():
        assume(r_out.requires_grad)
        gout = torch.randn(out.shape, generator=g).to(dtype)
        one_key = any(bool((visible(a, b, causal, window).sum(-1) == 1).any()) for a, b in lens)
        key_floor = flat_softmax_floor(q, k, v, gout) if dtype == torch.float32 and one_key else 0.0
        # a reference that never touches an input (no keys at all) gives None: its gradient is zero
        for name, a, rr, ss, leaf in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, gout),
                                         torch.autograd.grad(r_out, ref, gout.double(), allow_unused=True),
                                         torch.autograd.grad(d_out, same, gout, allow_unused=True), same):
            rr = torch.zeros_like(leaf, dtype=torch.float64) if rr is None else rr
            ss = torch.zeros_like(leaf) if ss is None else ss
            check_2x(name, a, rr, ss, 3, dtype, max(FLOORS[dtype] * max(1.0, _amax(rr)), key_floor))
