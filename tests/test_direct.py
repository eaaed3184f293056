"""The CPU flash forward without the dispatcher (attn_backends/_providers/ours.py: direct_ok, run_flash;
csrc/ab_direct.c: flash_fwd_cpu, and attention, ab.attention's fast path).

A plain eager call that needs no gradient skips the op's fixed cost; it must give exactly what the op
gives (same bits, same output layout, same errors), and everything that has to see the op (autograd,
torch.compile, dispatch modes, FakeTensor, functorch) must still get it.  Inference mode need not: it only
leaves autograd out, as a call that needs no gradient does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attn_backends as ab
from attn_backends import _C
from attn_backends._providers import ours as _providers  # the runners of our kernels
from attn_backends._testing import Case, cases, make_inputs, make_packed

ops = torch.ops.attn_backends


@pytest.fixture(autouse=True)
def _cpu_kernels():
    """The CPU kernels, even in a run with ATTN_BACKENDS_CUDA_EMULATE=1 (where CPU tensors take the
    emulated CUDA kernels, through the op)."""
    from cuda_devices import emulation_default, set_emulation

    if not emulation_default():
        yield
        return
    set_emulation(False)
    try:
        yield
    finally:
        set_emulation(True)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls that took the direct path and the ones that took the op."""
    seen = {"direct": 0, "op": 0}
    direct, op, by_decode = _C.flash_fwd_cpu, _providers._run_flash, _providers._run_by_decode

    class Module:
        def __getattr__(self, name):
            return getattr(_C, name)

        @staticmethod
        def flash_fwd_cpu(*args):
            seen["direct"] += 1
            return direct(*args)

    def run_op(*args):
        seen["op"] += 1
        return op(*args)

    fast = ab._fast_attention

    def fast_attention(*args):  # ab.attention's fast path (csrc/ab_direct.c): a direct call when it serves
        res = fast(*args)
        seen["direct"] += res is not None
        return res

    def run_by_decode(*args):  # short queries without the direct flash call: the decode kernel's (ours.py)
        res = by_decode(*args)
        seen["op"] += res is not None
        return res

    monkeypatch.setattr(_providers, "_C", Module())
    monkeypatch.setattr(_providers, "_run_flash", run_op)
    monkeypatch.setattr(_providers, "_run_by_decode", run_by_decode)
    monkeypatch.setattr(ab, "_fast_attention", fast_attention)
    return seen


def both_paths(monkeypatch, fn):
    """fn() through the direct path, then with it switched off (the op below autograd)."""
    direct = fn()
    with monkeypatch.context() as m:
        m.setattr(_providers, "direct_ok", lambda *args: False)
        m.setattr(ab, "_fast_attention", lambda *args: None)
        op = fn()
    return direct, op


def assert_same(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), (a.stride(), b.stride())
    assert torch.equal(a, b)  # bitwise: same kernel, same pool, same work split


DENSE = [c for c in cases() if c.dtype != torch.float64]  # float64 is math's, never flash's


@pytest.mark.parametrize("case", DENSE[::3], ids=str)
def test_direct_path_gives_the_ops_bits(case, calls, monkeypatch):
    q, k, v, mask = make_inputs(case, generator=torch.Generator().manual_seed(7))
    kw = dict(backend="flash", strict=True, causal=case.causal, attn_mask=mask, window=case.window,
              softcap=case.softcap, return_lse=True)
    (out_d, lse_d), (out_o, lse_o) = both_paths(monkeypatch, lambda: ab.attention(q, k, v, **kw))
    assert calls["direct"] == 1 and calls["op"] == 1, calls
    assert_same(out_d, out_o)
    assert_same(lse_d, lse_o)
    assert not out_d.requires_grad and out_d.is_contiguous() == out_o.is_contiguous()


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 8), (0, 2, 5, 5, 8), (2, 3, 0, 5, 8), (2, 3, 5, 0, 8),
                                   (1, 1, 7, 9, 24), (3, 1, 2, 3, 16)])
def test_direct_path_layout_of_empty_and_size_one_outputs(shape, calls, monkeypatch):
    B, H, Sq, Sk, D = shape
    q, k, v = torch.randn(B, H, Sq, D), torch.randn(B, H, Sk, D), torch.randn(B, H, Sk, D)
    (out_d, lse_d), (out_o, lse_o) = both_paths(
        monkeypatch, lambda: ab.attention(q, k, v, backend="flash", return_lse=True))
    assert calls["direct"] == 1
    assert_same(out_d, out_o)
    assert_same(lse_d, lse_o)
    if Sk == 0 and B * H * Sq:
        assert torch.all(out_d == 0) and torch.all(lse_d == -float("inf"))


def test_direct_path_without_lse_and_with_threads(calls, monkeypatch):
    # large enough for the kernel to split the work over torch's pool: both paths lend it the same pool
    case = Case(B=2, Hq=4, Hkv=2, Sq=130, Sk=129, D=64, causal=True, mask="bool_rows")
    q, k, v, mask = make_inputs(case, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        for n in {1, threads}:
            torch.set_num_threads(n)
            out_d, out_o = both_paths(monkeypatch, lambda: ab.attention(q, k, v, attn_mask=mask, causal=True))
            assert_same(out_d, out_o)
    finally:
        torch.set_num_threads(threads)
    assert calls["direct"] >= 1


def _kw():
    return dict(backend="flash", causal=True)


@pytest.mark.parametrize("how", ["requires_grad", "dispatch_mode", "fake_tensor", "dropout", "vmap", "subclass"])
def test_the_op_path_is_kept_where_something_must_see_the_op(how, calls):
    q = torch.randn(2, 2, 6, 16)
    if how == "requires_grad":
        qg = q.clone().requires_grad_()
        ab.attention(qg, q, q, **_kw()).sum().backward()
        assert qg.grad is not None
    elif how == "dispatch_mode":
        seen = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        with Record():
            ab.attention(q, q, q, **_kw())
        assert any("attn_backends.flash_fwd" in s for s in seen), seen
    elif how == "fake_tensor":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            fq = torch.randn(2, 2, 6, 16)
            out = ab.attention(fq, fq, fq, **_kw())
        assert out.shape == (2, 2, 6, 16) and type(out).__name__ == "FakeTensor"
    elif how == "dropout":
        ab.attention(q, q, q, dropout_p=0.5, **_kw())
    elif how == "vmap":
        out = torch.func.vmap(lambda x: ab.attention(x, x, x, **_kw()))(q.unsqueeze(0).expand(3, -1, -1, -1, -1))
        assert out.shape == (3, 2, 2, 6, 16)
    elif how == "subclass":
        p = torch.nn.Parameter(q, requires_grad=False)
        ab.attention(p, q, q, **_kw())
    assert calls["direct"] == 0 and calls["op"] >= 1, calls


@pytest.mark.parametrize("Sq", [6, 1])  # the flash kernel; a decode step (the decode kernel's direct call)
def test_inference_mode_takes_the_direct_path_with_the_ops_bits(Sq, calls, monkeypatch):
    # inference mode leaves autograd out and nothing else: ab.attention's fast path (once planned) and the direct
    # call serve it, with the op's bits, and the output is an inference tensor as the op's is
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, Sq, 16, generator=g)
    k, v = (torch.randn(2, 4, 40, 16, generator=g) for _ in range(2))
    with torch.inference_mode():
        ab.attention(q, k, v, causal=True)  # planned by the Python path
        out, served = _served(lambda: ab.attention(q, k, v, causal=True))
        assert served and out.is_inference()
        direct, op = both_paths(monkeypatch, lambda: ab.attention(q, k, v, causal=True, backend="flash"))
    assert_same(out, op)
    assert_same(direct, op)
    assert op.is_inference() and direct.is_inference()
    assert calls["op"] >= 1


