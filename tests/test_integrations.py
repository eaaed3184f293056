"""Integrations: ab.sdpa is F.scaled_dot_product_attention (results and errors), patching routes
nn.MultiheadAttention and nn.TransformerEncoderLayer through our backends and unpatching restores
torch's object, the argparse flags round-trip every name and fit parsers that already have some of
them, torch.compile traces both routes, and the training example runs.  HF transformers:
tests/test_hf.py; diffusers: tests/test_diffusers.py."""

import argparse
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import attn_backends as ab
from attn_backends import _names
from attn_backends._providers import ORIGINAL_SDPA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def spy(monkeypatch):
    """Counts calls that reach our dispatcher (the Python path, or the fast path when it serves)."""
    calls = []
    real, fast = ab._dispatch.attention, ab._fast_attention

    def counting(*args, **kwargs):
        calls.append(args[3])  # the requested backend
        return real(*args, **kwargs)

    def counting_fast(*args):
        res = fast(*args)
        if res is not None:
            calls.append(args[3])
        return res

    monkeypatch.setattr(ab._dispatch, "attention", counting)
    monkeypatch.setattr(ab, "_fast_attention", counting_fast)
    return calls


@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    ab.unpatch_sdpa()
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


# ---- ab.sdpa == F.sdpa ------------------------------------------------------------------------

def _grad_parity(fn_a, fn_b, inputs, rtol=1e-5, atol=1e-5):
    a_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    b_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out_a, out_b = fn_a(*a_in), fn_b(*b_in)
    torch.testing.assert_close(out_a, out_b, rtol=rtol, atol=atol)
    g = torch.randn_like(out_a)
    for x, y in zip(torch.autograd.grad(out_a, [t for t in a_in if t.requires_grad], g),
                    torch.autograd.grad(out_b, [t for t in b_in if t.requires_grad], g)):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


SDPA_CASES = {
    "4d": dict(shapes=((2, 4, 9, 16), (2, 4, 11, 16), (2, 4, 11, 8))),
    "4d causal": dict(shapes=((2, 4, 9, 16), (2, 4, 9, 16), (2, 4, 9, 16)), is_causal=True),
    "gqa": dict(shapes=((2, 8, 9, 16), (2, 2, 11, 16), (2, 2, 11, 16)), enable_gqa=True),
    "bool mask": dict(shapes=((2, 4, 9, 16), (2, 4, 11, 16), (2, 4, 11, 16)), mask=("bool", (2, 1, 9, 11))),
    "float mask": dict(shapes=((2, 4, 9, 16), (2, 4, 11, 16), (2, 4, 11, 16)), mask=("float", (9, 11))),
    "scale": dict(shapes=((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8)), scale=0.7),
    "3d": dict(shapes=((3, 9, 16), (3, 11, 16), (3, 11, 16)), mask=("bool", (3, 9, 11))),
    "2d": dict(shapes=((9, 16), (11, 16), (11, 16)), is_causal=True),
    "5d": dict(shapes=((2, 3, 4, 9, 16), (2, 3, 4, 11, 16), (2, 3, 4, 11, 16)), mask=("float", (4, 9, 11))),
    "broadcast batch": dict(shapes=((2, 4, 9, 16), (1, 4, 11, 16), (1, 4, 11, 16))),
    "bf16 with float32 mask": dict(shapes=((2, 4, 9, 16),) * 3, dtype=torch.bfloat16, mask=("float32", (9, 9))),
}


