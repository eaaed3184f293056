"""Backends that route to torch (SDPA, its forced kernels, FlexAttention) give our semantics on
CPU; the wrappers for optional packages map layouts and flags correctly (checked against stand-in
modules that implement each package's documented semantics with the float64 reference)."""

import logging
import math
import sys
import types

import pytest
import torch

import attn_backends as ab
from attn_backends import _providers
from attn_backends._testing import Case, check_against_reference, reference_attention

TORCH_CASES = [
    Case(B=2, Hq=4, Hkv=2, Sq=9, Sk=13, D=16, Dv=8, causal=True),
    Case(B=2, Hq=4, Hkv=4, Sq=9, Sk=13, D=16, causal="bottom_right", mask="bool_rows"),
    Case(B=1, Hq=2, Hkv=1, Sq=17, Sk=17, D=32, mask="float_rows", window=(3, 2)),
    Case(B=1, Hq=2, Hkv=2, Sq=8, Sk=20, D=16, causal="bottom_right", window=(4, 0), layout="bshd"),
    Case(B=1, Hq=2, Hkv=2, Sq=11, Sk=7, D=16, dtype=torch.float64, mask="key_padding"),
]


def named(name, want_lse=False):
    def fn(q, k, v, mask, c):
        res = ab.attention(q, k, v, backend=name, causal=c.causal, attn_mask=mask, window=c.window,
                           softcap=c.softcap, return_lse=want_lse, strict=True)
        return res if want_lse else (res, None)
    return fn


@pytest.mark.parametrize("name", ["sdpa", "_native_math"])
@pytest.mark.parametrize("case", TORCH_CASES, ids=str)
def test_torch_sdpa_routes(name, case, gen):
    check_against_reference(case, named(name), grad=True, check_lse=False, generator=gen)


@pytest.mark.parametrize("case", [c for c in TORCH_CASES if c.Hq == c.Hkv and c.dv == c.D], ids=str)
def test_torch_flash_on_cpu(case, gen):
    check_against_reference(case, named("_native_flash"), grad=True, check_lse=False, generator=gen)


# a last dim that is not contiguous: torch's fused CPU kernel refuses it ("No available kernel"), so the
# runner copies those operands (DESIGN.md section 3: any strides, the last dim too)
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", [Case(B=1, Hq=2, Hkv=2, Sq=8, Sk=12, D=64, layout="strided_d"),
                                  Case(B=1, Hq=2, Hkv=2, Sq=17, Sk=9, D=40, layout="strided_d", causal="bottom_right",
                                       mask="bool_rows")], ids=str)
def test_torch_flash_on_cpu_with_a_strided_last_dim(case, gen):
    check_against_reference(case, named("_native_flash"), grad=True, check_lse=False, generator=gen)


FLEX_CASES = [
    Case(B=2, Hq=4, Hkv=2, Sq=9, Sk=13, D=16, causal=True, softcap=4.0),
    Case(B=1, Hq=2, Hkv=2, Sq=9, Sk=13, D=16, causal="bottom_right", mask="bool_rows", window=(3, 1)),
    Case(B=1, Hq=2, Hkv=1, Sq=12, Sk=12, D=16, mask="float_rows"),
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", FLEX_CASES, ids=str)
def test_flex_forward_with_lse(case, gen):
    check_against_reference(case, named("flex", want_lse=True), grad=False, check_lse=True, generator=gen)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_keeps_a_floating_mask_as_torch_does(dtype, mask_dtype, gen):
    # torch SDPA adds a float32 mask to 2-byte q in float32; a mask in another floating dtype than q's
    # reaches it in float32 (torch refuses it as is), not rounded to q's dtype: a route to torch gives
    # torch's own bits with a float32 mask, and with the others the bits of that mask in float32 (a
    # float16 mask on float16 q goes as it is, which torch's answer shows to be the same)
    q, k, v = (torch.randn(1, 4, 33, 64, generator=gen).to(dtype) for _ in range(3))
    mask = (torch.randn(1, 1, 33, 33, generator=gen) * 3).to(mask_dtype)
    got = ab.attention(q, k, v, attn_mask=mask, backend="sdpa", strict=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.float())
    assert torch.equal(got, want)
    if mask_dtype != dtype:
        rounded = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(dtype))
        assert not torch.equal(got, rounded)