def test_the_op_path_is_kept_under_torch_compile(calls):
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    fn = torch.compile(lambda q, k, v: ab.attention(q, k, v, backend="flash", causal=True), fullgraph=True)
    with torch.no_grad():
        out = fn(q, k, v)
        ref = ab.attention(q, k, v, backend="flash", causal=True)
    assert calls["direct"] == 1  # the eager call only
    assert torch.equal(out, ref)


@pytest.mark.cuda_emu
def test_the_cuda_emulation_keeps_the_op(calls):
    # with the emulation on, CPU tensors run the CUDA kernels through the op: the direct call declines
    from cuda_devices import emulation_default, set_emulation

    q = torch.randn(1, 2, 8, 32, dtype=torch.float16)
    set_emulation(True)
    try:
        assert _C.flash_fwd_cpu(q, q, q, None, 0, 0.1, -1, -1, 0.0, False) is None
        ab.attention(q, q, q, backend="flash")
        assert calls["op"] == 1
    finally:
        set_emulation(emulation_default())


@pytest.mark.parametrize("bad", ["mask_shape", "q_3d", "k_head_dim", "float64"])
def test_direct_call_errors_are_the_ops(bad):
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    mask = None
    if bad == "mask_shape":
        mask = torch.ones(3, 5, dtype=torch.bool)
    elif bad == "q_3d":
        q = q[0]
    elif bad == "k_head_dim":
        k = torch.randn(1, 2, 5, 16)
    else:
        q, k, v = q.double(), k.double(), v.double()
    with pytest.raises(RuntimeError) as direct:
        _C.flash_fwd_cpu(q, k, v, mask, 0, 0.5, -1, -1, 0.0, True)
    with pytest.raises(RuntimeError) as op:
        ops.flash_fwd(q, k, v, mask, None, 0, 0.5, -1, -1, 0.0, 0.0)
    assert str(direct.value).startswith("attn_backends: ")
    assert str(direct.value) in str(op.value), (str(direct.value), str(op.value))


def test_an_isa_the_cpu_cannot_run_fails_the_same_way_on_both_paths():
    code = ("import attn_backends as ab, torch\n"
            "from attn_backends._providers import ours as _providers\n"
            "q = torch.randn(1, 1, 4, 8)\n"
            "msgs = []\n"
            "for direct in (True, False):\n"
            "    if not direct:\n"
            "        _providers.direct_ok = ab._fast_attention = lambda *a: None\n"
            "    try:\n        ab.attention(q, q, q, backend='flash')\n"
            "    except RuntimeError as e:\n        msgs.append(str(e))\n"
            "print(len(msgs), msgs[0] in msgs[1], msgs[0])\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ATTN_BACKENDS_CPU_ISA="avx9000"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("2 True attn_backends: ATTN_BACKENDS_CPU_ISA=avx9000: unknown path"), res.stdout


def test_the_bitwise_grid_covers_what_the_direct_path_must_match():
    # masks with fully masked rows, both causal alignments, windows, softcap, GQA, Dv != D, the
    # non-contiguous layouts and the three dtypes flash serves are all in the slice compared above
    grid = DENSE[::3]
    assert {c.mask for c in grid} >= {"bool_rows", "float_rows", "key_padding"}
    assert {str(c.causal) for c in grid} >= {"True", "bottom_right", "False"}
    assert {c.layout for c in grid} == {"bhsd", "bshd", "strided_d"}
    assert any(c.window for c in grid) and any(c.softcap for c in grid) and any(c.Hq != c.Hkv for c in grid)
    assert any(c.Dv is not None for c in grid)
    assert {c.dtype for c in grid} == {torch.float32, torch.float16, torch.bfloat16}


# ---- ab.attention's fast path (csrc/ab_direct.c: attention) -------------------------------------------
# A plain eager CPU forward whose plan the Python path has made once runs all in C: checks, call
# descriptor, plan lookup, kernel.  It must give the Python path's bits, serve only what that path
# would have sent to flash without a fallback, and hand everything else back.


def _served(fn):
    """(result, whether the fast path served the call)."""
    before = _C.fast_calls()
    res = fn()
    return res, _C.fast_calls() - before == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ["plain", "gqa_causal_lse", "strided_scale", "alias", "bottom_right", "bool_mask",
                                  "float_mask", "decode_mask"])
