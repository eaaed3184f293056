"""Ring attention on W ranks against one process, side by side, and a model of its scaling.

    python benchmarks/bench_context_parallel.py                       # 2 ranks, S=8192, causal, 3 rounds
    python benchmarks/bench_context_parallel.py --seq 4096 --rounds 1 --json out.json
    python benchmarks/bench_context_parallel.py --model-from out.json # the scaling model only

Spawns W processes (gloo on CPU, one thread each) and, round by round, interleaves:

    one      ab.attention on the whole sequence in one process with W threads (the others wait)
    ring     abd.ring_attention on W shards (zigzag), forward + backward
    compute  the same ring schedule with its transfers left out (every block's kernels, no send/recv)
    comm     the same ring schedule with its kernels left out (every send/recv, no compute)

and prints medians, the ratio one / ring, the peak memory each call adds per rank (Linux's VmHWM,
reset before each call), and the share of the communication hidden behind compute:
hidden = (compute + comm - ring) / comm.  From the measured compute rate (FLOP/s of the block
kernels) and link bandwidth (bytes/s of the transfers) it then models the ring at 8 and 64 ranks;
``--gpu-tflops`` and ``--link-gbs`` put GPU figures into the same model (docs/distributed.md).
FLOPs: 4 B H S^2 D for the forward, halved when causal, the backward 2.5x (DESIGN.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time

import torch


def _rss_reset() -> int:
    """Hands freed heap pages back, resets the peak resident set size (Linux >= 4.0) and returns the
    current one, in bytes.  With MALLOC_MMAP_THRESHOLD_ fixed (run() sets it for the workers) every
    large tensor is its own mapping, so the peak is what the call held at once, not what earlier calls
    left in malloc's free lists."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def _status(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _measure(fn):
    """(seconds, peak bytes the call added to this process)."""
    base = _rss_reset()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return dt, max(0, _status("VmHWM") - base)