def test_sdpa_dropout_is_torch_dropout():
    q = torch.randn(1, 1, 64, 8)
    v = torch.ones(1, 1, 64, 8)
    out = ab.attention(q, q, v, backend="sdpa", dropout_p=0.5, strict=True)
    assert abs(out.mean().item() - 1.0) < 0.2  # kept weights are rescaled by 1 / (1 - p)


# ---- optional packages, through stand-ins -------------------------------------------------------

def _hnd(t):
    return t.transpose(1, 2)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    calls = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        # flash-attn: (B, S, H, D); causal and window aligned bottom-right; lse (B, H, Sq) float32
        calls.append(dict(causal=causal, window_size=window_size, softcap=softcap, scale=softmax_scale))
        Sq, Sk = q.shape[1], k.shape[1]
        align = "bottom_right" if (causal or window_size != (-1, -1)) else False
        out, lse = reference_attention(_hnd(q), _hnd(k), _hnd(v), causal=align if causal else False,
                                       window=None if window_size == (-1, -1) else tuple(window_size),
                                       scale=softmax_scale, softcap=softcap, dtype=q.dtype)
        if not causal and window_size != (-1, -1) and Sq != Sk:
            raise AssertionError("the planner must not send a top-left window here when Sq != Sk")
        out = _hnd(out)
        return (out, lse.float(), None) if return_attn_probs else out

    mod = types.ModuleType("flash_attn")
    mod.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    return calls


def test_flash_attn_package_wrapper(fake_flash_attn, gen):
    q = torch.randn(2, 4, 10, 16, generator=gen)
    k = torch.randn(2, 2, 14, 16, generator=gen)
    v = torch.randn(2, 2, 14, 16, generator=gen)
    out, lse = _providers.packages.run_flash_attn_pkg(_providers.Attn(q, k, v, None, 2, 0.25, 5, 0, 3.0, 0.0, False, True))
    ref, ref_lse = reference_attention(q, k, v, causal="bottom_right", window=(5, 0), scale=0.25, softcap=3.0)
    assert out.shape == (2, 4, 10, 16) and lse.shape == (2, 4, 10)
    assert (out.double() - ref).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5
    assert fake_flash_attn[-1] == dict(causal=True, window_size=(5, 0), softcap=3.0, scale=0.25)


@pytest.fixture
def fake_xformers(monkeypatch):
    calls = []

    class LowerTriangularMask:
        pass

    class LowerTriangularFromBottomRightMask:
        pass

    def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
        calls.append(dict(shape=tuple(query.shape), bias=type(attn_bias).__name__))
        five = query.dim() == 5
        if five:  # (B, M, G, H, K) -> (B, G*H, M, K)
            B, M, G, H, K = query.shape
            qh = query.reshape(B, M, G * H, K).transpose(1, 2)
            kh = key.reshape(B, key.shape[1], G * H, K).transpose(1, 2)
            vh = value.reshape(B, value.shape[1], G * H, value.shape[-1]).transpose(1, 2)
        else:
            qh, kh, vh = _hnd(query), _hnd(key), _hnd(value)
        causal = {"LowerTriangularMask": True, "LowerTriangularFromBottomRightMask": "bottom_right"}.get(
            type(attn_bias).__name__, False)
        mask = attn_bias if isinstance(attn_bias, torch.Tensor) else None
        if mask is not None and five:
            mask = mask.reshape(mask.shape[0], -1, *mask.shape[-2:])
        out, _ = reference_attention(qh, kh, vh, causal=causal, attn_mask=mask, scale=scale, dtype=query.dtype)
        out = out.transpose(1, 2)
        return out.reshape(query.shape[:-1] + (value.shape[-1],)) if five else out

    xf = types.ModuleType("xformers")
    ops = types.ModuleType("xformers.ops")
    fmha = types.SimpleNamespace(attn_bias=types.SimpleNamespace(
        LowerTriangularMask=LowerTriangularMask, LowerTriangularFromBottomRightMask=LowerTriangularFromBottomRightMask))
    ops.fmha = fmha
    ops.memory_efficient_attention = memory_efficient_attention
    xf.ops = ops
    monkeypatch.setitem(sys.modules, "xformers", xf)
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)
    return calls