def test_fast_path_gives_the_python_paths_bits(dtype, spec, monkeypatch):
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, Sq, Sk, D = {"gqa_causal_lse": (2, 4, 2, 7, 9, 32), "bottom_right": (2, 8, 2, 1, 33, 16),
                             "decode_mask": (2, 8, 2, 1, 40, 16)}.get(
        spec, (1, 3, 3, 5, 5, 24))  # bottom_right, decode_mask: a decode step, which the decode kernel serves
    q, k, v = (torch.randn(B, h, s, D, generator=g).to(dtype) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    if spec == "strided_scale":  # non-contiguous views, a given scale
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert not q.is_contiguous()
    pad = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)  # HF's padding mask: the first keys of row 0 hidden
    pad[0, ..., :3] = False
    kw = {"plain": {}, "gqa_causal_lse": dict(causal=True, return_lse=True), "strided_scale": dict(scale=0.3),
          "alias": dict(backend="flash_attention_2"), "bottom_right": dict(causal="bottom_right"),
          "bool_mask": dict(attn_mask=pad, return_lse=True),
          "float_mask": dict(attn_mask=torch.randn(Sq, Sk, generator=g).to(dtype)),  # broadcast: zero strides
          "decode_mask": dict(attn_mask=torch.zeros(B, 1, Sq, Sk, dtype=dtype).masked_fill(~pad, -torch.inf),
                              return_lse=True)}[spec]
    ab.attention(q, k, v, **kw)  # the Python path plans it once and remembers the plan
    fast, served = _served(lambda: ab.attention(q, k, v, **kw))
    # the fast path serves what the plan gives our flash; on CPUs where auto sends this call to torch SDPA
    # first (bfloat16 on AMX, ab_registry.c's torch-faster rows) it must hand the call back
    plan = ab.explain(q, k, v, **kw)
    assert served == (plan.chosen == "flash"), plan
    with monkeypatch.context() as m:
        m.setattr(ab, "_fast_attention", lambda *args: None)
        slow, served = _served(lambda: ab.attention(q, k, v, **kw))
    assert not served
    for a, b in zip(*(r if isinstance(r, tuple) else (r,) for r in (fast, slow))):
        assert_same(a, b)


def test_fast_path_serves_only_remembered_plans_and_forgets_them():
    q = torch.randn(1, 2, 6, 16)
    ab._dispatch.reset_caches()
    _, served = _served(lambda: ab.attention(q, q, q))
    assert not served  # planned by the Python path first
    _, served = _served(lambda: ab.attention(q, q, q))
    assert served
    ab._dispatch.reset_caches()
    _, served = _served(lambda: ab.attention(q, q, q))
    assert not served
    _C.set_provider(ab._names.ID["flex"], True, "")  # any change to the registry drops the plans too
    _, served = _served(lambda: ab.attention(q, q, q))
    assert not served


def test_fast_path_lets_old_plans_go_and_takes_them_back():
    # the table of plans is bounded (AB_REMEMBERED_MAX, 64): more kinds of calls than that replace plans
    # by a clock (a plan used since the hand last passed gets a second chance, so the first pass over a
    # full table only clears marks), and a call whose plan was let go of is served by the Python path
    # once, which re-arms it
    ab._dispatch.reset_caches()
    qs = [torch.randn(1, 2, 6, d) for d in range(1, 141)]  # head dims: 140 kinds of calls
    ab.attention(qs[0], qs[0], qs[0], causal=True)
    assert _served(lambda: ab.attention(qs[0], qs[0], qs[0], causal=True))[1]
    for q in qs[1:]:
        ab.attention(q, q, q, causal=True)
    assert _served(lambda: ab.attention(qs[-1], qs[-1], qs[-1], causal=True))[1]
    assert not _served(lambda: ab.attention(qs[0], qs[0], qs[0], causal=True))[1]  # let go of
    assert _served(lambda: ab.attention(qs[0], qs[0], qs[0], causal=True))[1]  # and back


def test_fast_path_keeps_a_plan_in_use_among_many_kinds_of_calls():
    # a decode step's plan, say, used between calls of 139 other kinds (prefills of many lengths): the
    # clock passes over it every time, so the fast path keeps serving it (first in, first out let it go
    # after 64 kinds, and each return cost a trip through the Python path)
    ab._dispatch.reset_caches()
    hot = torch.randn(1, 2, 6, 16)
    ab.attention(hot, hot, hot)
    others = [torch.randn(1, 2, 6, d) for d in range(17, 156)]
    for q in others:
        assert _served(lambda: ab.attention(hot, hot, hot))[1]
        ab.attention(q, q, q)
    assert _served(lambda: ab.attention(hot, hot, hot))[1]


@pytest.mark.parametrize("how", ["use_math", "process_default", "named_math", "float64", "torch_faster",
                                 "requires_grad", "mask_grad", "int_scale", "other_backend"])
def test_fast_path_hands_back_what_is_not_flashs_plain_forward(how, torch_first_path):
    q = torch.randn(1, 2, 6, 16)
    for _ in range(2):  # the second call would be served if the plan allowed it
        if how == "use_math":
            with ab.use("math"):
                res, served = _served(lambda: ab.attention(q, q, q))
            ref = ab.attention(q, q, q, backend="math")
        elif how == "process_default":
            old = ab._planner._process_default[0]
            ab._planner.set_process_default("eager")
            try:
                res, served = _served(lambda: ab.attention(q, q, q))
            finally:
                ab._planner._process_default[0] = old
            ref = ab.attention(q, q, q, backend="eager")
        elif how == "named_math":
            res, served = _served(lambda: ab.attention(q, q, q, backend="math"))
            ref = res
        elif how == "float64":
            q64 = q.double()
            res, served = _served(lambda: ab.attention(q64, q64, q64))
            ref = res
        elif how == "torch_faster":  # float32 D=128 non-causal: auto plans torch SDPA (ab_torch_cpu_faster)
            q128 = torch.randn(1, 2, 6, 128)
            res, served = _served(lambda: ab.attention(q128, q128, q128))
            ref = torch.nn.functional.scaled_dot_product_attention(q128, q128, q128)
        elif how == "requires_grad":
            qg = q.clone().requires_grad_()
            res, served = _served(lambda: ab.attention(qg, q, q))
            assert res.requires_grad
            ref = res
        elif how == "mask_grad":  # a float mask that requires grad: the autograd Function gives its gradient
            m = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -torch.inf).requires_grad_()
            res, served = _served(lambda: ab.attention(q, q, q, attn_mask=m))
            assert res.requires_grad
            ref = ab.attention(q, q, q, causal=True)
        elif how == "int_scale":
            res, served = _served(lambda: ab.attention(q, q, q, scale=1))
            ref = ab.attention(q, q, q, scale=1.0)
        else:  # another backend named: sage serves it (lossy, so compared loosely)
            res, served = _served(lambda: ab.attention(q, q, q, backend="sage"))
            ref = ab.attention(q, q, q)
        assert not served, how
        tol = dict(rtol=0.05, atol=0.05) if how == "other_backend" else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res.detach(), ref.detach(), **tol)


