"""What external test suites and a fuzzer found (issue 18), each pinned by a regression test.

Hostile arguments get an error naming the argument; integer arguments come as ints, numpy integers
or 0-d integer tensors; packed calls cost what their real lengths cost, whatever bound they name.
"""

import contextlib
import math
import re

import numpy as np
import pytest
import torch

import attn_backends as ab
from attn_backends._testing import FLOORS, check_2x, make_packed, max_err, nonfinite_pattern, reference_attention

ops = torch.ops.attn_backends
CPU_BACKENDS = ["flash", "math", "eager", "sdpa", "flex"]

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def qkv(B=1, Hq=2, Hkv=2, Sq=5, Sk=7, D=8, dtype=torch.float32, g=None):
    return (torch.randn(B, Hq, Sq, D, generator=g).to(dtype), torch.randn(B, Hkv, Sk, D, generator=g).to(dtype),
            torch.randn(B, Hkv, Sk, D, generator=g).to(dtype))


# ---- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("window, exc, match", [
    ((2**64, 0), ValueError, r"window left must be at most 2\*\*63 - 1 .*got 18446744073709551616"),
    ((0, -2**70), ValueError, r"window right must be >= -1"),
    ((torch.tensor(1.5), 0), TypeError, r"window left must be an int or a 0-d integer tensor, got a torch.float32"),
    ((torch.tensor([1, 2]), 0), TypeError, r"window left must be an int or a 0-d integer tensor"),
    ((np.float64(2.0), 0), TypeError, r"window left must be an int, got float64"),
    ((0, True), TypeError, r"window right must be an int, got bool"),
    ((torch.tensor(2, device="meta"), 0), ValueError, r"window left must hold a value"),
])
def test_bad_window_names_the_argument(backend, window, exc, match):
    with pytest.raises(exc, match=match):
        ab.attention(*qkv(), window=window, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_window_takes_numpy_integers_and_0d_integer_tensors(backend, gen):
    q, k, v = qkv(g=gen)
    want = ab.attention(q, k, v, window=(2, 1), backend=backend)
    for window in ((np.int64(2), np.int32(1)), (torch.tensor(2), torch.tensor(1, dtype=torch.int32)),
                   [torch.tensor(2, dtype=torch.uint8), 1]):
        assert torch.equal(ab.attention(q, k, v, window=window, backend=backend), want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_window_wider_than_the_sequences_is_unbounded(backend, gen):
    # up to 2**63 - 1 is accepted; no kernel adds it to a row index (it would overflow there)
    q, k, v = qkv(g=gen)
    want = ab.attention(q, k, v, window=(-1, 0), backend=backend)
    assert torch.equal(ab.attention(q, k, v, window=(2**63 - 1, 0), backend=backend), want)
    assert torch.equal(ab.attention(q, k, v, window=(12, 0), backend=backend), want)


def test_op_boundary_survives_a_huge_window(gen):
    q, k, v = qkv(g=gen)
    for op in (ops.math_fwd, ops.flash_fwd):
        out = op(q, k, v, None, None, 0, 0.3, 2**63 - 1, 2**63 - 1, 0.0, 0.0)[0]
        assert torch.equal(out, op(q, k, v, None, None, 0, 0.3, -1, -1, 0.0, 0.0)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name, value", [("scale", 1e39), ("scale", -1e39), ("softcap", 1e39)])
def test_factors_beyond_float32_are_rejected_for_float32_scores(dtype, name, value):
    q, k, v = qkv(dtype=dtype)
    for backend in ("flash", "math", "eager", "sdpa"):
        with pytest.raises(ValueError, match=rf"{name} must be within float32's range .* got {re.escape(format(value, 'g'))}"):
            ab.attention(q, k, v, backend=backend, **{name: value})
    with pytest.raises(RuntimeError, match=rf"{name} must be within float32's range"):
        args = {"scale": 0.3, "softcap": 0.0, name: value}
        ops.flash_fwd(q, k, v, None, None, 0, args["scale"], -1, -1, args["softcap"], 0.0)


def test_float64_takes_factors_beyond_float32(gen):
    from attn_backends._testing import check_2x, reference_attention

    q, k, v = qkv(dtype=torch.float64, g=gen)
    for opts in (dict(scale=1e39), dict(softcap=1e39, scale=1e-3)):
        out = ab.attention(q, k, v, backend="math", **opts)
        check_2x("out", out, reference_attention(q, k, v, **opts)[0], reference_attention(q, k, v, **opts)[0], 2,
                 torch.float64)


# ---- packed sequences ----------------------------------------------------------------------------


def packed(gen):
    return make_packed([3, 5], [4, 6], 2, 1, 16, 16, torch.float32, gen)


@pytest.mark.parametrize("backend", ["flash_varlen", "math", "eager"])
def test_varlen_work_follows_the_real_lengths(backend, gen):
    # a loose max_seqlen used to size the grid and the padding: 2**31 took seconds, 2**40 hung
    q, k, v, cu_q, cu_k = packed(gen)
    want = ab.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, backend=backend, return_lse=True)
    for bound in (2**31 - 1, np.int64(2**20), torch.tensor(9)):
        got = ab.attention_varlen(q, k, v, cu_q, cu_k, bound, bound, backend=backend, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_varlen_dropout_does_not_depend_on_the_bound(gen):
    q, k, v, cu_q, cu_k = packed(gen)
    outs = []
    for bound in (5, 6, 1000):
        torch.manual_seed(3)
        outs.append(ab.attention_varlen(q, k, v, cu_q, cu_k, bound, max(bound, 6), dropout_p=0.3,
                                        backend="flash_varlen"))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("backend", ["flash_varlen", "math", "eager"])
@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
def test_varlen_impossible_bound_is_named(backend, which):
    q, k, v, cu_q, cu_k = packed(None)
    kw = dict(max_seqlen_q=5, max_seqlen_k=6)
    kw[which] = 2**40
    with pytest.raises(ValueError, match=rf"{which} = 1099511627776 is larger than any sequence .* 2\*\*31 - 1"):
        ab.attention_varlen(q, k, v, cu_q, cu_k, kw["max_seqlen_q"], kw["max_seqlen_k"], backend=backend)
    kw[which] = 4.0
    with pytest.raises(ValueError, match=rf"{which} must be a non-negative int, got 4.0"):
        ab.attention_varlen(q, k, v, cu_q, cu_k, kw["max_seqlen_q"], kw["max_seqlen_k"], backend=backend)


def test_varlen_op_boundary_bounds_max_seqlen_and_scales_with_real_lengths(gen):
    q, k, v, cu_q, cu_k = packed(gen)
    with pytest.raises(RuntimeError, match=r"max_seqlen_k = 1099511627776 must be at most 2\*\*31 - 1"):
        ops.flash_varlen_fwd(q, k, v, cu_q, cu_k, 5, 2**40, None, 0, 0.25, -1, -1, 0.0, 0.0)
    # the largest legal bound runs in the time of the real lengths (it used to take seconds)
    big = ops.flash_varlen_fwd(q, k, v, cu_q, cu_k, 2**31 - 1, 2**31 - 1, None, 0, 0.25, -1, -1, 0.0, 0.0)
    small = ops.flash_varlen_fwd(q, k, v, cu_q, cu_k, 5, 6, None, 0, 0.25, -1, -1, 0.0, 0.0)
    assert torch.equal(big[0], small[0])


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_varlen_cu_seqlens_on_meta_is_named(which):
    q, k, v, cu_q, cu_k = packed(None)
    cu = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    cu[which] = cu[which].to("meta")
    with pytest.raises(ValueError, match=rf"{which} must be on the CPU or on q's device \(cpu\), got a tensor on meta"):
        ab.attention_varlen(q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"], 5, 6)


# ---- ab.sdpa is F.sdpa ---------------------------------------------------------------------------


def _layout(kind, B, H, S, D, dtype, g):
    if kind == "bhsd":
        return torch.randn(B, H, S, D, generator=g).to(dtype)
    if kind == "bshd":
        return torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2)
    if kind == "hsbd":
        return torch.randn(H, S, B, D, generator=g).to(dtype).permute(2, 0, 1, 3)
    if kind == "strided_d":
        return torch.randn(B, H, S, 2 * D, generator=g).to(dtype)[..., ::2]
    return torch.randn(1, H, S, D, generator=g).to(dtype).expand(B, H, S, D)  # expand_batch


def _math(*args, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


@pytest.mark.parametrize("backend", ["flash", "math", "eager", "sdpa"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "hsbd", "strided_d", "expand_batch"])
@pytest.mark.parametrize("case", ["plain", "gqa", "dv", "mask", "causal", "decode", "dropout", "grad"])
def test_sdpa_output_has_torch_strides(backend, layout, case, gen):
    # contiguous (B, H, S, D) in gives contiguous out, as F.sdpa (code calls .view on it); torch's
    # fused CPU kernel lays its output out like q, its math path contiguously
    B, H, S, D = 2, 4, 5, 8
    q = _layout(layout, B, H, 1 if case == "decode" else S, D, torch.float32, gen)
    Hkv = 2 if case == "gqa" else H
    k = _layout("bhsd", B, Hkv, S, D, torch.float32, gen)
    v = _layout("bhsd", B, Hkv, S, 6 if case == "dv" else D, torch.float32, gen)
    kw = dict(enable_gqa=case == "gqa", is_causal=case == "causal", dropout_p=0.3 if case == "dropout" else 0.0)
    if case == "mask":
        kw["attn_mask"] = torch.rand(S, S, generator=gen) > 0.3
    if case == "grad":
        q.requires_grad_()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    with ab.use(backend):
        got = ab.sdpa(q, k, v, **kw)
    assert got.shape == want.shape and got.stride() == want.stride()
    if case != "dropout":
        assert max_err(got, want) < 1e-5
    if case == "grad":
        g = torch.randn(want.shape, generator=gen)
        assert max_err(torch.autograd.grad(got, q, g)[0], torch.autograd.grad(want, q, g)[0]) < 1e-5


def test_sdpa_contiguous_output_views_like_torch(gen):
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    out = ab.sdpa(q, k, v)
    assert out.stride() == (120, 40, 8, 1)
    out.view(2, 15, 8)  # what callers do with F.sdpa's result


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, 1e39])
def test_sdpa_scale_torch_takes_gives_torch_math_result(scale, gen):
    # torch's math backend: NaN everywhere (its fast CPU path returns finite garbage for NaN: the
    # deliberate difference of docs/integrations.md); our kernels cannot take these, torch's math runs
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    out = ab.sdpa(q, k, v, scale=scale)
    want = _math(q, k, v, scale=scale)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and bool(torch.isnan(out).all())
    assert out.stride() == torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).stride()


def test_sdpa_causal_negative_scale_follows_torch_math(gen):
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    want = _math(q, k, v, is_causal=True, scale=-0.5)
    assert bool(torch.isnan(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                             scale=-0.5)).any())  # torch's fast path
    for backend in ("flash", "math", "eager"):
        with ab.use(backend):
            assert max_err(ab.sdpa(q, k, v, is_causal=True, scale=-0.5), want) < 1e-6


