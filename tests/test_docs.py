"""The README documents what the code does: the environment table and the commands."""
from __future__ import annotations

import re
from pathlib import Path

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
    command = "python -m pytest -q"
    assert command in README
    assert command in (ROOT / ".ci" / "run").read_text()
    assert "python scripts/tune.py" in README