@pytest.mark.parametrize("bad", ["mask_dtype", "mask_shape", "mask_rank", "mask_device"])
def test_fast_path_leaves_bad_masks_to_the_python_checks(bad):
    q = torch.randn(1, 4, 6, 16)
    good = torch.ones(6, 6, dtype=torch.bool)
    ab.attention(q, q, q, attn_mask=good)
    assert _served(lambda: ab.attention(q, q, q, attn_mask=good))[1]  # armed for masked calls
    mask = {"mask_dtype": torch.ones(6, 6, dtype=torch.int32), "mask_shape": torch.ones(5, 6, dtype=torch.bool),
            "mask_rank": torch.ones(1, 1, 1, 6, 6, dtype=torch.bool), "mask_device": good.to("meta")}[bad]
    before = _C.fast_calls()
    with pytest.raises((ValueError, TypeError), match="attn_mask"):
        ab.attention(q, q, q, attn_mask=mask)
    assert _C.fast_calls() == before


@pytest.mark.parametrize("bad", ["head_dim", "batch", "dtype", "heads", "rank", "backend"])
def test_fast_path_leaves_bad_input_to_the_python_checks(bad):
    q = torch.randn(1, 4, 6, 16)
    ab.attention(q, q, q)  # remembered: the fast path is armed
    k = {"head_dim": torch.randn(1, 4, 6, 8), "batch": torch.randn(2, 4, 6, 16),
         "dtype": torch.randn(1, 4, 6, 16, dtype=torch.float16), "heads": torch.randn(1, 3, 6, 16),
         "rank": torch.randn(4, 6, 16), "backend": q}[bad]
    backend = "no_such_backend" if bad == "backend" else "auto"
    before = _C.fast_calls()
    with pytest.raises((ValueError, TypeError), match="backend|dim|dtype|batch|head|4-D|multiple|same"):
        ab.attention(q, k, k, backend=backend)
    assert _C.fast_calls() == before


def test_fast_path_logs_the_choice_once_through_the_python_path(caplog):
    import logging

    q = torch.randn(1, 1, 3, 40)
    ab._dispatch.reset_caches()
    with caplog.at_level(logging.INFO, logger="attn_backends"):
        for _ in range(3):
            ab.attention(q, q, q)
    served = [r for r in caplog.records if "flash serves" in r.getMessage()]
    assert len(served) == 1 and _C.fast_calls() > 0


# ---- packed calls: ab.attention_varlen's and flash_attn_varlen_func's fast path (_C.attention_varlen) ----

VARLEN_SPECS = {  # lens_q, lens_k, Hq, Hkv, D, Dv, causal
    "decode_gqa": ([1, 1, 1], [9, 0, 33], 8, 2, 16, 16, "bottom_right"),  # a sequence without keys
    "decode_mha_3": ([3, 3], [17, 2], 4, 4, 24, 24, "bottom_right"),     # Sq > Sk in one sequence
    "decode_noncausal": ([2, 2], [5, 40], 6, 3, 8, 8, False),
    "square_top_left": ([4, 4], [4, 4], 4, 2, 16, 16, True),              # top-left == bottom-right
    "mixed_flash": ([1, 5, 3], [7, 5, 12], 4, 2, 16, 16, "bottom_right"),  # unequal queries: flash
    "top_left_flash": ([2, 2], [9, 4], 4, 2, 16, 16, True),                # top-left differs: flash
    "dv_flash": ([1, 1], [6, 9], 2, 1, 16, 8, False),                      # Dv != D: flash
}


def _packed_inputs(spec, dtype, strided=False):
    lens_q, lens_k, Hq, Hkv, D, Dv, causal = VARLEN_SPECS[spec]
    g = torch.Generator().manual_seed(5)
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, Hq, Hkv, D, Dv, dtype, generator=g)
    if strided:  # rows of a wider buffer, as a fused QKV projection hands them over
        q = torch.cat([q, q], dim=-1)[..., :D]
        assert not q.is_contiguous()
    return (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)), causal


def _served_with_the_python_paths_bits(args, kw, monkeypatch, fn=ab.attention_varlen,
                                       fast_name="_fast_attention_varlen"):
    """fn(*args, **kw) (ab.attention_varlen's, or ab.attention's with its fast path's name), planned once,
    then served by the fast path with the bits of the Python path."""
    fn(*args, **kw)
    fast, served = _served(lambda: fn(*args, **kw))
    assert served
    with monkeypatch.context() as m:
        m.setattr(ab, fast_name, lambda *a: None)
        slow, served = _served(lambda: fn(*args, **kw))
    assert not served
    for a, b in zip(fast, slow):
        assert_same(a, b)
    return fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", list(VARLEN_SPECS))
def test_varlen_fast_path_gives_the_python_paths_bits(spec, dtype, monkeypatch):
    args, causal = _packed_inputs(spec, dtype, strided=spec == "decode_gqa")
    for lse in (False, True):
        kw = dict(causal=causal, return_lse=lse)
        ab.attention_varlen(*args, **kw)  # planned by the Python path once, remembered
        fast, served = _served(lambda: ab.attention_varlen(*args, **kw))
        assert served, (spec, lse)
        with monkeypatch.context() as m:
            m.setattr(ab, "_fast_attention_varlen", lambda *a: None)
            slow, served = _served(lambda: ab.attention_varlen(*args, **kw))
        assert not served
        for a, b in zip(*(r if isinstance(r, tuple) else (r,) for r in (fast, slow))):
            assert_same(a, b)


@pytest.mark.parametrize("spec", ["decode_gqa", "mixed_flash"])
def test_varlen_fast_path_matches_the_reference(spec, gen):
    from attn_backends._testing import check_2x, varlen_reference

    args, causal = _packed_inputs(spec, torch.float32)
    q, k, v, cu_q, cu_k = args[:5]
    ab.attention_varlen(*args, causal=causal)
    (out, lse), served = _served(lambda: ab.attention_varlen(*args, causal=causal, return_lse=True))
    assert served
    ref64, lse64 = varlen_reference(q, k, v, cu_q, cu_k, causal=causal)
    same, _ = varlen_reference(q, k, v, cu_q, cu_k, dtype=torch.float32, causal=causal)
    check_2x("out", out, ref64, same, 2, torch.float32)
    check_2x("lse", lse, lse64, lse64.float(), 2, torch.float32)


