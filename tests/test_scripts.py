"""The scripts: --help, dry runs (no GPU needed), --status, and clear errors without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pairgen import codegen
from pairgen.ops import get_op, render
from pairgen.tuned import make_key

ROOT = Path(__file__).resolve().parent.parent


def run(*args, env=None):
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


def test_tune_dry_run_streams_its_rows_and_compiles_each_set_once(tmp_path):
    """Two shapes with the same widths (the presets have such) compile one set of variants; the
    rows of the first strategy arrive while the others still compile (one worker, a cold cache:
    the cache holds fewer cubins than there are rows when the first row is read), not at the end."""
    args = [sys.executable, "scripts/tune.py", "--dry-run", "--op", "contact",
            "--shape", "B=1,N=64,P=64,H=32", "--shape", "B=2,N=256,P=64,H=32"]
    env = {**os.environ, "PAIRGEN_ARCH": "sm_90", "PAIRGEN_COMPILE_WORKERS": "1", "PAIRGEN_CACHE_DIR": str(tmp_path)}
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err, subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                                                     text=True) as proc:
        lines = []
        while not lines or not lines[-1].startswith("| contact |"):
            lines.append(proc.stdout.readline())
            assert lines[-1], f"no row before the end: {lines} {err_path.read_text()}"
        compiled_at_first_row = len(list((tmp_path / "cubin").rglob("*.json")))
        out = proc.stdout.read()  # not communicate(): it would skip what readline() has buffered
        proc.wait(timeout=600)
    assert proc.returncode == 0, err_path.read_text()
    lines += out.splitlines()
    labels = [line.split(" | ")[2] for line in lines if line.startswith("| contact |")]
    assert labels and len(labels) == len(set(labels)), "a variant was compiled and listed twice"
    assert lines[0].startswith("compiling "), "the dry run should say what it is doing before compiling"
    assert f"{len(labels)} of {len(labels)} variants rendered and compiled" in out
    assert compiled_at_first_row < len(labels), "the first row came only when every variant was compiled"


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
    widths = {"P": 64, "H": 32}
    strategy, params = get_op("contact").default_points[0]
    fresh = {"key": make_key("float32", widths, 64), "shape": {"B": 4, "N": 64, **widths},
             "strategy": strategy, "params": dict(params), "us": 5.0, "baselines_us": {"eager": 50.0},
             "template_sha256": codegen.template_hash("contact", strategy),
             "source_sha256": render("contact", strategy, params, widths).source_sha256}
    stale = dict(fresh, key=make_key("float32", widths, 256), shape={"B": 1, "N": 256, **widths},
                 source_sha256="0" * 64)
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
    result = run("scripts/tune.py", "--stale")  # was a traceback: Torch not compiled with CUDA enabled
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run("scripts/bench.py", "--preset", "seed")
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr
