"""What a new user sees first: the example's --help and banner (what was asked, what it resolved
to, what runs)."""

import importlib.util
from pathlib import Path

import pytest
import torch

import attn_backends as ab
from attn_backends import _planner

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "1", "--batch", "2", "--block", "16", "--layers", "1", "--dim", "32", "--heads", "2",
        "--kv_heads", "1", "--log_every", "1"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_example(example, capsys, argv):
    """Runs the example in this process and gives back its output; undoes what apply_args set."""
    before = _planner.default_backend()
    try:
        example.main(argv)
    finally:
        _planner.set_process_default(before)
        ab.unpatch_sdpa()
    return capsys.readouterr().out


def plan_for_tiny_model(backend):
    """The plan for the tiny model's attention call, made independently of the example."""
    x = torch.randn(2, 16, 3 * 16, requires_grad=True)  # (B, T, (H + 2 Hkv) * hd), H=2, Hkv=1, hd=16
    q, k, v = (t.reshape(2, 16, -1, 16).transpose(1, 2) for t in x.split(16, dim=-1))
    return ab.explain(q, k, v, backend=backend, causal=True)


def test_example_help_shows_the_whole_description(example, capsys):
    with pytest.raises(SystemExit) as exit_:
        example.main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(example.__doc__.split()) in out
    assert "--attn_implementation flash_attention_2 --steps 50" in out


def test_banner_shows_the_name_as_typed_its_resolution_and_what_runs(example, capsys):
    out = run_example(example, capsys, TINY + ["--attn_implementation", "flash_attention_2"])
    banner = out.splitlines()[0]
    plan = plan_for_tiny_model("flash")
    assert plan.chosen == "flash"  # a named backend that serves CPU training does not fall back
    assert banner == ("attention: asked for 'flash_attention_2', resolved to 'flash'; the model calls "
                      f"ab.attention; backend used: flash ({plan.path})")


def test_banner_names_the_fallback_and_its_reason(example, capsys):
    out = run_example(example, capsys, TINY + ["--attn_implementation", "SageAttention"])
    banner = out.splitlines()[0]
    plan = plan_for_tiny_model("sage")
    assert plan.chosen != "sage"  # forward only: a training step cannot use it
    assert banner.startswith("attention: asked for 'SageAttention', resolved to 'sage'; the model calls "
                             f"ab.attention; backend used: {plan.chosen} ({plan.path}), as sage cannot serve it (")
    assert plan.reasons["sage"] in banner


def test_banner_says_when_the_flag_does_not_reach_torchs_own_sdpa(example, capsys):
    out = run_example(example, capsys, TINY + ["--attention_call", "sdpa", "--attn_implementation", "math"])
    banner = out.splitlines()[0]
    assert banner.startswith("attention: asked for 'math', resolved to 'math'; the model calls torch's own "
                             "F.scaled_dot_product_attention, which the flag does not reach")
    assert banner.endswith("(--patch_sdpa routes it through attn_backends); backend used: torch SDPA")
    assert torch.nn.functional.scaled_dot_product_attention is ab._providers.ORIGINAL_SDPA