def test_flash_attn_varlen_func_takes_the_fast_path():
    from attn_backends import flash_attn as fa

    args, _ = _packed_inputs("decode_gqa", torch.float32)
    for causal in (True, False):
        for probs in (False, True):
            fa.flash_attn_varlen_func(*args, causal=causal, return_attn_probs=probs)
            res, served = _served(lambda: fa.flash_attn_varlen_func(*args, causal=causal, return_attn_probs=probs))
            assert served
            ref = ab.attention_varlen(*args, causal="bottom_right" if causal else False, return_lse=probs)
            if probs:
                assert res[2] is None
                assert_same(res[0], ref[0])
                assert_same(res[1], ref[1])
            else:
                assert_same(res, ref)


@pytest.mark.parametrize("spec", ["decode_gqa", "mixed_flash", "top_left_flash"])
@pytest.mark.parametrize("opts", [dict(window=(3, 0)), dict(window=(2, 1), softcap=5.0), dict(softcap=2),
                                  dict(window=(10**6, 0)), dict(window=(-1, -1))], ids=str)
def test_varlen_fast_path_takes_windows_and_softcap_with_the_python_paths_bits(spec, opts, monkeypatch):
    # a window side wider than any sequence pair is unbounded on both paths (_validate.clamp_window)
    args, causal = _packed_inputs(spec, torch.float32)
    _served_with_the_python_paths_bits(args, dict(causal=causal, return_lse=True, **opts), monkeypatch)


def test_flash_attn_varlen_func_takes_a_causal_window_on_the_fast_path():
    from attn_backends import flash_attn as fa

    args, _ = _packed_inputs("mixed_flash", torch.float32)
    for causal, window, fast in ((True, (4, 0), True), (False, (4, 0), False), (True, (-3, 0), True)):
        # without causal flash-attn aligns a window bottom-right (the Python path handles it, sequence by
        # sequence); a side below -1 is flash-attn's "unbounded", which the Python path reads as -1 and
        # hands to ab.attention_varlen, whose fast path then serves it
        kw = dict(causal=causal, window_size=window, softcap=3.0)
        fa.flash_attn_varlen_func(*args, **kw)
        res, served = _served(lambda: fa.flash_attn_varlen_func(*args, **kw))
        assert served == fast, (causal, window)
        opts = dict(causal="bottom_right" if causal else False, softcap=3.0)
        if causal:
            ref = ab.attention_varlen(*args, window=(max(window[0], -1), window[1]), **opts)
            assert_same(res, ref)


@pytest.mark.parametrize("how", ["requires_grad", "named_math", "use_math", "int64_cu", "strided_cu", "cu_on_meta",
                                 "loose_max_ok", "float64", "odd_causal", "sinks_grad", "list_window"])
def test_varlen_fast_path_hands_back_what_is_not_flash_varlens_plain_forward(how):
    args, causal = _packed_inputs("decode_gqa", torch.float32)
    q, k, v, cu_q, cu_k, mq, mk = args
    kw = dict(causal=causal)
    call = lambda: ab.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, **kw)  # noqa: E731
    if how == "sinks_grad":  # the sinks' gradient: the autograd Function
        kw["sinks"] = torch.zeros(q.shape[1], requires_grad=True)
    elif how == "list_window":  # a list, not a tuple: the Python path reads it
        kw["window"] = [3, 0]
    elif how == "requires_grad":
        q = q.clone().requires_grad_()
    elif how == "named_math":
        kw["backend"] = "math"
    elif how == "int64_cu":  # refused by the Python path, by name
        cu_q = cu_q.long()
    elif how == "strided_cu":
        cu_q = torch.stack([cu_q, cu_q], 1)[:, 0]
    elif how == "loose_max_ok":  # a looser bound is fine, and served: the kernel gets the real longest
        mq, mk = mq + 5, mk + 7
    elif how == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif how == "odd_causal":
        kw["causal"] = 1  # not a bool or a name: the Python path reads it
    for _ in range(2):  # the second call would be served if the plan allowed it
        try:
            if how == "use_math":
                with ab.use("math"):
                    res, served = _served(call)
            elif how == "cu_on_meta":
                res, served = _served(lambda: ab.attention_varlen(q, k, v, cu_q.to("meta"), cu_k, mq, mk, **kw))
            else:
                res, served = _served(call)
        except (ValueError, TypeError) as e:
            assert how in ("int64_cu", "cu_on_meta"), (how, e)
            assert "cu_seqlens" in str(e)
            continue
        assert how not in ("int64_cu", "cu_on_meta")
    if how in ("int64_cu", "cu_on_meta"):
        return
    assert served == (how == "loose_max_ok"), how  # a strided cu_seqlens is copied by the Python path
    if how in ("requires_grad", "sinks_grad"):
        assert res.requires_grad


def _sinks_alibi_opts(name, Hq, B):
    g = torch.Generator().manual_seed(11)
    opts = {}
    if "sinks" in name:
        opts["sinks"] = torch.randn(Hq, generator=g).to(torch.bfloat16 if "bf16" in name else torch.float32)
    if "alibi" in name:
        opts["alibi_slopes"] = torch.rand(B, Hq, generator=g) * 0.5 if "batch" in name else torch.rand(Hq, generator=g)
    if "window" in name:
        opts.update(window=(3, 0), softcap=4.0)
    return opts


@pytest.mark.parametrize("spec", ["decode_gqa", "decode_mha_3", "mixed_flash", "decode_noncausal"])
@pytest.mark.parametrize("name", ["sinks", "sinks_bf16", "alibi", "alibi_batch", "sinks_alibi_window"])
def test_varlen_fast_path_takes_sinks_and_alibi_with_the_python_paths_bits(spec, name, monkeypatch):
    args, causal = _packed_inputs(spec, torch.float32)
    lens_q, lens_k, Hq = VARLEN_SPECS[spec][:3]
    opts = _sinks_alibi_opts(name, Hq, len(lens_q))
    if "window" in name and causal is False:
        causal = "bottom_right"
    kw = dict(causal=causal, return_lse=True, **opts)
    fast = _served_with_the_python_paths_bits(args, kw, monkeypatch)
    if spec == "decode_gqa":  # and right
        from attn_backends._testing import check_2x, varlen_reference

        q, k, v, cu_q, cu_k = args[:5]
        ref64, lse64 = varlen_reference(q, k, v, cu_q, cu_k, **{k_: v_ for k_, v_ in kw.items() if k_ != "return_lse"})
        same, _ = varlen_reference(q, k, v, cu_q, cu_k, dtype=torch.float32,
                                   **{k_: v_ for k_, v_ in kw.items() if k_ != "return_lse"})
        check_2x("out", fast[0], ref64, same, 2, torch.float32)
        check_2x("lse", fast[1], lse64, lse64.float(), 2, torch.float32)


def test_flash_attn_varlen_func_takes_s_aux_and_alibi_on_the_fast_path(monkeypatch):
    from attn_backends import flash_attn as fa

    args, _ = _packed_inputs("decode_gqa", torch.float32)
    opts = _sinks_alibi_opts("sinks_alibi_batch", 8, 3)
    kw = dict(causal=True, s_aux=opts["sinks"], alibi_slopes=opts["alibi_slopes"])
    fa.flash_attn_varlen_func(*args, **kw)
    res, served = _served(lambda: fa.flash_attn_varlen_func(*args, **kw))
    assert served
    with monkeypatch.context() as m:  # the Python path's bits
        m.setattr(fa, "_fast_varlen", lambda *a: None)
        m.setattr(ab, "_fast_attention_varlen", lambda *a: None)
        slow, served = _served(lambda: fa.flash_attn_varlen_func(*args, **kw))
    assert not served
    assert_same(res, slow)


def test_varlen_fast_path_takes_parameter_sinks_without_a_gradient(monkeypatch):
    # a module's sinks (GPT-OSS hands its nn.Parameter over as s_aux): served under no_grad, and with a
    # gradient the autograd path, whose sinks get their gradient
    args, causal = _packed_inputs("decode_gqa", torch.float32)
    opts = _sinks_alibi_opts("sinks_alibi", 8, 3)
    sinks = torch.nn.Parameter(opts["sinks"].clone())
    with torch.no_grad():
        fast = _served_with_the_python_paths_bits(args, dict(causal=causal, return_lse=True, sinks=sinks,
                                                             alibi_slopes=torch.nn.Parameter(opts["alibi_slopes"])),
                                                  monkeypatch)
    assert_same(fast[0], ab.attention_varlen(*args, causal=causal, sinks=opts["sinks"],
                                             alibi_slopes=opts["alibi_slopes"]))
    out, served = _served(lambda: ab.attention_varlen(*args, causal=causal, sinks=sinks))
    assert not served and out.requires_grad
    out.sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0


def _bad_option(bad, Hq):
    """An option the Python checks reject (the fast paths must leave it to them)."""
    return {"sinks_shape": dict(sinks=torch.zeros(Hq + 1)), "sinks_int": dict(sinks=torch.zeros(Hq, dtype=torch.int32)),
            "alibi_shape": dict(alibi_slopes=torch.zeros(2, Hq + 1)),  # neither (Hq,) nor (B, Hq)
            "alibi_float64": dict(alibi_slopes=torch.zeros(Hq, dtype=torch.float64)),
            "window_3": dict(window=(3, 0, 1)), "window_below": dict(window=(-2, 0)),
            "softcap_negative": dict(softcap=-1.0)}[bad]


@pytest.mark.parametrize("bad", ["sinks_shape", "sinks_int", "alibi_shape", "alibi_float64"])
def test_varlen_fast_path_leaves_bad_sinks_and_alibi_to_the_python_checks(bad):
    args, causal = _packed_inputs("decode_gqa", torch.float32)
    Hq = args[0].shape[1]
    good = _sinks_alibi_opts("sinks_alibi", Hq, 3)
    ab.attention_varlen(*args, causal=causal, **good)  # remembered: the fast path is armed
    assert _served(lambda: ab.attention_varlen(*args, causal=causal, **good))[1]
    kw = dict(good, **_bad_option(bad, Hq))
    before = _C.fast_calls()
    with pytest.raises((ValueError, TypeError), match="sinks|alibi_slopes"):
        ab.attention_varlen(*args, causal=causal, **kw)
    assert _C.fast_calls() == before


DENSE_SPECS = {  # B, Hq, Hkv, Sq, Sk, D, causal
    "gqa_causal": (2, 4, 2, 7, 9, 16, True),
    "decode_br": (2, 8, 2, 1, 33, 16, "bottom_right"),  # a decode step, which the decode kernel serves
    "mha_noncausal": (1, 3, 3, 5, 12, 24, False),
}
DENSE_OPTIONS = ["window", "window_softcap_int", "sinks", "sinks_bf16", "alibi", "alibi_batch", "sinks_alibi_window"]


def _dense_options(spec, name):
    B, Hq, Hkv, Sq, Sk, D, causal = DENSE_SPECS[spec]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, s, D, generator=g) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    opts = _sinks_alibi_opts(name, Hq, B)
    if name.startswith("window"):
        opts["window"] = (3, 1)
        if "softcap" in name:
            opts["softcap"] = 2  # an int, as _validate takes it
    return (q, k, v), dict(causal=causal, **opts)


def _dense_served_with_the_python_paths_bits(args, kw, monkeypatch):
    """ab.attention(*args, **kw) (out, lse), planned once, then served by the fast path with the bits of
    the Python path."""
    return _served_with_the_python_paths_bits(args, dict(kw, return_lse=True), monkeypatch, ab.attention,
                                              "_fast_attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", list(DENSE_SPECS))
@pytest.mark.parametrize("name", DENSE_OPTIONS)
def test_fast_path_takes_windows_softcap_sinks_and_alibi_with_the_python_paths_bits(spec, name, dtype, monkeypatch):
    (q, k, v), kw = _dense_options(spec, name)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    fast = _dense_served_with_the_python_paths_bits((q, k, v), kw, monkeypatch)
    if dtype == torch.float32:  # and right
        from attn_backends._testing import check_2x, reference_attention

        opts = {n: val for n, val in kw.items()}
        ref64, lse64 = reference_attention(q.double(), k.double(), v.double(), **opts)
        same, _ = reference_attention(q, k, v, dtype=torch.float32, **opts)
        check_2x("out", fast[0], ref64, same, 2, torch.float32)
        check_2x("lse", fast[1], lse64, lse64.float(), 2, torch.float32)


