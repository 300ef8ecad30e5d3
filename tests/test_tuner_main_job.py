"""pairgen-tune's main job, on the CPU with a stand-in evaluator for the GPU's (as
tests/test_small_fixes_tune_write.py): the default set holds the models' bf16 triangle update; each
shape's line is printed as soon as the shape is done, with or without the progress bar; torch.compile
is a peer only when asked for; other libraries' output goes to a log file the report names; Ctrl-C
keeps the shapes done and exits 130; --seen tunes exactly the keys processes ran untuned."""
from __future__ import annotations

import io
import json
import logging
import os
import sys
import warnings

import pytest
import torch

from helpers import stand_in_gpu_for_tuning

from pairgen import codegen, compiler, first_use, runtime
from pairgen.ops import get_op, render
from pairgen.spec import DeviceLimits, precision_of
from pairgen.tuned import TunedDB, make_key
from pairgen.tuning import tune_cli
from pairgen.tuning.cli import selected_shapes
from pairgen.tuning.third_party_log import PAIRGEN_DIR

INFO = runtime.DeviceInfo(0, "Fake GPU", "fake-gpu", "sm_90", DeviceLimits())
MODELS_FORM = {"P": 128, "H": 128, "gate_normalized": 1, "bias": 0}

#: Printed by the stand-in's peers, as torch.compile's autotuning prints: none may reach the terminal.
NOISE = {
    "logger": "Runtime error during autotuning: synthetic. Ignoring this choice.",
    "sys.stderr": "AUTOTUNE mm(128x128, 128x128) synthetic table",
    "fd 2": "written to file descriptor 2 by a benchmark subprocess",
    "print": "printed by a peer to stdout",
    "warning": "a warning from inside torch",
}


class StandInEvaluator:
    """Compiles nothing (a plan is its own variant); a made-up time per point; the peers make
    third-party noise when NOISY. Every instance (one per shape) is recorded, with how many shape
    lines had been printed when it was made."""

    limits = DeviceLimits()
    made: list = []
    interrupt_at_shape: int | None = None  # Ctrl-C during this shape's search (0-based)
    noisy = False

    def __init__(self, spec, shape, device_index=0, seed=0, peers=("eager",), pool=None):
        self.spec, self.shape, self.peers = spec, dict(shape), peers
        self.number = len(StandInEvaluator.made)
        self.lines_before = _shape_lines_printed()
        StandInEvaluator.made.append(self)

    def baselines(self):
        if self.noisy:
            logging.getLogger("torch._inductor.select_algorithm").warning(NOISE["logger"])
            sys.stderr.write(NOISE["sys.stderr"] + "\n")
            os.write(2, (NOISE["fd 2"] + "\n").encode())
            print(NOISE["print"])
            warnings.warn_explicit(NOISE["warning"], UserWarning, "/site-packages/torch/_inductor/utils.py", 7)
        return {peer: 100.0 + 50 * (peer == "compile") for peer in self.peers}

    def compile(self, plans):
        return list(plans)

    def evaluate(self, plan):
        if self.number == StandInEvaluator.interrupt_at_shape:
            raise KeyboardInterrupt
        return 10.0 + len(json.dumps(plan.params, sort_keys=True)) % 7


