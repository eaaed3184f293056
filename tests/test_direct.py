"""The CPU flash forward without the dispatcher (attn_backends/_providers.py: direct_ok, run_flash;
csrc/ab_module.c: flash_fwd_cpu).

A plain eager call that needs no gradient skips the op's fixed cost; it must give exactly what the op
gives (same bits, same output layout, same errors), and everything that has to see the op (autograd,
torch.compile, dispatch modes, FakeTensor, inference mode, functorch) must still get it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attn_backends as ab
from attn_backends import _C, _providers
from attn_backends._testing import Case, cases, make_inputs

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
    direct, op = _C.flash_fwd_cpu, _providers._run_flash

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

    monkeypatch.setattr(_providers, "_C", Module())
    monkeypatch.setattr(_providers, "_run_flash", run_op)
    return seen


def both_paths(monkeypatch, fn):
    """fn() through the direct path, then with it switched off (the op below autograd)."""
    direct = fn()
    with monkeypatch.context() as m:
        m.setattr(_providers, "direct_ok", lambda *args: False)
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


@pytest.mark.parametrize("how", ["requires_grad", "inference_mode", "dispatch_mode", "fake_tensor", "dropout",
                                 "vmap", "subclass"])
def test_the_op_path_is_kept_where_something_must_see_the_op(how, calls):
    q = torch.randn(2, 2, 6, 16)
    if how == "requires_grad":
        qg = q.clone().requires_grad_()
        ab.attention(qg, q, q, **_kw()).sum().backward()
        assert qg.grad is not None
    elif how == "inference_mode":
        with torch.inference_mode():
            ab.attention(q, q, q, **_kw())
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
            "from attn_backends import _providers\n"
            "q = torch.randn(1, 1, 4, 8)\n"
            "msgs = []\n"
            "for direct in (True, False):\n"
            "    if not direct:\n"
            "        _providers.direct_ok = lambda *a: False\n"
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