@pytest.mark.parametrize("spec", list(DENSE_SPECS))
def test_fast_path_clamps_a_window_that_hides_no_key_as_the_python_path_does(spec, monkeypatch):
    # a side >= Sq + Sk is unbounded (_validate.clamp_window): (Sq + Sk, -1) is the call without a window
    (q, k, v), kw = _dense_options(spec, "none")
    Sq, Sk = q.shape[2], k.shape[2]
    fast = _dense_served_with_the_python_paths_bits((q, k, v), dict(kw, window=(Sq + Sk, -1)), monkeypatch)
    plain = ab.attention(q, k, v, return_lse=True, **kw)
    assert_same(fast[0], plain[0])
    assert_same(fast[1], plain[1])
    # one less on the left is a window the kernel applies (it hides no key here either): same bits again
    _dense_served_with_the_python_paths_bits((q, k, v), dict(kw, window=(Sq + Sk - 1, Sq + Sk)), monkeypatch)


def test_fast_path_takes_parameter_sinks_without_a_gradient(monkeypatch):
    (q, k, v), kw = _dense_options("decode_br", "sinks_alibi")
    sinks = torch.nn.Parameter(kw["sinks"].clone())
    with torch.no_grad():
        fast = _dense_served_with_the_python_paths_bits(
            (q, k, v), dict(kw, sinks=sinks, alibi_slopes=torch.nn.Parameter(kw["alibi_slopes"])), monkeypatch)
    assert_same(fast[0], ab.attention(q, k, v, **kw))
    out, served = _served(lambda: ab.attention(q, k, v, **dict(kw, sinks=sinks)))
    assert not served and out.requires_grad  # the sinks' gradient: the autograd path
    out.sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0


@pytest.mark.parametrize("bad", ["sinks_shape", "sinks_int", "alibi_shape", "alibi_float64", "window_3",
                                 "window_below", "softcap_negative"])
def test_fast_path_leaves_bad_options_to_the_python_checks(bad):
    (q, k, v), good = _dense_options("gqa_causal", "sinks_alibi_window")
    Hq = q.shape[1]
    ab.attention(q, k, v, **good)  # remembered: the fast path is armed
    assert _served(lambda: ab.attention(q, k, v, **good))[1]
    kw = dict(good, **_bad_option(bad, Hq))
    before = _C.fast_calls()
    with pytest.raises((ValueError, TypeError), match="sinks|alibi_slopes|window|softcap"):
        ab.attention(q, k, v, **kw)
    assert _C.fast_calls() == before


@pytest.mark.parametrize("bad", ["not_monotone", "wrong_total", "too_long", "batch", "heads", "dtype", "rank"])
def test_varlen_fast_path_leaves_bad_input_to_the_python_checks(bad):
    args, causal = _packed_inputs("decode_gqa", torch.float32)
    q, k, v, cu_q, cu_k, mq, mk = args
    ab.attention_varlen(*args, causal=causal)  # remembered: the fast path is armed
    if bad == "not_monotone":
        cu_k = torch.tensor([0, 9, 5, 42], dtype=torch.int32)
    elif bad == "wrong_total":
        cu_k = torch.tensor([0, 9, 9, 41], dtype=torch.int32)
    elif bad == "too_long":
        mk = 32
    elif bad == "batch":
        cu_q = torch.tensor([0, 1, 3], dtype=torch.int32)
    elif bad == "heads":
        k, v = k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1)
    elif bad == "dtype":
        k = k.half()
    else:
        q = q[None]
    before = _C.fast_calls()
    with pytest.raises((ValueError, TypeError), match="cu_seqlens|max_seqlen|heads|dtype|3-D|sequence"):
        ab.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal)
    assert _C.fast_calls() == before


# ---- tensors whose values are not their memory ---------------------------------------------------
#
# A negative view (x.conj().imag of a complex tensor, torch._neg_view) keeps its sign in a bit, and a
# zero tensor has no memory at all: a kernel handed their data pointer reads the wrong sign or NULL.
# The direct calls hand such calls to the op, whose dispatcher resolves them first (csrc/ab_direct.c
# read_view); a KV cache, read and written in place, must be plain memory (a ValueError naming it).

def _unplain(t: torch.Tensor, kind: str) -> torch.Tensor:
    """t's values as a negative view, or t's shape as a zero tensor."""
    if kind == "neg":
        return torch._neg_view(-t)
    return torch._efficientzerotensor(t.shape, dtype=t.dtype)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_neg() if not t._is_zerotensor() else torch.zeros(t.shape, dtype=t.dtype)


@pytest.mark.parametrize("kind", ["neg", "zero"])
@pytest.mark.parametrize("which", ["q", "k", "v", "mask"])
def test_views_whose_values_are_not_their_memory_give_their_values_results(which, kind):
    g = torch.Generator().manual_seed(5)
    t = {n: torch.randn(2, 4, 9, 16, generator=g) for n in "qkv"}
    t["mask"] = torch.randn(1, 1, 9, 9, generator=g)
    t[which] = _unplain(t[which], kind)
    assert t[which].is_neg() or t[which]._is_zerotensor()
    want = ab.attention(*(_plain(t[n]) for n in "qkv"), attn_mask=_plain(t["mask"]), backend="flash")
    for _ in range(2):  # the first call plans it; the second is one the fast path would take
        got, served = _served(lambda: ab.attention(t["q"], t["k"], t["v"], attn_mask=t["mask"], backend="flash"))
        assert not served
        assert torch.equal(got, want)


