"""Semantics every backend shares (docs/semantics.md), checked on the math backend on CPU: fully
masked rows, empty shapes, lse and its gradient, float-mask gradients, dropout replay and
reproducibility, gradcheck in float64, layouts, determinism, inputs never modified."""

import math

import pytest
import torch

import attn_backends as ab
from attn_backends import _providers
from attn_backends._testing import (Case, check_2x, check_out_and_grads_2x, keep_mask_for_next_call, make_inputs,
                                     make_packed, reference_attention, varlen_reference)

ops = torch.ops.attn_backends


def attn(q, k, v, **kw):
    kw.setdefault("backend", "math")
    return ab.attention(q, k, v, **kw)


# ---- fully masked rows -------------------------------------------------------------------------

def _dead_row_setups(B, H, Sq, Sk):
    bool_mask = torch.rand(B, H, Sq, Sk) > 0.5
    bool_mask[..., 0] = True  # every other row keeps a visible key
    bool_mask[:, :, 1] = False
    float_mask = torch.randn(B, H, Sq, Sk)
    float_mask[:, :, 1] = -math.inf
    return {
        "bool": (dict(attn_mask=bool_mask), [1]),
        "float": (dict(attn_mask=float_mask), [1]),
        # Sq > Sk with bottom-right causal: the first Sq - Sk queries see no key
        "bottom_right": (dict(causal="bottom_right"), list(range(Sq - Sk))),
    }


@pytest.mark.parametrize("kind", ["bool", "float", "bottom_right"])
@pytest.mark.parametrize("backend, dtype", [("math", torch.float32), ("math", torch.bfloat16), ("math", torch.float64),
                                            ("flash", torch.float32), ("flash", torch.bfloat16)])  # flash: no float64
def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_grad(backend, kind, dtype):
    B, H, Sq, Sk, D = 2, 3, 9, 5, 16
    opts, dead = _dead_row_setups(B, H, Sq, Sk)[kind]
    q, k, v = (torch.randn(B, H, s, D, dtype=dtype, requires_grad=True) for s in (Sq, Sk, Sk))
    out, lse = attn(q, k, v, return_lse=True, backend=backend, strict=True, **opts)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[:, :, dead] == 0)
    assert torch.all(lse[:, :, dead] == -math.inf)
    live = [i for i in range(Sq) if i not in dead]
    assert torch.isfinite(lse[:, :, live]).all()
    (out.float().square().sum() + lse[:, :, live].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :, dead] == 0)


def test_window_past_the_last_key_masks_rows():
    q = torch.randn(1, 1, 4, 8)
    k = torch.randn(1, 1, 2, 8)
    out, lse = attn(q, k, k, window=(0, 0), return_lse=True)  # query i sees only key i
    assert torch.all(out[:, :, 2:] == 0) and torch.all(lse[:, :, 2:] == -math.inf)
    assert torch.isfinite(lse[:, :, :2]).all()


def test_the_references_visibility_takes_window_sides_wider_than_any_sequence():
    # the tests' own mask (attn_backends/_testing.visible): a side near 2**63 hides nothing, as an unbounded
    # one (ii + side wrapped to a negative number before, hiding every key), and the result is the kernel's
    from attn_backends._testing import visible

    huge = 2**63 - 1
    for causal in (False, True, "bottom_right"):
        assert torch.equal(visible(5, 7, causal, (huge, huge)), visible(5, 7, causal, None))
        assert torch.equal(visible(5, 7, causal, (huge, 0)), visible(5, 7, causal, (-1, 0)))
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    out = attn(q, k, v, window=(huge, huge))
    ref, _ = reference_attention(q, k, v, window=(huge, huge))
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)


