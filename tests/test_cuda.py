"""CUDA tests (marked `cuda`, skipped without a GPU): the math forward kernel against the float64
reference, results on a non-default stream, the same dropout stream as the CPU kernels, and the
training fallback.  One command on a GPU machine: `python -m pytest -m cuda tests/`."""

import math

import pytest
import torch

import attn_backends as ab
from attn_backends import _dispatch
from attn_backends._testing import Case, cases, check_against_reference, reference_attention

pytestmark = pytest.mark.cuda


def run_math(q, k, v, mask, case):
    return ab.attention(q, k, v, backend="math", causal=case.causal, attn_mask=mask, window=case.window,
                        softcap=case.softcap, return_lse=True, strict=True)


@pytest.mark.parametrize("case", list(cases()), ids=str)
def test_cuda_math_forward_matches_reference(case, gen):
    check_against_reference(case, run_math, grad=False, device="cuda", generator=gen)


def test_cuda_math_runs_on_the_current_stream():
    case = Case(B=4, Hq=8, Hkv=2, Sq=1024, Sk=1024, D=64, causal=True)
    q, k, v = (torch.randn(case.B, h, case.Sq, case.D, device="cuda") for h in (8, 2, 2))
    ref, _ = reference_attention(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: a kernel on the wrong stream races
        out = ab.attention(q, k, v, backend="math", causal=True, strict=True)
    torch.cuda.current_stream().wait_stream(side)
    assert (out.double() - ref).abs().max().item() < 1e-4


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
