"""Several tuning workers on one study (one per GPU or host): on the CPU with a fake evaluator in
separate processes. No point is compiled and timed twice, none is lost (every attempted point has
its verdict in the study), the work is shared. A worker's claim on a point is its RUNNING trial,
respected while its heartbeat is kept and taken over once it lapses. (tests/test_tuner_cluster.py
runs pairgen-tune itself on several stand-in hosts, on PostgreSQL and on a journal, and kills a
worker mid-trial.)"""
from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pairgen.ops.contact import CONTACT
from pairgen.tuning import storage
from pairgen.tuning.tuner import (TuneSettings, _point_key, enqueue_points, in_one_precision, open_study, past_outcomes,
                                   study_name, suggest, tune_shape)
from test_tuner import SHAPE, WIDTHS, FakeEvaluator, _settings


class LoggingEvaluator(FakeEvaluator):
    """Appends every point it is asked to compile (attempted: timed, or failed to compile) to a file."""

    def __init__(self, log_path: str):
        super().__init__()
        self.log_path = log_path

    def compile(self, plans):
        with open(self.log_path, "a") as handle:
            handle.writelines(_point_key(p.strategy, p.params) + "\n" for p in plans)
        return super().compile(plans)

    def evaluate(self, plan):
        time.sleep(0.06)  # long enough for the workers' batches to overlap, on a loaded 2-core machine too
        return super().evaluate(plan)


class StreamingLoggingEvaluator(LoggingEvaluator):
    """Compiles in a background thread, as GpuEvaluator does on its pool: points stay in flight
    (claimed, not yet timed) while the worker asks for more."""

    def __init__(self, log_path: str, pool):
        super().__init__(log_path)
        self.pool = pool

    def start_compiles(self, plans):
        return [self.pool.submit(lambda p=p: self.compile([p])[0]).result for p in plans]


def _worker(storage: str, log_path: str, trials: int, seed: int, streaming: bool, start) -> None:
    from concurrent.futures import ThreadPoolExecutor

    start.wait(timeout=120)  # every worker has imported and starts tuning at once, so the sharing cannot be raced away
    settings = TuneSettings(trials=trials, batch=4, progress=False, seed=seed, finalists=0)  # as --devices workers
    with ThreadPoolExecutor(2) as pool:
        evaluator = StreamingLoggingEvaluator(log_path, pool) if streaming else LoggingEvaluator(log_path)
        tune_shape(CONTACT, SHAPE, evaluator, "fake-gpu", settings, storage_dir=Path(storage), shared=True)


@pytest.mark.parametrize("streaming", [False, True], ids=["compile-then-time", "streaming"])
def test_workers_share_a_study_without_losing_or_doubling_a_point(tmp_path, streaming):
    ctx = multiprocessing.get_context("spawn")
    logs = [tmp_path / f"worker{k}.log" for k in range(3)]
    start = ctx.Barrier(3)
    workers = [ctx.Process(target=_worker, args=(str(tmp_path), str(log), 30, k, streaming, start))
               for k, log in enumerate(logs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=180)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    attempted = [line for log in logs if log.exists() for line in log.read_text().splitlines()]
    assert len(attempted) == len(set(attempted)), "a point was compiled and timed by two workers"
    study = open_study(study_name("fake-gpu", "contact", "float32", WIDTHS, 64), 0, tmp_path)
    verdicts, _ = past_outcomes(study)
    assert set(verdicts) == set(attempted), "every attempted point has its verdict in the study, and only those"
    # Workers ask only for points no one has taken, so the study ends at the target; two workers
    # counting at the same moment can each ask for the last few (at most a batch each beyond it).
    assert 30 <= len(verdicts) <= 30 + 2 * 4
    assert sum(1 for log in logs if log.exists() and log.read_text()) >= 2, "the work was shared"


NAME = study_name("fake-gpu", "contact", "float32", WIDTHS, 64)


@pytest.fixture
def short_heartbeat(monkeypatch):
    monkeypatch.setattr(storage, "HEARTBEAT_INTERVAL_S", 1)
    monkeypatch.setattr(storage, "GRACE_PERIOD_S", 2)


def _claim_by_another_worker(directory: Path, beat: bool = True) -> tuple[str, int]:
    """A claim as a worker on another process or host leaves it: a RUNNING trial for a point (the
    first default point), its heartbeat recorded once and then never again (beat=False: never, as
    a pairgen before heartbeats left it)."""
    spec = in_one_precision(CONTACT, "float32")  # the study's view of the op, as tune_shape's
    study = open_study(NAME, 0, directory)
    enqueue_points(study, [_point_key(*spec.default_points[0])])
    with storage.quiet_heartbeat_warnings():
        trial = study.ask()
    point = _point_key(*suggest(trial, spec))
    trial.set_user_attr("point", point)
    if beat:
        study._storage.record_heartbeat(trial._trial_id)
    return point, trial.number


def test_a_claim_holds_while_its_heartbeat_lasts_and_is_taken_over_when_it_lapses(tmp_path, short_heartbeat, caplog):
    point, number = _claim_by_another_worker(tmp_path)
    ev = FakeEvaluator()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pairgen"):
        result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(6), storage_dir=tmp_path, shared=True)
    compiled = [_point_key(p.strategy, p.params) for p in ev.compiled]
    assert compiled.count(point) == 1 and compiled[-1] == point, "the claimed point waited for its claim to lapse"
    assert time.monotonic() - started >= storage.GRACE_PERIOD_S
    assert f"trial {number}'s worker stopped" in caplog.text
    study = open_study(NAME, 0, tmp_path)
    lapsed = study.trials[number]
    assert lapsed.state.name == "FAIL" and "fail_reason" not in lapsed.user_attrs
    verdicts, retry = past_outcomes(study)
    assert point in verdicts and not retry and result.counts["evaluated"] == len(verdicts) == 6


