"""The math backend on CPU against the float64 reference (DESIGN.md section 5): every dtype, odd
sizes, GQA, Dv != D, both causal alignments, masks with fully masked rows, windows, softcap and
non-contiguous layouts; output, lse and gradients."""

import pytest
import torch

import attn_backends as ab
from attn_backends._testing import Case, cases, check_against_reference


def run_math(q, k, v, mask, case):
    return ab.attention(q, k, v, backend="math", causal=case.causal, attn_mask=mask, window=case.window,
                        softcap=case.softcap, return_lse=True)


@pytest.mark.parametrize("case", list(cases()), ids=str)
def test_math_matches_reference(case, gen):
    check_against_reference(case, run_math, grad=True, generator=gen)


@pytest.mark.parametrize("name", ["math", "manual", "reference", "MATH", "eager"])
def test_names_served_by_math_on_cpu(name, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=9, Sk=13, D=16, causal=True)
    check_against_reference(
        case, lambda q, k, v, m, c: ab.attention(q, k, v, backend=name, causal=c.causal, return_lse=True),
        generator=gen)
