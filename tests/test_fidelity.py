"""What external test suites and a fuzzer found (issue 18), each pinned by a regression test.

Hostile arguments get an error naming the argument; integer arguments come as ints, numpy integers
or 0-d integer tensors; packed calls cost what their real lengths cost, whatever bound they name.
"""

import math
import re

import numpy as np
import pytest
import torch

import attn_backends as ab
from attn_backends._testing import make_packed

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
