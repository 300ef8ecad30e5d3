"""A tuned file that cannot be written (a read-only or missing folder) ends no tuning run with a
traceback: pairgen-tune says so in one line per shape (the file, the OS error, the winner), tunes
the other shapes, and exits non-zero; the trials are in the shapes' studies, so a re-run once the
folder is fixed writes the entries without timing the searched points again. Run on the CPU, with
a stand-in evaluator for the GPU's (as tests/test_tuner.py)."""
from __future__ import annotations

import json

import pytest

from pairgen import runtime
from pairgen.spec import DeviceLimits
from pairgen.tuned import TunedDB
from pairgen.tuning import tune_cli
from pairgen.tuning.cli import selected_shapes
from pairgen.tuning.tuner import TuneSettings

from helpers import stand_in_gpu_for_tuning

INFO = runtime.DeviceInfo(0, "Fake GPU", "fake-gpu", "sm_90", DeviceLimits())
SHAPES = ("B=1,N=64,P=64,H=32", "B=1,N=128,P=64,H=32")
TRIALS = 3


class StandInEvaluator:
    """Compiles nothing (a plan is its own variant); a made-up time per point."""

    limits = DeviceLimits()
    timed = 0  # evaluate calls, over every instance

    def __init__(self, *args):
        pass

    def baselines(self):
        return {"eager": 100.0}

    def compile(self, plans):
        return list(plans)

    def evaluate(self, plan):
        StandInEvaluator.timed += 1
        return 10.0 + len(json.dumps(plan.params, sort_keys=True)) % 7


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """tune() on the CPU: this fake GPU, the stand-in evaluator, no compile pool."""
    monkeypatch.setenv("PAIRGEN_CACHE_DIR", str(tmp_path / "cache"))  # the studies
    stand_in_gpu_for_tuning(monkeypatch, INFO, StandInEvaluator)
    StandInEvaluator.timed = 0


def _tune(capsys) -> tuple[int, str, str]:
    argv = ["--op", "contact", *(a for shape in SHAPES for a in ("--shape", shape)), "--trials", str(TRIALS),
            "--no-progress", "--peers", "eager"]
    parser, args = tune_cli.parse_args(argv)
    code = tune_cli.tune(selected_shapes(args, parser), args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.filterwarnings("ignore::pairgen.tuned.TunedDBWarning")  # lookups cannot read the folder either
def test_an_unwritable_tuned_folder_is_one_line_per_shape_and_a_nonzero_exit(tmp_path, monkeypatch, capsys, fake_gpu):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # its "subfolder" cannot be made, even by root
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(blocker / "tuned"))
    code, out, err = _tune(capsys)
    assert code == 1
    lines = [line for line in err.splitlines() if "cannot write the tuned entry" in line]
    assert len(lines) == len(SHAPES), err  # every shape tuned, each one's failure said
    for line, shape in zip(lines, ("B1 N64 ", "B1 N128 ")):
        assert f"contact {shape}" in line and str(blocker / "tuned" / "fake-gpu" / "contact.json") in line
        assert "Not a directory" in line and "kept in the shape's study" in line and "The winner:" in line
    assert "Traceback" not in err
    assert out.count("| contact |") == len(SHAPES)  # the closing table has both shapes

    # Fixed: a re-run writes both entries, timing only the finalists again, not the searched points.
    fixed = tmp_path / "tuned"
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(fixed))
    StandInEvaluator.timed = 0
    code, _, err = _tune(capsys)
    assert code == 0, err
    assert len(TunedDB("contact", "fake-gpu", fixed).entries()) == len(SHAPES)
    settings = TuneSettings()
    assert StandInEvaluator.timed == len(SHAPES) * min(TRIALS, settings.finalists) * settings.retime_rounds


def test_a_retune_keeps_an_entry_recorded_far_faster_than_its_best(tmp_path, monkeypatch, capsys, fake_gpu):
    """A re-tune whose best is over KEEP_RECORDED_BELOW times the current entry's recorded time keeps
    that entry and says so (its timings were off); within that margin it replaces it."""
    folder = tmp_path / "tuned"
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(folder))
    assert _tune(capsys)[0] == 0
    db = TunedDB("contact", "fake-gpu", folder)
    data = json.loads(db.path.read_text())
    first, second = data["entries"]
    fast, near = round(first["us"] / (2 * tune_cli.KEEP_RECORDED_BELOW), 2), round(second["us"] * 0.9, 2)
    first["us"], second["us"] = fast, near
    db.path.write_text(json.dumps(data))
    code, out, err = _tune(capsys)
    assert code == 0, err
    entries = {entry["shape"]["N"]: entry for entry in TunedDB("contact", "fake-gpu", folder).entries()}
    assert entries[first["shape"]["N"]]["us"] == fast
    assert f"contact B1 N{first['shape']['N']} " in out and f"kept the entry in use ({fast:.1f} µs" in out
    assert f"the entry in use kept ({fast:.1f} µs recorded" in out  # its shape line
    assert f"the entry in use, kept ({fast:.1f} µs recorded)" in out  # and its row of the closing table
    assert entries[second["shape"]["N"]]["us"] != near and out.count("kept the entry in use") == 1
