"""Context parallel (attn_backends.distributed) on CPU with gloo: ring attention (both layouts) and
Ulysses, forward and backward, against the float64 reference on the unsharded tensors by the 2x/3x
rule, and against single-process ab.attention by the same rule; shard/unshard round trips; the errors.

Processes are expensive on a 2-core machine (each imports torch), so there is one process group per
world size (2 and 4), started from a forkserver that imports torch and the library once, and every
case runs inside it in turn; each case below is still its own test, reporting what each rank saw.
Every collective has a timeout (the group's, and a deadline on the whole run), so a hang fails.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import traceback

import pytest
import torch

import attn_backends as ab
from attn_backends._testing import check_2x, max_err, reference_attention

pytestmark = pytest.mark.distributed

DEADLINE_S = 240  # the whole run of one world size; a healthy run takes seconds


# ---- the cases: each runs on every rank of the group -----------------------------------------------

def _inputs(seed, B, Hq, Hkv, Sq, Sk, D, Dv, dtype):
    """The whole (unsharded) q, k, v and an output gradient: the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, gout = (torch.randn(*s, generator=g).to(dtype)
                     for s in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv), (B, Hq, Sq, Dv)))
    return q, k, v, gout


def _compare(name, ours, ref64, peers, k, dtype):
    """The project's rule against every peer: plain torch ops in the same dtype and one process."""
    for peer in peers:
        check_2x(name, ours, ref64, peer, k, dtype)


