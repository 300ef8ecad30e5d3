"""The README documents what the code does: the environment table, the commands, code blocks that run;
and it stays a front door (at most 250 lines)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pairgen.config import ENVIRONMENT

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_environment_table_matches_the_code():
    rows = re.findall(r"^\| `(PAIRGEN_[A-Z_]+)` \| (.+?) \| (.+?) \|$", README, re.M)
    assert {name for name, _, _ in rows} == set(ENVIRONMENT)
    for name, default, meaning in rows:
        assert meaning.strip() == ENVIRONMENT[name][1], name
        assert ENVIRONMENT[name][0] in default, name


def test_ci_runs_the_readme_test_command():
    command = "python -m pytest -q -n auto"
    assert command in README
    assert command in (ROOT / ".ci" / "run").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else len(README)]


def test_fresh_machine_says_cpu_first_then_the_two_commands():
    """Users on a CPU-only machine must install the CPU torch before the install commands."""
    section = _section("On a fresh machine")
    cpu_note = section.index("pip install torch==2.13.0")
    commands = section.index('pip install -e ".[bench]" && pairgen-tune')
    assert cpu_note < commands < section.index('pip install -e ".[test]" && python -m pytest -q')
    assert "pairgen-tune" in section and "pairgen-bench" in section and "python scripts/tune.py" in section
    assert "torch==2.13.0" in (ROOT / ".ci" / "run").read_text()


def test_tuning_documents_the_commands_the_folders_and_the_lookup():
    section = _section("Tuning")
    for flag in ("--status", "--stale", "--dry-run", "--explain", "--gpu", "--arch"):
        assert f"pairgen-tune {flag}" in section or f" {flag} " in section, flag
    for where in ("$XDG_DATA_HOME/pairgen/tuned", "~/.local/share/pairgen/tuned", "PAIRGEN_TUNED_DIR",
                  "same compute capability", "default parameters", "pairgen-bench"):
        assert where in section, where


def training_example() -> str:
    """The README's training block (the python block after "Training:")."""
    start = README.index("Training: a small model")
    return README[README.index("```python\n", start) + len("```python\n"): README.index("```", README.index("```python\n", start) + 10)]


def test_the_readme_training_example_trains():
    """On the CPU the modules run their references: the example itself (names, shapes, dtypes under
    autocast, the loss) runs, and its steps move every parameter. tests/test_readme_gpu.py runs it
    on the GPU, through the kernels and the closed-form backward."""
    scope = {}
    exec(compile(training_example(), "README.md", "exec"), scope)
    model = scope["model"]
    torch.manual_seed(0)
    initial = scope["PairModel"]()  # the example seeds before building its model: its initial weights
    for (name, p), p0 in zip(model.named_parameters(), initial.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert not torch.equal(p.detach().cpu(), p0.detach()), f"{name} did not move"
    assert torch.isfinite(scope["loss"])


def test_the_readme_is_a_front_door_of_at_most_250_lines():
    """The README says what pairgen is, how to install, use and tune it, one results table per op
    and its limits; the long material lives in docs/ (performance.md, architecture.md)."""
    assert len(README.splitlines()) <= 250


def python_blocks() -> list[str]:
    """Every python code block of the README, in order."""
    return re.findall(r"^```python\n(.*?)^```", README, re.M | re.S)


def _missing_import(code: str) -> str | None:
    """The first top-level package a block imports that is not installed (e.g. a model package)."""
    import importlib.util

    for name in re.findall(r"^(?:from|import) ([A-Za-z_][\w]*)", code, re.M):
        if importlib.util.find_spec(name) is None:
            return name
    return None


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_every_readme_python_block_runs_on_the_cpu(index):
    """Each block, its "cuda" device made "cpu" (the modules run their references there), runs as
    written against the current API. tests/test_readme_gpu.py runs them on the GPU as they are."""
    code = python_blocks()[index]
    missing = _missing_import(code)
    if missing:
        pytest.skip(f"the block imports {missing}, not installed (pip install --no-deps -r tests/real-models.txt)")
    code = code.replace('"cuda"', '"cpu"').replace(".cuda()", ".cpu()")
    # The references at N = 256 take tens of seconds on a CI core in bf16; N = 48 runs the same code.
    code = code.replace("256, 256", "48, 48")
    exec(compile(code, f"README.md python block {index}", "exec"), {})