@pytest.mark.parametrize("causal", [0, 1, 2])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_xformers_wrapper(fake_xformers, causal, with_mask, gqa, gen):
    Hkv = 2 if gqa else 4
    q = torch.randn(2, 4, 9, 16, generator=gen)
    k = torch.randn(2, Hkv, 13, 16, generator=gen)
    v = torch.randn(2, Hkv, 13, 8, generator=gen)
    mask = None
    if with_mask:
        mask = torch.rand(2, 1, 9, 13, generator=gen) > 0.3
        mask[..., -1] = True
    out, _ = _providers.packages.run_xformers(_providers.Attn(q, k, v, mask, causal, 0.3))
    ref, _ = reference_attention(q, k, v, causal={0: False, 1: True, 2: "bottom_right"}[causal], attn_mask=mask,
                                 scale=0.3)
    assert (out.double() - ref).abs().max() < 1e-5
    call = fake_xformers[-1]
    assert call["shape"] == ((2, 9, 2, 2, 16) if gqa else (2, 9, 4, 16))  # (B, S, G, H/G, D) for GQA
    want_bias = "Tensor" if with_mask else {0: "NoneType", 1: "LowerTriangularMask", 2: "LowerTriangularFromBottomRightMask"}[causal]
    assert call["bias"] == want_bias


def test_sageattention_wrapper(monkeypatch):
    seen = {}

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None):
        seen.update(layout=tensor_layout, causal=is_causal, scale=sm_scale)
        return reference_attention(q, k, v, causal=is_causal, scale=sm_scale, dtype=q.dtype)[0]

    mod = types.ModuleType("sageattention")
    mod.sageattn = sageattn
    monkeypatch.setitem(sys.modules, "sageattention", mod)
    q = torch.randn(1, 2, 8, 64)
    out, lse = _providers.packages.run_sage_pkg(_providers.Attn(q, q, q, None, 1, 0.125))
    assert lse is None and seen == dict(layout="HND", causal=True, scale=0.125)
    assert (out.double() - reference_attention(q, q, q, causal=True, scale=0.125)[0]).abs().max() < 1e-5


def test_native_flash_on_cpu_does_not_take_dropout(caplog):
    # torch's fused CPU kernel refuses dropout: the plan used to choose it and torch raised "No available kernel"
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    assert ab.explain(q, k, v, backend="_native_flash", dropout_p=0.2).chosen != "_native_flash"
    ab._dispatch.reset_caches()
    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        ab.attention(q, k, v, backend="_native_flash", dropout_p=0.2).sum().backward()
    assert any("_native_flash" in r.getMessage() and "dropout" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="cannot serve"):
        ab.attention(q, k, v, backend="_native_flash", dropout_p=0.2, strict=True)


def test_native_flash_takes_a_head_dim_of_one_with_a_stride():
    q = torch.randn(1, 2, 5, 2)[..., ::2]  # last dim 1, stride 2: torch's fused kernel refused it
    k, v = torch.randn(1, 2, 7, 1), torch.randn(1, 2, 7, 1)
    out = ab.attention(q, k, v, backend="_native_flash", strict=True)
    ref = ab.attention(q.double(), k.double(), v.double(), backend="math")
    assert (out.double() - ref).abs().max().item() < 1e-5
