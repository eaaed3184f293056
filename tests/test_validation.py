"""Bad input gets a clear error naming the argument and the expectation; nothing crashes.

The public API raises TypeError (types, dtypes) and ValueError (shapes, values).  The torch ops
check again at their own boundary (a direct torch.ops call), raising RuntimeError.
"""

import math

import pytest
import torch

import attn_backends as ab

ops = torch.ops.attn_backends


def qkv(B=2, Hq=4, Hkv=2, Sq=5, Sk=7, D=8, Dv=8, dtype=torch.float32):
    return (torch.randn(B, Hq, Sq, D, dtype=dtype), torch.randn(B, Hkv, Sk, D, dtype=dtype),
            torch.randn(B, Hkv, Sk, Dv, dtype=dtype))


def raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-D \(B, Hq, Sq, D\), got shape \(4, 5, 8\)"),
        (lambda q, k, v: (q, k[None], v), ValueError, r"k must be 4-D"),
        (lambda q, k, v: (q, k, v[..., 0]), ValueError, r"v must be 4-D"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"same batch size, got 2, 1 and 1"),
        (lambda q, k, v: (q, k, v[:, :1]), ValueError, r"k and v must have the same number of heads"),
        (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, r"k and v must have the same sequence length"),
        (lambda q, k, v: (q, k[..., :4], v), ValueError, r"q and k must have the same head dim, got 8 and 4"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, r"query heads \(3\) must be a multiple of .* heads \(2\)"),
        (lambda q, k, v: (q.half(), k, v), TypeError, r"same dtype, got torch.float16, torch.float32"),
        (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, r"q must be float16, bfloat16, float32 or float64, got torch.int64"),
        (lambda q, k, v: (q > 0, k > 0, v > 0), TypeError, r"got torch.bool"),
        (lambda q, k, v: (q, k.to("meta"), v), ValueError, r"same device"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, r"q must be a torch.Tensor, got ndarray"),
        (lambda q, k, v: (q[..., :0], k[..., :0], v), ValueError, r"head dim of q and k must be at least 1"),
    ],
)
def test_bad_q_k_v(make, exc, match):
    raises(exc, match, ab.attention, *make(*qkv()))


@pytest.mark.parametrize(
    "mask, exc, match",
    [
        (torch.ones(2, 4, 5, 6, dtype=torch.bool), ValueError, r"attn_mask of shape \(2, 4, 5, 6\) is not broadcastable to \(B, Hq, Sq, Sk\) = \(2, 4, 5, 7\)"),
        (torch.ones(3, 1, 5, 7, dtype=torch.bool), ValueError, r"not broadcastable"),
        (torch.ones(1, 2, 4, 5, 7, dtype=torch.bool), ValueError, r"at most 4 dims"),
        (torch.ones(5, 7, dtype=torch.int64), TypeError, r"attn_mask must be bool .* or floating .*, got torch.int64"),
        ([[True]], TypeError, r"attn_mask must be a torch.Tensor or None, got list"),
        (torch.ones(5, 7, dtype=torch.bool, device="meta"), ValueError, r"attn_mask must be on the same device as q"),
    ],
)
def test_bad_mask(mask, exc, match):
    raises(exc, match, ab.attention, *qkv(), attn_mask=mask)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\), got -0.1"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
        (dict(dropout_p="0.1"), TypeError, r"dropout_p must be a float, got str"),
        (dict(softcap=-1.0), ValueError, r"softcap must be >= 0 and finite \(0 disables it\), got -1.0"),
        (dict(softcap=math.inf), ValueError, r"softcap must be >= 0 and finite"),
        (dict(softcap="big"), TypeError, r"softcap must be a float"),
        (dict(window=(-2, 0)), ValueError, r"window left must be >= -1 \(-1 = unbounded\), got -2"),
        (dict(window=(0, -5)), ValueError, r"window right must be >= -1"),
        (dict(window=(1, 2, 3)), ValueError, r"window must be None or a pair \(left, right\)"),
        (dict(window=5), ValueError, r"window must be None or a pair"),
        (dict(window=(1.5, 2)), TypeError, r"window left must be an int, got float"),
        (dict(causal="top-right"), ValueError, r'causal must be False, True, "top_left" or "bottom_right", got \'top-right\''),
        (dict(causal=2), ValueError, r"causal must be"),
        (dict(scale=math.nan), ValueError, r"scale must be finite, got nan"),
        (dict(scale="x"), TypeError, r"scale must be a float or None, got str"),
        (dict(scale=True), TypeError, r"scale must be a float or None, got bool"),
        (dict(scale=torch.ones(2)), TypeError, r"scale must be a float or None, got torch.Tensor"),
        (dict(softcap=torch.tensor(True)), TypeError, r"softcap must be a float, got torch.Tensor"),
        (dict(dropout_p=1j), TypeError, r"dropout_p must be a float, got complex"),
        (dict(backend="flash_attn_9"), ValueError, r"unknown backend 'flash_attn_9'; valid names are: auto, flash, flash_attn, .*math"),
        (dict(backend=3), TypeError, r"backend must be a str, got int"),
        # unhashable: the name table's lookup raised "unhashable type" before the check
        (dict(backend=["flash"]), TypeError, r"backend must be a str, got list"),
        (dict(backend={"flash": 1}), TypeError, r"backend must be a str, got dict"),
    ],
)
def test_bad_options(kwargs, exc, match):
    raises(exc, match, ab.attention, *qkv(), **kwargs)


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_float_options_as_numpy_scalars_and_0d_tensors(kind):
    # F.sdpa takes them (and window sides were taken so); scale, softcap and dropout_p raised TypeError
    import numpy as np

    wrap = {"numpy": np.float32, "tensor": torch.tensor}[kind]
    q, k, v = qkv()
    for name, value in (("scale", 0.25), ("softcap", 3.0)):
        got = ab.attention(q, k, v, backend="flash", **{name: wrap(value)})
        assert torch.equal(got, ab.attention(q, k, v, backend="flash", **{name: float(wrap(value))})), name
    torch.manual_seed(0)
    got = ab.attention(q, k, v, backend="math", dropout_p=wrap(0.25))
    torch.manual_seed(0)
    assert torch.equal(got, ab.attention(q, k, v, backend="math", dropout_p=float(wrap(0.25))))


