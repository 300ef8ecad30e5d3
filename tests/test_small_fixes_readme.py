"""The README says what the code does: the tuner's --peers default, and how to see why tests were skipped."""
from __future__ import annotations

import re
from pathlib import Path

from pairgen.tuning import tune_cli

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_the_readme_gives_the_tuners_peers_default():
    _, args = tune_cli.parse_args([])
    stated = re.findall(r"\(`--peers`, `([^`]*)` by default\)", README)
    assert stated == [args.peers]


def test_the_test_command_says_skip_reasons_need_rs():
    """pytest shows a skip's reason only with -rs (or -ra): -q alone prints an "s"."""
    line = next(l for l in README.splitlines() if "python -m pytest" in l and "skipped" in l)
    assert "-rs" in line
    assert "with the reason" not in line