@pytest.mark.parametrize("name", list(SDPA_CASES))
def test_sdpa_matches_torch(name, gen):
    c = SDPA_CASES[name]
    dtype = c.get("dtype", torch.float32)
    q, k, v = (torch.randn(s, generator=gen).to(dtype) for s in c["shapes"])
    mask = None
    if "mask" in c:
        kind, shape = c["mask"]
        mask = torch.rand(shape, generator=gen) > 0.3 if kind == "bool" else torch.randn(shape, generator=gen)
        if kind == "float":
            mask = mask.to(dtype)
    kw = dict(is_causal=c.get("is_causal", False), scale=c.get("scale"), enable_gqa=c.get("enable_gqa", False))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    _grad_parity(lambda q, k, v: ab.sdpa(q, k, v, attn_mask=mask, **kw),
                 lambda q, k, v: ORIGINAL_SDPA(q, k, v, attn_mask=mask, **kw), [q, k, v], rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "call",
    [
        lambda q, k, v: dict(query=q, key=k[:, :2], value=v[:, :2]),  # GQA without enable_gqa
        lambda q, k, v: dict(query=q[:, :3], key=k[:, :2], value=v[:, :2], enable_gqa=True),
        lambda q, k, v: dict(query=q, key=k, value=v, attn_mask=torch.zeros(5, 5, dtype=torch.float64)),
        lambda q, k, v: dict(query=q, key=k, value=v, attn_mask=torch.ones(5, 5, dtype=torch.int64)),
        lambda q, k, v: dict(query=q, key=k, value=v, dropout_p=1.5),
        lambda q, k, v: dict(query=q, key=k[..., :4], value=v),
        lambda q, k, v: dict(query=q.long(), key=k.long(), value=v.long()),
        lambda q, k, v: dict(query=q, key=k, value=v, attn_mask=torch.ones(3, 5, 7, dtype=torch.bool)),
    ],
)
def test_sdpa_raises_what_torch_raises(call):
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    with pytest.raises(Exception) as theirs:
        ORIGINAL_SDPA(**call(q, k, v))
    with pytest.raises(type(theirs.value)) as ours:
        ab.sdpa(**call(q, k, v))
    assert str(ours.value) == str(theirs.value)


