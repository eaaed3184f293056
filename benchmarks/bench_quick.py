"""A quick side-by-side run of the backends on this machine: each backend on one moderate causal
shape, in float32 and in bfloat16 (the dtype models train in), and one decode step (one query
token against a KV cache 16x the shape's length, dense and paged, bfloat16), checked against the
float64 reference and timed next to torch SDPA.  The header names the CPU, the ISA features the kernels
care about, the kernel path in use and torch's thread count, so the numbers can be read against
the machine that produced them.

    python benchmarks/bench_quick.py                                # ~15 s on 2 cores
    python benchmarks/bench_quick.py --shape 1,2,40,16 --rounds 1   # a smoke run (the tests use it)

This is the "main job" of README.md: a smoke test of the install that also shows relative speed.
The "rule" column applies the project's correctness rule (docs/semantics.md): within twice the
error of plain torch ops in the same dtype, plus a floor; the exit status is 1 if a row breaks it.
Full benchmarks: bench_overhead.py (per-call cost), and the per-device ones as they land.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attn_backends as ab
from attn_backends import _eager
from attn_backends._testing import FLOORS, max_err, reference_attention

# the x86 features that decide which kernels run and how fast; AMX keys are printed when the
# build's feature detection reports them
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16")

# (label, dtype): the prefill/training-shaped calls; run_decode adds the decode-shaped one
CASES = (("float32", torch.float32), ("bfloat16", torch.bfloat16))


def shape_arg(text: str) -> tuple:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected four positive integers B,H,S,D, got {text!r}")
    return dims


def rounds_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def machine_header() -> list:
    feats = ab._C.cpu_features()
    cpu = feats.get("brand", "").strip() or platform.processor() or platform.machine()
    vendor = feats.get("vendor", "")
    isa = " ".join(f for f in ISA_FLAGS if feats.get(f)) or "none of " + ", ".join(ISA_FLAGS)
    amx = [k for k in ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16") if feats.get(k)]
    amx_text = feats.get("amx_state", "not detected by this build") + (f" ({' '.join(amx)})" if amx else "")
    return [
        f"attn_backends {ab.__version__} quick side-by-side run, torch {torch.__version__}",
        f"cpu: {cpu}" + (f" ({vendor})" if vendor and vendor not in cpu else "")
        + f", {torch.get_num_threads()} torch threads",
        f"isa: {isa}; AMX: {amx_text}; kernel path {ab._C.cpu_isa()}",
    ]


def medians_us(fns: dict, rounds: int) -> dict:
    """Median microseconds per call of each fn (name -> fn), timed in interleaved rounds: each round times every
    fn in turn (torch's Timer, three runs of a few calls), so drift over the run falls on all of them alike."""
    timers = {n: benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())  # its default: 1
              for n, fn in fns.items()}
    for t in timers.values():
        t.timeit(1)
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, t in timers.items():
            times[n].append(t.timeit(3).median)
    return {n: statistics.median(x) * 1e6 for n, x in times.items()}


def run_case(label: str, dtype: torch.dtype, B: int, H: int, S: int, D: int, rounds: int) -> bool:
    """Prints one table; False if one of our backends breaks the correctness rule."""
    q, k, v = (torch.randn(B, H, S, D).to(dtype) for _ in range(3))
    ref, _ = reference_attention(q, k, v, causal=True)
    same, _ = reference_attention(q, k, v, causal=True, dtype=dtype)
    bound = 2 * max_err(same, ref) + FLOORS[dtype]
    plan = ab.explain(q, k, v, causal=True)
    scale = D ** -0.5
    same_ = lambda o: o
    runs = {
        "torch sdpa": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), same_),
        f"ab auto ({plan.chosen}, {plan.path})": (lambda: ab.attention(q, k, v, causal=True), same_),
        "ab math": (lambda: ab.attention(q, k, v, causal=True, backend="math"), same_),
        "ab eager (aten composite)": (lambda: _eager.attention(q, k, v, None, 1, scale, -1, -1, 0.0, 0.0)[0], same_),
    }
    return _table(f"causal attention, B={B} H={H} S={S} D={D} {label}", runs, ref, bound, rounds)


