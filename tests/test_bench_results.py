"""The bench's results on the CPU (rows as the GPU runs make them): the results file merges runs of
one GPU and date, a forward row and a training row of the same shape side by side; the training
table shows each peer's time, speedup, peak memory and gradient error."""
from __future__ import annotations

import json

from pairgen.tuning.bench_cli import results_name, training_table, write_results

ENV = {"gpu": "Test GPU", "torch": "t", "cuda": "c", "nvrtc": "n", "date": "2026-12-01", "timing": "t"}
SHAPE = {"B": 1, "N": 256, "P": 128, "H": 128}


def _forward_row(us):
    return {"op": "contact", "shape": SHAPE, "precision": "float32", "variant": "v", "call_us": us,
            "call_again_us": us, "graph_us": us, "host_us": 1.0, "check": "ok", "rel_l2": 1e-7}


def _training_row(us):
    return {"op": "contact", "shape": SHAPE, "precision": "float32", "mode": "train", "variant": "v",
            "pairgen_us": us, "eager_us": 3 * us, "pairgen_peak_mib": 10.0, "eager_peak_mib": 40.0,
            "pairgen_gpu_us": 0.6 * us, "pairgen_host_us": 0.9 * us, "eager_gpu_us": us, "eager_host_us": 2.5 * us,
            "pairgen_grad_rel_l2": 2e-7, "eager_grad_rel_l2": 3e-7,
            "unavailable": {"compile": "RuntimeError: no"}}


def test_forward_and_training_rows_of_one_shape_are_kept_side_by_side(tmp_path):
    write_results(tmp_path, ENV, [_forward_row(10.0)], ["eager"])
    write_results(tmp_path, ENV, [_training_row(100.0)], ["eager"])
    write_results(tmp_path, ENV, [_training_row(90.0)], ["eager"])  # a later run of the same row wins
    rows = json.loads((tmp_path / results_name(ENV)).read_text())["rows"]
    assert sorted((r.get("mode", "forward"), r.get("pairgen_us", r.get("call_us"))) for r in rows) == \
        [("forward", 10.0), ("train", 90.0)]
    assert "fwd+bwd" in (tmp_path / "bench.md").read_text()


def test_the_training_table():
    text = training_table([_training_row(100.0)], ["eager", "compile"])
    header, _, line = text.splitlines()[:3]
    assert "pairgen fwd+bwd µs" in header and "× vs eager" in header and "peak MiB" in header
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "train" and cells[5:8] == ["100.0", "300.0", "–"] and "3.00×" in cells and "10 / 40 / –" in cells
    assert "GPU / host µs a step: pairgen / eager / compile" in header and "60, 90 / 100, 250 / –" in cells
    assert "- not measured: compile: RuntimeError: no" in text


def test_the_compile_peers_mode_is_chosen_on_the_command_line_and_checked():
    """--compile-mode picks the torch.compile peer's mode (max-autotune without CUDA graphs unless
    asked: "default" builds a training step's backward in a fraction of the time); a mode torch
    does not have is refused by the parser, before anything is measured."""
    import pytest

    from pairgen.tuning.bench_cli import COMPILE_MODE, parse_args

    assert parse_args([])[1].compile_mode == COMPILE_MODE == "max-autotune-no-cudagraphs"
    assert parse_args(["--backward", "--compile-mode", "default"])[1].compile_mode == "default"
    with pytest.raises(SystemExit):
        parse_args(["--compile-mode", "fastest"])


def test_host_time_is_measured_as_separate_runs_with_the_gpu_drained_between(monkeypatch):
    """host_us_runs: one value per run, each run `calls` back-to-back calls after one untimed call,
    the GPU drained (synchronize) before and after every run, so no run waits on another's work."""
    import torch

    from pairgen.tuning import timing

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    values = timing.host_us_runs(lambda: events.append("call"), calls=3, runs=4)
    assert len(values) == 4 and all(v > 0 for v in values)
    assert events == (["call", "sync"] + ["call"] * 3 + ["sync"]) * 4


def test_the_forward_table_ends_with_the_rows_geometric_means():
    """GPU MODE ranks its TriMul shapes by the geometric mean: the table gives it for pairgen's call
    and each peer timed on every row (not for one missing a row)."""
    from pairgen.tuning.bench_cli import geometric_means, table

    rows = [{**_forward_row(100.0), "cuequivariance_us": 50.0, "eager_us": 10.0},
            {**_forward_row(400.0), "cuequivariance_us": 200.0}]
    means = geometric_means(rows, ["call", "cuequivariance", "eager"])
    assert means.keys() == {"call", "cuequivariance"}
    assert abs(means["call"] - 200.0) < 1e-9 and abs(means["cuequivariance"] - 100.0) < 1e-9
    text = table(rows, ["cuequivariance", "eager"])
    assert "- geometric means of these rows' µs (call, then each peer timed on all of them): call 200.0, " \
           "cuequivariance 100.0" in text


def test_autocast_is_for_16_bit_forwards_and_gpumode_lists_the_seven_shapes():
    import subprocess
    import sys

    def bench(*args):
        return subprocess.run([sys.executable, "scripts/bench.py", "--dry-run", "--op", "trimul", *args],
                              capture_output=True, text=True)

    listed = bench("--preset", "gpumode", "--precision", "bfloat16", "--autocast", "--peers", "cuequivariance")
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == 7
    assert "trimul B2 N256 P384 H128 bias=0 gate_normalized=1 outgoing=1" in listed.stdout
    for refused in (("--autocast",), ("--autocast", "--precision", "float32"), ("--autocast", "--precision",
                                                                                 "bfloat16", "--backward")):
        result = bench(*refused)
        assert result.returncode == 2 and "--autocast times forwards" in result.stderr


def test_the_l2_flush_made_first_under_inference_mode_still_runs_outside_it():
    # The forward bench times under inference_mode, a training row after it in the same process
    # does not: the flush buffer the first made must be one the second can zero.
    import torch

    from pairgen.tuning import timing

    device = torch.device("cpu", 0)  # (the buffers' key: a device with its index)
    timing._flush_buffers.pop(device, None)
    try:
        with torch.inference_mode():
            timing._flush_l2(device)
        timing._flush_l2(device)
        assert not timing._flush_buffers[device].is_inference()
        assert int(timing._flush_buffers[device][-1]) == 0
    finally:
        timing._flush_buffers.pop(device, None)