def _worker(rank, args, out_path):
    import torch.distributed as dist

    import attn_backends as ab
    from attn_backends import _cp, _ring, distributed as abd

    W = args.world
    dist.init_process_group("gloo", init_method=f"file://{out_path}.rdv", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=1800))
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, D = args.batch, args.heads, args.kv_heads, args.seq, args.dim
    q, k, v = (torch.randn(B, h, S, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    gout = torch.randn(B, H, S, D, generator=g).to(dtype)
    ql, kl, vl, gl = (abd.shard(t) for t in (q, k, v, gout))
    if rank:
        del q, k, v, gout  # only rank 0 runs the one-process baseline
    group = _cp.resolve_group(None)
    causal = 0 if args.no_causal else 1
    cfg = _ring.Config(group, "zigzag", "flash", causal, D ** -0.5, -1, -1, 0.0, S, S)

    def one():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = ab.attention(qq, kk, vv, causal=bool(causal), backend="flash")
        torch.autograd.grad(out, (qq, kk, vv), gout)

    def ring(**flags):
        c = dataclasses.replace(cfg, **flags)

        def run():
            qq, kk, vv = (t.detach().requires_grad_() for t in (ql, kl, vl))
            out, _ = _ring.RingFunction.apply(qq, kk, vv, c)
            torch.autograd.grad(out, (qq, kk, vv), gl)

        return run

    kinds = {"ring": ring(), "compute": ring(communicate=False), "comm": ring(compute=False)}
    results = {name: [] for name in ("one", *kinds)}
    ring()()  # warm-up: the first gloo transfers set up connections
    for _ in range(args.rounds):
        dist.barrier()
        if rank == 0:
            torch.set_num_threads(W)
            results["one"].append(_measure(one))
        dist.barrier()
        torch.set_num_threads(1)
        for name, fn in kinds.items():
            dist.barrier()
            results[name].append(_measure(fn))
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _flops(B, H, S, D, causal):
    fwd = 4 * B * H * S * S * D / (2 if causal else 1)
    return fwd * 3.5  # forward + backward (2.5x)


def _ring_bytes(B, Hkv, S, D, W, elt):
    """Bytes one rank sends in a forward + backward: W-1 K/V blocks each way, then W float32 dK/dV
    blocks in the backward."""
    block = 2 * B * Hkv * (S // W) * D
    return block * elt * 2 * (W - 1) + block * 4 * W


def run(args) -> dict:
    import torch.multiprocessing as mp

    # glibc raises its mmap threshold to the size of each freed mapping unless it is set: then large
    # blocks would stay in the heap after free and the peak memory of a call would hide in earlier ones
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res")
        mp.start_processes(_worker, args=(args, out), nprocs=args.world, start_method="spawn")
        per_rank = [json.load(open(f"{out}.{r}")) for r in range(args.world)]
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    summary = {}
    for name in per_rank[0]:
        ranks = [r[name] for r in per_rank if r[name]]
        summary[name] = dict(seconds=max(med(r, 0) for r in ranks),  # the slowest rank sets the pace
                             peak_mib=max(med(r, 1) for r in ranks) / 2**20)
    t = {k: v["seconds"] for k, v in summary.items()}
    hidden = (t["compute"] + t["comm"] - t["ring"]) / t["comm"] if t["comm"] > 0 else 1.0
    elt = torch.finfo(getattr(torch, args.dtype)).bits // 8
    flops = _flops(args.batch, args.heads, args.seq, args.dim, not args.no_causal)
    sent = _ring_bytes(args.batch, args.kv_heads, args.seq, args.dim, args.world, elt)
    return dict(args=vars(args), date=datetime.date.today().isoformat(), summary=summary,
                ratio_one_over_ring=t["one"] / t["ring"], hidden=max(0.0, min(1.0, hidden)),
                flops=flops, rank_flops_per_s=flops / args.world / t["compute"],
                link_bytes_per_s=sent / t["comm"], bytes_sent_per_rank=sent)


def model(res: dict, worlds=(8, 64), seqs=(32768, 131072, 1048576), gpu_tflops=None, link_gbs=None,
          latency_us=0.0):
    """The ring's step time at W ranks: each of the W steps computes one block pair per rank while the
    next K/V block (the backward: K/V and the float32 dK/dV) travels; a step takes max(compute, comm),
    comm = latency + bytes / bandwidth (the forward's and the backward's transfer: two latencies).
    link_gbs: {W: GB/s of the slowest link of a ring of W} (the steps are in lockstep).
    Returns rows (W, S, S_local, compute per step, comm per step, hidden, speedup over one rank)."""
    a = res["args"]
    F = gpu_tflops * 1e12 if gpu_tflops else res["rank_flops_per_s"]
    elt = torch.finfo(getattr(torch, a["dtype"])).bits // 8 if not gpu_tflops else 2
    B, H, Hkv, D, causal = a["batch"], a["heads"], a["kv_heads"], a["dim"], not a["no_causal"]
    rows = []
    for W in worlds:
        BW = link_gbs[W] * 1e9 if link_gbs else res["link_bytes_per_s"]
        for S in seqs:
            Sl = S // W
            step_flops = _flops(B, H, S, D, causal) / W / W
            step_bytes = 2 * B * Hkv * Sl * D * (2 * elt + 4)  # K/V forward and backward, dK/dV float32
            tc, tm = step_flops / F, step_bytes / BW + 2 * latency_us * 1e-6
            total = W * max(tc, tm)
            one = _flops(B, H, S, D, causal) / F
            rows.append(dict(W=W, S=S, S_local=Sl, compute_ms=tc * 1e3, comm_ms=tm * 1e3,
                             hidden=min(1.0, tc / tm), speedup=one / total, efficiency=one / total / W,
                             min_S_local=int(Sl * tm / tc) + 1 if tm > tc else None))
    return rows


def _print_model(rows, title):
    print(f"\n{title}")
    print(f"{'W':>4} {'S':>8} {'S/W':>7} {'compute/step ms':>16} {'comm/step ms':>13} {'hidden':>7} "
          f"{'speedup':>8} {'efficiency':>10}")
    for r in rows:
        print(f"{r['W']:>4} {r['S']:>8} {r['S_local']:>7} {r['compute_ms']:>16.3f} {r['comm_ms']:>13.3f} "
              f"{100 * r['hidden']:>6.0f}% {r['speedup']:>8.1f} {100 * r['efficiency']:>9.0f}%")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no_causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the measurements here")
    ap.add_argument("--model-from", dest="model_from", default=None, help="skip the run: model from this JSON")
    ap.add_argument("--gpu-tflops", type=float, default=None,
                    help="model GPUs: attention TFLOP/s per GPU (forward + backward average)")
    ap.add_argument("--latency-us", type=float, default=10.0, help="model GPUs: seconds per transfer, in us")
    ap.add_argument("--link-gbs", default=None,
                    help="model GPUs: W:GB/s of the slowest link per GPU of a ring of W, e.g. 8:450,64:50")
    args = ap.parse_args(argv)
    if args.model_from:
        res = json.load(open(args.model_from))
    else:
        if args.seq % (2 * args.world):
            ap.error(f"--seq must be a multiple of 2 * --world ({2 * args.world})")
        res = run(args)
        s = res["summary"]
        print(f"ring attention, {args.world} ranks x 1 thread vs one process x {args.world} threads; B={args.batch} "
              f"H={args.heads}/{args.kv_heads} S={args.seq} D={args.dim} {args.dtype} "
              f"{'non-causal' if args.no_causal else 'causal'}, forward+backward, median of {args.rounds}")
        print(f"{'':>9} {'seconds':>9} {'peak MiB/rank':>14}")
        for name in ("one", "ring", "compute", "comm"):
            print(f"{name:>9} {s[name]['seconds']:>9.3f} {s[name]['peak_mib']:>14.1f}")
        print(f"one / ring = {res['ratio_one_over_ring']:.2f}; communication hidden: {100 * res['hidden']:.0f}%; "
              f"per rank {res['rank_flops_per_s'] / 1e9:.1f} GFLOP/s, link {res['link_bytes_per_s'] / 1e9:.2f} GB/s "
              f"({res['bytes_sent_per_rank'] / 2**20:.1f} MiB sent per rank)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    _print_model(model(res), "model from these measured figures (CPU ranks, this link):")
    if args.gpu_tflops and args.link_gbs:
        links = {int(w): float(b) for w, b in (p.split(":") for p in args.link_gbs.split(","))}
        _print_model(model(res, worlds=tuple(links), gpu_tflops=args.gpu_tflops, link_gbs=links,
                           latency_us=args.latency_us),
                     f"model for GPUs at {args.gpu_tflops:g} TFLOP/s, links {args.link_gbs} GB/s, "
                     f"{args.latency_us:g} us a transfer (bf16):")


if __name__ == "__main__":
    main()
