"""Train a small character-level GPT on this repository's own documentation, with the attention
backend chosen by a flag, as a training script passes --attn_implementation through.

    python examples/train_gpt.py --attn_implementation flash          # ~half a minute on 2 CPU cores
    python examples/train_gpt.py --attn_implementation flash_attention_2 --steps 50
    python examples/train_gpt.py --attention_call sdpa --patch_sdpa   # model calls F.sdpa, patched
    torchrun --nproc_per_node 2 examples/train_gpt.py --context_parallel 2   # each sequence over 2 ranks
    python examples/train_gpt.py --steps 200 --generate 100          # then decode through a paged KV cache

Prints the backend name as given, the name it resolves to and the backend that actually runs the
model's attention (the planner's choice, with the reason when it falls back), then the loss,
tokens/s and MFU (model FLOPs utilisation: the model's FLOPs per second over this device's measured
float32 FMA peak on CPU, or the bfloat16 dense peak of known GPUs) as it trains.  --json writes the
loss curve (examples/plot_losses.py draws several of them).

--context_parallel W (under torchrun with W processes; gloo on CPU, NCCL on GPUs) splits every
sequence across the W ranks (attn_backends.distributed, zigzag layout): each rank embeds, runs and
scores its rows, the attention runs as ring attention (or --cp_scheme ulysses), and the parameter
gradients are averaged across ranks, so the loss curve is the one process's (docs/distributed.md).

--generate N then writes N characters after a prompt, one token per step through
ab.attention_with_kvcache over a paged KV cache (pages of 16 positions, in shuffled order), and
checks the first step's logits against the model's full forward.  The prompt and the N characters
must fit in --block (the model's learned positions); that is checked before training starts.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import attn_backends as ab
from attn_backends import distributed as abd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# bfloat16 dense tensor-core peaks (FLOP/s) of GPUs this example may meet; others report MFU n/a
GPU_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def load_corpus() -> str:
    """The project's README and docs: a small corpus that ships with the repository."""
    paths = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return "\n\n".join(open(p, encoding="utf-8").read() for p in paths if os.path.exists(p))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, dropout: float, attention_call: str):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.dropout = dropout
        self.attention_call = attention_call

    def heads_of(self, x):
        """q (B, H, T, hd), k and v (B, Hkv, T, hd): the attention call's operands, as views (no copies)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split([self.heads * self.hd, self.kv_heads * self.hd,
                                                self.kv_heads * self.hd], dim=-1)
        return (q.view(B, T, self.heads, self.hd).transpose(1, 2),
                k.view(B, T, self.kv_heads, self.hd).transpose(1, 2),
                v.view(B, T, self.kv_heads, self.hd).transpose(1, 2))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.heads_of(x)
        p = self.dropout if self.training else 0.0
        if self.attention_call == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)
        elif self.attention_call == "ring":  # --context_parallel: x holds this rank's rows of each sequence
            y = abd.ring_attention(q, k, v, causal=True)
        elif self.attention_call == "ulysses":
            y = abd.ulysses_attention(q, k, v, causal=True)
        else:
            y = ab.attention(q, k, v, causal=True, dropout_p=p)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.ln2(x))

    def decode(self, x, cache):
        """x (B, T, d) new positions against the block's paged cache (k_pages, v_pages, block_table,
        lengths): the new keys and values are written into the pages and attended with the rest."""
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split([self.heads * self.hd, self.kv_heads * self.hd,
                                                self.kv_heads * self.hd], dim=-1)
        k_pages, v_pages, table, lengths = cache
        y = ab.attention_with_kvcache(q.view(B, T, self.heads, self.hd), k_pages, v_pages,
                                      k.view(B, T, self.kv_heads, self.hd), v.view(B, T, self.kv_heads, self.hd),
                                      cache_seqlens=lengths, block_table=table, causal=True)
        x = x + self.proj(y.reshape(B, T, -1))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, d: int, heads: int, kv_heads: int, dropout: float,
                 attention_call: str):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads, dropout, attention_call) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():  # GPT-2's initialisation: small weights, so the first loss is ~log(vocab)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None, pos=None):
        # pos: the rows' positions in their sequences (a context-parallel rank holds a shard of them)
        pos = torch.arange(idx.shape[1], device=idx.device) if pos is None else pos
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, n: int, page: int = 16, seed: int = 0) -> tuple[torch.Tensor, float]:
    """prompt (1, T) token ids -> (1, T + n) with n sampled tokens, decoding one token per step through
    a paged KV cache per block, and max |logits - full forward's logits| at the prompt's last position."""
    p = model.tok.weight
    T = prompt.shape[1]
    total = T + n
    if total > model.pos.num_embeddings:
        raise ValueError(f"prompt + generated tokens ({total}) exceed the model's block ({model.pos.num_embeddings})")
    pages = -(-total // page)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(1, pages).to(p.device)  # any order works
    caches = []
    for blk in model.blocks:
        shape = (pages, page, blk.kv_heads, blk.hd)
        caches.append((torch.zeros(shape, dtype=p.dtype, device=p.device),
                       torch.zeros(shape, dtype=p.dtype, device=p.device), table))

    def step(ids, start):
        x = model.tok(ids) + model.pos(torch.arange(start, start + ids.shape[1], device=ids.device))
        lengths = torch.tensor([start], dtype=torch.int32, device=ids.device)
        for blk, (kp, vp, tb) in zip(model.blocks, caches):
            x = blk.decode(x, (kp, vp, tb, lengths))
        return model.head(model.ln(x))[:, -1]

    logits = step(prompt, 0)  # the prompt in one call (chunked prefill), then one token per call
    drift = (logits - model(prompt)[0][:, -1]).abs().max().item()
    out = [prompt]
    for t in range(n):
        nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen)
        out.append(nxt)
        if t + 1 < n:
            logits = step(nxt, T + t)
    return torch.cat(out, 1), drift


def peak_flops(device: torch.device) -> float | None:
    if device.type == "cpu":
        return ab._C.fma_peak(0.2, torch.get_num_threads())
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in GPU_PEAKS.items() if k in name), None)
    return None


class ContextParallel:
    """--context_parallel W: every rank draws the same batch, keeps its zigzag shard of each sequence
    (tokens, targets and positions), and averages the parameter gradients across ranks.  Each rank's
    loss is the mean over its rows, and every rank has as many rows, so the mean of the ranks' losses
    is the whole batch's loss and the mean of their gradients its gradient."""

    def __init__(self, world: int, device: torch.device):
        import torch.distributed as dist

        self.dist = dist
        if not dist.is_initialized():  # torchrun's environment; a test may have made the group already
            if "RANK" not in os.environ:
                raise SystemExit(f"--context_parallel {world}: run under torchrun --nproc_per_node {world}")
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if dist.get_world_size() != world:
            raise SystemExit(f"--context_parallel {world} needs {world} processes "
                             f"(torchrun --nproc_per_node {world}), got {dist.get_world_size()}")
        self.world, self.rank = world, dist.get_rank()

    def loss(self, model, x, y):
        pos = abd.shard(torch.arange(x.shape[1], device=x.device), dim=0)
        return model(abd.shard(x, dim=1), abd.shard(y, dim=1), pos=pos)[1]

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        total = loss.detach().clone()
        self.dist.all_reduce(total)
        return total / self.world

    def average_gradients(self, model) -> None:
        for p in model.parameters():
            if p.grad is not None:
                self.dist.all_reduce(p.grad)
                p.grad /= self.world


