"""Smallest useful program: attention with GQA, a causal mask and a padding mask, forward and
backward, on whatever device is available.

    python examples/quickstart.py [--backend auto]
"""

import argparse

import torch

import attn_backends as ab

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="auto", help="any accepted name, e.g. flash_attention_2, math, eager")
args = ap.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
B, Hq, Hkv, S, D = 2, 8, 2, 128, 64
x = torch.randn(B, S, Hq * D, device=device)
proj_q = torch.nn.Linear(Hq * D, Hq * D, device=device)
proj_kv = torch.nn.Linear(Hq * D, 2 * Hkv * D, device=device)

q = proj_q(x).view(B, S, Hq, D).transpose(1, 2)          # (B, Hq, S, D) view, no copy
k, v = proj_kv(x).view(B, S, 2, Hkv, D).unbind(2)
k, v = k.transpose(1, 2), v.transpose(1, 2)               # (B, Hkv, S, D)
lengths = torch.tensor([S, S - 37], device=device)
padding = torch.arange(S, device=device)[None, :] < lengths[:, None]   # (B, S) True = real token

out = ab.attention(q, k, v, backend=args.backend, causal=True, attn_mask=padding[:, None, None, :])
y = out.transpose(1, 2).reshape(B, S, Hq * D)             # free: out is stored (B, S, H, D)
y.square().mean().backward()
print(f"backend={args.backend!r} device={device} out={tuple(out.shape)} "
      f"grad norm={proj_q.weight.grad.norm():.4f}")