def _table(title: str, runs: dict, ref, bound: float, rounds: int) -> bool:
    print(f"\n{title}")
    print(f"{'backend':<34}{'max err vs fp64':>16}{'rule':>6}{'median ms':>12}{'vs torch':>10}")
    ok = True
    errs = {name: max_err(view(fn()), ref) for name, (fn, view) in runs.items()}
    times = medians_us({name: fn for name, (fn, _) in runs.items()}, rounds)
    base = times["torch sdpa"]
    for name, err in errs.items():
        verdict = "-" if name == "torch sdpa" else ("ok" if err <= bound else "FAIL")
        ok = ok and verdict != "FAIL"
        t = times[name]
        print(f"{name:<34}{err:>16.2e}{verdict:>6}{t / 1e3:>12.3f}{t / base:>9.2f}x")
    return ok


def run_decode(B: int, H: int, S: int, D: int, rounds: int, dtype=torch.bfloat16) -> bool:
    """One decode step: q (B, 1, H, D) against a cache of 16 S tokens with H / 4 KV heads (GQA), through
    ab.attention_with_kvcache on a dense cache and on the same cache paged in shuffled blocks of 16;
    torch SDPA on the dense equivalent (contiguous K, V, enable_gqa).  False if ours breaks the rule."""
    Hkv = max(1, H // 4)
    while H % Hkv:
        Hkv -= 1
    Sk, blk = 16 * S, 16
    q = torch.randn(B, 1, H, D).to(dtype)
    k_cache, v_cache = (torch.randn(B, Sk, Hkv, D).to(dtype) for _ in range(2))
    qs, ks, vs = q.transpose(1, 2), k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
    ref, _ = reference_attention(qs, ks, vs)
    same, _ = reference_attention(qs, ks, vs, dtype=dtype)
    bound = 2 * max_err(same, ref) + FLOORS[dtype]
    nb = Sk // blk
    perm = torch.randperm(B * nb)
    k_pages = torch.empty(B * nb, blk, Hkv, D, dtype=dtype)
    v_pages = torch.empty_like(k_pages)
    k_pages[perm] = k_cache.reshape(B * nb, blk, Hkv, D)
    v_pages[perm] = v_cache.reshape(B * nb, blk, Hkv, D)
    table = perm.view(B, nb).to(torch.int32)
    as_ref = lambda out: out.transpose(1, 2)  # (B, 1, H, D) -> (B, H, 1, D)
    runs = {
        "torch sdpa": (lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=Hkv != H), lambda o: o),
        "ab attention_with_kvcache": (lambda: ab.attention_with_kvcache(q, k_cache, v_cache), as_ref),
        f"ab ... paged (blocks of {blk})": (lambda: ab.attention_with_kvcache(q, k_pages, v_pages, block_table=table),
                                           as_ref),
    }
    with torch.inference_mode():
        return _table(f"decode step, B={B} Hq={H} Hkv={Hkv} cache {Sk} D={D} {str(dtype)[6:]}", runs, ref, bound,
                      rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="quick side-by-side run of the backends on this machine")
    ap.add_argument("--shape", type=shape_arg, default=(2, 8, 256, 64), help="B,H,S,D (default 2,8,256,64)")
    ap.add_argument("--rounds", type=rounds_arg, default=7, metavar="N",
                    help="timing rounds per backend; the median is shown (default 7)")
    args = ap.parse_args(argv)
    print("\n".join(machine_header()))
    torch.manual_seed(0)
    ok = True
    for label, dtype in CASES:
        ok = run_case(label, dtype, *args.shape, args.rounds) and ok
    ok = run_decode(*args.shape, args.rounds) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