@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_1d_mask_follows_torch_math(gqa, gen):
    # torch's fast CPU path raises IndexError on a 1-D mask (4-D inputs); its math path broadcasts it
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k, v = (torch.randn(2, 2 if gqa else 4, 7, 8, generator=gen) for _ in range(2))
    for mask in (torch.rand(7, generator=gen) > 0.3, torch.randn(7, generator=gen)):
        with pytest.raises(IndexError):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        want = _math(q, k, v, attn_mask=mask, enable_gqa=gqa)
        got = ab.sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)
        assert got.stride() == want.stride() and max_err(got, want) < 1e-6


def test_sdpa_2d_inputs_with_enable_gqa_raise_as_torch(gen):
    # (L, E) inputs have no head dim: every torch backend raises IndexError, with or without a mask
    q, k = torch.randn(5, 8, generator=gen), torch.randn(7, 8, generator=gen)
    for mask in (None, torch.rand(7, generator=gen) > 0.3, torch.rand(5, 7, generator=gen) > 0.3):
        with pytest.raises(IndexError):
            ab.sdpa(q, k, k, attn_mask=mask, enable_gqa=True)
        assert max_err(ab.sdpa(q, k, k, attn_mask=mask), _math(q, k, k, attn_mask=mask)) < 1e-6


