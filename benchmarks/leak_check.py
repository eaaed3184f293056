"""Long leak run: a million small calls of each kind, RSS and live tensors checked along the way.

    python benchmarks/leak_check.py                       # 1,000,000 calls of each kind (~25 min here)
    python benchmarks/leak_check.py --calls 20000 --kinds forward planner

Each kind (attn_backends._testing.leak_workloads: forward, forward_backward, masked_dropout,
varlen, planner, explain, patched_sdpa, errors) runs ``--warmup`` calls, then ``--calls`` calls
with ``--checkpoints`` RSS readings (after gc and malloc_trim).  A leak of even 8 bytes a call
shows as 8 MB over a million calls; the table reports the growth per kind and per call.  The
tests (tests/test_reliability.py) run the same workloads for 3000 calls each.
"""
import argparse
import datetime
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attn_backends as ab  # noqa: E402
from attn_backends._testing import leak_check, leak_workloads  # noqa: E402


def main(argv=None) -> int:
    kinds = list(leak_workloads())
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=1_000_000, help="calls per kind (default 1,000,000)")
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--checkpoints", type=int, default=10, help="RSS readings per kind")
    ap.add_argument("--kinds", nargs="+", choices=kinds, default=kinds)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "leak.json"))
    ap.add_argument("--max-growth-mib", type=float, default=4.0,
                    help="exit 1 if any kind's RSS grows by more than this (default 4 MiB)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)  # small calls; one thread keeps the timing steady
    rows = []
    print(f"{'kind':<16}{'calls':>10}{'us/call':>9}{'RSS start MiB':>15}{'growth KiB':>12}{'B/call':>8}{'tensors +':>10}")
    for kind in args.kinds:
        r = leak_check(kind, args.calls, warmup=args.warmup, checkpoints=args.checkpoints)
        rows.append(r)
        print(f"{kind:<16}{r['calls']:>10}{r['seconds'] / r['calls'] * 1e6:>9.1f}{r['rss'][0] / 2**20:>15.1f}"
              f"{r['rss_growth'] / 1024:>12.1f}{r['rss_growth'] / r['calls']:>8.3f}{r['tensor_growth']:>10}",
              flush=True)
    meta = dict(date=datetime.date.today().isoformat(), machine=platform.machine(), python=platform.python_version(),
                torch=torch.__version__, attn_backends=ab.__version__, cpus=os.cpu_count(), calls=args.calls,
                command="python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    print(f"wrote {args.out}")
    worst = max(r["rss_growth"] for r in rows)
    bad = worst > args.max_growth_mib * 2**20 or any(r["tensor_growth"] for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
