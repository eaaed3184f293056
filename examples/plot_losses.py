"""Draw loss curves written by train_gpt.py --json on one chart (a moving average, so backends
that compute the same thing are seen to overlap).

    python examples/train_gpt.py --attn_implementation flash --json /tmp/flash.json
    python examples/train_gpt.py --attn_implementation sdpa  --json /tmp/sdpa.json
    python examples/plot_losses.py /tmp/flash.json /tmp/sdpa.json --out docs/loss_curves.png

Needs matplotlib (not a dependency of the library).
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def smooth(xs, n):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", type=int, default=10)
    args = ap.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, path in enumerate(args.logs):
        d = json.load(open(path))
        style = ["-", "--", ":", "-."][i % 4]
        ax.plot(range(1, len(d["loss"]) + 1), smooth(d["loss"], args.window), style, linewidth=1.5,
                label=f"{d['requested']} -> {d['backend']} ({d['seconds']:.0f} s, val {d['val_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({args.window}-step mean)")
    ax.set_title("examples/train_gpt.py, one seed, per backend")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