@pytest.mark.parametrize("which", ["q", "k", "v", "cu_seqlens"])
def test_packed_negative_views_give_their_values_results(which):
    g = torch.Generator().manual_seed(6)
    t = {n: torch.randn(12, 4, 16, generator=g) for n in "qkv"}
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    if which == "cu_seqlens":  # an int32 negative view of -cu: its values are cu's
        t["cu"] = torch._neg_view(-cu)
    else:
        t["cu"] = cu
        t[which] = _unplain(t[which], "neg")
    want = ab.attention_varlen(*(_plain(t[n]) for n in "qkv"), cu, cu, 7, 7)
    for _ in range(2):
        got, served = _served(lambda: ab.attention_varlen(t["q"], t["k"], t["v"], t["cu"], t["cu"], 7, 7))
        assert not served
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["neg", "zero"])
@pytest.mark.parametrize("which", ["q", "k", "v", "cache_seqlens"])
def test_kvcache_inputs_whose_values_are_not_their_memory_give_their_values_results(which, kind):
    g = torch.Generator().manual_seed(7)
    B, S, Hkv, D = 2, 40, 2, 16
    t = dict(q=torch.randn(B, 1, 4, D, generator=g), k=torch.randn(B, 1, Hkv, D, generator=g),
             v=torch.randn(B, 1, Hkv, D, generator=g), cache_seqlens=torch.tensor([3, 30], dtype=torch.int32))
    t[which] = _unplain(t[which], kind)
    caches = [torch.randn(B, S, Hkv, D, generator=g) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    with torch.inference_mode():
        want = ab.attention_with_kvcache(_plain(t["q"]), *want_caches, _plain(t["k"]), _plain(t["v"]),
                                         cache_seqlens=_plain(t["cache_seqlens"]))
        for i in range(2):
            got_caches = [c.clone() for c in caches]
            got, served = _served(lambda: ab.attention_with_kvcache(t["q"], *got_caches, t["k"], t["v"],
                                                                     cache_seqlens=t["cache_seqlens"]))
            assert not served
            assert torch.equal(got, want)
            assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


@pytest.mark.parametrize("kind", ["neg", "zero"])
@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_a_cache_whose_values_are_not_its_memory_is_refused_by_name(which, kind):
    q, kc, vc = torch.randn(1, 1, 2, 8), torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    caches = dict(k_cache=kc, v_cache=vc)
    caches[which] = _unplain(caches[which], kind)
    with torch.inference_mode():
        ab.attention_with_kvcache(q, kc, vc, cache_seqlens=4)  # a plan the fast path knows
        with pytest.raises(ValueError, match=f"{which} is a negative view or a zero tensor"):
            ab.attention_with_kvcache(q, caches["k_cache"], caches["v_cache"], cache_seqlens=4)


def test_a_sparse_index_tensor_gets_the_python_paths_error_from_the_fast_path():
    q, kc = torch.randn(2, 1, 2, 8), torch.randn(2, 10, 2, 8)
    with torch.inference_mode():
        ab.attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=4)  # a plan the fast path knows
        leftpad = torch.zeros(3, dtype=torch.int32).to_sparse()  # no strides, no data pointer
        with pytest.raises(ValueError, match=r"cache_leftpad must have shape \(B,\)"):
            ab.attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=4, cache_leftpad=leftpad)


def test_a_strict_that_is_not_a_bool_is_read_by_the_python_path():
    """strict is read by the Python path (bool(strict)): a value whose truth raises fails there, before
    anything is written, rather than being skipped by a fast path that never reads it."""
    import numpy as np

    q, kc = torch.randn(2, 1, 4, 16), torch.randn(2, 32, 2, 16)
    k = torch.randn(2, 1, 2, 16)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    bad = np.array([1, 2])
    with torch.inference_mode():
        ab.attention_with_kvcache(q, kc.clone(), kc.clone(), k, k, cache_seqlens=seqlens)  # plans it
        caches = (kc.clone(), kc.clone())
        with pytest.raises(ValueError, match="truth value"):
            ab.attention_with_kvcache(q, *caches, k, k, cache_seqlens=seqlens, strict=bad)
        assert torch.equal(caches[0], kc) and torch.equal(caches[1], kc)
    x = torch.randn(1, 2, 5, 16)
    ab.attention(x, x, x)
    with pytest.raises(ValueError, match="truth value"):
        ab.attention(x, x, x, strict=bad)
    packed, cu = torch.randn(5, 2, 16), torch.tensor([0, 5], dtype=torch.int32)
    ab.attention_varlen(packed, packed, packed, cu, cu, 5, 5)
    with pytest.raises(ValueError, match="truth value"):
        ab.attention_varlen(packed, packed, packed, cu, cu, 5, 5, strict=bad)


def test_a_backend_name_with_a_nul_inside_is_the_python_paths_to_refuse():
    q = torch.randn(2, 4, 16, 32)
    ab.attention(q, q, q, backend="flash")  # a plan the fast path knows
    with pytest.raises(ValueError, match="unknown backend"):
        ab.attention(q, q, q, backend="flash\x00junk")  # the lookup would have stopped at the NUL
    packed, cu = torch.randn(5, 2, 16), torch.tensor([0, 5], dtype=torch.int32)
    ab.attention_varlen(packed, packed, packed, cu, cu, 5, 5, backend="flash_varlen")
    with pytest.raises(ValueError, match="unknown backend"):
        ab.attention_varlen(packed, packed, packed, cu, cu, 5, 5, backend="flash_varlen\x00x")


@pytest.mark.parametrize("sinks", [False, True])
def test_rows_whose_lse_bytes_would_wrap_are_an_allocation_error_not_a_crash(sinks):
    """An empty out (Dv = 0) lets an expanded q of 2**62 rows reach the lse buffer the kernel writes
    when the caller wants none: its size in bytes wrapped to 0 and the kernel wrote past it."""
    k, v = torch.randn(1, 1, 1, 1), torch.randn(1, 1, 1, 0)
    kw = dict(sinks=torch.randn(1)) if sinks else {}
    for _ in range(2):  # planned, then a call the fast path knows
        ab.attention(torch.randn(1, 1, 8, 1), k, v, **kw)
    q = torch.randn(1, 1, 1, 1).expand(1, 1, 2**62, 1)
    with pytest.raises(RuntimeError, match="allocation failed"):
        ab.attention(q, k, v, **kw)


def test_flash_attn_varlen_funcs_fast_gate_leaves_a_bad_window_to_the_checks():
    from attn_backends import flash_attn as fa

    packed, cu = torch.randn(12, 4, 16), torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"window_size\[0\] must be an int"):
        fa.flash_attn_varlen_func(packed, packed, packed, cu, cu, 7, 7, window_size=(torch.tensor([1, 2]), -1))
