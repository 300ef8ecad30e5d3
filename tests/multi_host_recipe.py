"""docs/multi-host.md's shell blocks, as the tests run them.

A block is the ```bash fence after a `<!-- recipe: NAME -->` line. Its leading `NAME=value` lines are
its settings, the values a user changes; the rest are its commands, which the tests run exactly as
written, with the settings given as environment variables instead of the doc's example values.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

RECIPE = Path(__file__).resolve().parent.parent / "docs" / "multi-host.md"

SETTING = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")


def block(name: str, text: str | None = None) -> str:
    text = RECIPE.read_text() if text is None else text
    match = re.search(rf"^<!-- recipe: {re.escape(name)} -->\n```bash\n(.*?)^```$", text, re.M | re.S)
    if match is None:
        raise LookupError(f"{RECIPE}: no block marked <!-- recipe: {name} -->")
    return match.group(1)


def settings(name: str) -> dict[str, str]:
    """The block's settings as the doc writes them (name -> the rest of the line, comment and all)."""
    head, _ = _split(name)
    return dict(SETTING.match(line).groups() for line in head)


def commands(name: str) -> str:
    """The block less its settings lines."""
    _, body = _split(name)
    return "".join(line + "\n" for line in body)


def _split(name: str) -> tuple[list[str], list[str]]:
    """The block's leading NAME=value lines, and the rest."""
    lines = block(name).splitlines()
    n = 0
    while n < len(lines) and SETTING.match(lines[n]):
        n += 1
    return lines[:n], lines[n:]


def run(name: str, values: dict[str, str], env: dict[str, str], **popen_kwargs) -> subprocess.Popen:
    """Start the block's commands in bash (stopping at the first that fails), with every setting
    given a value (values), in the environment `env`."""
    missing = set(settings(name)) - set(values)
    if missing:
        raise ValueError(f"no value for the settings {sorted(missing)} of the recipe block {name}")
    return subprocess.Popen(["bash", "-euo", "pipefail", "-c", commands(name)], env={**env, **values},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen_kwargs)


def run_to_end(name: str, values: dict[str, str], env: dict[str, str], timeout: float = 60, **popen_kwargs) -> str:
    """run(), waited for; its output, or AssertionError with the output where it failed."""
    process = run(name, values, env, **popen_kwargs)
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"recipe block {name} failed ({process.returncode}):\n{output}"
    return output
