"""Property-based tests (hypothesis): random problems against the float64 reference.

Every drawn problem (shape, strides, dtype, mask, causal mode, window, softcap, scale, backend,
gradient or not) must satisfy the DESIGN.md section 5 rule against ref64.  Also: NaN and inf in the
inputs reach exactly the rows the reference says (docs/reliability.md), huge float16 logits never
overflow to NaN, and packed (varlen) problems with empty sequences.

The profile in conftest.py is derandomized, so CI runs the same examples every time;
`python -m pytest -m fuzz tests` runs only these, 20 times longer (still seeded);
ATTN_BACKENDS_FUZZ_EXAMPLES sets the count and ATTN_BACKENDS_FUZZ_RANDOM=1 explores new ones.
"""

import math

import pytest
import torch
from hypothesis import assume, event, example, given, note
from hypothesis import strategies as st

import attn_backends as ab
from attn_backends._testing import (FLOORS, check_2x, flat_softmax_floor, keep_mask_for_next_call, make_packed, max_err,
                                    nonfinite_pattern, out_and_grads_three_ways, reference_attention, varlen_reference,
                                    visible)

from cuda_devices import cuda_kernels

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"), pytest.mark.fuzz]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
BACKENDS = ["auto", "math", "flash", "eager", "sdpa", "flex"]
EMU_DTYPES = [torch.bfloat16, torch.float16, torch.bfloat16, torch.float16, torch.float32]
EMU_BACKENDS = ["auto", "flash", "flash", "math"]  # the ones with CUDA kernels under the rule (sage has its own)
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