# ---- empty shapes ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "shape",
    [
        dict(B=0, Hq=2, Hkv=2, Sq=3, Sk=4),
        dict(B=2, Hq=0, Hkv=0, Sq=3, Sk=4),
        dict(B=2, Hq=2, Hkv=1, Sq=0, Sk=4),
        dict(B=2, Hq=2, Hkv=1, Sq=3, Sk=0),
    ],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()),
)
@pytest.mark.parametrize("backend", ["math", "flash"])
def test_empty_shapes(shape, backend):
    B, Hq, Hkv, Sq, Sk, D, Dv = shape["B"], shape["Hq"], shape["Hkv"], shape["Sq"], shape["Sk"], 8, 6
    q = torch.randn(B, Hq, Sq, D, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, Dv, requires_grad=True)
    out, lse = attn(q, k, v, return_lse=True, backend=backend, strict=True)
    assert out.shape == (B, Hq, Sq, Dv) and lse.shape == (B, Hq, Sq)
    if Sk == 0:
        assert torch.all(out == 0) and torch.all(lse == -math.inf)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert torch.all(q.grad == 0) and torch.all(k.grad == 0) and torch.all(v.grad == 0)


# ---- lse ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", [("math", torch.float32), ("math", torch.float64), ("flash", torch.float32)])
def test_gradient_through_lse(backend, dtype, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=13, Sk=21, D=24, dtype=dtype, causal="bottom_right", mask="bool_rows")
    q, k, v, mask = make_inputs(case, requires_grad=True, generator=gen)
    out, lse = attn(q, k, v, causal=case.causal, attn_mask=mask, return_lse=True, backend=backend, strict=True)
    w = torch.randn(lse.shape, generator=gen, dtype=dtype)
    live = torch.isfinite(lse)

    def loss(o, l):
        return o.square().sum() + torch.where(live, l * w.to(l.dtype), torch.zeros_like(l)).sum()

    ours = torch.autograd.grad(loss(out, lse), (q, k, v))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = reference_attention(*leaves64, causal=case.causal, attn_mask=mask)
    ref = torch.autograd.grad(loss(r_out, r_lse), leaves64)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    d_out, d_lse = reference_attention(*leaves, causal=case.causal, attn_mask=mask, dtype=dtype)
    same = torch.autograd.grad(loss(d_out, d_lse), leaves)
    for name, a, r, s in zip(("dq", "dk", "dv"), ours, ref, same):
        check_2x(name, a, r, s, 3, dtype)


@pytest.mark.parametrize("backend, packed", [("math", False), ("flash", False), ("flash_varlen", True),
                                             ("math", True), ("eager", True)])
def test_gradient_through_lse_alone(backend, packed, gen):
    # a loss of lse only: autograd hands the backward no output gradient (the packed kernels' backward
    # once passed that None to the op, which failed reading its strides)
    dtype = torch.float32
    if packed:
        q, k, v, cu_q, cu_k = make_packed([4, 0, 6], [5, 3, 7], 4, 2, 16, 16, dtype, gen)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        _, lse = ab.attention_varlen(*leaves, cu_q, cu_k, 6, 7, return_lse=True, backend=backend, strict=True)

        def ref(*xs, dtype):
            return varlen_reference(*xs, cu_q, cu_k, dtype=dtype)[1]
    else:
        case = Case(B=2, Hq=4, Hkv=2, Sq=9, Sk=11, D=16, dtype=dtype, causal="bottom_right")
        leaves = make_inputs(case, requires_grad=True, generator=gen)[:3]
        _, lse = attn(*leaves, causal=case.causal, return_lse=True, backend=backend, strict=True)

        def ref(*xs, dtype):
            return reference_attention(*xs, causal=case.causal, dtype=dtype)[1]
    w = torch.randn(lse.shape, generator=gen, dtype=dtype)
    ours = torch.autograd.grad((lse * w).sum(), leaves)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad((ref(*leaves64, dtype=torch.float64) * w.double()).sum(), leaves64,
                               materialize_grads=True)  # lse does not depend on v: its gradient is 0
    same_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    same = torch.autograd.grad((ref(*same_leaves, dtype=dtype) * w).sum(), same_leaves, materialize_grads=True)
    assert ours[0].abs().sum() > 0 and ours[1].abs().sum() > 0
    for name, a, r, s in zip(("dq", "dk", "dv"), ours, want, same):
        check_2x(name, a, r, s, 3, dtype)


def test_lse_dtype_is_float32_or_float64():
    for dtype, want in [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)]:
        q = torch.randn(1, 2, 3, 8, dtype=dtype)
        _, lse = attn(q, q, q, return_lse=True)
        assert lse.dtype == want