@pytest.mark.parametrize("shape_k", [(2, 3, 4, 0, 8), (2, 0, 4, 7, 8), (0, 3, 4, 7, 8)])
def test_sdpa_5d_with_an_empty_dim_returns_torch_result(shape_k, gen):
    q = torch.randn(*shape_k[:3], 5, 8, generator=gen)
    k, v = torch.randn(*shape_k, generator=gen), torch.randn(*shape_k, generator=gen)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    got = ab.sdpa(q, k, v)
    assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)


# ---- double backward -----------------------------------------------------------------------------


def _second_order(fn, leaves, w, u, r):
    """First-order grads of <out, w> + <lse, u> (recorded), then grads of <first, r>."""
    out, lse = fn(*leaves)
    first = torch.autograd.grad((out * w).sum() + (lse[lse > -math.inf] * u[lse > -math.inf]).sum(), leaves,
                                create_graph=True, allow_unused=True)
    total = sum((f * rr).sum() for f, rr in zip(first, r) if f is not None)
    second = torch.autograd.grad(total, leaves, allow_unused=True)
    return [f.detach() if f is not None else torch.zeros_like(x) for f, x in zip(first, leaves)], \
        [s if s is not None else torch.zeros_like(x) for s, x in zip(second, leaves)]


def _check_second_order(ours, ref, leaves, w, u, r, zero_if_ref_zero=False):
    """First and second derivatives of ours (_second_order) against ref(float64) by the 2x rule, ref(float32) the
    yardstick; each must be nonzero (or zero where the float64 one is, with zero_if_ref_zero)."""
    from attn_backends._testing import check_2x

    got = _second_order(ours, [t.clone().requires_grad_() for t in leaves], w, u, r)
    r64 = _second_order(ref(torch.float64), [t.double().requires_grad_() for t in leaves], w.double(), u.double(),
                        [t.double() for t in r])
    r32 = _second_order(ref(torch.float32), [t.clone().requires_grad_() for t in leaves], w, u, r)
    for order, a, b, c in zip(("first", "second"), got, r64, r32):
        for name, x, y, z in zip(("q", "k", "v", "mask"), a, b, c):
            assert bool(x.abs().max() > 0) or (zero_if_ref_zero and bool(y.abs().max() == 0)), \
                f"{order} d{name} is zero"
            check_2x(f"{order} d{name}", x, y, z, 3, torch.float32, 1e-5 * max(1.0, float(y.abs().max())))


@pytest.mark.parametrize("backend", ["flash", "math", "eager"])
@pytest.mark.parametrize("opts", [dict(), dict(causal=True, softcap=5.0), dict(mask="float", causal="bottom_right"),
                                  dict(mask="bool", window=(3, 1)), dict(dropout_p=0.3)])
