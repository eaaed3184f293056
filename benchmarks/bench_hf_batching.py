"""HF transformers' continuous batching (`model.generate_batch`) on our functions against HF's own paged
sdpa, end to end, in one run.

A random-weight Llama (nothing downloaded; --layers, --hidden, GQA 8/2 heads of 64) generates
--new tokens greedily for --requests prompts of 200-600 tokens, in rounds that alternate:

  - "sdpa": attn_implementation="sdpa", transformers' paged path through torch's SDPA;
  - "ours": attn_implementation="attn_backends_flash_attention_2" (ab.register_transformers()):
    transformers' flash path on attn_backends.flash_attn (on the CPU every prefill and decode step
    through flash_attn_varlen_func; on CUDA the decode fast path through flash_attn_with_kvcache).

It prints the median wall time of each, the time spent inside the attention calls (torch's SDPA,
or our flash functions), and whether both produced the same tokens (float32: they should; in
bfloat16 rounding may move a token of a random model).

    python benchmarks/bench_hf_batching.py --dtype float32 --json benchmarks/results/hf_batching_f32.json
    python benchmarks/bench_hf_batching.py --device cuda --dtype bfloat16
"""

import argparse
import inspect
import json
import logging
import platform
import statistics
import time

import torch

import attn_backends as ab
from attn_backends import _transformers
from attn_backends import flash_attn as fa


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()

    import transformers
    from attn_backends._testing import continuous_batching_config

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    transformers.logging.set_verbosity_error()
    ab.register_transformers()
    torch.manual_seed(0)
    heads = args.hidden // 64
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=heads,
                                   num_key_value_heads=max(1, heads // 4), max_position_embeddings=4096)
    model = transformers.LlamaForCausalLM(cfg).eval().to(device=args.device, dtype=getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(200, 600, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in lens]
    gen_cfg = transformers.GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)

    inside = [0.0]

    def timed(f):
        def call(*a, **kw):
            if args.device != "cpu":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = f(*a, **kw)
            if args.device != "cpu":
                torch.cuda.synchronize()
            inside[0] += time.perf_counter() - t
            return out

        try:  # transformers reads our functions' signatures
            call.__signature__ = inspect.signature(f)
        except ValueError:  # a builtin (torch's SDPA)
            pass
        return call

    for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
        setattr(fa, name, timed(getattr(fa, name)))
    torch.nn.functional.scaled_dot_product_attention = timed(torch.nn.functional.scaled_dot_product_attention)

    def run(impl):
        model.set_attn_implementation(impl)
        cb = continuous_batching_config(16, num_blocks=1024, max_batch_tokens=1024,
                                        auto_switch_to_flash=False, use_cuda_graph=False)
        inside[0] = 0.0
        t = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen_cfg, continuous_batching_config=cb)
        wall = time.perf_counter() - t
        return wall, inside[0], {k: r.generated_tokens for k, r in out.items()}

    names = {"sdpa": "sdpa", "ours": _transformers.FLASH_API}
    res = {k: {"wall": [], "attention": []} for k in names}
    tokens = {}
    for r in range(args.rounds):
        for key in (names if r % 2 == 0 else list(names)[::-1]):
            wall, att, toks = run(names[key])
            res[key]["wall"].append(wall)
            res[key]["attention"].append(att)
            tokens[key] = toks
    same = tokens["sdpa"] == tokens["ours"]
    cpu = ab._C.cpu_features()["brand"].strip() or platform.processor() or platform.machine()
    print(f"{args.device} ({cpu}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {args.dtype}")
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {heads}/{max(1, heads // 4)} heads of 64; "
          f"{args.requests} requests of {min(lens)}-{max(lens)} tokens, {args.new} new each; "
          f"medians of {args.rounds} rounds")
    print("| path | wall s | attention s | rest s |")
    print("|---|---|---|---|")
    med = {}
    for key in names:
        w, a = statistics.median(res[key]["wall"]), statistics.median(res[key]["attention"])
        med[key] = (w, a)
        print(f"| {key} | {w:.2f} | {a:.2f} | {w - a:.2f} |")
    print(f"sdpa / ours: wall {med['sdpa'][0] / med['ours'][0]:.2f}, attention "
          f"{med['sdpa'][1] / med['ours'][1]:.2f}; same tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "rounds": res, "same_tokens": same,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)


if __name__ == "__main__":
    main()