def typed_backend(argv) -> str:
    """The backend as the user spelled it: --attn_implementation's own parser keeps only the
    canonical name ('flash_attention_2' -> 'flash'), and the banner shows both."""
    raw = argparse.ArgumentParser(add_help=False)
    raw.add_argument("--attn_implementation", "--attn-implementation")
    raw.add_argument("--use_flash_attention", "--use_flash_attention_2", dest="attn_implementation",
                     action="store_const", const="--use_flash_attention")
    typed = raw.parse_known_args(argv)[0].attn_implementation
    if typed is None:
        return "nothing (the default)"
    return typed if typed.startswith("--") else repr(typed)


def attention_banner(typed: str, backend: str, plan, attention_call: str, patched: bool) -> str:
    """What was asked, what it resolved to, and what runs: the planner's choice for the model's call."""
    if attention_call == "sdpa" and not patched:
        ran = ("the model calls torch's own F.scaled_dot_product_attention, which the flag does not reach "
               "(--patch_sdpa routes it through attn_backends); backend used: torch SDPA")
    else:
        via = "F.scaled_dot_product_attention (patched)" if attention_call == "sdpa" else "ab.attention"
        ran = f"the model calls {via}; backend used: {plan.chosen} ({plan.path})"
        if plan.fell_back:
            ran += f", as {plan.requested} cannot serve it ({plan.reasons.get(plan.requested, 'see ab.explain')})"
    return f"attention: asked for {typed}, resolved to {backend!r}; {ran}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ab.add_argparse_args(ap)
    ap.add_argument("--attention_call", choices=["ab", "sdpa"], default="ab",
                    help="the model calls ab.attention, or torch's F.scaled_dot_product_attention")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (fullgraph)")
    ap.add_argument("--log_every", type=int, default=25)
    ap.add_argument("--json", default=None, help="write the loss curve here")
    ap.add_argument("--context_parallel", type=int, default=1, metavar="W",
                    help="split each sequence across W ranks (run under torchrun --nproc_per_node W)")
    ap.add_argument("--cp_scheme", choices=["ring", "ulysses"], default="ring",
                    help="with --context_parallel: ring attention, or Ulysses (heads divisible by W)")
    ap.add_argument("--generate", type=int, default=0,
                    help="after training, write this many characters through a paged KV cache")
    ap.add_argument("--prompt", default="attention ", help="what --generate starts from")
    args = ap.parse_args(argv)
    if args.generate < 0:
        ap.error(f"--generate takes a number of characters, 0 or more, got {args.generate}")
    if args.context_parallel > 1:
        if args.dropout > 0:
            ap.error("--dropout is not supported with --context_parallel (docs/distributed.md)")
        if args.compile:
            ap.error("--compile is not supported with --context_parallel (the collectives break the graph)")
        if args.attention_call != "ab":
            ap.error("--context_parallel runs the model's attention through attn_backends.distributed")
        if args.generate:
            ap.error("--generate decodes in one process: run it without --context_parallel")
    backend = ab.apply_args(args)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    text = load_corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    if args.generate:  # checked before training, not after it: generate() cannot go past the block
        known = sum(c in chars for c in args.prompt)
        if not known:
            ap.error(f"--prompt {args.prompt!r} has no character of the training text")
        if known + args.generate > args.block:
            ap.error(f"--prompt ({known} characters) + --generate {args.generate} exceed --block {args.block}: "
                     f"generate at most {args.block - known}, or raise --block")
    n_train = int(0.9 * len(data))
    train, val = data[:n_train], data[n_train:]
    gen = torch.Generator().manual_seed(args.seed)

    def batch(split):
        src = train if split == "train" else val
        ix = torch.randint(len(src) - args.block - 1, (args.batch,), generator=gen)
        x = torch.stack([src[i:i + args.block] for i in ix])
        y = torch.stack([src[i + 1:i + args.block + 1] for i in ix])
        return x.to(device), y.to(device)

    model = GPT(len(chars), args.block, args.layers, args.dim, args.heads, args.kv_heads, args.dropout,
                args.attention_call).to(device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    step_fn = torch.compile(model, fullgraph=True) if args.compile else model
    cp = ContextParallel(args.context_parallel, device) if args.context_parallel > 1 else None
    if cp is not None:
        for blk in model.blocks:
            blk.attention_call = args.cp_scheme
    say = print if cp is None or cp.rank == 0 else (lambda *a, **k: None)

    # the plan for the model's own attention call: its operands (views with requires_grad), dtype,
    # device and dropout, as a training step makes them
    plan = ab.explain(*model.blocks[0].heads_of(torch.zeros(args.batch, args.block, args.dim, device=device,
                                                            dtype=dtype)), causal=True, dropout_p=args.dropout)
    used = plan.chosen if args.attention_call == "ab" or args.patch_sdpa else "torch SDPA"
    say(attention_banner(typed_backend(argv), backend, plan, args.attention_call, args.patch_sdpa))
    if cp is not None:
        say(f"context parallel: each sequence split over {cp.world} ranks (zigzag), the model's attention by "
            f"abd.{args.cp_scheme}_attention")
    say(f"model: {n_params / 1e6:.2f}M parameters, {args.layers} layers, d={args.dim}, heads {args.heads}/"
          f"{args.kv_heads}, block {args.block}, batch {args.batch}, {len(text)} characters of text, "
          f"{args.device} {args.dtype}")

    # FLOPs per token (PaLM appendix B): 6N for the weights, 12 L T d for attention (scores and
    # values, forward and backward), halved for causal
    flops_per_token = 6 * n_params + 6 * args.layers * args.block * args.dim
    peak = peak_flops(device)
    if peak and cp is not None:
        peak *= cp.world  # every rank runs on its own share of the machine (torchrun: one thread each)
    curve = []
    tokens = 0
    t0 = time.perf_counter()
    last_t, last_tokens = t0, 0
    for step in range(1, args.steps + 1):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch("train")
        loss = step_fn(x, y)[1] if cp is None else cp.loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cp is not None:
            cp.average_gradients(model)
            loss = cp.mean(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += x.numel()
        curve.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            tps = (tokens - last_tokens) / (now - last_t)
            last_t, last_tokens = now, tokens
            mfu = f"{100 * flops_per_token * tps / peak:.1f}%" if peak else "n/a"
            recent = curve[-args.log_every:]
            say(f"step {step:5d}  loss {sum(recent) / len(recent):.4f} (mean of the last {len(recent)})  "
                  f"lr {lr:.2e}  tokens/s {tps:9.0f}  MFU {mfu}", flush=True)
    model.eval()
    with torch.no_grad():
        val = [batch("val") for _ in range(4)]
        val_loss = sum(float(model(*b)[1] if cp is None else cp.mean(cp.loss(model, *b))) for b in val) / 4
    elapsed = time.perf_counter() - t0
    say(f"done: {args.steps} steps in {elapsed:.1f}s, final train loss {curve[-1]:.4f}, val loss {val_loss:.4f}")
    if args.generate:
        prompt = torch.tensor([[chars.index(c) for c in args.prompt if c in chars]], device=device)
        t = time.perf_counter()
        ids, drift = generate(model, prompt, args.generate, seed=args.seed)
        dt = time.perf_counter() - t
        print(f"generate: {args.generate} tokens in {dt:.2f}s ({args.generate / dt:.0f} tokens/s) through "
              f"ab.attention_with_kvcache, paged; first step vs full forward: max |logits diff| {drift:.2e}")
        print("".join(chars[i] for i in ids[0].tolist()))
    if args.json and (cp is None or cp.rank == 0):
        with open(args.json, "w") as f:
            json.dump(dict(backend=used, requested=args.attn_implementation, steps=args.steps, loss=curve,
                           val_loss=val_loss, seconds=elapsed, args=vars(args)), f)


if __name__ == "__main__":
    main()