# ---- float mask gradients ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["math", "flash"])
@pytest.mark.parametrize("mask_shape", [(2, 4, 7, 11), (1, 4, 7, 11), (7, 11), (2, 1, 1, 11)])
def test_float_mask_gradient(mask_shape, backend, gen):
    q = torch.randn(2, 4, 7, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 11, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 11, 16, generator=gen, requires_grad=True)
    bias = torch.randn(mask_shape, generator=gen, requires_grad=True)
    out = attn(q, k, v, attn_mask=bias, causal=True, softcap=4.0, backend=backend, strict=True)
    g = torch.randn(out.shape, generator=gen)
    ours = torch.autograd.grad(out, (q, k, v, bias), g)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    r_out, _ = reference_attention(*leaves64[:3], attn_mask=leaves64[3], causal=True, softcap=4.0)
    ref = torch.autograd.grad(r_out, leaves64, g.double())
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    d_out, _ = reference_attention(*leaves[:3], attn_mask=leaves[3], causal=True, softcap=4.0, dtype=torch.float32)
    same = torch.autograd.grad(d_out, leaves, g)
    for name, a, r, s in zip(("dq", "dk", "dv", "dmask"), ours, ref, same):
        check_2x(name, a, r, s, 3, torch.float32)
    assert ours[3].shape == bias.shape


# ---- dropout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", [("math", torch.float32), ("math", torch.bfloat16), ("math", torch.float64),
                                            ("flash", torch.float32), ("flash", torch.bfloat16)])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_output_and_gradients_replay_the_same_mask(backend, dtype, p, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=19, Sk=37, D=24, dtype=dtype, causal=True, mask="float_rows")
    q, k, v, mask = make_inputs(case, requires_grad=True, generator=gen)
    keep = keep_mask_for_next_call(1234, case.B, case.Hq, case.Sq, case.Sk, p)
    torch.manual_seed(1234)
    out = attn(q, k, v, causal=True, attn_mask=mask, dropout_p=p, backend=backend, strict=True)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(dtype)
    ours = torch.autograd.grad(out, (q, k, v), g)
    check_out_and_grads_2x(out, ours, (q, k, v), g, dtype, causal=True, attn_mask=mask, keep=keep, dropout_p=p)


