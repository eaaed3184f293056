"""The CPU calls auto may send to torch SDPA (csrc/ab_registry.c, the torch-faster rows): torch SDPA, our
flash (named) and auto side by side on this machine, with the backend auto chose.  It says whether a row's
rule holds here: where our flash beats torch and auto chose torch, the row costs this CPU speed.

    python benchmarks/bench_torch_rows.py --json benchmarks/results/torch_rows.json

Each call is timed in rounds that alternate the three (the best of --reps calls per round, the median over
rounds); B=2 H=8, forward or forward+backward as the row says.  ratio = torch ms / ours ms (> 1: ours faster).
"""

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import attn_backends as ab

# (dtype, D, S, backward, mask): the rows' calls (float32 forward at D >= 128; bfloat16 forward+backward at
# D >= 128, with and without a mask; bfloat16 forward with a float mask)
ROWS = [(torch.float32, 128, 1024, False, None), (torch.float32, 128, 2048, False, None),
        (torch.float32, 256, 1024, False, None), (torch.bfloat16, 128, 1024, True, None),
        (torch.bfloat16, 128, 2048, True, None), (torch.bfloat16, 256, 1024, True, None),
        (torch.bfloat16, 128, 1024, False, "float"), (torch.bfloat16, 128, 2048, False, "float"),
        (torch.bfloat16, 128, 1024, True, "bool")]


def best_of(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--grid", action="store_true",
                    help="instead of the rows' calls, every (dtype, D, pass, mask) at --grid-seqlens: float32, "
                         "bfloat16, float16; D 64, 128; fwd, fwd+bwd; no mask, bool, float (finds a class the "
                         "rows miss)")
    ap.add_argument("--grid-seqlens", default="1024")
    ap.add_argument("--grid-dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--grid-dims", default="64,128")
    ap.add_argument("--grid-passes", default="fwd,fwd+bwd")
    ap.add_argument("--grid-masks", default="none,bool,float")
    args = ap.parse_args()
    rows = ROWS
    if args.grid:
        rows = [(getattr(torch, dt), D, S, grad == "fwd+bwd", None if mask == "none" else mask)
                for dt in args.grid_dtypes.split(",") for D in map(int, args.grid_dims.split(","))
                for S in map(int, args.grid_seqlens.split(",")) for grad in args.grid_passes.split(",")
                for mask in args.grid_masks.split(",")]
    feats = ab._C.cpu_features()
    print(f"{feats['brand'].strip()} (family {feats['family']} model {feats['model']}), {torch.get_num_threads()} "
          f"threads, CPU path {ab._C.cpu_isa()}, torch {torch.__version__}")
    print(f"{'dtype':9} {'D':>4} {'S':>5} {'pass':8} {'mask':5} {'torch':>8} {'flash':>8} {'auto':>8} "
          f"{'torch/flash':>11} {'torch/auto':>10}  auto chose")
    g = torch.Generator().manual_seed(0)
    results = []
    for dtype, D, S, grad, mask in rows:
        q, k, v = (torch.randn(2, 8, S, D, generator=g).to(dtype).requires_grad_(grad) for _ in range(3))
        m = (torch.randn(S, S, generator=g).to(dtype) if mask == "float"
             else torch.rand(S, S, generator=g) > 0.2 if mask == "bool" else None)
        gout = torch.randn(2, 8, S, D, generator=g).to(dtype)

        def call(fn):
            def go():
                out = fn()
                if grad:
                    torch.autograd.grad(out, (q, k, v), gout)
            return go

        cands = {"torch": call(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
                 "flash": call(lambda: ab.attention(q, k, v, attn_mask=m, backend="flash")),
                 "auto": call(lambda: ab.attention(q, k, v, attn_mask=m))}
        for fn in cands.values():
            fn()  # warm-up
        per = {n: [] for n in cands}
        for _ in range(args.rounds):
            for n, fn in cands.items():
                per[n].append(best_of(fn, args.reps))
        med = {n: statistics.median(t) for n, t in per.items()}
        chose = ab.explain(q, k, v, attn_mask=m).chosen
        row = dict(dtype=str(dtype)[6:], D=D, S=S, backward=grad, mask=mask, **{f"{n}_ms": t for n, t in med.items()},
                   torch_over_flash=med["torch"] / med["flash"], torch_over_auto=med["torch"] / med["auto"],
                   auto_chose=chose)
        results.append(row)
        print(f"{row['dtype']:9} {D:>4} {S:>5} {'fwd+bwd' if grad else 'fwd':8} {str(mask):5} {med['torch']:8.1f} "
              f"{med['flash']:8.1f} {med['auto']:8.1f} {row['torch_over_flash']:11.2f} {row['torch_over_auto']:10.2f}"
              f"  {chose}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=platform.platform(), cpu=feats["brand"].strip(), family=feats["family"],
                           model=feats["model"], cpu_path=ab._C.cpu_isa(), threads=torch.get_num_threads(),
                           torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           results=results), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