def test_sdpa_with_no_heads_and_enable_gqa_returns_what_torch_returns():
    # 4-D inputs with 0 heads and enable_gqa=True: torch's F.sdpa returns the empty result, but its
    # backend selection (torch._fused_sdp_choice, which ab.sdpa asks for the output's strides) divides
    # by the head count: the process died of SIGFPE.  Run in a child so that a crash fails the test
    code = """
import torch, torch.nn.functional as F
import attn_backends as ab
from attn_backends._providers import ORIGINAL_SDPA
q, k = torch.randn(2, 0, 5, 8), torch.randn(2, 0, 7, 8)
for kw in (dict(), dict(is_causal=True), dict(attn_mask=torch.ones(5, 7, dtype=torch.bool))):
    want = ORIGINAL_SDPA(q, k, k, enable_gqa=True, **kw)
    for got in (ab.sdpa(q, k, k, enable_gqa=True, **kw), ab._integrations.sdpa(q, k, k, enable_gqa=True, backend="flash", **kw)):
        assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype
    with ab.patched_sdpa("flash"):
        got = F.scaled_dot_product_attention(q, k, k, enable_gqa=True, **kw)
    assert got.shape == want.shape
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", (res.returncode, res.stderr[-2000:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", [None, "float", "bool"])
def test_sdpa_under_autocast_casts_as_torch(dtype, mask, gen):
    # torch casts F.sdpa's floating arguments to the autocast dtype (float64 excepted); ours returned float32
    q, k, v = (torch.randn(2, 4, 9, 16, generator=gen) for _ in range(3))
    m = {None: None, "float": torch.randn(9, 9, generator=gen), "bool": torch.rand(9, 9, generator=gen) > 0.3}[mask]
    with torch.autocast("cpu", dtype=dtype):
        theirs = ORIGINAL_SDPA(q, k, v, attn_mask=m, is_causal=m is None)
        ours = ab.sdpa(q, k, v, attn_mask=m, is_causal=m is None)
        with ab.patched_sdpa():
            patched = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None)
        kept = ab.sdpa(q.double(), k.double(), v.double(), is_causal=True)  # float64 is not cast
    assert ours.dtype == patched.dtype == theirs.dtype == dtype and kept.dtype == torch.float64
    cast = [t.to(dtype) for t in (q, k, v)]
    want = ORIGINAL_SDPA(*cast, attn_mask=m.to(dtype) if mask == "float" else m, is_causal=m is None)
    assert torch.equal(ours, ab.sdpa(*cast, attn_mask=m.to(dtype) if mask == "float" else m, is_causal=m is None))
    torch.testing.assert_close(ours, want, atol=2e-2, rtol=2e-2)


def test_sdpa_mask_with_is_causal_behaves_as_torch():
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    m = torch.rand(5, 5) > 0.2
    torch.testing.assert_close(ab.sdpa(q, k, v, attn_mask=m, is_causal=True),
                               ORIGINAL_SDPA(q, k, v, attn_mask=m, is_causal=True))


def test_sdpa_goes_through_the_planner(spy):
    q = torch.randn(1, 2, 4, 8)
    ab.sdpa(q, q, q)
    assert len(spy) == 1
    with ab.use("math"):
        ab.sdpa(q, q, q)
    assert ab.explain(q, q, q).requested == "auto"
    ab.sdpa(q, q[:1, :1].expand(1, 1, 4, 8), q[:1, :1].expand(1, 1, 4, 8))  # GQA without the flag: torch raises
    assert len(spy) == 2


def test_sdpa_dropout_rescales_like_torch():
    q = torch.randn(1, 1, 64, 8)
    v = torch.ones(1, 1, 64, 8)
    out = ab.sdpa(q, q, v, dropout_p=0.5)
    assert abs(out.mean().item() - 1.0) < 0.2


# ---- patching ----------------------------------------------------------------------------------

def test_patch_and_unpatch_restore_the_same_object():
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    ab.patch_sdpa("flash")
    assert F.scaled_dot_product_attention is not ORIGINAL_SDPA
    assert F.scaled_dot_product_attention.__attn_backends__ == "flash"
    ab.patch_sdpa("math")
    assert F.scaled_dot_product_attention.__attn_backends__ == "math"
    ab.unpatch_sdpa()
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    with ab.patched_sdpa("flash_attention_2"):
        outer = F.scaled_dot_product_attention
        with ab.patched_sdpa("math"):
            assert F.scaled_dot_product_attention.__attn_backends__ == "math"
        assert F.scaled_dot_product_attention is outer
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_patched_sdpa_blocks_of_two_threads_closing_out_of_order_restore_torch():
    # thread A opens a block, thread B opens one, A closes first, then B: every block is closed, so
    # torch's function must be back (a plain save and restore left A's router patched in for good),
    # and B's router stays in place while B's block is still open
    import threading

    a_in, b_in, a_out = (threading.Event() for _ in range(3))
    seen = {}

    def a():
        with ab.patched_sdpa("flash"):
            a_in.set()
            b_in.wait(30)
        a_out.set()

    def b():
        a_in.wait(30)
        with ab.patched_sdpa("math"):
            b_in.set()
            a_out.wait(30)
            seen["inside_b"] = getattr(F.scaled_dot_product_attention, "__attn_backends__", None)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert seen["inside_b"] == "math"
        assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    finally:
        ab.unpatch_sdpa()


def test_patched_sdpa_routes_to_the_named_backend(spy):
    q = torch.randn(1, 2, 4, 8)
    with ab.patched_sdpa("math"):
        F.scaled_dot_product_attention(q, q, q)
    assert spy == ["math"]


@pytest.mark.parametrize("training", [True, False])
def test_multihead_attention_patched_vs_unpatched(training, spy, gen):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True, dropout=0.0).train(training)
    x = torch.randn(2, 7, 32, generator=gen)
    mask = torch.rand(7, 7, generator=gen) > 0.3
    mask.fill_diagonal_(True)

    def run(x):
        return mha(x, x, x, attn_mask=~mask, need_weights=False)[0]

    with ab.patched_sdpa("flash"):
        xa = x.clone().requires_grad_()
        a = run(xa)
        ga = torch.autograd.grad(a.square().sum(), [xa] + list(mha.parameters()))
    assert spy, "nn.MultiheadAttention did not call the patched function"
    xb = x.clone().requires_grad_()
    b = run(xb)
    gb = torch.autograd.grad(b.square().sum(), [xb] + list(mha.parameters()))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for u, w in zip(ga, gb):
        torch.testing.assert_close(u, w, rtol=1e-4, atol=1e-5)


def test_transformer_encoder_layer_patched_vs_unpatched(spy, gen):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    x = torch.randn(2, 9, 32, generator=gen)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    with ab.patched_sdpa():
        a = layer(x, src_key_padding_mask=pad)
    assert spy
    b = layer(x, src_key_padding_mask=pad)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- argparse ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", _names.ALL_NAMES)
def test_argparse_round_trip_every_name(name):
    parser = ab.add_argparse_args(argparse.ArgumentParser())
    for spelled in (name, name.upper(), name.replace("_", "-")):
        args = parser.parse_args([f"--attn_implementation={spelled}"])  # "=": "-flash-3" is not a flag
        assert args.attn_implementation == ab.resolve(name)
    assert parser.parse_args([]).attn_implementation == "auto"


def test_argparse_flags(capsys):
    parser = ab.add_argparse_args(argparse.ArgumentParser(prog="train"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        args = parser.parse_args(["--use_flash_attention"])
    assert args.attn_implementation == "flash"
    assert any(issubclass(x.category, FutureWarning) and "--attn_implementation flash" in str(x.message) for x in w)
    assert all(x.filename == __file__ for x in w)  # attributed to the parse_args line, not to argparse
    with pytest.raises(SystemExit):
        parser.parse_args(["--attn_implementation", "flash_attn_9"])
    assert "unknown backend 'flash_attn_9'; valid names are" in capsys.readouterr().err
    help_text = parser.format_help()
    assert "--attn_implementation" in help_text and "flash_attention_2" in help_text and "--disable_mps_fix" in help_text


def test_apply_args_sets_default_mps_rule_and_patch():
    from attn_backends import _planner

    parser = ab.add_argparse_args(argparse.ArgumentParser())
    q = torch.randn(1, 1, 4, 8)
    try:
        assert ab.apply_args(parser.parse_args(["--attn_implementation", "MANUAL", "--disable_mps_fix",
                                                "--patch_sdpa"])) == "math"
        assert ab.explain(q, q, q).requested == "math"
        assert _planner.settings["mps_fix"] is False
        assert F.scaled_dot_product_attention.__attn_backends__ == "math"
        with ab.use("sdpa"):
            assert ab.explain(q, q, q).requested == "sdpa"
    finally:
        _planner.set_process_default("auto")
        _planner.settings["mps_fix"] = True
        ab.unpatch_sdpa()
    assert ab.explain(q, q, q).requested == "auto"


def test_apply_args_without_the_flag_keeps_the_environment_backend():
    code = ("import argparse, attn_backends as ab, torch\n"
            "parser = ab.add_argparse_args(argparse.ArgumentParser())\n"
            "q = torch.randn(1, 1, 4, 8)\n"
            "print(ab.apply_args(parser.parse_args([])), ab.explain(q, q, q).requested)\n"
            "print(ab.apply_args(parser.parse_args(['--attn_implementation', 'flash'])), ab.explain(q, q, q).requested)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, ATTN_BACKENDS_BACKEND="math"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["math", "math", "flash", "flash"]


def _run_script_under_default_filters(script, text):
    """Writes text to script and runs it with Python's default warning filters (no PYTHONWARNINGS); asserts it
    exits 0 and printed "flash"; returns its stderr."""
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "flash"
    return res.stderr


def test_deprecation_notice_shows_once_under_default_filters(tmp_path):
    script = tmp_path / "train.py"
    stderr = _run_script_under_default_filters(script, "import argparse, attn_backends as ab\n"
                                               "parser = ab.add_argparse_args(argparse.ArgumentParser())\n"
                                               "for _ in range(3):\n"
                                               "    args = parser.parse_args(['--use_flash_attention'])\n"
                                               "print(args.attn_implementation)\n")
    assert stderr.count("--use_flash_attention is deprecated; use --attn_implementation flash") == 1
    assert f"{script}:4: FutureWarning" in stderr


def test_deprecation_notice_points_at_the_script_under_hf_argument_parser(tmp_path):
    # HfArgumentParser.parse_args_into_dataclasses calls argparse: the notice used to point into transformers
    script = tmp_path / "train_hf.py"
    stderr = _run_script_under_default_filters(
        script, "import dataclasses, transformers, attn_backends as ab\n"
                "@dataclasses.dataclass\n"
                "class Args:\n"
                "    lr: float = 1e-3\n"
                "parser = ab.add_argparse_args(transformers.HfArgumentParser(Args))\n"
                "args, extra = parser.parse_args_into_dataclasses(['--use_flash_attention'])\n"
                "print(extra.attn_implementation)\n")
    assert f"{script}:6: FutureWarning: --use_flash_attention is deprecated" in stderr, stderr


def test_argparse_on_a_parser_that_already_has_attn_implementation():
    parser = argparse.ArgumentParser()
    parser.add_argument("--attn_implementation", "--attn-implementation", dest="attn_impl", default=None)
    ab.add_argparse_args(parser)  # no "conflicting option strings"
    assert "any of (case-insensitive)" not in parser.format_help()  # theirs is kept as it is
    args = parser.parse_args(["--attn_implementation", "flash_attention_2", "--patch_sdpa"])
    assert args.attn_impl == "flash_attention_2" and args.patch_sdpa
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert parser.parse_args(["--use_flash_attention"]).attn_impl == "flash"  # into their dest
    skipping = ab.add_argparse_args(argparse.ArgumentParser(), skip=("patch_sdpa", "--use_flash_attention"))
    assert "--patch_sdpa" not in skipping.format_help() and "--use_flash_attention" not in skipping.format_help()
    assert "--disable_mps_fix" in skipping.format_help()
    assert ab.add_argparse_args(skipping) is skipping  # again: everything is there, nothing added


def test_apply_args_with_hf_argument_parser_hands_back_the_hf_name():
    transformers = pytest.importorskip("transformers")
    from dataclasses import dataclass, field
    from typing import Optional

    from attn_backends import _planner

    @dataclass
    class ModelArguments:
        model_name_or_path: str = "tiny"
        attn_implementation: Optional[str] = field(default=None, metadata={"help": "attention"})

    parser = transformers.HfArgumentParser(ModelArguments)
    ab.add_argparse_args(parser)
    try:
        model_args, extra = parser.parse_args_into_dataclasses(["--attn_implementation", "flash_attention_2",
                                                                "--disable_mps_fix"])
        assert model_args.attn_implementation == "flash_attention_2" and extra.disable_mps_fix
        hf = ab.apply_args(model_args, extra, for_hf=True)
        assert hf == "attn_backends_fa" and hf in transformers.AttentionInterface._global_mapping
        assert _planner.default_backend() == "flash" and _planner.settings["mps_fix"] is False
        model_args, extra = parser.parse_args_into_dataclasses([])
        assert ab.apply_args(model_args, extra) == "auto"  # theirs defaults to None
        assert ab.apply_args(argparse.Namespace(attn_implementation="attn_backends_torch")) == "sdpa"
        with pytest.raises(ValueError, match="unknown backend 'flash_attn_9'"):
            ab.apply_args(argparse.Namespace(attn_implementation="flash_attn_9"))
    finally:
        _planner.set_process_default("auto")
        _planner.settings["mps_fix"] = True


def test_continuous_batching_names_give_the_name_generate_batch_takes():
    # "paged|eager" (transformers' continuous-batching spelling, which its generate_batch still takes) was an
    # unknown backend to hf_name and to apply_args, so a script that added our flags stopped parsing it
    transformers = pytest.importorskip("transformers")
    from dataclasses import dataclass, field
    from typing import Optional

    from attn_backends import _planner, _transformers

    for name in ("paged|eager", "paged|sdpa", "paged|flash_attention_2", "paged|attn_backends_fa"):
        assert ab.hf_name(name) == _transformers.FLASH_API
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        ab.hf_name("paged|bogus")

    @dataclass
    class ModelArguments:
        attn_implementation: Optional[str] = field(default=None, metadata={"help": "attention"})

    parser = transformers.HfArgumentParser(ModelArguments)
    ab.add_argparse_args(parser)
    try:
        model_args, extra = parser.parse_args_into_dataclasses(["--attn_implementation", "paged|eager"])
        assert model_args.attn_implementation == "paged|eager"
        hf = ab.apply_args(model_args, extra, for_hf=True)
        assert hf == _transformers.FLASH_API and hf in transformers.AttentionInterface._global_mapping
        assert _planner.default_backend() == "auto"
        plain = ab.add_argparse_args(argparse.ArgumentParser())
        assert ab.apply_args(plain.parse_args(["--attn_implementation", "paged|sdpa"])) == "auto"
        with pytest.raises(SystemExit):
            plain.parse_args(["--attn_implementation", "paged|bogus"])
    finally:
        _planner.set_process_default("auto")


def test_paged_prefix_keeps_our_backend_and_takes_any_case():
    # "paged|math" gave FLASH_API on the planner's choice: the backend named after the prefix was dropped
    # without a word; "Paged|eager" was refused (names are case-insensitive); add_argparse_args refused a
    # default the flag itself takes ("paged|eager", "attn_backends_paged")
    pytest.importorskip("transformers")
    from attn_backends import _planner, _transformers

    try:
        parser = ab.add_argparse_args(argparse.ArgumentParser())
        assert ab.apply_args(parser.parse_args(["--attn_implementation", "paged|math"]),
                             for_hf=True) == _transformers.FLASH_API
        assert _planner.default_backend() == "math"
        assert ab.apply_args(parser.parse_args(["--attn_implementation", "Paged|eager"]),
                             for_hf=True) == _transformers.FLASH_API
        assert _planner.default_backend() == "auto"  # transformers' own paged names: the planner's choice
        for default, want in (("paged|eager", "paged|eager"), ("attn_backends_paged", "paged_attention"),
                              ("math", "math")):
            assert ab.add_argparse_args(argparse.ArgumentParser(), default=default).parse_args(
                []).attn_implementation == want
        with pytest.raises(ValueError, match="default: unknown backend 'bogus'"):
            ab.add_argparse_args(argparse.ArgumentParser(), default="bogus")
    finally:
        _planner.set_process_default("auto")


# ---- torch.compile -----------------------------------------------------------------------------

class _Tiny(torch.nn.Module):
    def __init__(self, call):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.call = call

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 9, 3, 4, 8).permute(2, 0, 3, 1, 4)
        if self.call == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = ab.attention(q, k, v, causal=True)
        return y.transpose(1, 2).reshape(2, 9, 32)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("call", ["patched sdpa", "ab.attention"])
def test_compile_models_fullgraph_forward_and_backward(call, dynamic, spy):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Tiny("sdpa" if call == "patched sdpa" else "ab")
    x = torch.randn(2, 9, 32)
    with ab.patched_sdpa("flash"):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        out = compiled(x)
        grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
        assert spy  # traced through our router
        ref = model(x)
        ref_grads = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


# ---- the example -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["--attn_implementation", "flash_attention_2"],
    ["--attention_call", "sdpa", "--patch_sdpa", "--attn_implementation", "math"],
])
def test_train_gpt_example_runs(argv, tmp_path):
    log = tmp_path / "loss.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--steps", "6",
                          "--log_every", "3", "--json", str(log), *argv], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "backend used: flash" in out or "backend used: math" in out
    assert "loss" in out and "tokens/s" in out and "MFU" in out
    import json

    curve = json.load(open(log))["loss"]
    assert len(curve) == 6 and all(x == x for x in curve)


def test_sdpa_on_meta_tensors_works_as_torch_does():
    # ab.sdpa asked autocast about the meta device, which raised "unknown device type for autocast"
    q = torch.randn(2, 3, 5, 8, device="meta")
    want = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    out = ab.sdpa(q, q, q, is_causal=True)
    assert out.device.type == "meta" and out.shape == want.shape
    with ab.patched_sdpa("auto"):
        assert F.scaled_dot_product_attention(q[0], q[0], q[0]).shape == (3, 5, 8)