def test_dropout_is_reproducible_under_manual_seed():
    q, k, v = (torch.randn(2, 2, 33, 16) for _ in range(3))
    torch.manual_seed(7)
    a = attn(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    b = attn(q, k, v, dropout_p=0.3)
    c = attn(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_dropout_keep_fraction_matches_p():
    n_rows, Sk = 512, 509  # Sk not a multiple of 4: every word position of the Philox block is used
    for p in (0.1, 0.3, 0.9):
        keep = ops.dropout_mask(_providers.draw_rng_state(), 1, 1, n_rows, Sk, p)
        n = keep.numel()
        frac = keep.double().mean().item()
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(frac - (1 - p)) < 6 * sigma, (p, frac)
        # no structure along keys or rows: per-column keep rates stay within a loose band
        cols = keep.double().mean(dim=(0, 1, 2))
        assert (cols - (1 - p)).abs().max() < 6 * math.sqrt(p * (1 - p) / n_rows)


def test_dropout_keeps_expectation():
    # E[out] over dropout masks equals the output without dropout
    q, k, v = (torch.randn(1, 1, 4, 8, dtype=torch.float64) for _ in range(3))
    ref = attn(q, k, v)
    acc = torch.zeros_like(ref)
    n = 4000
    for _ in range(n):
        acc += attn(q, k, v, dropout_p=0.5)
    assert (acc / n - ref).abs().max() < 0.1


def test_dropout_zero_is_exactly_no_dropout():
    q, k, v = (torch.randn(2, 2, 9, 8) for _ in range(3))
    assert torch.equal(attn(q, k, v, dropout_p=0.0), attn(q, k, v))


# ---- gradcheck ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(causal=True),
        dict(causal="bottom_right", window=(2, 1)),
        dict(softcap=3.0, mask="float"),
        dict(mask="bool"),
        dict(dropout_p=0.3),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain",
)
def test_gradcheck_float64(opts):
    opts = dict(opts)
    B, Hq, Hkv, Sq, Sk, D, Dv = 1, 2, 1, 5, 7, 4, 3
    q = torch.randn(B, Hq, Sq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, Dv, dtype=torch.float64, requires_grad=True)
    inputs = [q, k, v]
    kind = opts.pop("mask", None)
    if kind == "float":
        inputs.append(torch.randn(1, Hq, Sq, Sk, dtype=torch.float64, requires_grad=True))
    elif kind == "bool":
        m = torch.rand(B, 1, Sq, Sk) > 0.4
        m[..., 0] = True
        opts["attn_mask"] = m

    def f(*args):
        if len(args) == 4:
            opts["attn_mask"] = args[3]
        torch.manual_seed(0)  # the same dropout mask on every evaluation
        out, lse = attn(*args[:3], return_lse=True, **opts)
        return out, lse

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


# ---- layouts, determinism, no mutation ---------------------------------------------------------

def test_output_is_laid_out_b_s_h_d():
    q = torch.randn(2, 4, 5, 8)
    out = attn(q, q, q)
    assert out.shape == (2, 4, 5, 8)
    assert out.transpose(1, 2).is_contiguous()


def test_gradients_follow_input_layout():
    x = torch.randn(2, 5, 4, 8, requires_grad=True)  # (B, S, H, D) projection output
    q = x.transpose(1, 2)
    kv = torch.randn(2, 4, 6, 8, requires_grad=True)
    out = attn(q, kv, kv)
    dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    assert dq.stride() == q.stride()
    assert dkv.stride() == kv.stride()


def test_non_contiguous_mask(gen):
    case = Case(B=2, Hq=2, Hkv=2, Sq=6, Sk=6, D=8)
    q, k, v, _ = make_inputs(case, generator=gen)
    m = torch.rand(2, 2, 6, 6, generator=gen) > 0.3
    out = attn(q, k, v, attn_mask=m.transpose(-1, -2))
    ref, _ = reference_attention(q, k, v, attn_mask=m.transpose(-1, -2).contiguous())
    assert (out.double() - ref).abs().max() < 1e-5


def test_results_do_not_depend_on_thread_count():
    case = Case(B=2, Hq=8, Hkv=2, Sq=130, Sk=70, D=32, causal=True)
    q, k, v, _ = make_inputs(case, requires_grad=True)
    results = []
    n = torch.get_num_threads()
    try:
        for threads in (1, max(2, n)):
            torch.set_num_threads(threads)
            out = attn(q, k, v, causal=True)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
            results.append((out.detach(), *grads))
    finally:
        torch.set_num_threads(n)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["math", "flash", "eager", "sdpa"])
def test_inputs_are_never_modified(backend, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=11, Sk=11, D=16, mask="float_rows", layout="bshd")
    q, k, v, mask = make_inputs(case, requires_grad=True, generator=gen)
    mask.requires_grad_(True)
    before = [t.detach().clone() for t in (q, k, v, mask)]
    softcap = 0.0 if backend == "sdpa" else 2.0
    out = attn(q, k, v, attn_mask=mask, causal=True, softcap=softcap, dropout_p=0.2, backend=backend)
    lse = torch.zeros(1)
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    for a, b in zip(before, (q, k, v, mask)):
        assert torch.equal(a, b.detach())


# ---- forward-mode AD and functorch transforms ----------------------------------------------------------
# The kernels' ops have a backward only: under forward-mode AD their outputs carried no tangent (jvp gave a
# silent 0) and functorch's grad refused their autograd.Function; such calls run the aten composite
# (_dispatch.transformed).  The references: torch's math SDPA and reverse-mode autograd through our kernels.