def test_resolve():
    assert ab.resolve("Flash-Attn") == "flash"
    assert ab.resolve("FLASH_ATTENTION_2") == "flash"
    assert ab.resolve("manual") == "math"
    with pytest.raises(ValueError, match="valid names are: auto, flash"):
        ab.resolve("nope")


def test_bad_input_leaves_inputs_untouched():
    q, k, v = qkv()
    before = [t.clone() for t in (q, k, v)]
    with pytest.raises(ValueError):
        ab.attention(q, k, v, dropout_p=2.0)
    for a, b in zip(before, (q, k, v)):
        assert torch.equal(a, b)


# ---- the op boundary ---------------------------------------------------------------------------

def fwd_args(**over):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, attn_mask=None, rng_state=None, causal=0, scale=0.3, window_left=-1,
                window_right=-1, softcap=0.0, dropout_p=0.0)
    args.update(over)
    return list(args.values())


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(k=torch.randn(2, 2, 7, 4)), r"k has size 4 in dim 3, expected 8"),
        (dict(v=torch.randn(2, 3, 7, 8)), r"v has size 3 in dim 1, expected 2"),
        (dict(q=torch.randn(2, 3, 5, 8)), r"multiple of key/value heads"),
        (dict(q=torch.randn(2, 4, 5)), r"q, k and v must be 4-D"),
        (dict(v=torch.randn(2, 2, 7, 8, dtype=torch.float64)), r"v must be float32, got float64"),
        (dict(attn_mask=torch.ones(3, 5, 7, dtype=torch.bool)), r"attn_mask of shape \(3, 5, 7\) is not broadcastable"),
        (dict(attn_mask=torch.ones(5, 7, dtype=torch.int32)), r"attn_mask must be bool or floating, got int32"),
        (dict(causal=3), r"causal must be 0, 1 or 2, got 3"),
        (dict(window_left=-4), r"window values must be >= -1"),
        (dict(softcap=-2.0), r"softcap must be >= 0"),
        (dict(dropout_p=1.0, rng_state=torch.zeros(2, dtype=torch.int64)), r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p=0.5), r"dropout_p > 0 needs rng_state"),
        (dict(dropout_p=0.5, rng_state=torch.zeros(3, dtype=torch.int64)), r"rng_state must be an int64 tensor of shape \(2,\)"),
        (dict(scale=math.inf), r"scale must be finite"),
    ],
)
def test_op_boundary_rejects_bad_arguments(over, match):
    with pytest.raises(RuntimeError, match=match):
        ops.math_fwd(*fwd_args(**over))


def test_backward_op_rejects_bad_arguments():
    q, k, v = qkv()
    out, lse = ops.math_fwd(q, k, v, None, None, 0, 0.3, -1, -1, 0.0, 0.0)
    with pytest.raises(RuntimeError, match=r"lse must be float32, got float64"):
        ops.math_bwd(out, q, k, v, out, lse.double(), None, None, None, 0, 0.3, -1, -1, 0.0, 0.0, False)
    with pytest.raises(RuntimeError, match=r"grad_out has size 3 in dim 3, expected 8"):
        ops.math_bwd(out[..., :3], q, k, v, out, lse, None, None, None, 0, 0.3, -1, -1, 0.0, 0.0, False)
    with pytest.raises(RuntimeError, match=r"mask_grad needs a floating attn_mask"):
        ops.math_bwd(out, q, k, v, out, lse, None, None, None, 0, 0.3, -1, -1, 0.0, 0.0, True)


def test_dropout_mask_op_rejects_bad_arguments():
    rng = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\)"):
        ops.dropout_mask(rng, 1, 1, 2, 2, 1.5)
    with pytest.raises(RuntimeError, match=r"sizes must be non-negative"):
        ops.dropout_mask(rng, 1, -1, 2, 2, 0.5)
    with pytest.raises(RuntimeError, match=r"rng_state must be an int64 tensor"):
        ops.dropout_mask(rng.float(), 1, 1, 2, 2, 0.5)


def test_strict_that_is_not_a_bool_is_read_by_its_truth():
    # it used to raise "tuple indices must be integers or slices, not str" (strict="yes") or IndexError (strict=2)
    q = torch.randn(1, 2, 4, 8)
    for strict in ("yes", 2, 1, None, 0):
        ab.attention(q, q, q, backend="flash", strict=strict)
        ab.attention_varlen(q[0], q[0], q[0], torch.tensor([0, 2], dtype=torch.int32),
                            torch.tensor([0, 2], dtype=torch.int32), 2, 2, strict=strict)
    with pytest.raises(RuntimeError, match="cannot serve"):
        ab.attention(q, q, q, backend="flash_varlen", strict="yes")  # truthy: raises instead of falling back
