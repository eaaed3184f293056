"""A quick side-by-side run of the backends on this machine: each available backend on one
moderate shape, checked against the float64 reference and timed next to torch SDPA.

    python benchmarks/bench_quick.py

This is the "main job" of README.md: a smoke test of the install that also shows relative speed.
Full benchmarks: bench_overhead.py (per-call cost), and the per-device ones as they land.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attn_backends as ab
from attn_backends import _eager
from attn_backends._testing import max_err, reference_attention


def median_us(fn, rounds=7):
    t = benchmark.Timer("fn()", globals={"fn": fn})
    t.timeit(1)
    return statistics.median(t.timeit(3).median for _ in range(rounds)) * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description="quick side-by-side run of the backends")
    ap.add_argument("--shape", default="2,8,256,64", help="B,H,S,D")
    args = ap.parse_args(argv)
    B, H, S, D = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    ref, _ = reference_attention(q, k, v, causal=True)
    scale = D ** -0.5
    runs = {
        "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "ab auto": lambda: ab.attention(q, k, v, causal=True),
        "ab math": lambda: ab.attention(q, k, v, causal=True, backend="math"),
        "ab eager (aten composite)": lambda: _eager.attention(q, k, v, None, 1, scale, -1, -1, 0.0, 0.0)[0],
    }
    base = None
    print(f"causal attention, B={B} H={H} S={S} D={D} float32, {torch.get_num_threads()} threads")
    print(f"{'backend':<28}{'max err vs fp64':>16}{'median ms':>12}{'vs torch':>10}")
    for name, fn in runs.items():
        err = max_err(fn(), ref)
        t = median_us(fn) / 1e3
        base = base or t
        print(f"{name:<28}{err:>16.2e}{t:>12.3f}{t / base:>9.2f}x")


if __name__ == "__main__":
    main()