def _share(n):
    """n examples per 100 of the profile (the default run's budget; -m fuzz raises the profile)."""
    from hypothesis import settings

    return settings(max_examples=max(5, settings.default.max_examples * n // 100))


@st.composite
def problems(draw, emulated=False):
    """emulated: problems for the CUDA emulator (test_random_problems_on_the_cuda_emulator), smaller (it
    runs a kernel ~1000x slower than a GPU), mostly in the 16-bit dtypes the CUDA flash kernels take."""
    dims = st.integers
    B = draw(st.sampled_from([1, 1, 2, 0] if emulated else [1, 1, 2, 3, 0]))
    Hkv = draw(dims(1, 2 if emulated else 3))
    Hq = Hkv * draw(dims(1, 2 if emulated else 3))
    Sq = draw(st.one_of(st.just(1), dims(0, 40), dims(60, 80 if emulated else 140)))
    Sk = draw(st.one_of(st.just(1), dims(0, 40), dims(60, 80 if emulated else 140)))
    D = draw(st.one_of(dims(1, 24), st.sampled_from([32, 40, 64, 96, 128, 160, 256])))
    Dv = draw(st.one_of(st.just(D), dims(1, 72)))
    if emulated and draw(st.booleans()):  # what the CUDA flash kernels take: D = Dv, a multiple of 8, no mask
        D = Dv = draw(st.sampled_from([32, 40, 64, 96, 128, 160, 256]))
    dtype = draw(st.sampled_from(EMU_DTYPES if emulated else DTYPES))
    causal = draw(st.sampled_from([False, True, "bottom_right"]))
    window = draw(st.one_of(st.none(), st.tuples(dims(-1, 9), dims(-1, 9))))
    masks = ["bool", "float", "bool_rows", "float_rows", "key_padding", "keys_only", "per_head"]
    mask = draw(st.sampled_from(["none"] * (len(masks) if emulated else 2) + masks))
    return dict(
        B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=Dv, dtype=dtype, causal=causal, window=window, mask=mask,
        softcap=draw(st.sampled_from([0.0, 0.0, 2.5, 30.0])),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        layouts=[draw(st.sampled_from(LAYOUTS)) for _ in range(3)],
        backend=draw(st.sampled_from(EMU_BACKENDS if emulated else BACKENDS)),
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
    _check_problem(p)


@pytest.mark.cuda_emu
@_share(30)
@given(problems(emulated=True))
def test_random_problems_on_the_cuda_emulator(p):
    with cuda_kernels():
        _check_problem(p)


def _check_problem(p):
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
    event(f"ran {plan.chosen} on {plan.path}")  # --hypothesis-show-statistics: which kernels the draws reached
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
# found by the fuzzer where auto chose torch SDPA (bfloat16 on a CPU with AMX-BF16, and the CUDA emulation's plans):
# torch's fused CPU kernel gave a row with a NaN score zeros (a NaN q, one under a mask, an inf key under
# bottom-right causal, an inf q beside a NaN value) and a masked-out row of a NaN q NaN; anomaly mode checks it
@example(1, 1, 1, 2, 1, torch.bfloat16, True, "none", 0.0, "auto", [("q", math.nan, 0.0, 0.0)], 0)
@example(1, 1, 1, 2, 1, torch.bfloat16, True, "bool", 0.0, "auto", [("q", math.nan, 0.0, 0.0)], 0)
@example(1, 1, 5, 16, 1, torch.bfloat16, "bottom_right", "none", 0.0, "auto", [("k", math.inf, 0.0, 0.0)], 0)
@example(1, 1, 5, 16, 2, torch.bfloat16, False, "none", 0.0, "auto", [("q", math.inf, 0.0, 0.0), ("v", math.nan, 0.0, 0.5)],
         0)
@pytest.mark.parametrize("emulated", [False, pytest.param(True, marks=pytest.mark.cuda_emu, id="cuda_emu")])
def test_nan_and_inf_reach_the_rows_that_see_them(emulated, B, H, Sq, Sk, D, dtype, causal, mask_kind, softcap, backend,
                                                  spots, seed):
    """NaN / inf in the inputs (docs/reliability.md): every output element that is non-finite in the
    reference restricted to what each row sees (only_visible) is non-finite in ours, of the same
    kind (NaN, +inf, -inf); ours may add non-finite elements only where a plain P.V (the reference,
    torch) has them too, i.e. a non-finite value spreading through 0 * NaN to a row of the same head
    that does not see it; every other element is finite and passes the 2x rule."""
    with cuda_kernels(emulated):  # emulated: on the CUDA kernels
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
        # anomaly mode: where auto chooses torch SDPA, its output is checked (torch's fused CPU kernel turns NaN
        # rows into zeros; _dispatch._sdpa_as_auto), as a user hunting NaN would have it
        with torch.autograd.set_detect_anomaly(True):
            out = ab.attention(q, k, v, backend=backend, **opts)
        strict64, _ = reference_attention(q, k, v, only_visible=True, **opts)
        strictd, _ = reference_attention(q, k, v, dtype=dtype, only_visible=True, **opts)
        spread64, _ = reference_attention(q, k, v, **opts)

        po, ps = nonfinite_pattern(out), nonfinite_pattern(strict64)
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
@pytest.mark.parametrize("emulated", [False, pytest.param(True, marks=pytest.mark.cuda_emu, id="cuda_emu")])
def test_huge_logits_do_not_overflow(emulated, Sq, Sk, D, magnitude, causal, backend, dtype, seed):
    """q.k far beyond float16's 65504: the scores are computed in float32, so nothing overflows;
    the result is as close to ref64 as torch computing in float32 from the same inputs."""
    with cuda_kernels(emulated):  # emulated: on the CUDA kernels
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
# a random run's case: rows that see one key each, lse = the score, 5 float32 ulps off in ours
@example([(5, 2)], 1, 1, 64, torch.float32, "bottom_right", (0, 0), "auto", 0, False, 2)
@pytest.mark.parametrize("emulated", [False, pytest.param(True, marks=pytest.mark.cuda_emu, id="cuda_emu")])
def test_random_packed_problems_match_reference(emulated, lens, Hkv, group, D, dtype, causal, window, backend, slack,
                                                grad, seed):
    # emulated: on the CUDA kernels (cuda_devices.cuda_kernels), where flash_varlen takes the bfloat16 draws
    with cuda_kernels(emulated):
        _check_packed(lens, Hkv, group, D, dtype, causal, window, backend, slack, grad, seed)


def _check_packed(lens, Hkv, group, D, dtype, causal, window, backend, slack, grad, seed):
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
    # a row that sees one key has lse = its score, whose float32 sum over D rounds by up to about
    # eps * scale * sum_d |q_d k_d| in any order (a random run: D=64, one key per row, ours 1.16e-6
    # off where torch's order happened to be 5e-8 off); the floor carries that rounding
    qa, ka = q.detach().double().abs(), k.detach().double().abs().repeat_interleave(group, dim=1)
    dots = torch.einsum("ihd,jhd->hij", qa, ka) if q.numel() and k.numel() else torch.zeros(1)
    score_err = torch.finfo(torch.float32).eps * D ** -0.5 * float(dots.max()) if dtype != torch.float64 else 0.0
    check_2x("lse", lse, r_lse, d_lse, 2, dtype, FLOORS[dtype] + score_err)
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


# ---- the fuzzer of issue 18: hostile magnitudes, large logits, double backward, ab.sdpa, bounds --------
# Each property below found a defect once (tests/test_fidelity.py pins each one).  The default run
# takes a fraction of the profile's examples; `python -m pytest -m fuzz tests` runs every property
# test of this file with the long profile (conftest.py).

F32_MAX = float(torch.finfo(torch.float32).max)


MAGNITUDES = [1.0, 1e-3, 1e10, 1e18, 1e19, 1e30]


@_share(60)
@given(st.integers(1, 2), st.integers(1, 12), st.integers(1, 12), st.sampled_from([1, 3, 8, 64]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from(MAGNITUDES), st.sampled_from(MAGNITUDES),
       st.booleans(), st.one_of(st.none(), st.sampled_from([1e-39, 1e-3, 0.5, 2.0, -2.0, 1e10, 3e38, 1e39, -1e39])),
       st.sampled_from([0.0, 0.0, 1e-30, 5.0, 50.0, 3e38, 1e39]), st.sampled_from([False, True, "bottom_right"]),
       st.sampled_from(["none", "alibi"]), st.sampled_from(["flash", "math", "eager"]), st.integers(0, 2**31 - 1))
# a random run's case: one bfloat16 query token (the decode kernel), whose P is rounded to bfloat16
@example(1, 1, 2, 64, torch.bfloat16, 1.0, 1.0, False, None, 0.0, False, "alibi", "flash", 299879)
def test_extreme_magnitudes_stay_finite_or_are_rejected(H, Sq, Sk, D, dtype, mq, mk, spots, scale, softcap, causal,
                                                        mask_kind, backend, seed):
    """q, k up to 1e30 (whole tensors or a few elements), scales and softcaps up to and past float32's
    range: a factor float32 cannot hold is rejected naming it; otherwise, wherever no partial sum of
    scale * q.k can overflow float32 (sum_d |scale q_d k_d| < FLT_MAX / 2: then torch's float32 SDPA,
    which scales q and k by sqrt(scale), cannot overflow either) and the float64 reference is finite,
    ours is finite too and no further from it than the score's float32 rounding allows."""
    g = torch.Generator().manual_seed(seed)

    def draw(S, m):
        t = torch.randn(1, H, S, D, generator=g, dtype=torch.float64)
        if spots:
            t.view(-1)[torch.randint(0, t.numel(), (2,), generator=g)] *= m
            return t.to(dtype)
        return (t * m).to(dtype)

    q, k, v = draw(Sq, mq), draw(Sk, mk), torch.randn(1, H, Sk, D, generator=g).to(dtype)
    mask = None
    if mask_kind == "alibi":
        mask = (-(torch.arange(Sq).view(-1, 1) - torch.arange(Sk).view(1, -1)).abs() + 100.0).to(dtype)
    opts = dict(scale=scale, softcap=softcap, causal=causal, attn_mask=mask)
    note(f"opts={opts}")
    for name, val in (("scale", scale or 0.0), ("softcap", softcap)):
        if abs(val) > F32_MAX:
            with pytest.raises(ValueError, match=f"{name} must be within float32's range"):
                ab.attention(q, k, v, backend=backend, **opts)
            return
    out = ab.attention(q, k, v, backend=backend, **opts)
    eff = D ** -0.5 if scale is None else scale
    bound = torch.einsum("bhid,bhjd->bhij", q.double().abs(), k.double().abs()) * abs(eff)
    ref64, _ = reference_attention(q, k, v, **opts)
    safe = (bound.amax(-1) < F32_MAX / 2)[..., None] & torch.isfinite(ref64)
    assert bool(torch.isfinite(out)[safe].all()), "non-finite where no float32 partial sum can overflow"
    # the rule where it can be stated: the float32 reference finite there too (it overflows on q.k
    # before the scale, so torch's SDPA stands in for it when it can)
    same = reference_attention(q, k, v, dtype=torch.float32, **opts)[0]
    if softcap == 0 and dtype == torch.float32:
        bias = torch.zeros(Sq, Sk) if mask is None else mask.float()
        bias = bias.masked_fill(~visible(Sq, Sk, causal, None), -math.inf)
        same = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=eff)
    finite_bound = bound[torch.isfinite(bound)]
    score_err = torch.finfo(torch.float32).eps * (float(finite_bound.amax()) if finite_bound.numel() else 0.0)
    zero = torch.zeros((), dtype=torch.float64)
    region = safe & torch.isfinite(same.double())
    vmax = float(v.double().abs().amax())
    floor = FLOORS[dtype] + max_err(ref64.to(dtype), ref64) + score_err * vmax
    if dtype != torch.float32:
        # the rule's same-dtype reference rounds P to the input dtype before P V, as the 16-bit
        # kernels do (flash-attn's too); the float32 stand-in keeps P exact, so that rounding
        # (at most half an ulp of each P, sum P = 1: u * max|v| on the output) joins the floor
        floor += torch.finfo(dtype).eps / 2 * vmax
    check_2x("out", torch.where(region, out.double(), zero), torch.where(region, ref64, zero),
             torch.where(region, same.double(), zero), 2, dtype, floor)


def _alibi_bias(Hq, Sq, Sk, offset, g):
    slopes = 2.0 ** (-8.0 * torch.arange(1, Hq + 1) / Hq) * 16
    dist = (torch.arange(Sq).view(-1, 1) + Sk - Sq - torch.arange(Sk).view(1, -1)).abs()
    return (-slopes.view(Hq, 1, 1) * dist + offset + 0.5 * torch.randn(Hq, Sq, Sk, generator=g))[None]


@_share(60)
@given(st.integers(1, 3), st.sampled_from([1, 2, 5, 17, 40]), st.sampled_from([2, 3, 7, 17, 40, 70]),
       st.sampled_from([8, 16, 40, 96]), st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       st.sampled_from(["softcap", "alibi", "scale"]), st.sampled_from([False, "bottom_right"]),
       st.sampled_from(LAYOUTS[:4]), st.sampled_from(["flash", "math", "eager"]), st.integers(0, 2**31 - 1))
@pytest.mark.parametrize("emulated", [False, pytest.param(True, marks=pytest.mark.cuda_emu, id="cuda_emu")])
def test_large_logits_and_saturated_rows_keep_the_rule(emulated, group, Sq, Sk, D, dtype, kind, causal, layout, backend, seed):
    """Logits up to ~100 (softcap 50 at scale up to 10, ALiBi biases with offsets up to +-100, scale 2 to
    4 at any D) and the nearly one-hot rows they make: the output within 2x, every gradient within 3x of
    torch's error in the same dtype (the backward used to take p from lse rounded to float32, and
    flash's delta from the output rounded to the input dtype)."""
    # the CUDA flash kernels take neither float32 nor a float mask (ALiBi as a bias here); the call is strict
    assume(not (emulated and backend == "flash" and (dtype == torch.float32 or kind == "alibi")))
    with cuda_kernels(emulated):  # emulated: on the CUDA kernels
        g = torch.Generator().manual_seed(seed)
        Hkv = 1
        Hq = Hkv * group
        if causal and Sk < Sq + 1:
            causal = False  # bottom-right rows that see one key: the flat-softmax floor of the other property
        q = make((1, Hq, Sq, D), layout, dtype, g)
        k = make((1, Hkv, Sk, D), layout, dtype, g)
        v = make((1, Hkv, Sk, D), layout, dtype, g)
        r = torch.rand((), generator=g).item()
        opts = {"softcap": dict(softcap=50.0, scale=2.0 + 8.0 * r),
                "alibi": dict(attn_mask=_alibi_bias(Hq, Sq, Sk, [-100.0, -50.0, 0.0, 50.0, 100.0][int(5 * r)], g).to(dtype)),
                "scale": dict(scale=2.0 + 2.0 * r)}[kind]
        opts["causal"] = causal
        note(f"opts={opts}")
        gout = torch.randn(1, Hq, Sq, D, generator=g).to(dtype)
        (out, _, ours), (r_out, _, refg), (d_out, _, sameg) = out_and_grads_three_ways(backend, q, k, v, gout, **opts)
        # the floors of the first property: q.k summed in float32 (ours and torch's, each its own way) is
        # rounded in proportion to scale * sqrt(D); the half-precision gradients keep the plain floor,
        # since their saturated rows were the failure (delta read from O rounded to the input dtype)
        eff = opts.get("scale", D ** -0.5)
        grow = max(1.0, eff * D ** 0.5)
        # a score plus an ALiBi bias of magnitude ~100 is rounded in float32 at that magnitude, by torch and by
        # ours alike but at different points of each score's own rounding: half an ulp of the largest bias
        # per weight, times the largest value, is each one's share of luck (a random call found ours at 2.4x
        # torch's error there, both within that)
        bias_floor = 0.0
        if kind == "alibi":
            bias_floor = torch.finfo(torch.float32).eps / 2 * float(opts["attn_mask"].double().abs().amax()) * _amax(v)
        check_2x("out", out, r_out, d_out, 2, dtype, FLOORS[dtype] * grow + bias_floor)
        for name, a, rr, ss in zip(("dq", "dk", "dv"), ours, refg, sameg):
            check_2x(name, a, rr, ss, 3, dtype, FLOORS[dtype] * (grow if dtype == torch.float32 else 1.0) * max(1.0, _amax(rr)))


@_share(25)
@given(st.integers(1, 2), st.integers(1, 2), st.integers(1, 9), st.integers(1, 9), st.sampled_from([4, 8, 17]),
       st.sampled_from([False, True, "bottom_right"]), st.sampled_from(["none", "bool", "float_rows"]),
       st.sampled_from([0.0, 4.0]), st.sampled_from([0.0, 0.25]), st.booleans(),
       st.sampled_from(["flash", "math", "eager"]), st.integers(0, 2**31 - 1))
def test_second_derivatives_match_reference(B, group, Sq, Sk, D, causal, mask_kind, softcap, dropout_p, use_lse,
                                            backend, seed):
    """A gradient of a gradient (create_graph=True), every kernel backend: against the float64
    reference, 3x of torch's float32 error (it used to be silently zero)."""
    g = torch.Generator().manual_seed(seed)
    Hq = group
    q, k, v = (torch.randn(B, Hq if i == 0 else 1, S, D, generator=g) for i, S in enumerate((Sq, Sk, Sk)))
    mask = make_mask(mask_kind, B, Hq, Sq, Sk, torch.float32, g)
    leaves = [q, k, v] + ([mask] if mask is not None and mask.dtype != torch.bool else [])
    w = torch.randn(B, Hq, Sq, D, generator=g)
    u = torch.randn(B, Hq, Sq, generator=g) if use_lse else torch.zeros(B, Hq, Sq)
    rr = [torch.randn(t.shape, generator=g) for t in leaves]
    keep = keep_mask_for_next_call(7, B, Hq, Sq, Sk, dropout_p) if dropout_p else None

    def second(fn, xs, dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in xs]
        out, lse = fn(*xs)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        first = torch.autograd.grad((out * w.to(dtype)).sum() + (lse * u.to(lse.dtype)).sum(), xs, create_graph=True,
                                    allow_unused=True)
        first = [f if f is not None else torch.zeros_like(x) for f, x in zip(first, xs)]
        sec = torch.autograd.grad(sum((f * r.to(dtype)).sum() for f, r in zip(first, rr)), xs, allow_unused=True)
        return [f.detach() for f in first], [s if s is not None else torch.zeros_like(x) for s, x in zip(sec, xs)]

    def ours(*xs):
        torch.manual_seed(7)
        m = xs[3] if len(xs) > 3 else mask
        return ab.attention(*xs[:3], attn_mask=m, causal=causal, softcap=softcap, dropout_p=dropout_p,
                            backend=backend, strict=True, return_lse=True)

    def ref(dtype):
        return lambda *xs: reference_attention(*xs[:3], attn_mask=xs[3] if len(xs) > 3 else mask, causal=causal,
                                               softcap=softcap, keep=keep, dropout_p=dropout_p, dtype=dtype)

    got, r64, r32 = second(ours, leaves, torch.float32), second(ref(torch.float64), leaves, torch.float64), \
        second(ref(torch.float32), leaves, torch.float32)
    for order, a, b, c in zip(("first", "second"), got, r64, r32):
        for name, x, y, z in zip(("q", "k", "v", "mask"), a, b, c):
            check_2x(f"{order} d{name}", x, y, z, 3, torch.float32, 1e-5 * max(1.0, _amax(y)))


def _sdpa_outcome(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 (the type is what is compared)
        return None, type(e)


@_share(60)
@given(st.integers(2, 5), st.sampled_from([0, 1, 2, 3]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]),
       st.integers(0, 6), st.integers(0, 6), st.sampled_from([4, 8]), st.sampled_from([4, 8]),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.sampled_from(["contiguous", "bshd"]),
       st.sampled_from(["none", "bool1d", "float1d", "bool2d", "float4d"]), st.booleans(),
       st.one_of(st.none(), st.sampled_from([0.3, -0.5, 2.0, math.nan, math.inf, 1e39])), st.booleans(),
       st.sampled_from(["auto", "flash", "math", "eager", "sdpa"]), st.integers(0, 2**31 - 1))
def test_sdpa_is_torch_sdpa(nd, B, Hq, group, Sq, Sk, D, Dv, dtype, layout, mask_kind, is_causal, scale, gqa, backend,
                            seed):
    """ab.sdpa against F.sdpa on ranks 2 to 5, empty dims, layouts, masks of every rank, GQA, odd
    scales: the same exception type where torch raises, else the same shape, dtype and strides, and
    values as close to the float64 result as torch's math backend (where torch's fast CPU path
    misbehaves, as on 1-D masks, a causal negative scale or a NaN scale, its math backend is the
    reference: docs/integrations.md)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(seed)
    Hkv = Hq // group if gqa and Hq % group == 0 else Hq
    lead = {2: (), 3: (B,), 4: (B, Hq), 5: (2, B, Hq)}[nd]
    lead_kv = lead[:-1] + (Hkv,) if nd >= 4 else lead

    def mk(shape):
        t = torch.randn(*shape, generator=g).to(dtype)
        if layout == "bshd" and len(shape) >= 3:
            t = t.transpose(-2, -3).contiguous().transpose(-2, -3)
        return t

    q, k, v = mk(lead + (Sq, D)), mk(lead_kv + (Sk, D)), mk(lead_kv + (Sk, Dv))
    mask = {"none": None, "bool1d": torch.rand(Sk, generator=g) > 0.3, "float1d": torch.randn(Sk, generator=g),
            "bool2d": torch.rand(Sq, Sk, generator=g) > 0.3,
            "float4d": torch.randn((1,) * max(0, nd - 2) + (Sq, Sk), generator=g).to(dtype)}[mask_kind]
    kw = dict(attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    note(f"q {tuple(q.shape)} k {tuple(k.shape)} kw {kw}")
    want, want_exc = _sdpa_outcome(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw))
    with sdpa_kernel(SDPBackend.MATH):
        math_res, math_exc = _sdpa_outcome(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw))
        ref64, _ = _sdpa_outcome(lambda: torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), **dict(kw, attn_mask=mask.double() if mask is not None and
                                                       mask.dtype != torch.bool else mask)))
    with ab.use(backend):
        got, got_exc = _sdpa_outcome(lambda: ab.sdpa(q, k, v, **kw))
    if want_exc is not None and math_exc is not None:
        assert got_exc is want_exc, f"torch raises {want_exc.__name__}, ours {got_exc}"
        return
    assert got_exc is None, f"ours raised {got_exc.__name__}"
    if math_exc is not None:  # only torch's fast path takes it (a mask with is_causal): torch's answer
        assert got.stride() == want.stride() and torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
        return
    assert got.shape == math_res.shape and got.dtype == math_res.dtype
    if want is not None and want.numel():  # (an empty tensor's strides address nothing)
        assert got.stride() == want.stride()
    assert torch.equal(torch.isnan(got), torch.isnan(math_res))
    fin = ~torch.isnan(math_res)
    zero = torch.zeros((), dtype=torch.float64)
    check_2x("out", torch.where(fin, got.double(), zero), torch.where(fin, ref64, zero),
             torch.where(fin, math_res.double(), zero), 2, dtype, 10 * FLOORS[dtype])


@_share(30)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=4),
       st.sampled_from([1, 7, 2**20, 2**31 - 1]), st.sampled_from(["int", "numpy", "tensor"]),
       st.sampled_from(["flash_varlen", "math", "eager"]), st.sampled_from([0.0, 0.3]), st.integers(0, 2**31 - 1))
def test_varlen_result_does_not_depend_on_the_bound(lens, slack, kind, backend, dropout_p, seed):
    """A loose max_seqlen (up to 2**31 - 1, as an int, a numpy integer or a 0-d tensor) gives bitwise
    the result of the tight one, dropout included, in the time of the real lengths (it used to size
    the work: 2**40 hung)."""
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 2, 1, 8, 8, torch.float32, g)
    tight = (max(lens_q), max(lens_k))
    loose = [min(2**31 - 1, t + slack) for t in tight]
    loose = {"int": loose, "numpy": [np.int64(x) for x in loose], "tensor": [torch.tensor(x) for x in loose]}[kind]
    p = dropout_p if backend != "eager" else 0.0  # eager draws torch's own dropout
    results = []
    for bounds in (tight, loose):
        torch.manual_seed(seed)
        results.append(ab.attention_varlen(q, k, v, cu_q, cu_k, *bounds, backend=backend, dropout_p=p,
                                           return_lse=True))
    assert all(torch.equal(a, b) for a, b in zip(*results))
