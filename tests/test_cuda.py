"""CUDA tests (marked `cuda`, skipped without a GPU): the math and flash forward kernels (dense and
varlen) against the float64 reference, results on a non-default stream, the same dropout stream as
the CPU kernels, fully masked rows, and the training fallback.  One command on a GPU machine: `python -m pytest -m cuda tests/`."""

import dataclasses
import math
import os

import pytest
import torch

import attn_backends as ab
from attn_backends import _dispatch
from attn_backends._testing import (Case, cases, check_2x, check_against_reference, make_packed, reference_attention,
                                    varlen_reference)

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def cuda_flash_on():
    # our CUDA flash forward is opt-in until verified (ATTN_BACKENDS_CUDA_FLASH=1); these tests verify it
    ab._C.enable_cuda_flash(True)
    _dispatch.reset_caches()
    yield
    ab._C.enable_cuda_flash(os.environ.get("ATTN_BACKENDS_CUDA_FLASH", "0") == "1")
    _dispatch.reset_caches()


def run_math(q, k, v, mask, case):
    return ab.attention(q, k, v, backend="math", causal=case.causal, attn_mask=mask, window=case.window,
                        softcap=case.softcap, return_lse=True, strict=True)


@pytest.mark.parametrize("case", list(cases()), ids=str)
def test_cuda_math_forward_matches_reference(case, gen):
    check_against_reference(case, run_math, grad=False, device="cuda", generator=gen)


@pytest.mark.parametrize("backend, S, D, dtype, tol", [
    ("math", 1024, 64, torch.float32, 1e-4),
    ("flash", 2048, 128, torch.bfloat16, 2e-2),  # the CUDA flash forward (opt-in, see cuda_flash_on)
])
def test_cuda_kernel_runs_on_the_current_stream(backend, S, D, dtype, tol):
    q, k, v = (torch.randn(4, h, S, D, device="cuda", dtype=dtype) for h in (8, 2, 2))
    ref, _ = reference_attention(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: a kernel on the wrong stream races
        out = ab.attention(q, k, v, backend=backend, causal=True, strict=True)
    torch.cuda.current_stream().wait_stream(side)
    assert (out.double() - ref).abs().max().item() < tol


def test_cuda_dropout_draws_the_same_mask_as_cpu():
    q, k, v = (torch.randn(2, 3, 37, 16, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(11)
    cpu = ab.attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(11)
    gpu = ab.attention(q.cuda(), k.cuda(), v.cuda(), dropout_p=0.4, backend="math", strict=True)
    torch.testing.assert_close(gpu.cpu(), cpu)


def test_cuda_training_uses_eager_with_correct_gradients(gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=33, Sk=65, D=64, causal="bottom_right", mask="bool_rows")
    check_against_reference(
        case, lambda q, k, v, m, c: ab.attention(q, k, v, causal=c.causal, attn_mask=m, return_lse=True),
        grad=True, device="cuda", generator=gen)


def test_cuda_fully_masked_rows_are_zero():
    q, k, v = (torch.randn(1, 2, 9, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(9, 9, dtype=torch.bool, device="cuda")
    mask[3] = False
    out, lse = ab.attention(q, k, v, attn_mask=mask, return_lse=True, backend="math", strict=True)
    assert torch.all(out[:, :, 3] == 0) and torch.all(lse[:, :, 3] == -math.inf)
    assert not torch.isnan(out).any()


def test_cuda_device_report():
    cc, ok, why = ab._C.cuda_device(torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability()
    assert cc == major * 10 + minor
    assert ok or why
    ready = _dispatch.cuda_math_ready(torch.cuda.current_device())
    assert (ready == "") == (ok and cc >= 80), ready


# ---- flash on CUDA (csrc/cuda/flash_fwd*.cu): forward only, float16/bfloat16, no mask ------------


def _flash_cases():
    """The grid's problems the CUDA flash forward serves (half dtypes, D in 32..256 by 8, Dv == D, no
    mask, any layout), each in float16 and bfloat16, plus long and odd ones."""
    seen = set()
    for case in cases():
        if case.mask != "none" or case.dv != case.D or case.D % 8 or not 32 <= case.D <= 256:
            continue
        for dt in (torch.float16, torch.bfloat16):
            c = dataclasses.replace(case, dtype=dt)
            if c not in seen:
                seen.add(c)
                yield c
    for D in (32, 64, 96, 128, 160, 200, 256):  # every instantiated width, and one padded (200)
        yield Case(B=2, Hq=4, Hkv=1, Sq=300, Sk=517, D=D, dtype=torch.bfloat16, causal="bottom_right")
    yield Case(B=1, Hq=2, Hkv=2, Sq=1, Sk=4099, D=128, dtype=torch.float16)  # decode
    yield Case(B=1, Hq=2, Hkv=2, Sq=2048, Sk=2048, D=128, dtype=torch.bfloat16, causal=True, softcap=30.0)
    yield Case(B=1, Hq=2, Hkv=2, Sq=200, Sk=100, D=64, dtype=torch.float16, causal="bottom_right")  # empty rows


def run_flash(q, k, v, mask, case):
    return ab.attention(q, k, v, backend="flash", causal=case.causal, attn_mask=mask, window=case.window,
                        softcap=case.softcap, return_lse=True, strict=True)


@pytest.mark.parametrize("case", list(_flash_cases()), ids=str)
def test_cuda_flash_forward_matches_reference(case, gen):
    assert ab.explain(*(torch.empty(1, 1, 1, case.D, device="cuda", dtype=case.dtype),) * 3,
                      backend="flash").chosen == "flash"
    check_against_reference(case, run_flash, grad=False, device="cuda", generator=gen)


def test_cuda_flash_fully_masked_rows_are_zero():
    # bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key
    q = torch.randn(1, 2, 40, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, 25, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    out, lse = ab.attention(q, k, v, causal="bottom_right", backend="flash", return_lse=True, strict=True)
    assert torch.all(out[:, :, :15] == 0) and torch.all(lse[:, :, :15] == -math.inf)
    assert torch.isfinite(out).all()


def test_cuda_flash_training_falls_back_with_a_warning(caplog):
    q, k, v = (torch.randn(1, 2, 33, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    assert ab.explain(q, k, v, backend="flash").chosen != "flash"  # no CUDA backward yet
    with pytest.raises(RuntimeError):
        ab.attention(q, k, v, backend="flash", strict=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), ("bottom_right", (16, 0))])
def test_cuda_flash_varlen_matches_reference(dtype, causal, window, gen):
    lens_q, lens_k = [1, 130, 0, 67, 513], [5, 130, 9, 300, 513]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 4, 2, 128, 128, dtype, gen)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    out, lse = ab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), backend="flash_varlen",
                                   causal=causal, window=window, return_lse=True, strict=True)
    r_out, r_lse = varlen_reference(q, k, v, cu_q, cu_k, causal=causal, window=window)
    d_out, d_lse = varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype, causal=causal, window=window)
    check_2x("out", out, r_out, d_out, 2, dtype)
    check_2x("lse", lse, r_lse, d_lse, 2, dtype)
