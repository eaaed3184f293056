"""CUDA benchmark: our flash and flash_varlen vs torch SDPA's flash, cuDNN and efficient backends,
side by side in one run: the forward, the backward, or both.

bf16 and fp16, D in {64, 128, 256}, causal and not, S from 512 to 16k with B*S = 16k tokens and a
hidden size of 2048 (H = 2048 / D).  Each round times every candidate once, in turn (CUDA events,
after warm-up), so clock drift hits all alike; the table shows the median over rounds as TFLOP/s
(forward 4 B H S^2 D, half with causal; backward 2.5x that; forward + backward 3.5x) and ratio =
ours / torch's flash (> 1: ours is faster).  --mode bwd times the backward alone (autograd.grad on
a kept graph, retain_graph=True) and adds our deterministic backward; --mode fwdbwd a whole training
step of the attention.  flash_varlen runs the same tokens packed as B sequences of S (its target:
within 5% of dense).  A candidate torch cannot run on this device/shape is shown as "-" with the
reason in the JSON.

    python benchmarks/bench_cuda.py --json benchmarks/results/cuda.json --plot docs/bench_cuda.png
    python benchmarks/bench_cuda.py --mode bwd --json benchmarks/results/cuda_bwd.json
    python benchmarks/bench_cuda.py --mode fwdbwd --json benchmarks/results/cuda_fwdbwd.json
    python benchmarks/bench_cuda.py --quick            # D=128, S in {2048, 8192}, bf16 only
    python benchmarks/bench_cuda.py --sage             # adds our sage to the grid above
    python benchmarks/bench_cuda.py --sage-vs-flash --json benchmarks/results/cuda_sage.json
                                                       # sage's own table (see sage_vs_flash)

Needs a CUDA GPU (sm_80+); exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

os.environ.setdefault("ATTN_BACKENDS_CUDA_FLASH", "1")  # our CUDA flash is opt-in until verified
os.environ.setdefault("ATTN_BACKENDS_CUDA_SAGE", "1")  # and so is our CUDA sage

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attn_backends as ab  # noqa: E402

TOKENS = 16384
HIDDEN = 2048


MODES = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}  # FLOPs relative to the forward (DESIGN.md section 6)


def flops(B, H, S, D, causal, mode="fwd"):
    return 4.0 * B * H * S * S * D / (2 if causal else 1) * MODES[mode]


def with_mode(fwd, inputs, mode):
    """The callable to time for `mode`, from a forward callable and the tensors it differentiates."""
    if mode == "fwd":
        return fwd
    out = fwd()
    g = torch.randn_like(out)
    if mode == "bwd":  # the backward alone: the graph is kept and walked again on every call
        return lambda: torch.autograd.grad(out, inputs, g, retain_graph=True)
    return lambda: torch.autograd.grad(fwd(), inputs, g)


def candidates(q, k, v, causal, with_sage, mode="fwd"):
    """name -> (zero-argument callable running one forward, the tensors its backward differentiates)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, S, D = q.shape
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    pq, pk, pv = (t.transpose(1, 2).reshape(B * S, H, D) for t in (q, k, v))

    def torch_backend(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    dense, packed = (q, k, v), (pq, pk, pv)
    c = {
        "ours flash": (lambda: ab.attention(q, k, v, causal=causal, backend="flash", strict=True), dense),
        "ours flash_varlen": (lambda: ab.attention_varlen(pq, pk, pv, cu, cu, S, S, causal=causal,
                                                          backend="flash_varlen", strict=True), packed),
        "torch flash": (torch_backend(SDPBackend.FLASH_ATTENTION), dense),
        "torch cudnn": (torch_backend(SDPBackend.CUDNN_ATTENTION), dense),
        "torch efficient": (torch_backend(SDPBackend.EFFICIENT_ATTENTION), dense),
    }
    if mode != "fwd":
        c["ours flash determ."] = (lambda: ab.attention(q, k, v, causal=causal, backend="flash", strict=True,
                                                        deterministic=True), dense)
    if with_sage and mode == "fwd":  # sage is forward only
        c["ours sage"] = (lambda: ab.attention(q, k, v, causal=causal, backend="sage", strict=True), dense)
    return c


def time_round(fns, reps):
    """One round: each callable `reps` times between two events, in turn; ms per call."""
    out = {}
    for name, fn in fns.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out[name] = start.elapsed_time(end) / reps
    return out


def median_times(fns, rounds):
    """Median ms per call of each candidate over `rounds` interleaved rounds, after a warm-up round
    that also sets each one's rep count (~20 ms per candidate per round)."""
    first = time_round(fns, 3)
    reps = {n: max(1, int(20.0 / max(ms, 1e-3))) for n, ms in first.items()}
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n in fns:
            times[n].append(time_round({n: fns[n]}, reps[n])[n])
    return {n: statistics.median(t) for n, t in times.items()}


def run_case(S, D, dtype, causal, rounds, with_sage, mode="fwd"):
    B, H = TOKENS // S, HIDDEN // D
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g).requires_grad_(mode != "fwd")
               for _ in range(3))
    fns, errors, forwards = {}, {}, {}
    for name, (fwd, inputs) in candidates(q, k, v, causal, with_sage, mode).items():
        try:
            fn = with_mode(fwd, inputs, mode)
            fn()
            torch.cuda.synchronize()
            fns[name], forwards[name] = fn, fwd
        except Exception as e:  # noqa: BLE001 - a backend torch cannot run here is reported, not fatal
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    # accuracy of ours against torch's flash (both bf16/fp16 kernels: a gross error shows): the
    # outputs, and with a backward the gradients too
    diff = None
    if "ours flash" in fns and "torch flash" in fns:
        with torch.no_grad():
            diff = (forwards["ours flash"]().float() - forwards["torch flash"]().float()).abs().max().item()
        if mode != "fwd":
            ga, gb = fns["ours flash"](), fns["torch flash"]()
            diff = max(diff, max((a.float() - b.float()).abs().max().item() for a, b in zip(ga, gb)))
    med = median_times(fns, rounds)
    f = flops(B, H, S, D, causal, mode)
    return dict(mode=mode, B=B, H=H, S=S, D=D, dtype=str(dtype).replace("torch.", ""), causal=causal,
                ms=med, tflops={n: f / (ms * 1e-3) / 1e12 for n, ms in med.items()},
                errors=errors, max_abs_diff_vs_torch_flash=diff)