def _attention_case(scheme, layout="zigzag", causal=False, window=None, softcap=0.0, dtype=torch.float32,
                    Hq=4, Hkv=2, D=16, Dv=8, q_chunk=3, k_chunk=None, B=2, noncontig=False, scale=None,
                    backend="auto"):
    """Shard q, k, v; run ring or Ulysses forward and backward; unshard out, lse and the gradients and
    check them against the float64 reference on the whole tensors by the 2x/3x rule, with plain torch
    ops in the same dtype and single-process ab.attention as the peers."""

    def run(W, rank):
        from attn_backends import distributed as abd

        n = 2 * W if layout == "zigzag" else W
        Sq, Sk = q_chunk * n, (k_chunk or q_chunk) * n
        q, k, v, gout = _inputs(1000 * W + Sq, B, Hq, Hkv, Sq, Sk, D, Dv, dtype)
        shard = lambda t: abd.shard(t, layout=layout)  # noqa: E731
        leaves = []
        for t in (q, k, v):
            t = shard(t)
            if noncontig:  # a (B, S, H, D) buffer seen as (B, H, S, D)
                t = t.transpose(1, 2).contiguous().transpose(1, 2)
            leaves.append(t.requires_grad_())
        opts = dict(causal=causal, window=window, softcap=softcap, scale=scale, backend=backend)
        originals = [t.detach().clone() for t in leaves]
        if scheme == "ring":
            out, lse = abd.ring_attention(*leaves, layout=layout, return_lse=True, **opts)
            assert lse.dtype == torch.float32 and lse.shape == out.shape[:3]
        else:
            out, lse = abd.ulysses_attention(*leaves, layout=layout, **opts), None
        assert out.dtype == dtype and out.shape == (B, Hq, Sq // W, Dv), out.shape
        grads = torch.autograd.grad(out, leaves, shard(gout))
        for t, o in zip(leaves, originals):
            assert torch.equal(t.detach(), o), "the call modified its inputs"
        whole = [abd.unshard(t, layout=layout) for t in (out, *grads)]
        lse = abd.unshard(lse, layout=layout) if lse is not None else None

        ref_opts = dict(causal=causal, window=window, softcap=softcap, scale=scale)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        r_out, r_lse = reference_attention(*ref_leaves, **ref_opts)
        r_grads = torch.autograd.grad(r_out, ref_leaves, gout.double())
        same_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        s_out, s_lse = reference_attention(*same_leaves, dtype=dtype, **ref_opts)
        s_grads = torch.autograd.grad(s_out, same_leaves, gout)
        one_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o_out, o_lse = ab.attention(*one_leaves, return_lse=True, **{**opts, "backend": _one_backend(backend)})
        o_grads = torch.autograd.grad(o_out, one_leaves, gout)

        _compare("out", whole[0], r_out, (s_out, o_out), 2, dtype)
        if lse is not None:
            _compare("lse", lse, r_lse, (s_lse, o_lse), 2, dtype)
        for name, ours, r, s, o in zip(("dq", "dk", "dv"), whole[1:], r_grads, s_grads, o_grads):
            _compare(name, ours, r, (s, o), 3, dtype)

    return run


def _varlen_case(scheme, layout="zigzag", causal=False, window=None, softcap=0.0, dtype=torch.float32, Hq=4,
                 Hkv=2, D=16, Dv=8, chunks=(3, 1, 2)):
    """As _attention_case for packed sequences: sequence b is chunks[b] chunks per rank long."""

    def run(W, rank):
        from attn_backends import distributed as abd
        from attn_backends._testing import varlen_reference

        n = 2 * W if layout == "zigzag" else W
        lens = [c * n for c in chunks]
        T = sum(lens)
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
        g = torch.Generator().manual_seed(77 * W + T)
        q, k, v, gout = (torch.randn(*s, generator=g).to(dtype) for s in ((T, Hq, D), (T, Hkv, D), (T, Hkv, Dv),
                                                                          (T, Hq, Dv)))
        shard = lambda t: abd.shard_varlen(t, cu, layout=layout)  # noqa: E731
        leaves = [shard(t).requires_grad_() for t in (q, k, v)]
        opts = dict(causal=causal, window=window, softcap=softcap)
        if scheme == "ring":
            out, lse = abd.ring_attention_varlen(*leaves, cu, max(lens), layout=layout, return_lse=True, **opts)
            assert lse.shape == (Hq, T // W) and lse.dtype == torch.float32
        else:
            out, lse = abd.ulysses_attention_varlen(*leaves, cu, max(lens), layout=layout, **opts), None
        assert out.shape == (T // W, Hq, Dv) and out.dtype == dtype
        grads = torch.autograd.grad(out, leaves, shard(gout))
        whole = [abd.unshard_varlen(t, cu, layout=layout) for t in (out, *grads)]
        if lse is not None:
            lse = abd.unshard_varlen(lse, cu, layout=layout, dim=1)

        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        r_out, r_lse = varlen_reference(*ref_leaves, cu, cu, **opts)
        r_grads = torch.autograd.grad(r_out, ref_leaves, gout.double())
        same_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        s_out, s_lse = varlen_reference(*same_leaves, cu, cu, dtype=dtype, **opts)
        s_grads = torch.autograd.grad(s_out, same_leaves, gout)
        one_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o_out, o_lse = ab.attention_varlen(*one_leaves, cu, cu, max(lens), max(lens), return_lse=True, **opts)
        o_grads = torch.autograd.grad(o_out, one_leaves, gout)
        _compare("out", whole[0], r_out, (s_out, o_out), 2, dtype)
        if lse is not None:
            _compare("lse", lse, r_lse, (s_lse, o_lse), 2, dtype)
        for name, ours, r, s_, o in zip(("dq", "dk", "dv"), whole[1:], r_grads, s_grads, o_grads):
            _compare(name, ours, r, (s_, o), 3, dtype)

    return run


def _one_backend(backend):
    return "flash" if backend == "auto" else backend


def _round_trips(W, rank):
    from attn_backends import distributed as abd

    g = torch.Generator().manual_seed(7)
    for layout in ("zigzag", "contiguous"):
        n = 2 * W if layout == "zigzag" else W
        for shape, dim in (((2, 3, 5 * n, 4), 2), ((5 * n, 3), 0), ((2, 3 * n), -1), ((1, 2 * n, 3, 4), 1)):
            x = torch.randn(*shape, generator=g)
            before = x.clone()
            piece = abd.shard(x, layout=layout, dim=dim)
            assert piece.shape[dim] == x.shape[dim] // W
            assert piece.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), "shard returned a view"
            assert torch.equal(abd.unshard(piece, layout=layout, dim=dim), x)
            assert torch.equal(x, before)
        # which rows a rank holds: zigzag chunks r and 2W-1-r, contiguous chunk r
        pos = torch.arange(4 * n).view(1, 1, -1, 1)
        want = [rank, 2 * W - 1 - rank] if layout == "zigzag" else [rank]
        assert abd.shard(pos, layout=layout).flatten().tolist() == [4 * c + i for c in want for i in range(4)]
        # packed: every sequence is cut the same way, and a rank's piece goes sequence after sequence
        lens = [2 * n, n, 3 * n]
        cu = torch.tensor([0, lens[0], lens[0] + lens[1], sum(lens)], dtype=torch.int32)
        x = torch.randn(sum(lens), 3, 5, generator=g)
        piece = abd.shard_varlen(x, cu, layout=layout)
        assert piece.shape == (sum(lens) // W, 3, 5)
        assert torch.equal(abd.unshard_varlen(piece, cu, layout=layout), x)
        rows = abd.shard_varlen(torch.arange(sum(lens)), cu, layout=layout).tolist()
        want_rows = [start + c * (L // n) + i for start, L in zip(cu.tolist(), lens) for c in want
                     for i in range(L // n)]
        assert rows == want_rows
    # unshard's gradient is torch.distributed.nn's all_gather rule: each rank's rows, summed over ranks
    x = torch.randn(2, 3, 2 * W * 2, 4, generator=g)
    piece = abd.shard(x).requires_grad_()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))  # a different loss per rank
    (grad,) = torch.autograd.grad((abd.unshard(piece) * w).sum(), piece)
    total = sum(torch.randn(x.shape, generator=torch.Generator().manual_seed(r)) for r in range(W))
    assert torch.allclose(grad, abd.shard(total))


def _raises(exc, *fragments):
    """A case that must raise exc on this rank with a message containing every fragment."""

    def check(fn):
        try:
            fn()
        except exc as e:
            msg = str(e)
            missing = [f for f in fragments if f not in msg]
            assert not missing, f"the {exc.__name__} does not say {missing}: {msg}"
            return
        raise AssertionError(f"no {exc.__name__} raised")

    return check


def _errors(W, rank):
    import torch.distributed as dist

    from attn_backends import distributed as abd

    n = 2 * W
    q = torch.randn(1, 4, 2 * n, 8)
    ql = abd.shard(q)
    # uneven lengths: shard names x and the chunk count; the ring names q
    _raises(ValueError, "x:", f"{n} equal chunks")(lambda: abd.shard(torch.randn(1, 2, n + 1, 8)))
    odd = torch.randn(1, 4, 3, 8)
    _raises(ValueError, "q:", "even")(lambda: abd.ring_attention(odd, odd, odd))
    _raises(ValueError, "layout")(lambda: abd.ring_attention(ql, ql, ql, layout="striped"))
    _raises(ValueError, "layout")(lambda: abd.shard(q, layout="striped"))
    _raises(ValueError, "dim 4 is out of range")(lambda: abd.shard(q, dim=4))
    _raises(TypeError, "group")(lambda: abd.shard(q, group="world"))
    # shards that differ across ranks: every rank raises, naming what differs, and nobody hangs
    mine = ql if rank else ql[:, :, :2]
    _raises(ValueError, "disagree on q's local length", "rank 0 has 2")(lambda: abd.ring_attention(mine, mine, mine))
    _raises(ValueError, "disagree on causal")(lambda: abd.ulysses_attention(ql, ql, ql, causal=rank == 1))
    # one rank's invalid argument: its own error there, a pointer to it on the others
    if rank == 1:
        _raises(ValueError, "window left")(lambda: abd.ring_attention(ql, ql, ql, window=(-3, 0)))
    else:
        _raises(RuntimeError, "rank 1", "rejected")(lambda: abd.ring_attention(ql, ql, ql))
    # the ring's backward runs our flash backward, which has no float64
    q64 = ql.double().requires_grad_()
    _raises(ValueError, "backend", "flash backward")(lambda: abd.ring_attention(q64, q64, q64))
        # Ulysses splits heads: 3 heads do not divide over 2 or 4 ranks
    q3 = abd.shard(torch.randn(1, 3, 2 * n, 8))
    _raises(ValueError, "q:", "heads (3)", f"divisible by {W}")(lambda: abd.ulysses_attention(q3, q3, q3))
    # a backend name one rank alone gets wrong: Ulysses used to check it only after its first all_to_all,
    # so that rank raised and the others waited in the second one until the group's timeout
    cu2 = torch.tensor([0, 2 * n], dtype=torch.int32)
    pl2 = abd.shard_varlen(torch.randn(2 * n, 4, 8), cu2)
    for call in (lambda b: abd.ulysses_attention(ql, ql, ql, backend=b),
                 lambda b: abd.ulysses_attention_varlen(pl2, pl2, pl2, cu2, 2 * n, backend=b)):
        if rank == 1:
            _raises(ValueError, "unknown backend 'nonsense'")(lambda: call("nonsense"))
        else:
            _raises(RuntimeError, "rank 1", "rejected")(lambda: call("flash"))
    # ranks in different calls
    if rank == 0:
        _raises(RuntimeError, "not all in the same call")(lambda: abd.ring_attention(ql, ql, ql))
    else:
        _raises(RuntimeError, "not all in the same call")(lambda: abd.ulysses_attention(ql, ql, ql))
    # packed: lengths that do not divide into the chunks, a window on the packed ring
    cu = torch.tensor([0, n, 3 * n - 1, 4 * n], dtype=torch.int32)
    _raises(ValueError, "cu_seqlens", "divide")(lambda: abd.shard_varlen(torch.randn(4 * n, 2, 8), cu))
    cu = torch.tensor([0, n, 4 * n], dtype=torch.int32)
    pl = abd.shard_varlen(torch.randn(4 * n, 4, 8), cu)
    _raises(ValueError, "window")(lambda: abd.ring_attention_varlen(pl, pl, pl, cu, 3 * n, window=(2, 0)))
    _raises(ValueError, "max_seqlen")(lambda: abd.ring_attention_varlen(pl, pl, pl, cu, 2))
    # a dense call on one rank and its packed variant on the others: every rank raises (the packed calls
    # shared the dense ones' ids, so rank 0 passed the check and waited in the collective until the timeout)
    pairs = ((lambda: abd.unshard(pl, dim=0), lambda: abd.unshard_varlen(pl, cu, dim=0)),
             (lambda: abd.ring_attention(ql, ql, ql), lambda: abd.ring_attention_varlen(pl, pl, pl, cu, 3 * n)),
             (lambda: abd.ulysses_attention(ql, ql, ql), lambda: abd.ulysses_attention_varlen(pl, pl, pl, cu, 3 * n)))
    for dense, packed in pairs:
        _raises(RuntimeError, "not all in the same call")(dense if rank == 0 else packed)
    # batches of one total whose lengths differ across ranks ([n, 2n, n] and [2n, 0, 2n]: a weighted sum of the
    # lengths, the check before, could not tell them apart, and the ring ran)
    mine = torch.tensor([0, n, 3 * n, 4 * n] if rank == 0 else [0, 2 * n, 2 * n, 4 * n], dtype=torch.int32)
    pm = abd.shard_varlen(torch.randn(4 * n, 4, 8), mine)
    _raises(ValueError, "disagree on cu_seqlens")(lambda: abd.ring_attention_varlen(pm, pm, pm, mine, 2 * n))
    # a process outside the group it is given: named as such (torch hands it an int, not a ProcessGroup)
    sub = dist.new_group([1])
    if rank != 1:
        _raises(ValueError, "not a member of the group")(lambda: abd.ring_attention(ql, ql, ql, group=sub))
        _raises(ValueError, "not a member of the group")(lambda: abd.shard(q, group=sub))
    # after all that the group still works
    out = abd.ring_attention(ql, ql, ql, causal=True)
    ref, _ = reference_attention(q, q, q, causal=True)
    assert max_err(abd.unshard(out), ref) < 1e-5


def _example(W, rank):
    """examples/train_gpt.py --context_parallel W (ring and Ulysses) gives the one process's loss curve.
    The example joins the group the test made, as it would join torchrun's."""
    import contextlib
    import importlib.util
    import io

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt.py")
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    small = ["--steps", "4", "--batch", "2", "--block", "32", "--layers", "1", "--dim", "32", "--heads", "4",
             "--kv_heads", "2", "--log_every", "4"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        example.main(small + ["--json", os.path.join(tmp, "one.json")])
        for scheme in ("ring", "ulysses"):
            log = os.path.join(tmp, f"{scheme}.json")
            example.main(small + ["--context_parallel", str(W), "--cp_scheme", scheme, "--json", log])
            if rank == 0:  # the rank that writes the curve
                one, cp = (json.load(open(os.path.join(tmp, f)))["loss"] for f in ("one.json", f"{scheme}.json"))
                assert len(cp) == len(one) == 4
                assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(one, cp)), (scheme, one, cp)


def _double_backward(W, rank):
    """create_graph=True, then a gradient of the gradient (gradient penalties): Ulysses and unshard give
    the float64 reference's second derivative; the ring, whose backward autograd cannot differentiate,
    raises a clear error naming itself instead of a silent 0 (it gave 0 before), and its first-order
    gradients under create_graph=True are unchanged."""
    from attn_backends import distributed as abd

    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, 4, 4 * W, 8, generator=g) for _ in range(3))
    w = torch.randn(1, 4, 4 * W, 8, generator=g)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    r_out, _ = reference_attention(*ref, causal=True)
    (r_dq,) = torch.autograd.grad(r_out.square().sum(), ref[0], create_graph=True)
    r_dk2 = torch.autograd.grad(r_dq.square().sum(), ref[1])[0]
    # Ulysses: exact to second order (every rank's penalty is its rows of dq)
    leaves = [abd.shard(t).requires_grad_() for t in (q, k, v)]
    out = abd.ulysses_attention(*leaves, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
    (dk2,) = torch.autograd.grad(dq.square().sum(), leaves[1])
    assert max_err(abd.unshard(dk2), r_dk2) <= 1e-4 * r_dk2.abs().max().item(), (max_err(abd.unshard(dk2), r_dk2),)
    # unshard: d/dx of (d/dx sum over ranks of sum(unshard(x)^3)) summed = 6 W x
    x = abd.shard(q).requires_grad_()
    (gx,) = torch.autograd.grad(abd.unshard(x).pow(3).sum(), x, create_graph=True)
    (gx2,) = torch.autograd.grad(gx.sum(), x)
    assert torch.allclose(gx2, 6 * W * x.detach(), rtol=1e-5, atol=1e-5)
    # the ring: first order unchanged under create_graph, a second derivative raises (loss quadratic
    # in out, and linear: then only the saved q, k, v connect the gradient to the graph)
    for loss in (lambda o: o.square().sum(), lambda o: (o * abd.shard(w)).sum()):
        leaves = [abd.shard(t).requires_grad_() for t in (q, k, v)]
        out = abd.ring_attention(*leaves, causal=True)
        dq, dk, dv = torch.autograd.grad(loss(out), leaves, create_graph=True)
        plain = [abd.shard(t).requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(loss(abd.ring_attention(*plain, causal=True)), plain)
        for a, b in zip((dq, dk, dv), want):
            assert torch.equal(a.detach(), b)
        _raises(RuntimeError, "ring attention", "no second derivative")(
            lambda: torch.autograd.grad(dq.square().sum() + (leaves[1] * 0).sum(), leaves[1]))


f32, bf16 = torch.float32, torch.bfloat16
CASES = {
    "ring-zigzag-float32": _attention_case("ring"),
    "ring-zigzag-causal-float32": _attention_case("ring", causal=True),
    "ring-zigzag-causal-window-softcap-float32": _attention_case("ring", causal=True, window=(4, 0), softcap=3.0),
    "ring-zigzag-window-across-chunks-float32": _attention_case("ring", window=(5, 2), q_chunk=2),
    "ring-zigzag-causal-bfloat16": _attention_case("ring", causal=True, dtype=bf16),
    "ring-zigzag-window-softcap-bfloat16": _attention_case("ring", window=(3, 7), softcap=5.0, dtype=bf16),
    "ring-zigzag-bottom-right-masked-rows-float32": _attention_case("ring", causal="bottom_right", window=(3, 1),
                                                                    q_chunk=4, k_chunk=2),
    "ring-zigzag-noncontiguous-scale-math": _attention_case("ring", causal=True, noncontig=True, scale=0.3,
                                                           backend="math"),
    "ring-contiguous-float32": _attention_case("ring", layout="contiguous", Hkv=1),
    "ring-contiguous-causal-float32": _attention_case("ring", layout="contiguous", causal=True),
    "ring-contiguous-window-float32": _attention_case("ring", layout="contiguous", window=(2, 6), q_chunk=5),
    "ring-contiguous-causal-window-bfloat16": _attention_case("ring", layout="contiguous", causal=True,
                                                              window=(6, 0), softcap=4.0, dtype=bf16, q_chunk=5),
    "ring-contiguous-bottom-right-masked-rows-float32": _attention_case("ring", layout="contiguous",
                                                                        causal="bottom_right", q_chunk=6, k_chunk=3),
    "ulysses-zigzag-causal-float32": _attention_case("ulysses", causal=True),
    "ulysses-zigzag-window-softcap-bfloat16": _attention_case("ulysses", window=(4, 2), softcap=5.0, dtype=bf16),
    "ulysses-contiguous-mqa-float32": _attention_case("ulysses", layout="contiguous", causal=True, Hkv=1),
    "ulysses-contiguous-window-bfloat16": _attention_case("ulysses", layout="contiguous", window=(3, 0),
                                                          dtype=bf16, noncontig=True),
    "ring-varlen-zigzag-causal-float32": _varlen_case("ring", causal=True),
    "ring-varlen-zigzag-softcap-bfloat16": _varlen_case("ring", softcap=4.0, dtype=bf16, Hkv=1),
    "ring-varlen-contiguous-causal-float32": _varlen_case("ring", layout="contiguous", causal=True, chunks=(2, 5)),
    "ulysses-varlen-zigzag-causal-window-float32": _varlen_case("ulysses", causal=True, window=(3, 0)),
    "ulysses-varlen-contiguous-window-bfloat16": _varlen_case("ulysses", layout="contiguous", window=(2, 4),
                                                              dtype=bf16, Hkv=1),
    "shard-unshard-round-trips": _round_trips,
    "errors": _errors,
    "double-backward": _double_backward,
    "example-train-gpt-same-loss-curve": _example,
}


# ---- one process group per world size ----------------------------------------------------------

def _worker(rank, world, rendezvous, out_dir, names):
    import torch.distributed as dist

    torch.set_num_threads(1)  # W processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in names:
        try:
            CASES[name](world, rank)
            results[name] = ""
        except Exception:  # reported per case by the test of that name
            results[name] = traceback.format_exc(limit=4)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _run_group(world: int) -> dict:
    import torch.multiprocessing as mp

    mp.set_forkserver_preload(["torch", "attn_backends"])
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "rendezvous"), tmp, list(CASES)),
                                 nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + DEADLINE_S
        failure = ""
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    failure = f"the {world} processes did not finish within {DEADLINE_S} s (a hang)"
                    break
        except Exception as e:  # a worker died outside a case
            failure = f"a worker failed: {e}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = {}
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[rank] = json.load(f)
            else:
                results[rank] = {name: failure or "no result" for name in CASES}
        return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"W{w}")
def group_results(request):
    return _run_group(request.param)


@pytest.mark.parametrize("case", list(CASES))
def test_case_on_every_rank(group_results, case):
    failed = {rank: res[case] for rank, res in group_results.items() if res.get(case, "missing")}
    assert not failed, "\n".join(f"rank {r}:\n{msg}" for r, msg in failed.items())


# ---- without a process group -----------------------------------------------------------------------

def test_missing_process_group_is_named():
    from attn_backends import distributed as abd

    q = torch.randn(1, 2, 4, 8)
    for call in (lambda: abd.ring_attention(q, q, q), lambda: abd.ulysses_attention(q, q, q),
                 lambda: abd.shard(q), lambda: abd.unshard(q)):
        with pytest.raises(RuntimeError, match="group: torch.distributed is not initialized"):
            call()


def test_block_masks_cover_every_pair_exactly():
    """The ring's decomposition of a (query chunk, key chunk) pair into one kernel call reproduces the
    global mask exactly, for both alignments, windows and chunk offsets (no process group needed)."""
    from attn_backends import _ring
    from attn_backends._testing import visible

    for Sq, Sk in ((12, 12), (12, 6), (8, 16)):
        for causal in (0, 1, 2):
            for wl, wr in ((-1, -1), (0, 0), (3, 0), (2, 5), (-1, 4), (6, -1), (20, 1)):
                name = {0: False, 1: True, 2: "bottom_right"}[causal]
                want = visible(Sq, Sk, name, None if (wl, wr) == (-1, -1) else (wl, wr))
                lo, hi = _ring.band(causal, wl, wr)
                shift = Sk - Sq if causal == 2 else 0
                for cq in (1, 3, 4):
                    for ck in (1, 2, 3):
                        for qo in range(0, Sq - cq + 1, cq):
                            for ko in range(0, Sk - ck + 1, ck):
                                got = torch.zeros(cq, ck, dtype=torch.bool)
                                bl = _ring.block(qo + shift, cq, ko, ck, lo, hi)
                                if bl is not None:
                                    sub = visible(bl.r1 - bl.r0, bl.c1 - bl.c0, bool(bl.causal),
                                                  None if (bl.wl, bl.wr) == (-1, -1) else (bl.wl, bl.wr))
                                    got[bl.r0:bl.r1, bl.c0:bl.c1] = sub
                                assert torch.equal(got, want[qo:qo + cq, ko:ko + ck]), (Sq, Sk, causal, wl, wr, qo,
                                                                                        ko, cq, ck, bl)


def test_zigzag_causal_schedule_is_balanced_and_joined():
    """Under a causal mask zigzag gives every rank the same number of visible pairs, and the joined
    schedule makes 3 kernel calls at a rank's own step and 1 at every other."""
    from attn_backends import _cp, _ring

    for W in (2, 4, 8):
        work = []
        for rank in range(W):
            g = _cp.Group(None, rank, W, (rank + 1) % W, (rank - 1) % W, torch.device("cpu"))
            cfg = _ring.Config(g, "zigzag", "flash", 1, 1.0, -1, -1, 0.0, 8 * W, 8 * W)
            steps = [_ring.plan_step(cfg, (rank - s) % W, 8, 8) for s in range(W)]
            assert [len(c) for c in steps] == [3] + [1] * (W - 1)
            work.append(sum((c.q1 - c.q0) * (c.k1 - c.k0) / (2 if c.causal else 1) for cs in steps for c in cs))
        assert len(set(work)) == 1, work


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_backward_calls_sum_to_the_whole_row(dtype):
    """What the ring's backward rests on: our backward op, given a row's final out and lse, returns for
    a subset of the keys exactly that subset's share of the gradient (delta comes from the out it is
    given).  Key halves' dq add up to the whole call's, their dk, dv are its rows."""
    from attn_backends import _ring

    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(*s, generator=g).to(dtype) for s in ((2, 4, 9, 16), (2, 2, 14, 16),
                                                                     (2, 2, 14, 8), (2, 4, 9, 8)))
    out, lse = _ring.kernel_fwd("flash", q, k, v, 0, 0.25, -1, -1, 0.0)
    whole = _ring.kernel_bwd(dout, q, k, v, out, lse, None, 0, 0.25, -1, -1, 0.0, False)
    halves = [_ring.kernel_bwd(dout, q, k[:, :, s], v[:, :, s], out, lse, None, 0, 0.25, -1, -1, 0.0, False)
              for s in (slice(0, 5), slice(5, 14))]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose((halves[0][0].float() + halves[1][0].float()), whole[0].float(), atol=tol)
    for i in (1, 2):
        assert torch.allclose(torch.cat([h[i] for h in halves], 2).float(), whole[i].float(), atol=tol)

