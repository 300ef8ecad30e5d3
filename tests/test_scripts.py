"""The scripts: --help, dry runs (no GPU needed), --status, and clear errors without a GPU."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pairgen import codegen
from pairgen.tuned import make_key

ROOT = Path(__file__).resolve().parent.parent


def run(*args, env=None):
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=full_env, timeout=600)


@pytest.mark.parametrize("script", ["scripts/tune.py", "scripts/bench.py"])
def test_help(script):
    result = run(script, "--help")
    assert result.returncode == 0
    assert "--shape" in result.stdout and "--preset" in result.stdout


def test_tune_dry_run_compiles_every_strategy():
    result = run("scripts/tune.py", "--dry-run", "--preset", "seed", env={"PAIRGEN_ARCH": "sm_90"})
    assert result.returncode == 0, result.stderr
    for strategy in ("thread_per_pair", "tiled", "symmetric_tiled"):
        assert f"| {strategy}(" in result.stdout
    assert "rendered and compiled for sm_90" in result.stdout and "FAILED" not in result.stdout


def test_bench_dry_run_lists_the_shapes():
    result = run("scripts/bench.py", "--dry-run", "--op", "contact", "--shape", "B=2,N=37,P=64,H=32")
    assert result.returncode == 0 and "contact B2 N37 P64 H32" in result.stdout


def test_bad_shapes_are_refused():
    result = run("scripts/tune.py", "--dry-run", "--op", "contact", "--shape", "B=2,N=37")
    assert result.returncode == 2 and "needs exactly" in result.stderr
    result = run("scripts/tune.py", "--dry-run", "--shape", "B=two")
    assert result.returncode == 2 and "bad shape" in result.stderr


def test_status_lists_stale_entries(tmp_path):
    folder = tmp_path / "some-gpu"
    folder.mkdir()
    fresh = {"key": make_key("float32", {"P": 64, "H": 32}, 64), "shape": {"B": 4, "N": 64, "P": 64, "H": 32},
             "strategy": "tiled", "params": {}, "us": 5.0, "baselines_us": {"eager": 50.0},
             "template_sha256": codegen.template_hash("contact", "tiled")}
    stale = dict(fresh, key=make_key("float32", {"P": 64, "H": 32}, 256), shape={"B": 1, "N": 256, "P": 64, "H": 32},
                 template_sha256="0" * 64)
    (folder / "contact.json").write_text(json.dumps({"schema": 1, "op": "contact", "gpu": "some-gpu",
                                                      "entries": [fresh, stale]}))
    result = run("scripts/tune.py", "--status", env={"PAIRGEN_TUNED_DIR": str(tmp_path)})
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert any("B4 N64" in l and "| ok |" in l and "10.0×" in l for l in lines)
    assert any("B1 N256" in l and "STALE" in l for l in lines)
    assert "1 stale entry" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_tuning_without_a_gpu_says_so():
    result = run("scripts/tune.py", "--preset", "seed", "--trials", "1")
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr
    result = run("scripts/bench.py", "--preset", "seed")
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr
