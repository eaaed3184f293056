"""Per-call cost: ab.attention vs F.scaled_dot_product_attention on tiny CPU shapes.

At B=1 H=1 S=16 D=64 the arithmetic is a few thousand multiply-adds, so the time is mostly what a
call costs: argument checks, planning, the dispatcher, allocation, autograd bookkeeping.  Both are
timed side by side, interleaved round by round, and the table shows medians and the ratio
(target: ours <= 1.5x torch's, forward and forward+backward).  "forward" takes ab.attention's fast
path (all in C, csrc/ab_direct.c); "forward, Python path" is the same call with the fast path switched
off (validation, the call descriptor and the plan lookup in Python, then the direct kernel call: what
calls the fast path hands back pay); "forward, op path" switches the direct call off too (what calls
that must keep the op still pay).  "op alone" times our flash op with none of our Python around it,
called below autograd as the op path calls it; "direct alone" the direct call of the same kernel
(_C.flash_fwd_cpu, docs/architecture.md): the floors that validation, planning and dispatch add to.

With --decode the calls are ab.attention_with_kvcache's, at B,H,S,D = batch, heads (query and KV),
tokens in the cache, head dim: "decode read" attends to the cache as it is (k=None), against SDPA on
the dense cache in torch's layout (B, H, S, D), contiguous; "decode step" first writes one new token's
k and v at position S (as a generation loop does), against the same write by slice assignment into
torch's cache and then SDPA; its ", Python path" and
", op path" rows switch the fast path, then the direct kernel call, off as above.

    python benchmarks/bench_overhead.py [--rounds 40] [--json benchmarks/results/overhead.json]
    python benchmarks/bench_overhead.py --decode --shape 1,8,16,64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attn_backends as ab


def _never(*args):
    return False


def make_calls(B, H, S, D, dtype, backend):
    q, k, v = (torch.randn(B, H, S, D, dtype=dtype) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def ours_fwd():
        ab.attention(q, k, v, backend=backend)

    def torch_fwd():
        F.scaled_dot_product_attention(q, k, v)

    def ours_fwd_bwd():
        ab.attention(qg, kg, vg, backend=backend).sum().backward()

    def torch_fwd_bwd():
        F.scaled_dot_product_attention(qg, kg, vg).sum().backward()

    op = torch.ops.attn_backends.flash_fwd.default
    below = torch._C._AutoDispatchBelowAutograd
    scale = D ** -0.5

    def op_alone():
        # the floor under ours_fwd: the flash op itself, called as the no-grad path calls it, with none
        # of our Python (validation, planning, dispatch) around it
        with below():
            op(q, k, v, None, None, 0, scale, -1, -1, 0.0, 0.0)

    from attn_backends._providers import ours as _providers

    direct_ok = _providers.direct_ok

    fast = ab._fast_attention

    def _no_fast(*args):
        return None

    def ours_fwd_python_path():
        # the same call with the fast path switched off: the Python path, then the direct kernel call
        ab._fast_attention = _no_fast
        try:
            ab.attention(q, k, v, backend=backend)
        finally:
            ab._fast_attention = fast

    def ours_fwd_op_path():
        # the same call with the fast path and the direct call switched off: the op below autograd
        ab._fast_attention, _providers.direct_ok = _no_fast, _never
        try:
            ab.attention(q, k, v, backend=backend)
        finally:
            ab._fast_attention, _providers.direct_ok = fast, direct_ok

    def direct_alone():
        # the floor under ours_fwd on the direct path: the kernel called from _C, outputs allocated there
        ab._C.flash_fwd_cpu(q, k, v, None, 0, scale, -1, -1, 0.0, False)

    calls = {
        "forward": (ours_fwd, torch_fwd),
        "forward+backward": (ours_fwd_bwd, torch_fwd_bwd),
    }
    if backend in ("auto", "flash"):
        calls["forward, Python path"] = (ours_fwd_python_path, torch_fwd)
        calls["forward, op path"] = (ours_fwd_op_path, torch_fwd)
        calls["forward, op alone"] = (op_alone, torch_fwd)
        calls["forward, direct alone"] = (direct_alone, torch_fwd)
    return calls


def make_decode_calls(B, H, S, D, dtype, backend):
    cap = S + 16
    q = torch.randn(B, 1, H, D, dtype=dtype)
    k_cache, v_cache = (torch.randn(B, cap, H, D, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, 1, H, D, dtype=dtype) for _ in range(2))
    seqlens = torch.full((B,), S, dtype=torch.int32)
    # torch's caches in the layout it likes best (B, H, S, D), as HF's cache classes keep them
    qt, kt, vt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    k_torch, v_torch = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()

    def ours_read():
        ab.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, backend=backend)

    def torch_read():
        F.scaled_dot_product_attention(qt, k_torch[:, :, :S], v_torch[:, :, :S])

    def ours_step():
        ab.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, backend=backend)

    def torch_step():
        k_torch[:, :, S:S + 1] = kt
        v_torch[:, :, S:S + 1] = vt
        F.scaled_dot_product_attention(qt, k_torch[:, :, :S + 1], v_torch[:, :, :S + 1])

    from attn_backends import _kvcache

    fast, direct_ok = ab._fast_kvcache, _kvcache._direct_ok

    def _no_fast(*args):
        return None

    def ours_step_python_path():
        ab._fast_kvcache = _no_fast
        try:
            ours_step()
        finally:
            ab._fast_kvcache = fast

    def ours_step_op_path():
        ab._fast_kvcache, _kvcache._direct_ok = _no_fast, _never
        try:
            ours_step()
        finally:
            ab._fast_kvcache, _kvcache._direct_ok = fast, direct_ok

    return {
        "decode read": (ours_read, torch_read),
        "decode step": (ours_step, torch_step),
        "decode step, Python path": (ours_step_python_path, torch_step),
        "decode step, op path": (ours_step_op_path, torch_step),
    }


def interleaved(fns, rounds, number):
    """Median seconds per call of each fn, alternating fns every round so drift hits all alike."""
    # Timer runs on one thread unless told (its num_threads defaults to 1): torch's count, as calls run
    timers = [benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()) for fn in fns]
    for t in timers:
        t.timeit(number)  # warm-up
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for i, t in enumerate(timers):
            samples[i].append(t.timeit(number).median)
    return [statistics.median(s) for s in samples]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,1,16,64", help="B,H,S,D")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--number", type=int, default=200, help="calls per timing sample")
    ap.add_argument("--decode", action="store_true", help="attention_with_kvcache calls (see above)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    B, H, S, D = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"per-call cost, B={B} H={H} S={S} D={D} {args.dtype}, backend={args.backend!r}, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds")
    print(f"{'pass':<26}{'ours us':>10}{'torch us':>10}{'ratio':>8}")
    make = make_decode_calls if args.decode else make_calls
    calls = make(B, H, S, D, dtype, args.backend)
    for name, (ours, theirs) in calls.items():
        t_ours, t_torch = interleaved([ours, theirs], args.rounds, args.number)
        ratio = t_ours / t_torch
        rows.append(dict(pass_=name, ours_us=t_ours * 1e6, torch_us=t_torch * 1e6, ratio=ratio))
        print(f"{name:<26}{t_ours * 1e6:>10.1f}{t_torch * 1e6:>10.1f}{ratio:>8.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(
                benchmark="overhead", date=time.strftime("%Y-%m-%d"), command=" ".join([sys.executable] + sys.argv),
                machine=platform.processor() or platform.machine(), cpu=ab._C.cpu_features()["brand"].strip(),
                threads=torch.get_num_threads(), torch=torch.__version__, attn_backends=ab.__version__,
                shape=dict(B=B, H=H, S=S, D=D), dtype=args.dtype, backend=args.backend, decode=args.decode,
                results=[{("pass" if k == "pass_" else k): v for k, v in r.items()} for r in rows],
            ), f, indent=2)
    return rows


if __name__ == "__main__":
    main()
