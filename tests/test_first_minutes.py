"""What a new user sees first: the example's --help."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_help_shows_the_whole_description(example, capsys):
    with pytest.raises(SystemExit) as exit_:
        example.main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(example.__doc__.split()) in out
    assert "--attn_implementation flash_attention_2 --steps 50" in out