def test_double_backward_matches_reference(backend, opts, gen):
    # it used to be silently zero (torch only warned that math_bwd had no autograd kernel)
    from attn_backends._testing import keep_mask_for_next_call, reference_attention

    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 9, 11, 16
    q, k, v = qkv(B, Hq, Hkv, Sq, Sk, D, g=gen)
    opts = dict(opts)
    kind = opts.pop("mask", None)
    leaves = [q, k, v]
    if kind == "float":
        m = torch.randn(B, 1, Sq, Sk, generator=gen).masked_fill(torch.rand(B, 1, Sq, Sk, generator=gen) < 0.2,
                                                                 -math.inf)
        m[:, :, 0] = -math.inf  # a fully masked row
        leaves.append(m)
    elif kind == "bool":
        opts["attn_mask"] = torch.rand(B, 1, Sq, Sk, generator=gen) > 0.3
    w = torch.randn(B, Hq, Sq, D, generator=gen)
    u = torch.randn(B, Hq, Sq, generator=gen)
    r = [torch.randn(t.shape, generator=gen) for t in leaves]
    p = opts.pop("dropout_p", 0.0)
    keep = keep_mask_for_next_call(11, B, Hq, Sq, Sk, p) if p else None

    def ours(*xs):
        torch.manual_seed(11)
        mask = xs[3] if len(xs) > 3 else opts.get("attn_mask")
        return ab.attention(*xs[:3], backend=backend, strict=True, return_lse=True, dropout_p=p,
                            **dict(opts, attn_mask=mask))

    def ref(dtype):
        def fn(*xs):
            mask = xs[3] if len(xs) > 3 else opts.get("attn_mask")
            return reference_attention(*xs[:3], dtype=dtype, keep=keep, dropout_p=p, **dict(opts, attn_mask=mask))
        return fn

    _check_second_order(ours, ref, leaves, w, u, r, zero_if_ref_zero=True)


def test_math_float64_passes_gradgradcheck(gen):
    q, k, v = (t.double().requires_grad_() for t in qkv(1, 2, 1, 3, 4, 5, g=gen))
    mask = torch.randn(1, 1, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)

    def fn(q, k, v, mask):
        out, lse = ab.attention(q, k, v, attn_mask=mask, softcap=3.0, causal="bottom_right", backend="math",
                                strict=True, return_lse=True)
        return out, lse

    assert torch.autograd.gradgradcheck(fn, (q, k, v, mask))


@pytest.mark.parametrize("backend", ["flash_varlen", "math", "eager"])
def test_varlen_double_backward_matches_padded_reference(backend, gen):
    from attn_backends._testing import varlen_reference

    q, k, v, cu_q, cu_k = make_packed([3, 0, 6], [5, 2, 6], 4, 2, 16, 16, torch.float32, gen)
    w = torch.randn(q.shape[0], 4, 16, generator=gen)
    u = torch.randn(4, q.shape[0], generator=gen)
    r = [torch.randn(t.shape, generator=gen) for t in (q, k, v)]
    opts = dict(causal="bottom_right", softcap=4.0)
    _check_second_order(lambda *xs: ab.attention_varlen(*xs, cu_q, cu_k, 9, 9, backend=backend, strict=True,
                                                        return_lse=True, **opts),
                        lambda dtype: lambda *xs: varlen_reference(*xs, cu_q, cu_k, dtype=dtype, **opts),
                        [q, k, v], w, u, r)


def test_op_called_directly_has_a_double_backward(gen):
    # register_autograd's path (torch.ops called directly) takes the same backward
    q, k, v = (t.requires_grad_() for t in qkv(g=gen))
    out = ops.flash_fwd(q, k, v, None, None, 1, 0.3, -1, -1, 0.0, 0.0)[0]
    (g,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), k)
    assert bool(h.abs().max() > 0)


@pytest.mark.parametrize("backend, opts", [
    (backend, opts) for backend in ("sdpa", "_native_flash", "_native_math")
    for opts in (dict(), dict(mask="float", causal="bottom_right"), dict(mask="bool", window=(3, 1)))
    if not (backend == "_native_flash" and opts.get("mask") == "float")])  # no mask gradient there: refused
def test_double_backward_through_torch_sdpa(backend, opts, gen):
    # torch's fused CPU kernel has no derivative of its backward: a gradient of a gradient raised
    # "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented", and
    # `auto` serves some training calls through torch SDPA
    from attn_backends._testing import reference_attention

    B, Hq, Sq, Sk, D = 2, 4, 9, 11, 16
    Hkv = Hq if backend == "_native_flash" else 2  # torch's flash kernel takes no GQA
    q, k, v = qkv(B, Hq, Hkv, Sq, Sk, D, g=gen)
    opts = dict(opts)
    kind = opts.pop("mask", None)
    leaves = [q, k, v]
    if kind == "float":
        m = torch.randn(B, 1, Sq, Sk, generator=gen).masked_fill(torch.rand(B, 1, Sq, Sk, generator=gen) < 0.2,
                                                                 -math.inf)
        m[:, :, :, -1] = 0.0  # bottom-right causal leaves every row its last key: no NaN rows in torch
        leaves.append(m)
    elif kind == "bool":
        opts["attn_mask"] = torch.rand(B, 1, Sq, Sk, generator=gen) > 0.3
        opts["attn_mask"][..., :] |= torch.eye(Sq, Sk, dtype=torch.bool)  # every row sees a key in its window
    w = torch.randn(B, Hq, Sq, D, generator=gen)
    u = torch.zeros(B, Hq, Sq)
    r = [torch.randn(t.shape, generator=gen) for t in leaves]

    def with_lse(fn):
        return lambda *xs: (fn(*xs), torch.zeros(B, Hq, Sq, dtype=xs[0].dtype))

    def ours(*xs):
        mask = xs[3] if len(xs) > 3 else opts.get("attn_mask")
        return ab.attention(*xs[:3], backend=backend, strict=True, **dict(opts, attn_mask=mask))

    def ref(dtype):
        def fn(*xs):
            mask = xs[3] if len(xs) > 3 else opts.get("attn_mask")
            return reference_attention(*xs[:3], dtype=dtype, **dict(opts, attn_mask=mask))[0]
        return fn

    _check_second_order(with_lse(ours), lambda dtype: with_lse(ref(dtype)), leaves, w, u, r)