def table(rows):
    names = ["ours flash", "ours flash determ.", "ours flash_varlen", "torch flash", "torch cudnn",
             "torch efficient", "ours sage"]
    names = [n for n in names if any(n in r["tflops"] or n in r["errors"] for r in rows)]
    head = "| mode | dtype | D | causal | S | B x H | " + " | ".join(names) + " | ours / torch flash |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r['tflops'][n]:.0f}" if n in r["tflops"] else "-" for n in names]
        ratio = (r["tflops"]["ours flash"] / r["tflops"]["torch flash"]
                 if "ours flash" in r["tflops"] and "torch flash" in r["tflops"] else None)
        lines.append(f"| {r['mode']} | {r['dtype']} | {r['D']} | {r['causal']} | {r['S']} | {r['B']}x{r['H']} | "
                     + " | ".join(cells) + f" | {'-' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dtype"], r["D"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.6), squeeze=False)
    for ax, (dt, D, causal) in zip(axes[0], groups):
        sel = sorted((r for r in rows if (r["dtype"], r["D"], r["causal"]) == (dt, D, causal)), key=lambda r: r["S"])
        for name in sorted({n for r in sel for n in r["tflops"]}):
            pts = [(r["S"], r["tflops"][name]) for r in sel if name in r["tflops"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{sel[0]['mode']} {dt} D={D} {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("S (B*S = 16k)")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _meta(argv):
    return dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                capability=torch.cuda.get_device_capability(), torch=torch.__version__,
                cuda=torch.version.cuda, attn_backends=ab.__version__, python=platform.python_version(),
                command="python benchmarks/bench_cuda.py " + " ".join(argv if argv is not None else sys.argv[1:]))


def sage_vs_flash(rounds, S_list=(4096, 8192, 16384)):
    """Our sage forward against our flash forward (the target: sage at least 1.5x flash) and the
    sageattention package when importable: bf16, D = 128, B*S = 16k tokens, H = 16, causal and not,
    interleaved rounds as run_case.  Also the accuracy of each output against torch's flash (cosine
    similarity and relative L1 over the whole output; tests/test_sage_cuda.py has the float64 checks)."""
    try:
        import sageattention
    except ImportError:
        sageattention = None
    D, H, dtype = 128, 16, torch.bfloat16
    rows = []
    for causal in (False, True):
        for S in S_list:
            B = max(1, TOKENS // S)
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
            fns = {
                "ours flash": lambda: ab.attention(q, k, v, causal=causal, backend="flash", strict=True),
                "ours sage": lambda: ab.attention(q, k, v, causal=causal, backend="sage", strict=True),
                "torch flash": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
            }
            if sageattention is not None:
                fns["sageattention"] = lambda: sageattention.sageattn(q, k, v, tensor_layout="HND", is_causal=causal)
            with torch.inference_mode():
                ref = fns["torch flash"]().float()
                acc = {}
                for name in [n for n in fns if n != "torch flash"]:
                    o = fns[name]().float()
                    acc[name] = dict(cos=F.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item(),
                                     rel_l1=((o - ref).abs().sum() / ref.abs().sum()).item())
                med = median_times(fns, rounds)
            f = flops(B, H, S, D, causal)
            r = dict(B=B, H=H, S=S, D=D, dtype="bfloat16", causal=causal, ms=med,
                     tflops={n: f / (ms * 1e-3) / 1e12 for n, ms in med.items()}, accuracy=acc,
                     sage_over_flash=med["ours flash"] / med["ours sage"])
            rows.append(r)
            print(f"causal={causal} S={S}: " + ", ".join(f"{n} {t:.0f}" for n, t in r["tflops"].items())
                  + f" TFLOP/s; sage / flash = {r['sage_over_flash']:.2f}x", flush=True)
    names = ["ours sage", "ours flash", "torch flash", "sageattention"]
    names = [n for n in names if any(n in r["tflops"] for r in rows)]
    head = "| causal | S | B x H | " + " | ".join(names) + " | sage / flash | sage cos, rel L1 |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        a = r["accuracy"]["ours sage"]
        lines.append(f"| {r['causal']} | {r['S']} | {r['B']}x{r['H']} | "
                     + " | ".join(f"{r['tflops'][n]:.0f}" if n in r["tflops"] else "-" for n in names)
                     + f" | {r['sage_over_flash']:.2f} | {a['cos']:.5f}, {a['rel_l1']:.4f} |")
    print("TFLOP/s (4 B H S^2 D, half with causal); target: sage / flash >= 1.5")
    print("\n".join(lines))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sage", action="store_true")
    ap.add_argument("--sage-vs-flash", action="store_true", help="only sage_vs_flash's table (bf16, D=128, S >= 4k)")
    ap.add_argument("--mode", choices=sorted(MODES), default="fwd",
                    help="fwd (default), bwd (the backward alone) or fwdbwd (forward + backward)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device", file=sys.stderr)
        return 2
    if args.sage_vs_flash:
        rows = sage_vs_flash(args.rounds)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(meta=_meta(argv), rows=rows), f, indent=1)
        return 0
    if args.quick:
        grid = [(torch.bfloat16, 128, c, S) for c in (False, True) for S in (2048, 8192)]
    else:
        grid = [(dt, D, c, S) for dt in (torch.bfloat16, torch.float16) for D in (64, 128, 256)
                for c in (False, True) for S in (512, 1024, 2048, 4096, 8192, 16384)]
    rows = []
    for dt, D, causal, S in grid:
        r = run_case(S, D, dt, causal, args.rounds, args.sage, args.mode)
        rows.append(r)
        print(f"{args.mode} {r['dtype']} D={D} causal={causal} S={S}: "
              + ", ".join(f"{n} {t:.0f}" for n, t in r["tflops"].items()) + " TFLOP/s", flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=_meta(argv), rows=rows), f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