def _shape_lines_printed() -> int:
    out = sys.stdout.getvalue() if isinstance(sys.stdout, io.StringIO) else ""
    return sum(1 for line in out.splitlines() if line.startswith("["))


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """tune_cli.main on the CPU: this fake GPU, the stand-in evaluator, no compile pool; the tuned
    folder, the studies and the logs under tmp_path."""
    monkeypatch.setenv("PAIRGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path / "tuned"))
    stand_in_gpu_for_tuning(monkeypatch, INFO, StandInEvaluator)
    monkeypatch.setattr(StandInEvaluator, "made", [])
    monkeypatch.setattr(StandInEvaluator, "interrupt_at_shape", None)
    monkeypatch.setattr(StandInEvaluator, "noisy", False)
    runtime.clear_caches()
    yield tmp_path
    runtime.clear_caches()


CONTACT_SHAPES = ("B=1,N=64,P=64,H=32", "B=1,N=128,P=64,H=32", "B=2,N=256,P=64,H=32")


def _contact_argv(*extra, shapes=CONTACT_SHAPES) -> list[str]:
    return ["--op", "contact", *(a for shape in shapes for a in ("--shape", shape)), "--trials", "3", *extra]


# ---- the default set ------------------------------------------------------------------------------

def test_the_default_set_is_the_models_bf16_triangle_update_then_the_fp32_defaults():
    parser, args = tune_cli.parse_args([])
    work = selected_shapes(args, parser, main_job=True)
    labels = [(spec.name, precision_of(spec), shape) for spec, shape in work]
    models = [(n, o) for n in (256, 512, 768) for o in (1, 0)]
    assert labels[:len(models)] == [("trimul", "bfloat16", {"B": 1, "N": n, **MODELS_FORM, "outgoing": o})
                                    for n, o in models], "the models' form in bf16 first, both directions"
    _, every = tune_cli.parse_args(["--preset", "all"])
    fp32 = [(spec.name, precision_of(spec), shape) for spec, shape in selected_shapes(every, parser)]
    assert labels[len(models):] == fp32 and {p for _, p, _ in fp32} == {"float32"}
    assert len(labels) == 19
    # A search budget per shape keeps the 19 near 10 minutes on an H200; a re-run resumes each study.
    assert args.time_budget == tune_cli.MAIN_JOB_TIME_BUDGET_S == 20.0
    assert args.peers == "eager"


def test_the_default_set_narrowed_by_op_and_the_old_selections_unchanged():
    parser, args = tune_cli.parse_args(["--op", "contact"])
    assert {precision_of(spec) for spec, _ in selected_shapes(args, parser, main_job=True)} == {"float32"}
    parser, args = tune_cli.parse_args(["--op", "trimul", "--precision", "bfloat16"])
    shapes = [shape for _, shape in selected_shapes(args, parser, main_job=True)]
    assert shapes == [dict(s) for p in ("seed", "real") for s in get_op("trimul").presets[p]]
    assert args.time_budget is None, "the budget is the main job's; named shapes get their trials"
    parser, args = tune_cli.parse_args(["--op", "contact", "--shape", "B=1,N=64,P=64,H=32"])
    assert args.time_budget is None and len(selected_shapes(args, parser, main_job=True)) == 1


def test_torch_compile_is_a_peer_only_when_asked_for(capsys):
    assert tune_cli.parse_args(["--peers", "eager,compile"])[1].peers == "eager,compile"
    with pytest.raises(SystemExit) as stop:
        tune_cli.parse_args(["--peers", "eager,inductor"])
    assert stop.value.code == 2
    assert "--peers: no peer named 'inductor'; the peers are eager, compile" in capsys.readouterr().err


def test_the_docs_say_which_shapes_the_main_job_tunes():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    main_line = next(line for line in readme.splitlines() if line.startswith("pairgen-tune    "))
    for fact in ("bf16", "N256/512/768", "P=H=128", "both directions", "fp32 seed + real", "20 s", "eager"):
        assert fact in main_line, fact
    help_text = " ".join(tune_cli.__doc__.split())
    for fact in ("19 shapes", "bf16", "N = 256, 512 and 768", "P = H = 128", "both directions",
                 "fp32 seed and real shapes", "64 trials or 20 s of search", "Eager PyTorch is the peer"):
        assert fact in help_text, fact
    assert "pairgen-tune --seen" in readme and "pairgen-tune --peers eager,compile" in readme


# ---- a line per shape, as soon as it is done -----------------------------------------------------------

@pytest.mark.parametrize("progress", [True, False], ids=["progress-bar", "no-progress"])
def test_each_shape_line_is_printed_as_soon_as_the_shape_is_done(fake_gpu, monkeypatch, progress):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)  # read as the run goes, by the stand-in
    code = tune_cli.main(_contact_argv(*([] if progress else ["--no-progress"])))
    assert code == 0
    assert [ev.lines_before for ev in StandInEvaluator.made] == [0, 1, 2], \
        "a shape's line must be out before the next shape starts"
    lines = [line for line in out.getvalue().splitlines() if line.startswith("[")]
    assert len(lines) == 3
    best_us = {e["key"]["n_bucket"]: e["us"] for e in TunedDB("contact", "fake-gpu").entries()}
    for k, (line, label, bucket) in enumerate(zip(lines, ("B1 N64 P64 H32", "B1 N128 P64 H32", "B2 N256 P64 H32"),
                                                  (64, 128, 256))):
        assert line.startswith(f"[{k + 1}/3] contact {label} float32: `"), line
        best = best_us[bucket]
        assert f"` {best:.1f} µs against eager 100.0 µs ({100.0 / best:.1f}×); 3 trials in " in line, line
    closing = out.getvalue().split("µs = median module call")[1]
    assert closing.count("| contact |") == 3 and "| precision |" in closing and "| float32 |" in closing


