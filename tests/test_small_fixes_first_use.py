"""First-use verdicts written by several processes at once are all kept: each process reads the
file, adds its verdict and replaces the file, so without a lock around that the last writer drops
the others' verdicts."""
from __future__ import annotations

import multiprocessing

from pairgen import first_use

PROCESSES = 4
VERDICTS_EACH = 40
SOURCE = "0" * 64


def _record_many(tuned_dir: str, worker: int, start) -> None:
    import os

    os.environ["PAIRGEN_TUNED_DIR"] = tuned_dir
    start.wait()  # every process writes at the same time
    for k in range(VERDICTS_EACH):
        first_use.record_verdict("contact", "test-gpu", "float32", {"P": 64, "H": 8 * worker + 8}, 2 ** k, SOURCE,
                                 "default", 1.0, 2.0)


def test_concurrent_processes_keep_every_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(PROCESSES)
    workers = [ctx.Process(target=_record_many, args=(str(tmp_path), w, start)) for w in range(PROCESSES)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert [w.exitcode for w in workers] == [0] * PROCESSES
    verdicts = first_use.load_verdicts(first_use.verdict_path("contact", "test-gpu"))
    keys = {(v["key"]["widths"]["H"], v["key"]["n_bucket"]) for v in verdicts}
    assert len(verdicts) == len(keys) == PROCESSES * VERDICTS_EACH
    assert not [p.name for p in (tmp_path / "test-gpu" / "first-use").iterdir() if p.name.endswith(".tmp")
                or p.name.startswith(".contact.json.")], "a temp file was left behind"
