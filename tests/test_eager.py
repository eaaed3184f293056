"""The eager composite (aten ops through the dispatcher, for devices without our kernels), run on
CPU against the float64 reference: same grid as the kernels, gradients, fully masked rows."""

import math

import pytest
import torch

from attn_backends import _eager, _validate
from attn_backends._testing import cases, check_against_reference


def run_eager(q, k, v, mask, case):
    wl, wr = _validate.check_window(case.window)
    return _eager.attention(q, k, v, mask, _validate.check_causal(case.causal), 1.0 / math.sqrt(case.D),
                            wl, wr, case.softcap, 0.0)


@pytest.mark.parametrize("case", list(cases(quick=True)), ids=str)
def test_eager_matches_reference(case, gen):
    check_against_reference(case, run_eager, grad=True, generator=gen)


def test_eager_fully_masked_rows_have_zero_output_and_finite_gradients():
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 2, :] = False
    out, lse = _eager.attention(q, k, v, mask, 1, 0.3, -1, -1, 0.0, 0.0)
    assert torch.all(out[:, :, 2] == 0) and torch.all(lse[:, :, 2] == -math.inf)
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, :, 2] == 0)


def test_eager_dropout_rate():
    q, k, v = (torch.randn(1, 1, 64, 8) for _ in range(3))
    v = torch.ones_like(v)
    out, _ = _eager.attention(q, k, v, None, 0, 0.3, -1, -1, 0.0, 0.5)
    # each output is sum_j keep_j p_j / (1 - p): mean 1 over rows
    assert abs(out.mean().item() - 1.0) < 0.15