# ---- other libraries' output in a log file -----------------------------------------------------------

def test_other_libraries_output_goes_to_the_log_file_the_report_names(fake_gpu, capfd):
    StandInEvaluator.noisy = True
    report = fake_gpu / "out" / "report.md"
    showwarning = warnings.showwarning
    torch_handlers = [h for h in logging.getLogger("torch._inductor").handlers if type(h) is logging.StreamHandler]
    streams = [h.stream for h in torch_handlers]
    assert streams, "torch writes its inductor logs with a StreamHandler of its own"
    code = tune_cli.main(_contact_argv("--no-progress", "--report", str(report), "--peers", "eager,compile"))
    out, err = capfd.readouterr()
    assert code == 0, err
    for where, text in NOISE.items():
        assert text not in out + err, f"{where} output reached the terminal"
    log = report.with_suffix(".third-party.log")
    logged = log.read_text()
    for where, text in NOISE.items():
        assert logged.count(text) == 3, f"{where}: one per shape in the log"
    lines = len(logged.splitlines())
    said = f"other libraries' output (torch.compile, torch's warnings and logs): {lines} lines in {log}"
    assert out.rstrip().endswith(said)
    # pairgen's own output stays on the terminal: a line per shape, the table
    assert out.count("against eager 100.0 µs") == 3 and out.count("against compile 150.0 µs") == 3
    assert out.split("µs = median module call")[1].count("| contact |") == 3
    assert warnings.showwarning is showwarning, "the run's warning filter ends with the run"
    assert [h.stream for h in torch_handlers] == streams, "torch's handlers write where they did before the run"


def test_pairgens_own_warnings_are_not_other_libraries_output(tmp_path):
    from pairgen.tuning.third_party_log import ThirdPartyLog

    with pytest.warns(UserWarning) as shown, ThirdPartyLog(tmp_path / "run.log"):
        warnings.warn_explicit("pairgen: its own", UserWarning, os.path.join(PAIRGEN_DIR, "runtime.py"), 1)
        warnings.warn_explicit("torch's", UserWarning, "/site-packages/torch/_dynamo/utils.py", 1)
    assert [str(w.message) for w in shown] == ["pairgen: its own"]
    logged = (tmp_path / "run.log").read_text()
    assert "torch's" in logged and "pairgen: its own" not in logged


def test_the_quiet_evaluator_is_the_evaluator_but_for_its_peers_output(tmp_path):
    """Reads and settings reach the evaluator it wraps (the tuner and its tests set attributes on
    the evaluator they are given); its baselines' output goes to the log."""
    from pairgen.tuning.third_party_log import ThirdPartyLog

    class Evaluator:
        retiming = False

        def baselines(self):
            print("a peer's autotuning table")
            return {"eager": 2.0}

    inner = Evaluator()
    log = ThirdPartyLog(tmp_path / "third-party.log")
    with log:
        quiet = log.quiet_peers(inner)
        quiet.retiming = True
        assert inner.retiming and quiet.retiming
        assert quiet.baselines() == {"eager": 2.0}
    assert "a peer's autotuning table" in (tmp_path / "third-party.log").read_text()


def test_a_quiet_run_removes_its_empty_log_and_says_none(fake_gpu, capsys):
    assert tune_cli.main(_contact_argv("--no-progress")) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("other libraries' output (torch.compile, torch's warnings and logs): none")
    assert not list((fake_gpu / "cache" / "logs").glob("*.log"))


# ---- Ctrl-C -----------------------------------------------------------------------------------------------

def test_ctrl_c_keeps_the_shapes_done_prints_their_table_and_exits_130(fake_gpu, capsys):
    StandInEvaluator.interrupt_at_shape = 2
    code = tune_cli.main(_contact_argv("--no-progress"))
    out, err = capsys.readouterr()
    assert code == 130 == tune_cli.INTERRUPTED_EXIT
    entries = TunedDB("contact", "fake-gpu").entries()
    assert sorted(e["key"]["n_bucket"] for e in entries) == [64, 128], "the two shapes done are written"
    assert "interrupted: 2 of 3 shape(s) done, their entries written; a search cut short keeps its trials" in out
    closing = out.split("µs = median module call")[1]
    assert closing.count("| contact |") == 2 and "B1 N64 " in closing and "B1 N128 " in closing
    assert "B2 N256" not in closing and "Traceback" not in err
    # The third shape's search resumes: a re-run tunes only it and the finished ones again quickly.
    StandInEvaluator.interrupt_at_shape = None
    assert tune_cli.main(_contact_argv("--no-progress")) == 0
    assert len(TunedDB("contact", "fake-gpu").entries()) == 3


