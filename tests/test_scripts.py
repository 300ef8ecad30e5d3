"""The commands (pairgen-tune, pairgen-bench; scripts/tune.py and scripts/bench.py are the same from a
checkout): --help, dry runs (no GPU needed), --status, --explain, and clear errors without a GPU."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pairgen import codegen
from pairgen.ops import get_op, render
from pairgen.tuned import TunedDB, make_key

ROOT = Path(__file__).resolve().parent.parent


def run(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=full_env, timeout=600)


def run_main(command: str, *args, env=None):
    """scripts/<command>.py's main in this process (what the script calls; test_help and
    test_the_scripts_are_thin_wrappers_... run the scripts themselves): its exit status and output,
    with `env` set for the call and pairgen's lookups cleared around it. A process per call took
    about 2 s of importing torch each."""
    from pairgen import runtime
    from pairgen.tuning import bench_cli, tune_cli

    main = {"tune": tune_cli.main, "bench": bench_cli.main}[command]
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        runtime.clear_caches()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(list(args))
                except SystemExit as exit_:  # argparse's errors
                    code = exit_.code
        finally:
            runtime.clear_caches()
    return subprocess.CompletedProcess([command, *args], code or 0, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("command", [("scripts/tune.py",), ("scripts/bench.py",), ("-m", "pairgen.tuning.tune_cli"),
                                     ("-m", "pairgen.tuning.bench_cli"), ("scripts/sampler_study.py",)])
def test_help(command):
    result = run(*command, "--help")
    assert result.returncode == 0
    assert "--shape" in result.stdout and "--preset" in result.stdout


def test_the_scripts_are_thin_wrappers_that_run_from_anywhere(tmp_path):
    """scripts/*.py put their checkout first on sys.path and call the console commands' main, so
    they work from a checkout that is not installed, whatever the working folder."""
    for name, module in (("tune", "tune_cli"), ("bench", "bench_cli")):
        text = (ROOT / "scripts" / f"{name}.py").read_text()
        assert f"from pairgen.tuning.{module} import main" in text and len(text.splitlines()) <= 12
    probe = (f"import runpy, sys; runpy.run_path({str(ROOT / 'scripts' / 'tune.py')!r}); "
             "print(sys.path[0]); print(sys.modules['pairgen'].__file__)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(ROOT), str(ROOT / "pairgen" / "__init__.py")]


@pytest.mark.slow  # its fast share: test_tune_dry_run_streams_its_rows_and_compiles_each_set_once, and tests/test_compile.py
def test_tune_dry_run_compiles_every_strategy():
    result = run_main("tune", "--dry-run", "--preset", "seed", env={"PAIRGEN_ARCH": "sm_90"})
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
    result = run_main("bench", "--dry-run", "--op", "contact", "--shape", "B=2,N=37,P=64,H=32")
    assert result.returncode == 0 and "contact B2 N37 P64 H32" in result.stdout


def test_bad_shapes_are_refused():
    result = run_main("tune", "--dry-run", "--op", "contact", "--shape", "B=2,N=37")
    assert result.returncode == 2 and "needs exactly" in result.stderr
    result = run_main("tune", "--dry-run", "--shape", "B=two")
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
    result = run_main("tune", "--status", env={"PAIRGEN_TUNED_DIR": str(tmp_path)})
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert any("B4 N64" in l and "| ok |" in l and "10.0×" in l for l in lines)
    assert any("B1 N256" in l and "STALE" in l for l in lines)
    assert "1 stale entry" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_tuning_without_a_gpu_says_so():
    result = run_main("tune", "--preset", "seed", "--trials", "1")
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr
    result = run_main("tune", "--stale")  # was a traceback: Torch not compiled with CUDA enabled
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_main("bench", "--preset", "seed")
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr


def _entry_on(root: Path, slug: str, widths: dict, bucket: int, **extra) -> None:
    """A fresh contact entry (today's templates) in root/slug, tuned on sm_90."""
    strategy, params = get_op("contact").default_points[0]
    entry = {"key": make_key("float32", widths, bucket), "shape": {"B": 1, "N": bucket, **widths},
             "strategy": strategy, "params": dict(params), "us": 7.5,
             "template_sha256": codegen.template_hash("contact", strategy),
             "source_sha256": render("contact", strategy, params, widths).source_sha256, **extra}
    TunedDB("contact", slug, root).upsert(entry, arch="sm_90")


def test_explain_says_when_the_tuner_timed_the_reference_faster(tmp_path):
    _entry_on(tmp_path, "nvidia-h200", {"P": 64, "H": 32}, 64, baselines_us={"eager": 6.5})
    result = run_main("tune", "--explain", "--op", "contact", "--shape", "B=1,N=64,P=64,H=32",
                 "--gpu", "nvidia-h200", "--arch", "sm_90", env={"PAIRGEN_TUNED_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    line = result.stdout.splitlines()[1]
    assert "the PyTorch reference" in line
    assert "the PyTorch reference measured faster when it was tuned (6.5 µs against the best kernel's 7.5 µs)" in line


def test_explain_says_how_far_behind_the_next_point_its_tune_timed_came(tmp_path):
    timed = [{"us": 8.0, "changes": {"threads": 256}}, {"us": 9.0, "strategy": "tiled", "changes": {}}]
    _entry_on(tmp_path, "nvidia-h200", {"P": 64, "H": 32}, 64, timed=timed)
    result = run_main("tune", "--explain", "--op", "contact", "--shape", "B=1,N=64,P=64,H=32",
                      "--gpu", "nvidia-h200", "--arch", "sm_90", env={"PAIRGEN_TUNED_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert ("measured 7.5 us when tuned (the fastest of 3 points kept from its tune; the next +6.7 %)"
            in result.stdout.splitlines()[1])


def test_explain_for_a_described_gpu(tmp_path):
    """--explain --gpu/--arch needs no GPU: this GPU's entry, its nearest bucket, a same-architecture
    GPU's entry, or the defaults, with the parameters, the time and the file."""
    _entry_on(tmp_path, "nvidia-h200", {"P": 64, "H": 32}, 64)
    env = {"PAIRGEN_TUNED_DIR": str(tmp_path)}
    explain = ("--explain", "--op", "contact", "--shape", "B=1,N=64,P=64,H=32",
               "--shape", "B=1,N=300,P=64,H=32", "--shape", "B=1,N=64,P=128,H=64")
    result = run_main("tune", *explain, "--gpu", "nvidia-h200", "--arch", "sm_90", env=env)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if not line.startswith("  training call's backward")]
    backward = [line for line in result.stdout.splitlines() if line.startswith("  training call's backward")]
    assert str(tmp_path) in lines[0] and len(lines) == 4
    assert lines[1].startswith("B1 N64 P64 H32: contact N=64 (bucket 64) on nvidia-h200: ")
    assert "from tuned, measured 7.5 us when tuned" in lines[1] and str(tmp_path / "nvidia-h200" / "contact.json") in lines[1]
    assert "from tuned (nearest N bucket 64)" in lines[2]
    assert "from default" in lines[3] and "measured" not in lines[3]
    # a training call's backward: its fused kernels, their launch shape and where it came from
    assert len(backward) == 3 and all("pairgen_contact_symmetric_ln_grad" in line for line in backward)
    assert "(row_blocks=4; default)" in backward[0]
    result = run_main("tune", *explain, "--gpu", "NVIDIA H100", "--arch", "sm_90", env=env)
    assert result.returncode == 0 and "on nvidia-h100: " in result.stdout
    assert "from tuned on nvidia-h200 (same architecture, sm_90), measured 7.5 us" in result.stdout
    result = run_main("tune", *explain, "--gpu", "nvidia-a100", "--arch", "sm_80", env=env)
    assert result.returncode == 0 and result.stdout.count("from default") == 3


def test_explain_refuses_half_a_gpu_and_says_what_it_needs(tmp_path):
    result = run_main("tune", "--explain", "--op", "contact", "--gpu", "nvidia-h200")
    assert result.returncode == 2 and "--gpu and --arch go together" in result.stderr
    result = run_main("tune", "--explain", "--op", "contact", "--gpu", "nvidia-h200", "--arch", "compute_90")
    assert result.returncode == 2 and "is not a GPU target" in result.stderr
    result = run_main("tune", "--dry-run", "--gpu", "nvidia-h200", "--arch", "sm_90")
    assert result.returncode == 2 and "--explain and --status only" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_explain_without_a_gpu_says_so_in_one_line():
    result = run_main("tune", "--explain", "--op", "contact", "--shape", "B=1,N=64,P=64,H=32")
    assert result.returncode == 2 and "--gpu SLUG --arch sm_XY" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not result.stdout


def test_status_says_which_entries_apply_on_a_described_gpu(tmp_path):
    _entry_on(tmp_path, "nvidia-h200", {"P": 64, "H": 32}, 64)
    result = run_main("tune", "--status", "--gpu", "nvidia-h100", "--arch", "sm_90",
                 env={"PAIRGEN_TUNED_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert f"## {tmp_path} (PAIRGEN_TUNED_DIR: read and written)" in result.stdout
    assert "on nvidia-h100 (nvidia-h100, sm_90):" in result.stdout
    assert "contact: no entries of its own; entries tuned on nvidia-h200 (same architecture, sm_90) apply" in result.stdout


def test_status_and_explain_run_where_torch_is_not_installed():
    """--status and --explain (for a described GPU) need only the specs: the op packages load
    their torch half on first use and the options need no Optuna, so a machine without torch or
    Optuna can still read the tuned folders."""
    blocked = ("import runpy, sys; sys.modules['torch'] = sys.modules['optuna'] = None; "
               "sys.argv = ['tune.py'] + sys.argv[1:]; "
               "runpy.run_path('scripts/tune.py', run_name='__main__')")
    status = run("-c", blocked, "--status")
    assert status.returncode == 0, status.stderr
    assert "nvidia-h200 | contact" in status.stdout and "0 stale entries" in status.stdout
    explain = run("-c", blocked, "--explain", "--op", "contact", "--shape", "B=4,N=70,P=64,H=32",
                         "--gpu", "NVIDIA H100", "--arch", "sm_90")
    assert explain.returncode == 0, explain.stderr
    assert "same architecture" in explain.stdout
    assert "torch" not in explain.stderr and "optuna" not in explain.stderr