@pytest.mark.parametrize("backend", ["sdpa", "_native_flash"])
def test_torch_sdpa_first_order_is_torch_own(backend, gen):
    # the node that gives torch SDPA its second derivative runs torch's own forward and backward otherwise:
    # the same bits as calling torch, retain_graph honoured, dropout's mask the same in forward and backward
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.requires_grad_() for t in qkv(2, 4, 4 if backend == "_native_flash" else 2, 33, 40, 64, g=gen))
    m = torch.randn(33, 40, generator=gen, requires_grad=backend == "sdpa")  # flash: no mask gradient
    out = ab.attention(q, k, v, attn_mask=m, backend=backend, strict=True)
    g = torch.randn(out.shape, generator=gen)
    wrt = (q, k, v, m) if m.requires_grad else (q, k, v)
    got = torch.autograd.grad(out, wrt, g)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if backend == "_native_flash" else contextlib.nullcontext():
        want_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    want = torch.autograd.grad(want_out, wrt, g)
    assert torch.equal(out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    loss = ab.attention(q, k, v, backend=backend, strict=True).square().sum()
    loss.backward(retain_graph=True)
    once = q.grad.clone()
    loss.backward()  # the second pass through the kept graph
    assert torch.allclose(q.grad, 2 * once)
    if backend != "sdpa":
        return  # torch's flash kernel on the CPU has no dropout: the planner refuses such calls

    torch.manual_seed(5)
    out = ab.attention(q, k, v, backend=backend, strict=True, dropout_p=0.5)
    (dv,) = torch.autograd.grad(out.sum(), v, create_graph=False)
    torch.manual_seed(5)
    want_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=True)
    assert torch.equal(out, want_out)
    assert torch.equal(dv, torch.autograd.grad(want_out.sum(), v)[0])
    # with dropout the composite cannot redraw torch's mask: the gradients are torch's own to second order (its
    # math kernel serves dropout on the CPU and has a derivative)
    torch.manual_seed(6)
    out = ab.attention(q, k, v, backend=backend, strict=True, dropout_p=0.5)
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (h,) = torch.autograd.grad(gq.square().sum(), k)
    torch.manual_seed(6)
    want_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=True)
    (want_gq,) = torch.autograd.grad(want_out.square().sum(), q, create_graph=True)
    assert torch.equal(gq, want_gq) and torch.equal(h, torch.autograd.grad(want_gq.square().sum(), k)[0])


def test_torch_sdpa_output_behaves_as_torchs_in_place_and_under_saved_tensor_hooks(gen):
    # the second-derivative node returned a view made in a custom Function, which refused an in-place change at
    # once (torch refuses it only at a backward that needs the output), and it saved q, k, v a second time
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 8, 8, 16, g=gen))
    out = ab.attention(q, k, v, backend="sdpa", strict=True)
    out.add_(1)  # no backward follows: fine, as on torch's output
    torch.manual_seed(3)
    out = ab.attention(q, k, v, backend="sdpa", strict=True, dropout_p=0.1)
    out.mul_(2)  # torch's math kernel (dropout on the CPU) does not need its output: the backward runs
    (got,) = torch.autograd.grad(out.sum(), v)
    torch.manual_seed(3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    want.mul_(2)
    assert torch.equal(got, torch.autograd.grad(want.sum(), v)[0])

    def packs(fn):
        n = [0]

        def pack(t):
            n[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return n[0]

    assert packs(lambda: ab.attention(q, k, v, backend="sdpa", strict=True, causal=True)) == \
        packs(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    # an input changed in place before a recorded backward: an error, as a saved tensor's would be
    x = q.detach().clone().requires_grad_()
    y = x * 1.0
    out = ab.attention(y, k, v, backend="sdpa", strict=True)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


# ---- precision with large logits and saturated rows ----------------------------------------------


def _alibi(Hq, Sq, Sk, offset, g):
    """ALiBi-like float bias, per head slopes, bottom-right aligned distances, plus a constant offset:
    with it the logits reach |offset| + slope * distance."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, Hq + 1) / Hq) * 16
    dist = (torch.arange(Sq).view(-1, 1) + Sk - Sq - torch.arange(Sk).view(1, -1)).abs()
    return (-slopes.view(Hq, 1, 1) * dist + offset + 0.5 * torch.randn(Hq, Sq, Sk, generator=g))[None]


def _check_large(backend, dtype, Sq, Sk, D, kind, g, Hq=2, Hkv=1, layout="bhsd", grad_grow=True, device="cpu"):
    """One call with large logits or saturated rows (kind) under the rule; inputs drawn on the CPU from g, then
    moved to `device` (test_cuda.py runs these on the GPU and the CUDA emulator)."""
    from attn_backends._testing import FLOORS, check_2x, out_and_grads_three_ways

    q = _layout(layout, 1, Hq, Sq, D, dtype, g)
    k = _layout(layout, 1, Hkv, Sk, D, dtype, g)
    v = _layout(layout, 1, Hkv, Sk, D, dtype, g)
    if kind.startswith("onehot"):  # each query a key plus noise: at scale 2, one weight near 1, the rest near 0
        pick = torch.randint(0, Sk, (Hq, Sq), generator=g)
        kk = k.float().repeat_interleave(Hq // Hkv, dim=1)[0]
        q = (torch.stack([kk[h, pick[h]] for h in range(Hq)])[None]
             + float(kind[6:]) * torch.randn(1, Hq, Sq, D, generator=g)).to(dtype)
        kind = "scale2"
    opts = {"softcap50": dict(softcap=50.0, scale=8.0), "softcap100": dict(softcap=100.0, scale=16.0),
            "alibi": dict(attn_mask=_alibi(Hq, Sq, Sk, -50.0, g)), "alibi100": dict(attn_mask=_alibi(Hq, Sq, Sk, 100.0, g)),
            "scale2": dict(scale=2.0), "scale3.5": dict(scale=3.5),
            "scale4_causal": dict(scale=4.0, causal="bottom_right")}[kind]
    if "attn_mask" in opts:
        opts["attn_mask"] = opts["attn_mask"].to(dtype).to(device)
    gout = torch.randn(1, Hq, Sq, D, generator=g).to(dtype).to(device)
    q, k, v = (t.to(device) for t in (q, k, v))
    (out, lse, grads), (r_out, r_lse, r_grads), (d_out, d_lse, d_grads) = out_and_grads_three_ways(
        backend, q, k, v, gout, return_lse=True, **opts)
    # the floors of test_properties.py: a score's float32 rounding (q.k summed in float32, here and in
    # torch) grows with the logits' spread scale * sqrt(D), which the outputs show first; the
    # gradients' floor grows too unless grad_grow=False (saturated rows: there torch's own error is
    # tiny, and the bug was the gap to it)
    eff = opts.get("scale", D ** -0.5)
    grow = max(1.0, eff * D ** 0.5)
    check_2x("out", out, r_out, d_out, 2, dtype, FLOORS[dtype] * grow)
    check_2x("lse", lse, r_lse, d_lse, 2, dtype, FLOORS[dtype] * grow * max(1.0, float(r_lse.detach().abs().amax())))
    for name, a, rr, dd in zip(("dq", "dk", "dv"), grads, r_grads, d_grads):
        check_2x(name, a, rr, dd, 3, dtype, FLOORS[dtype] * (grow if grad_grow else 1.0) * max(1.0, float(rr.abs().amax())))


# shapes where the 3x rule broke: few keys (torch's error is then small), decode rows, odd sizes
LARGE_SHAPES = [(1, 7, 96), (40, 2, 8), (5, 3, 40), (17, 70, 96), (2, 17, 16), (40, 40, 40)]


@pytest.mark.parametrize("backend", ["flash", "math", "eager"])
@pytest.mark.parametrize("kind", ["softcap50", "softcap100", "alibi", "alibi100", "scale2", "scale4_causal"])
def test_backward_precision_with_logits_up_to_100(backend, kind, gen):
    # the backward took p = exp(x - lse) with lse rounded to float32: dq, dk reached 7x torch's float32
    # error for flash and 27-31x for math, dv 12x for both
    for i, (Sq, Sk, D) in enumerate(LARGE_SHAPES):
        for _ in range(2):
            _check_large(backend, torch.float32, Sq, Sk, D, kind, gen, layout=("bhsd", "bshd")[i % 2])


@pytest.mark.parametrize("backend", ["flash", "math", "eager"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gradients_of_saturated_rows(backend, dtype, gen):
    # scale 2: nearly one-hot rows, where torch's own softmax backward is nearly exact; flash's
    # delta = rowsum(dO * O) read O rounded to float16 and reached 38x torch's error (float16 and
    # bfloat16 keep the plain floors: the float32 scores' rounding is far below theirs)
    for Sq, Sk, D in [(1, 2, 8), (1, 3, 96), (2, 5, 64), (3, 2, 16), (5, 9, 128), (17, 23, 64)]:
        for kind in ("scale2", "onehot0.3", "onehot2.0") + ("onehot1.0",) * (4 if Sq * Sk < 10 else 1):
            _check_large(backend, dtype, Sq, Sk, D, kind, gen, Hq=2, Hkv=2, grad_grow=dtype == torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradients_of_saturated_rows_on_every_cpu_path(isa, dtype, gen):
    # test_gradients_of_saturated_rows on each CPU kernel path: the AMX backward lacked the vector one's
    # correction of delta's rounding on heavy keys, and its dq reached 6x torch's bfloat16 error (a random
    # run under amx_emu: logits near 20)
    for Sq, Sk, D in [(1, 3, 96), (2, 40, 40), (5, 9, 128), (17, 23, 64)]:
        for kind in ("scale2", "scale3.5", "onehot0.3", "onehot1.0"):
            _check_large("flash", dtype, Sq, Sk, D, kind, gen, Hq=2, Hkv=2, grad_grow=dtype == torch.float32)


def test_varlen_backward_precision_with_large_logits(gen):
    from attn_backends._testing import FLOORS, check_2x, varlen_reference

    for _ in range(4):
        q, k, v, cu_q, cu_k = make_packed([1, 40, 5], [7, 2, 3], 4, 2, 40, 40, torch.float32, gen)
        opts = dict(softcap=50.0, scale=8.0, causal="bottom_right")
        gout = torch.randn(q.shape, generator=gen)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ab.attention_varlen(*leaves, cu_q, cu_k, 40, 7, backend="flash_varlen", strict=True, **opts)
        grads = torch.autograd.grad(out, leaves, gout)
        r = [t.double().requires_grad_() for t in (q, k, v)]
        r_grads = torch.autograd.grad(varlen_reference(*r, cu_q, cu_k, **opts)[0], r, gout.double())
        d = [t.clone().requires_grad_() for t in (q, k, v)]
        d_grads = torch.autograd.grad(varlen_reference(*d, cu_q, cu_k, dtype=torch.float32, **opts)[0], d, gout)
        for name, a, rr, dd in zip(("dq", "dk", "dv"), grads, r_grads, d_grads):
            check_2x(name, a, rr, dd, 3, torch.float32, FLOORS[torch.float32] * max(1.0, float(rr.abs().amax())))


def test_flash_ops_with_stats_pass_opcheck(gen):
    # flash's forward returns (out, lse, stats) and its backward takes stats: fake kernels, schemas and
    # autograd agree (torch.compile relies on them)
    q, k, v = (t.requires_grad_() for t in qkv(2, 4, 2, 5, 7, 8, g=gen))
    mask = torch.randn(2, 1, 5, 7, generator=gen)
    args = (q, k, v, mask, None, 2, 0.3, -1, -1, 5.0, 0.0)
    torch.library.opcheck(ops.flash_fwd.default, args)
    out, lse, stats = ops.flash_fwd(*args)
    assert stats.shape == (2,) + lse.shape and torch.equal(stats[0] + stats[1], lse)
    g = torch.randn(out.shape, generator=gen)
    q, k, v, out, lse, stats = (t.detach() for t in (q, k, v, out, lse, stats))  # the backward op has no autograd
    torch.library.opcheck(ops.flash_bwd.default, (g, q, k, v, out, lse, None, mask, None, 2, 0.3, -1, -1, 5.0, 0.0,
                                                  False, False, stats))
    pq, pk, pv, cu_q, cu_k = make_packed([3, 5], [4, 6], 2, 1, 8, 8, torch.float32, gen)
    torch.library.opcheck(ops.flash_varlen_fwd.default, (pq, pk, pv, cu_q, cu_k, 5, 6, None, 1, 0.3, -1, -1, 0.0, 0.0))


@pytest.mark.parametrize("scale", [1e-39, 2.0**-133, 0.0])
@pytest.mark.parametrize("Sq", [1, 40])
def test_bfloat16_products_past_float32_before_the_scale_stay_finite(isa, scale, Sq):
    # q near 1e10 and k near 1e30: q.k (about 1e41) is past float32's range, the scaled scores (0 to
    # about 100) are not.  On every CPU path flash gives finite rows and gradients near the float64
    # reference; the bfloat16 products (the decode kernel that one query token takes on AVX512_BF16, the
    # AMX tiles at 40) once multiplied the unscaled q.k and made them NaN, and the AMX backward then
    # rounded dS (which carries the scale) below bfloat16's normal range, so dq and dk came out 0.
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(1, 2, Sq, 64, generator=g, dtype=torch.float64) * 1e10).to(torch.bfloat16).requires_grad_()
    k = (torch.randn(1, 2, 50, 64, generator=g, dtype=torch.float64) * 1e30).to(torch.bfloat16).requires_grad_()
    v = torch.randn(1, 2, 50, 64, generator=g).to(torch.bfloat16).requires_grad_()
    go = torch.randn(1, 2, Sq, 64, generator=g).to(torch.bfloat16)
    out, lse = ab.attention(q, k, v, backend="flash", scale=scale, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), go)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = ab.attention(q64, k64, v64, backend="math", scale=scale, return_lse=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), go.double())
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{isa}: non-finite rows"
    assert (out.double() - ref).abs().max() < 3e-2
    assert (lse.double() - ref_lse).abs().max() < 1e-2
    # within 3% of the largest reference value on every path (0, the defect, is 100%); the AMX backward
    # needed 10% until it took delta's rounding off the heavy keys' dS as the vector backward does
    rel = 3e-2
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.isfinite(a).all(), f"{isa}: non-finite {name}"
        assert (a.double() - b).abs().max() <= rel * b.abs().max(), f"{isa}: {name} off"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4), (3, 8), (1, 2, 3, 8), (2, 2, 17, 8)])
def test_torch_sdpa_backend_keeps_causal_rows_under_a_negative_scale(shape, dtype, gen):
    # torch's fused CPU kernel (2.13) returns NaN rows for is_causal=True with a negative scale, and the
    # right ones with the same mask given explicitly; our "sdpa" backend, which calls it, passes the mask
    # then, so ab.sdpa and ab.attention equal torch's math backend there for every backend (a random run
    # found a 2-D call: F.sdpa takes math for it, ours reshaped it to 4-D and met the fused kernel)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(*shape[:-2], n, shape[-1], generator=gen).to(dtype) for n in (shape[-2], 5, 5))
    with sdpa_kernel(SDPBackend.MATH):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=-0.5)
        ref64 = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                                 scale=-0.5)
    assert not torch.isnan(want).any()
    for backend in ("sdpa", "auto", "math"):
        with ab.use(backend):
            got = ab.sdpa(q, k, v, is_causal=True, scale=-0.5)
        assert not torch.isnan(got).any(), f"{backend}: NaN rows"
        assert max_err(got, ref64) <= 2 * max_err(want, ref64) + FLOORS[dtype], backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["q_nan", "q_nan_masked_row", "k_inf_bottom_right", "q_inf_v_nan", "finite",
                                  "finite_masked_rows"])
def test_torch_as_autos_choice_keeps_the_rule_for_nan(case, dtype, gen):
    # torch's fused CPU kernel (2.13) gives a row with a NaN or +inf score zeros, and a row a mask hides entirely
    # NaN when its q holds a NaN (docs/reliability.md); where auto chooses torch (bfloat16 on AMX-BF16, some
    # float32 classes), the runner auto uses then (_dispatch._sdpa_as_auto, built here for any CPU) serves such a
    # call with our kernels, and leaves torch's own output, bit for bit, wherever q and k are finite
    from attn_backends import _dispatch
    from attn_backends._providers import RUNNERS

    Sq, Sk, D = 5, 16, 8
    q, k, v = (torch.randn(2, 2, n, D, generator=gen).to(dtype) for n in (Sq, Sk, Sk))
    causal, mask = False, None
    if case == "q_nan":
        q[0, 1, 2, 3] = math.nan
        causal = True
    elif case == "q_nan_masked_row":
        q[1, 0, 0, 0] = math.nan
        mask = torch.ones(2, 1, Sq, Sk, dtype=torch.bool)
        mask[1, :, 0] = False  # the NaN row sees no key: zeros
    elif case == "k_inf_bottom_right":
        k[0, 0, 0, 1] = math.inf
        causal = "bottom_right"
    elif case == "q_inf_v_nan":
        q[1, 1, 4, 0] = math.inf
        v[1, 1, 3, 1] = math.nan
    elif case == "finite_masked_rows":
        mask = torch.ones(2, 1, Sq, Sk, dtype=torch.bool)
        mask[0, :, 1] = False  # a padded row: zeros from torch, kept
    opts = dict(causal=causal, attn_mask=mask)
    args, sig = _dispatch.prepare(q, k, v, "auto", causal, mask, 0.0, None, None, 0.0, False)
    got, _ = _dispatch._sdpa_as_auto(sig)(args)
    torch_own, _ = RUNNERS[_dispatch._SDPA](args)
    want = ab.attention(q, k, v, backend="math", **opts)
    if case.startswith("finite"):
        assert torch.equal(got, torch_own)  # torch's bits: no second run
    assert torch.equal(nonfinite_pattern(got), nonfinite_pattern(want)), case
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    ref64, _ = reference_attention(q, k, v, only_visible=True, **opts)
    ref_d, _ = reference_attention(q, k, v, dtype=dtype, only_visible=True, **opts)
    zero = torch.zeros((), dtype=torch.float64)
    check_2x("finite part", torch.where(fin, got.double(), zero), torch.where(fin, ref64, zero),
             torch.where(fin, ref_d.double(), zero), 2, dtype, FLOORS[dtype])


def test_torch_as_autos_choice_is_checked_only_when_asked(monkeypatch):
    # the check costs 3-23% of torch's time (docs/reliability.md): auto's runner for torch SDPA is torch's own
    # unless anomaly mode is on or ATTN_BACKENDS_CHECK_TORCH_NAN=1 was set at import
    from attn_backends import _dispatch
    from attn_backends._providers import RUNNERS

    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    _, sig = _dispatch.prepare(q, q, q, "auto", True, None, 0.0, None, None, 0.0, False)
    monkeypatch.setattr(_dispatch, "_chosen", ({sig: _dispatch._SDPA}, {sig: _dispatch._SDPA}))  # auto chose torch
    monkeypatch.setattr(_dispatch, "_CHECK_TORCH_NAN", False)
    assert _dispatch._runner(sig, False) is RUNNERS[_dispatch._SDPA]
    with torch.autograd.set_detect_anomaly(True):
        checked = _dispatch._runner(sig, False)
    assert checked is not RUNNERS[_dispatch._SDPA]
    monkeypatch.setattr(_dispatch, "_CHECK_TORCH_NAN", True)
    assert _dispatch._runner(sig, False) is checked
    # a named torch SDPA is torch's, checked or not
    _, named = _dispatch.prepare(q, q, q, "sdpa", True, None, 0.0, None, None, 0.0, False)
    assert _dispatch._runner(named, False) is RUNNERS[_dispatch._SDPA]


@pytest.mark.parametrize("backend", ["math", "eager"])
def test_math_is_exact_to_the_rounding_in_float32(backend, gen):
    # the reference kernel accumulated float32 calls in float32: with q, k of standard deviation 2 over 1000
    # keys, out came to 3.5x torch's float32 error and the gradients to 6x, past the 2x / 3x rule; it
    # accumulates in float64 now, so out and the gradients are the float64 result rounded once
    from attn_backends._testing import reference_attention

    q = 2 * torch.randn(2, 4, 64, 64, generator=gen)
    k = 2 * torch.randn(2, 2, 1000, 64, generator=gen)
    v = torch.randn(2, 2, 1000, 64, generator=gen)
    gout = torch.randn(2, 4, 64, 64, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ab.attention(*leaves, backend=backend, strict=True)
    grads = torch.autograd.grad(out, leaves, gout)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves64)[0]
    refs = torch.autograd.grad(ref, leaves64, gout.double())
    ulp = torch.finfo(torch.float32).eps
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *refs)):
        assert max_err(a, r) <= ulp * float(r.abs().amax()), f"{name}: {max_err(a, r):.3g} off the float64 result"