@pytest.mark.parametrize("beat", [True, False], ids=["heartbeat", "no-heartbeat"])
def test_a_run_after_a_killed_one_tries_its_running_points_again_first(tmp_path, short_heartbeat, beat):
    """A worker killed mid-trial (SIGKILL: no chance to record anything) and the study run again
    later, by one worker: the killed trial's heartbeat has lapsed (or, never recorded, its start
    is as old), and its point is tried first."""
    point, _ = _claim_by_another_worker(tmp_path, beat)
    time.sleep(storage.GRACE_PERIOD_S + 0.5)
    ev = FakeEvaluator()
    tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(3), storage_dir=tmp_path)
    assert _point_key(ev.compiled[0].strategy, ev.compiled[0].params) == point


def test_a_study_in_an_optuna_storage_url(tmp_path):
    """--storage: any Optuna storage (here SQLite; PostgreSQL is how several hosts share)."""
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    settings = TuneSettings(trials=6, batch=3, progress=False)
    result = tune_shape(CONTACT, SHAPE, FakeEvaluator(), "fake-gpu", settings, storage_dir=tmp_path, storage_url=url,
                        shared=True)
    assert result.counts["evaluated"] == 6
    study = open_study(study_name("fake-gpu", "contact", "float32", WIDTHS, 64), 0, None, url)
    assert len(past_outcomes(study)[0]) == 6 and study.user_attrs["baselines"]["eager"] == 200.0
    assert not list(tmp_path.glob("*.journal")), "nothing written to a journal file"


def test_an_unreachable_storage_is_one_line_and_exit_2():
    """Port 1 of this machine's loopback: nothing listens there (without the driver, the line says
    to install it: pip install -e ".[test]" has none). The password is never printed."""
    url = "postgresql+psycopg://pairgen:s3cret@127.0.0.1:1/pairgen"
    run = subprocess.run([sys.executable, "scripts/tune.py", "--storage", url, "--op", "contact", "--shape",
                          "B=1,N=64,P=64,H=32"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith("pairgen-tune: --storage postgresql+psycopg://pairgen:***@127.0.0.1:1/pairgen")
    assert "s3cret" not in run.stderr
    if importlib.util.find_spec("psycopg") is None:
        assert 'the URL\'s database driver is not installed; for PostgreSQL: pip install -e ".[cluster]"' in run.stderr
    else:
        assert "multi-host.md" in run.stderr


@pytest.mark.parametrize("url, says", [("nonsense", "is not a database URL"), ("nosuchdb://x", "Can't load plugin")])
def test_a_storage_that_is_not_a_database_url_is_refused_in_one_line(url, says):
    from pairgen.tuning.tune_cli import storage_problem

    problem = storage_problem(url)
    assert says in problem and "\n" not in problem and "postgresql+psycopg://" in problem
