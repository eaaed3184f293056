"""What a new user sees first: the README main command's output (no warning, no traceback), the
example's --help and banner (what was asked, what it resolved to, what runs), and the import from a
source tree that has no built extension."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attn_backends as ab
from attn_backends import _planner

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "1", "--batch", "2", "--block", "16", "--layers", "1", "--dim", "32", "--heads", "2",
        "--kv_heads", "1", "--log_every", "1"]


def readme_command(marker):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)\n```", text, re.S).group(1).strip()


def pip_packages(command):
    """Names of what the command's pip lines install (not the project itself)."""
    names = set()
    for step in command.split("&&"):
        words = step.split()
        if words[:2] == ["pip", "install"]:
            names |= {re.match(r"[A-Za-z0-9_.-]*", w.strip("\"'")).group().lower() for w in words[2:]
                      if not w.startswith("-") and w != "."}
    return names - {""}


def test_readme_main_command_python_steps_print_no_warning(tmp_path):
    steps = [s.strip() for s in readme_command("main-command").split("&&")]
    python_steps = [s for s in steps if s.startswith("python ")]
    assert python_steps == ["python -m attn_backends", "python benchmarks/bench_quick.py"]
    # this suite's environment has more than the main command installs (the test command's extras):
    # each of those is made unimportable, as in the environment the main command builds
    absent = pip_packages(readme_command("test-command")) - pip_packages(readme_command("main-command"))
    assert "pytest" in absent  # the parse found the extras
    for name in absent:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", "
                                                     f"name={name!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    smoke = {"python benchmarks/bench_quick.py": ["--shape", "1,2,40,16", "--rounds", "1"]}
    for step in python_steps:
        argv = [sys.executable] + step.split()[1:] + smoke.get(step, [])
        r = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout
        assert not re.search(r"(?i)warning|traceback", r.stdout), r.stdout
    assert "bfloat16" in r.stdout and "torch threads" in r.stdout
    # the decode-shaped case, dense and paged, each within the correctness rule
    decode = r.stdout[r.stdout.index("decode step"):].splitlines()
    assert [line.split()[-3] for line in decode[3:5]] == ["ok", "ok"], r.stdout


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


def test_example_refuses_a_negative_generate(example, capsys):
    # it printed "-5 tokens in 0.67s (-7 tokens/s)"
    with pytest.raises(SystemExit) as exit_:
        example.main(["--generate", "-5"])
    assert exit_.value.code == 2
    assert "--generate takes a number of characters, 0 or more, got -5" in capsys.readouterr().err


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


def test_generate_past_the_block_is_refused_before_training(example, capsys):
    # the docstring's `--steps 200 --generate 200` trained for 200 steps, then raised ValueError in
    # generate(): the prompt (10 characters) + 200 tokens exceed the default block of 128
    with pytest.raises(SystemExit) as exit_:
        run_example(example, capsys, TINY + ["--generate", "200"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "exceed --block 16" in captured.err and "step" not in captured.out
    with pytest.raises(SystemExit):
        run_example(example, capsys, TINY + ["--generate", "5", "--prompt", "\u2603\u2603"])
    assert "has no character of the training text" in capsys.readouterr().err


def test_the_docstrings_generate_invocation_runs_at_the_default_block(example, capsys):
    n = re.search(r"--generate (\d+)", example.__doc__).group(1)
    small = ["--steps", "1", "--batch", "2", "--layers", "1", "--dim", "32", "--heads", "2", "--kv_heads", "1"]
    out = run_example(example, capsys, small + ["--generate", n])
    assert f"generate: {n} tokens in" in out


# ---- import from a source tree without _C ---------------------------------------------------------

def python_without_install_hooks(code, cwd, first_on_path=()):
    """Runs code with this interpreter's sys.path but without site's .pth hooks (-S), so an editable
    install's finder cannot supply _C: what a non-editable install sees from the repository root."""
    path = [str(p) for p in first_on_path]
    path += [p for p in sys.path if p and Path(p).resolve() not in (ROOT, ROOT / "tests")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def copy_sources(dest):
    shutil.copytree(ROOT / "attn_backends", dest / "attn_backends",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "setup.py", dest / "setup.py")


def test_import_from_a_source_tree_without_the_extension_says_what_happened_and_what_to_do(tmp_path):
    tree, installed = tmp_path / "checkout", tmp_path / "site" / "attn_backends"
    copy_sources(tree)
    installed.mkdir(parents=True)  # stands for a non-editable install: a package with its built _C
    (installed / "_C.abi3.so").write_bytes(b"")
    r = python_without_install_hooks("import attn_backends", tree, first_on_path=[tmp_path / "site"])
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: attn_backends was imported from the source tree {tree / 'attn_backends'}, "
                           "which has no built extension (_C)"), r.stderr
    assert f"the sources shadow the package installed at {installed}" in last
    assert "pip install --no-build-isolation -e ." in last and "run Python from another directory" in last
    assert "most likely due to a circular import" not in r.stderr


def test_an_extension_that_fails_to_load_keeps_its_own_error(tmp_path):
    copy_sources(tmp_path)
    (tmp_path / "attn_backends" / "_C.abi3.so").write_bytes(b"not a shared object")
    r = python_without_install_hooks("import attn_backends", tmp_path)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and "_C.abi3.so" in last, r.stderr
    assert "source tree" not in r.stderr