def _math_sdpa(q, k, v, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


@pytest.mark.parametrize("backend", ["auto", "flash", "math", "eager"])
def test_forward_mode_ad_gives_the_tangent(backend, gen):
    q, k, v, t = (torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    mask = torch.rand(2, 1, 5, 5, generator=gen) > 0.3
    want = torch.func.jvp(lambda q: _math_sdpa(q, k, v, attn_mask=mask), (q,), (t,))[1]
    got = torch.func.jvp(lambda q: ab.attention(q, k, v, attn_mask=mask, backend=backend), (q,), (t,))[1]
    assert torch.allclose(got, want, atol=1e-12, rtol=1e-10)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        out = ab.attention(fwAD.make_dual(q, t), k, v, attn_mask=mask, backend=backend)
        tangent = fwAD.unpack_dual(out).tangent
    assert tangent is not None and torch.allclose(tangent, want, atol=1e-12, rtol=1e-10)


def test_jacfwd_matches_reverse_mode(gen):
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    fwd = torch.func.jacfwd(lambda q: ab.attention(q, k, v, causal=True))(q)
    rev = torch.func.jacrev(lambda q: ab.attention(q, k, v, causal=True))(q)
    assert fwd.abs().max() > 0 and torch.allclose(fwd, rev, atol=1e-12)


def test_functorch_grad_and_per_sample_gradients(gen):
    from attn_backends.flash_attn import flash_attn_func

    q, k, v = (torch.randn(5, 2, 4, 8, generator=gen) for _ in range(3))
    per_sample = torch.func.vmap(torch.func.grad(lambda q, k, v: ab.attention(q[None], k[None], v[None],
                                                                             causal=True).sum()))
    got = per_sample(q, k, v)
    leaves = q.clone().requires_grad_()
    ab.attention(leaves, k, v, causal=True).sum().backward()  # the samples are independent
    assert torch.allclose(got, leaves.grad, atol=1e-5)
    qf = q.transpose(1, 2)  # flash-attn's (B, S, H, D)
    g = torch.func.grad(lambda x: flash_attn_func(x, qf, qf).sum())(qf)
    x = qf.clone().requires_grad_()
    flash_attn_func(x, qf, qf).sum().backward()
    assert torch.allclose(g, x.grad, atol=1e-5)
    # torch's own route under the transform, as torch runs it there (its second-derivative node, which
    # functorch would refuse, stays out of transforms)
    g = torch.func.grad(lambda x: ab.attention(x, k, v, backend="sdpa", strict=True).sum())(q)
    x = q.clone().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(x, k, v).sum().backward()
    assert torch.allclose(g, x.grad, atol=1e-6)


def test_packed_calls_under_forward_mode_ad(gen):
    q, k, v, cu_q, cu_k = make_packed([3, 0, 5], [4, 2, 6], 2, 1, 8, 8, torch.float64, gen)
    t = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    got = torch.func.jvp(lambda q: ab.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True), (q,), (t,))[1]
    want = torch.func.jvp(lambda q: varlen_reference(q, k, v, cu_q, cu_k, causal=True)[0], (q,), (t,))[1]
    assert torch.allclose(got, want, atol=1e-12, rtol=1e-10)


def test_a_kernel_named_under_a_transform_falls_back_once_or_raises_when_strict(caplog, gen):
    q, t = (torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    with pytest.raises(RuntimeError, match="'flash' cannot serve this call: forward-mode AD"):
        torch.func.jvp(lambda q: ab.attention(q, q, q, backend="flash", strict=True), (q,), (t,))
    from attn_backends import _dispatch

    _dispatch.reset_caches()
    with caplog.at_level("WARNING", logger="attn_backends"):
        for _ in range(2):
            torch.func.jvp(lambda q: ab.attention(q, q, q, backend="sage"), (q,), (t,))
    assert sum("'sage' cannot serve this call: forward-mode AD" in r.getMessage() for r in caplog.records) == 1


def test_vmap_of_a_forward_keeps_the_kernel(gen):
    # no gradient to take: the op runs under vmap (torch loops over the batch), as before
    q = torch.randn(3, 2, 2, 6, 16, generator=gen)
    got = torch.func.vmap(lambda x: ab.attention(x, x, x, causal=True))(q)
    want = torch.stack([ab.attention(x, x, x, causal=True) for x in q])
    assert torch.allclose(got, want, atol=1e-6)
