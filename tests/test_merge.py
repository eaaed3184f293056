"""ab.merge_attention_states: two partial results over disjoint key sets merge into attention over
their union (the float64 reference), fully masked parts weigh nothing, bad input is named."""

import pytest
import torch

import attn_backends as ab
from attn_backends._testing import reference_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [0, 1, 13, 40])
def test_two_halves_merge_into_the_whole(dtype, split):
    torch.manual_seed(split)
    B, H, Sq, Sk, D = 2, 3, 17, 40, 24
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype) for n in (Sq, Sk, Sk))
    ref, ref_lse = reference_attention(q, k, v)
    same_dtype, _ = reference_attention(q, k, v, dtype=dtype)
    parts = []
    for sl in (slice(0, split), slice(split, Sk)):
        parts += list(ab.attention(q, k[:, :, sl], v[:, :, sl], backend="math", return_lse=True))
    out, lse = ab.merge_attention_states(*parts)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # the project's rule: at most twice the error of plain torch ops in the same dtype
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * (same_dtype.double() - ref).abs().max().item() + 1e-6
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)


def test_fully_masked_parts_weigh_nothing():
    out_a = torch.randn(1, 2, 3, 8)
    lse_a = torch.randn(1, 2, 3)
    empty_out, empty_lse = torch.zeros(1, 2, 3, 8), torch.full((1, 2, 3), float("-inf"))
    out, lse = ab.merge_attention_states(out_a, lse_a, empty_out, empty_lse)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = ab.merge_attention_states(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, empty_out) and torch.isneginf(lse).all()


def test_an_empty_part_weighs_nothing_whatever_its_out_holds():
    # a producer may leave NaN in an empty part's out (0 / 0): with weight 0 it used to make the row NaN
    out_a = torch.randn(1, 2, 3, 8, requires_grad=True)
    lse_a = torch.randn(1, 2, 3)
    junk = torch.full((1, 2, 3, 8), float("nan"), requires_grad=True)
    empty = torch.full((1, 2, 3), float("-inf"))
    for args in ((out_a, lse_a, junk, empty), (junk, empty, out_a, lse_a)):
        out, lse = ab.merge_attention_states(*args)
        assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
        ga, gj = torch.autograd.grad(out.sum(), (out_a, junk))
        assert torch.equal(ga, torch.ones_like(ga)) and torch.equal(gj, torch.zeros_like(gj))
    out, lse = ab.merge_attention_states(junk, empty, junk, empty)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    # a part that saw keys but whose weight underflows keeps its NaN (0 * NaN), as the float64 reference does
    out, _ = ab.merge_attention_states(torch.tensor([[float("nan"), 1.0]]), torch.tensor([-200.0]),
                                       torch.tensor([[2.0, 3.0]]), torch.tensor([0.0]))
    assert torch.isnan(out[0, 0]) and out[0, 1] == 3.0


@pytest.mark.parametrize("other", [0.0, float("-inf"), float("nan")])
def test_a_nan_or_infinite_lse_is_not_taken_for_an_empty_part(other):
    # a NaN lse (a NaN score among a part's keys) made lse -inf, the marker of a row that saw no key, with
    # out NaN; torch.logaddexp and the split-KV kernels' merge give NaN
    out_a, out_b = torch.randn(3, 8), torch.randn(3, 8)
    lse_a = torch.tensor([float("nan"), float("inf"), 0.5])
    lse_b = torch.full((3,), other)
    want = torch.logaddexp(lse_a, lse_b)
    for args in ((out_a, lse_a, out_b, lse_b), (out_b, lse_b, out_a, lse_a)):  # either order
        out, lse = ab.merge_attention_states(*args)
        assert torch.allclose(lse, want, equal_nan=True, rtol=1e-6), (lse, want)
        assert torch.isnan(out[:2]).all()  # NaN in, NaN out; inf - inf in the weights of the second row
        assert torch.isnan(out[2]).all() == (other != other)
        assert torch.isfinite(out[2]).all() == (other == other)


def test_large_lse_stays_finite_and_exact():
    out_a, out_b = torch.randn(4, 8), torch.randn(4, 8)
    lse_a = torch.full((4,), 1e4)
    lse_b = lse_a + torch.tensor([0.0, 1.0, -50.0, 200.0])
    out, lse = ab.merge_attention_states(out_a, lse_a, out_b, lse_b)
    wb = torch.sigmoid((lse_b - lse_a).double())
    want = out_a.double() * (1 - wb)[:, None] + out_b.double() * wb[:, None]
    assert torch.isfinite(out).all() and torch.allclose(out.double(), want, atol=1e-6)
    assert torch.allclose(lse.double(), torch.logaddexp(lse_a.double(), lse_b.double()), rtol=1e-7)


def test_gradients_flow_through_the_merge():
    out_a, out_b = (torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    lse_a, lse_b = (torch.randn(2, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda *t: ab.merge_attention_states(*t), (out_a, lse_a, out_b, lse_b))


def test_a_row_neither_part_saw_gets_zero_gradients():
    """Rows empty on both sides (lse -inf, out 0): out 0, lse -inf, and gradients 0 there, not NaN (the
    log of the zero total had a 0/0 backward); the other rows' gradients as gradcheck has them."""
    out_a, out_b = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    lse_a = torch.tensor([float("-inf"), 0.3, float("-inf")], dtype=torch.float64, requires_grad=True)
    lse_b = torch.tensor([float("-inf"), -0.2, 1.1], dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        out_a[0] = 0
        out_b[0] = 0
    out, lse = ab.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert torch.isneginf(lse[0]) and torch.equal(out[0], torch.zeros(4, dtype=torch.float64))
    loss = out.sum() + lse.masked_fill(torch.isneginf(lse), 0).sum()
    grads = torch.autograd.grad(loss, (out_a, lse_a, out_b, lse_b))
    assert all(torch.isfinite(g).all() for g in grads), grads
    assert grads[1][0] == 0 and grads[3][0] == 0 and (grads[0][0] == 0).all() and (grads[2][0] == 0).all()


def test_the_accumulation_dtype_does_not_depend_on_the_order():
    out, lse32 = torch.randn(2, 4), torch.randn(2)
    lse64 = torch.randn(2, dtype=torch.float64)
    _, ab_lse = ab.merge_attention_states(out, lse32, out, lse64)
    _, ba_lse = ab.merge_attention_states(out, lse64, out, lse32)
    assert ab_lse.dtype == ba_lse.dtype == torch.float64 and torch.equal(ab_lse, ba_lse)


def test_inputs_are_not_modified():
    out_a, lse_a, out_b, lse_b = torch.randn(3, 4), torch.randn(3), torch.randn(3, 4), torch.randn(3)
    copies = [t.clone() for t in (out_a, lse_a, out_b, lse_b)]
    ab.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert all(torch.equal(a, b) for a, b in zip((out_a, lse_a, out_b, lse_b), copies))


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 4), torch.randn(2), torch.randn(3, 4), torch.randn(3)), "out_a and out_b"),
    ((torch.randn(2, 4), torch.randn(4), torch.randn(2, 4), torch.randn(2)), "lse_a must have out's shape"),
    ((torch.randn(2, 4), torch.randn(2), torch.randn(2, 4), torch.ones(2, dtype=torch.int32)), "lse_b must be a float"),
    ((torch.randn(2, 4), torch.randn(2), torch.randn(2, 4).half(), torch.randn(2)), "one floating-point dtype"),
    ((torch.randn(2, 4), [0.0, 0.0], torch.randn(2, 4), torch.randn(2)), "lse_a must be a torch.Tensor"),
])
def test_bad_input_names_the_argument(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ab.merge_attention_states(*args)