def test_ctrl_c_before_any_shape_is_done_says_so(fake_gpu, capsys):
    StandInEvaluator.interrupt_at_shape = 0
    assert tune_cli.main(_contact_argv("--no-progress")) == 130
    out = capsys.readouterr().out
    assert "interrupted: 0 of 3 shape(s) done" in out and "| contact |" not in out
    assert TunedDB("contact", "fake-gpu").entries() == []


# ---- --seen ---------------------------------------------------------------------------------------------

def _fresh_contact_entry(widths: dict, bucket: int) -> None:
    strategy, params = get_op("contact").default_points[0]
    TunedDB("contact", "fake-gpu").upsert(
        {"key": make_key("float32", widths, bucket), "shape": {"B": 1, "N": bucket, **widths},
         "strategy": strategy, "params": dict(params), "us": 7.5,
         "template_sha256": codegen.template_hash("contact", strategy),
         "source_sha256": render("contact", strategy, params, widths).source_sha256}, arch="sm_90")


def test_seen_tunes_exactly_the_keys_run_without_a_tuned_entry(fake_gpu, capsys):
    trimul_widths = {**MODELS_FORM, "outgoing": 0}
    ran = [("contact", "float32", {"P": 48, "H": 16}, 128),
           ("trimul", "bfloat16", trimul_widths, 512),
           ("contact", "float32", {"P": 64, "H": 32}, 64)]  # tuned since: left out
    for op, dtype, widths, bucket in ran:
        first_use.record_verdict(op, "fake-gpu", dtype, widths, bucket, "0" * 64, "x", 50.0, 20.0)
    first_use.record_verdict("contact", "another-gpu", "float32", {"P": 32, "H": 32}, 64, "0" * 64, "x", 5.0, 9.0)
    _fresh_contact_entry({"P": 64, "H": 32}, 64)

    code = tune_cli.main(["--seen", "--trials", "2", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    tuned = sorted((ev.spec.name, precision_of(ev.spec), json.dumps(ev.shape, sort_keys=True))
                   for ev in StandInEvaluator.made)
    assert tuned == sorted([("contact", "float32", json.dumps({"B": 1, "N": 128, "P": 48, "H": 16}, sort_keys=True)),
                            ("trimul", "bfloat16", json.dumps({"B": 1, "N": 512, **trimul_widths}, sort_keys=True))])
    assert "--seen: 2 key(s) this GPU's processes ran without a tuned entry" in out and "1 more tuned since" in out
    keys = {json.dumps(e["key"], sort_keys=True)
            for op in ("contact", "trimul") for e in TunedDB(op, "fake-gpu").entries()}
    for op, dtype, widths, bucket in ran:
        assert json.dumps(make_key(dtype, widths, bucket), sort_keys=True) in keys, "each key has its entry now"
    assert args_time_budget_of(["--seen"]) is None, "--seen keys get their trials"

    StandInEvaluator.made.clear()
    assert tune_cli.main(["--seen", "--trials", "2", "--no-progress"]) == 0
    assert StandInEvaluator.made == [], "every recorded key is tuned now"
    assert "--seen: no key to tune" in capsys.readouterr().out


def args_time_budget_of(argv):
    return tune_cli.parse_args(argv)[1].time_budget


def test_seen_and_stale_refuse_a_selection(capsys):
    for argv in (["--seen", "--preset", "seed"], ["--seen", "--op", "contact", "--shape", "B=1,N=64,P=64,H=32"],
                 ["--stale", "--precision", "bfloat16"]):
        with pytest.raises(SystemExit) as stop:
            tune_cli.parse_args(argv)
        assert stop.value.code == 2
        assert "picks its own keys: it takes --op, not --shape, --preset or --precision" in capsys.readouterr().err


#: A pairgen-tune process on the CPU (the fixture's stand-ins), whose second shape gets a real
#: SIGINT, as from a terminal's Ctrl-C, in the middle of its search.
SIGINT_RUN = """
import contextlib, os, signal, sys, torch
# As a terminal starts a command: SIGINT delivered and handled by Python (a test runner's worker
# may hand its children SIGINT blocked or ignored, and then no Ctrl-C would arrive).
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from pairgen import compiler, runtime
from pairgen.tuning import evaluate, tune_cli
import test_tuner_main_job as t

class Interrupted(t.StandInEvaluator):
    def evaluate(self, plan):
        if self.number == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return super().evaluate(plan)

tune_cli.gpu_missing = lambda what: False
torch.cuda.current_device = lambda: 0
torch.cuda.device_count = lambda: 1
runtime.device_info = lambda index=0: t.INFO
evaluate.GpuEvaluator = Interrupted
compiler.compile_pool = lambda workers=None: contextlib.nullcontext()
sys.exit(tune_cli.main(t._contact_argv("--no-progress")))
"""


def test_a_real_ctrl_c_exits_130_with_the_shapes_done(tmp_path):
    import subprocess
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PAIRGEN_CACHE_DIR": str(tmp_path / "cache"), "PAIRGEN_TUNED_DIR": str(tmp_path / "tuned"),
           "PYTHONPATH": str(tests.parent)}
    run = subprocess.run([sys.executable, "-c", SIGINT_RUN.format(tests=str(tests))], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 130, run.stderr
    assert "[1/3] contact B1 N64 P64 H32 float32: `" in run.stdout and "[2/3]" not in run.stdout
    assert "interrupted: 1 of 3 shape(s) done, their entries written" in run.stdout
    assert "Traceback" not in run.stderr
    assert [e["key"]["n_bucket"] for e in TunedDB("contact", "fake-gpu", tmp_path / "tuned").entries()] == [64]


def test_compile_workers_leave_ctrl_c_to_the_command():
    """A terminal's Ctrl-C reaches every process of the command: a compile worker that took it
    would die (an idle one printing a traceback) and break the pool the command shuts down."""
    import signal

    with compiler.compile_pool(1) as pool:
        assert pool.submit(signal.getsignal, signal.SIGINT).result(timeout=300) == signal.SIG_IGN


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_seen_without_a_gpu_says_so_in_one_line():
    import subprocess
    from pathlib import Path

    run = subprocess.run([sys.executable, "scripts/tune.py", "--seen"], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "tuning the keys this GPU ran needs a CUDA GPU; none is visible to torch (--dry-run, --status, and "
        "--explain with --gpu/--arch work without one)"]


def test_a_shape_line_names_the_closed_form_where_the_tuner_timed_it():
    """A 16-bit shape's line gives the closed form (what a module runs without a kernel) beside the
    peers, so a kernel that beats eager but not the closed form shows it as it finishes."""
    from pairgen.tuning.tuner import TuneResult

    result = TuneResult("trimul", {"B": 1, "N": 512, "P": 512, "H": 512}, {"label": "wgmma[bfloat16]", "us": 200.0},
                        {"eager": 800.0, "closed_form": 250.0}, {"evaluated": 4}, elapsed_s=3.0)
    line = tune_cli.shape_line(1, 1, tune_cli.ShapeDone("bfloat16", result, True), ("eager",), trials=4)
    assert "200.0 µs against eager 800.0 µs (4.0×) against the closed form 250.0 µs (1.2×); 4 trials" in line, line


def test_the_report_says_what_a_module_runs_where_the_kernel_lost():
    """A kernel slower than the closed form (or, without one timed, than eager) is written but not
    run: the shape's line and the closing table say what a module runs instead, with its time."""
    from pairgen.tuning.tuner import TuneResult

    def done(baselines):
        return tune_cli.ShapeDone("bfloat16", TuneResult(
            "trimul", {"B": 1, "N": 512, "P": 512, "H": 512}, {"label": "wgmma[bfloat16]", "us": 600.0}, baselines,
            {"evaluated": 4}, elapsed_s=3.0), True)

    lost = done({"eager": 800.0, "closed_form": 250.0})
    line = tune_cli.shape_line(1, 1, lost, ("eager",), trials=4)
    assert "(0.4×); a module runs the closed form (250.0 µs); 4 trials" in line, line
    won = done({"eager": 800.0, "closed_form": 700.0})
    assert "a module runs" not in tune_cli.shape_line(1, 1, won, ("eager",), trials=4)
    table = tune_cli.closing_table([lost, won, done({"eager": 500.0})], ("eager",)).splitlines()
    assert "a module runs" in table[0]
    assert [row.split(" | ")[7] for row in table[2:]] == [
        "the closed form (250.0 µs)", "the kernel", "the PyTorch reference (500.0 µs)"]
