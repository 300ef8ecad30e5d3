"""Several tuning workers on one study (one per GPU or host): on the CPU with a fake evaluator in
separate processes. No point is compiled and timed twice, none is lost (every attempted point has
its verdict in the study), the work is shared; a dead worker's claim is taken over."""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from pairgen.ops.contact import CONTACT
from pairgen.tuning.tuner import PointClaims, TuneSettings, _point_key, open_study, past_outcomes, study_name, tune_shape
from test_tuner import SHAPE, WIDTHS, FakeEvaluator


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
        time.sleep(0.005)  # long enough for the workers' batches to overlap
        return super().evaluate(plan)


class StreamingLoggingEvaluator(LoggingEvaluator):
    """Compiles in a background thread, as GpuEvaluator does on its pool: points stay in flight
    (claimed, not yet timed) while the worker asks for more."""

    def __init__(self, log_path: str, pool):
        super().__init__(log_path)
        self.pool = pool

    def start_compiles(self, plans):
        return [self.pool.submit(lambda p=p: self.compile([p])[0]).result for p in plans]


def _worker(storage: str, log_path: str, trials: int, seed: int, streaming: bool) -> None:
    from concurrent.futures import ThreadPoolExecutor

    settings = TuneSettings(trials=trials, batch=4, progress=False, seed=seed, finalists=0)  # as --devices workers
    with ThreadPoolExecutor(2) as pool:
        evaluator = StreamingLoggingEvaluator(log_path, pool) if streaming else LoggingEvaluator(log_path)
        tune_shape(CONTACT, SHAPE, evaluator, "fake-gpu", settings, storage_dir=Path(storage), shared=True)


@pytest.mark.parametrize("streaming", [False, True], ids=["compile-then-time", "streaming"])
def test_workers_share_a_study_without_losing_or_doubling_a_point(tmp_path, streaming):
    ctx = multiprocessing.get_context("spawn")
    logs = [tmp_path / f"worker{k}.log" for k in range(3)]
    workers = [ctx.Process(target=_worker, args=(str(tmp_path), str(log), 30, k, streaming))
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


def _dead_pid() -> int:
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(target=time.sleep, args=(0,))
    process.start()
    process.join()
    return process.pid


def test_claims_are_exclusive_and_a_dead_workers_claim_is_taken_over(tmp_path):
    claims = PointClaims(tmp_path)
    assert claims.claim("p1", 1) == (True, None)
    assert PointClaims(tmp_path).claim("p1", 2) == (False, None), "held by a live process (this one)"
    claims.release("p1")
    assert claims.claim("p1", 3) == (True, None)

    dead = {"host": os.uname().nodename, "pid": _dead_pid(), "trial": 7, "time": time.time()}
    claims._path("p2").write_text(json.dumps(dead))
    assert claims.claim("p2", 4) == (True, 7), "its worker is gone: taken over, its trial named"

    recent = {"host": "elsewhere", "pid": 1, "trial": 8, "time": time.time()}
    claims._path("p3").write_text(json.dumps(recent))
    assert claims.claim("p3", 5) == (False, None), "another host's recent claim stands"
    old = {**recent, "time": time.time() - 2 * claims.stale_after_s}
    claims._path("p4").write_text(json.dumps(old))
    assert claims.claim("p4", 6) == (True, 8), "another host's claim older than stale_after_s is taken over"


def test_a_finished_points_claim_outlives_its_worker(tmp_path):
    """A worker that reached the target and exited leaves claims of points with verdicts: those
    are final (a later worker that took them over timed a point twice)."""
    claims = PointClaims(tmp_path)
    done = {"host": os.uname().nodename, "pid": _dead_pid(), "done": True}
    claims._path("p").write_text(json.dumps(done))
    assert claims.claim("p", 1) == (False, None)


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
