"""Where the tuner's Optuna studies live, and how a worker's claim on a point stays alive.

A study is in a journal file (the default: one host, a file per study under the cache folder) or in
a database named by a URL (`pairgen-tune --storage`: every host that names the URL shares the
studies, and the database is all the hosts share).

A worker claims a point by holding a RUNNING trial for it (tuner._Search). While it holds any, a
thread records their heartbeat every HEARTBEAT_INTERVAL_S. A trial whose heartbeat has lapsed for
GRACE_PERIOD_S belongs to a worker that died (killed, out of memory, its host down): the next
worker that checks (take_over_lapsed, as optuna.storages.fail_stale_trials) queues its point again
and fails it. Optuna's RDBStorage has this heartbeat; Optuna's JournalStorage (5.1) has not, and
HeartbeatJournalStorage adds it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import warnings
from typing import Callable

from optuna.exceptions import ExperimentalWarning, UpdateFinishedTrialError
from optuna.storages import JournalStorage, RDBStorage
# Not exported by optuna.storages, but the interface its heartbeat storages have.
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import TrialState

log = logging.getLogger("pairgen")

#: How often a worker records that its trials are alive. The heartbeat is a thread of its own, so
#: a long compile or timing does not delay it.
HEARTBEAT_INTERVAL_S = 20
#: How long a trial's heartbeat may lapse before another worker takes its point over: several
#: intervals, so a database (or journal file system) that is slow for a while fails no live worker.
GRACE_PERIOD_S = 120

#: The system attr a journal trial's heartbeat is kept in (seconds since the epoch, the worker's clock).
JOURNAL_HEARTBEAT_ATTR = "pairgen:heartbeat"


class StorageError(Exception):
    """A storage URL that cannot be opened; the message is one line, for the command to print."""


@contextlib.contextmanager
def quiet_heartbeat_warnings():
    """Optuna marks its heartbeat experimental, and warns that it is meant for Study.optimize: the
    tuner asks and tells trials itself and keeps the heartbeat itself (Heartbeat below)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        yield


@functools.lru_cache(maxsize=None)
def database_storage(url: str) -> RDBStorage:
    """The Optuna RDBStorage at `url`, heartbeat on: one per URL in a process (its engine holds a
    pool of connections). Raises StorageError, in one line, where it cannot be opened."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StorageError(f"--storage {url!r} is not a database URL such as "
                           "postgresql+psycopg://user:password@host:5432/pairgen") from None
    shown = parsed.render_as_string(hide_password=True)
    # pool_pre_ping: a tuning run outlives a connection the server or a firewall dropped.
    engine_kwargs: dict = {"pool_pre_ping": True}
    if parsed.get_backend_name() in ("postgresql", "mysql"):
        engine_kwargs["connect_args"] = {"connect_timeout": 10}  # a host that drops packets: an error, not a hang
    try:
        with quiet_heartbeat_warnings():
            return _with_retry(lambda: RDBStorage(url, engine_kwargs=engine_kwargs,
                                                  heartbeat_interval=HEARTBEAT_INTERVAL_S,
                                                  grace_period=GRACE_PERIOD_S))
    except (SQLAlchemyError, ImportError) as exc:
        raise StorageError(f"--storage {shown}: cannot open it: {_first_line(exc)}{_hint(exc)}") from None


def _with_retry(open_storage: Callable[[], RDBStorage]) -> RDBStorage:
    """Open, trying again when the tables were being created by another process at the same moment
    (hosts started together on a new database: both create Optuna's tables, one of them fails)."""
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(3):
        try:
            return open_storage()
        except (IntegrityError, ProgrammingError):
            if attempt == 2:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def _first_line(exc: BaseException) -> str:
    """The driver's own message: SQLAlchemy prefixes the driver's class and appends a link line."""
    cause = exc.__cause__ or exc
    text = str(getattr(exc, "orig", None) or cause) or type(exc).__name__
    return text.strip().splitlines()[0]


def _hint(exc: BaseException) -> str:
    from sqlalchemy.exc import ArgumentError

    if isinstance(exc, ImportError):
        return " (the URL's database driver is not installed; for PostgreSQL: pip install -e \".[cluster]\", psycopg)"
    if isinstance(exc, ArgumentError):  # an unknown dialect or driver
        return " (a URL such as postgresql+psycopg://user:password@host:5432/pairgen)"
    if "does not exist" in str(exc):
        return " (create it first: docs/multi-host.md)"
    return " (docs/multi-host.md: start a server, create the database)"


class HeartbeatJournalStorage(JournalStorage, BaseHeartbeat):
    """A journal file with Optuna's heartbeat interface, so take_over_lapsed (and Optuna's
    fail_stale_trials) treat it as they treat a database. A trial's heartbeat is a system attr holding the worker's clock:
    right for a journal on one host, and for one on a file system shared by hosts whose clocks
    agree to well within GRACE_PERIOD_S."""

    def record_heartbeat(self, trial_id: int) -> None:
        try:
            self.set_trial_system_attr(trial_id, JOURNAL_HEARTBEAT_ATTR, time.time())
        except UpdateFinishedTrialError:  # told between the worker's last look and this beat
            pass

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        now = time.time()
        running = self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
        return [t._trial_id for t in running if now - self._last_sign_of_life(t) > GRACE_PERIOD_S]

    @staticmethod
    def _last_sign_of_life(trial) -> float:
        """Its last beat; else its start (its worker died before the first beat, or the trial was
        left RUNNING by a pairgen without heartbeats): on one host, the clock that wrote both."""
        if JOURNAL_HEARTBEAT_ATTR in trial.system_attrs:
            return trial.system_attrs[JOURNAL_HEARTBEAT_ATTR]
        return trial.datetime_start.timestamp() if trial.datetime_start else time.time()

    def get_heartbeat_interval(self) -> int:
        return HEARTBEAT_INTERVAL_S

    def get_heartbeat_stale_trial_callback(self) -> None:
        return None  # take_over_lapsed queues the points itself


def take_over_lapsed(study, requeue: Callable[[object, list[str]], None]) -> None:
    """Fail the study's trials whose heartbeat lapsed, as optuna.storages.fail_stale_trials does, but
    queue each one's point first, with requeue(study, [point]): a worker that finds the point free
    then finds a trial waiting to take it, and asks for that, not for another point."""
    heartbeat_storage = study._storage  # Optuna's Study has no public accessor for its storage
    for trial_id in heartbeat_storage._get_stale_trial_ids(study._study_id):
        trial = heartbeat_storage.get_trial(trial_id)
        if trial.state != TrialState.RUNNING:
            continue
        point = trial.user_attrs.get("point")
        if point is not None:
            requeue(study, [point])
        try:
            heartbeat_storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
        except UpdateFinishedTrialError:  # another worker took it over first (its copy of the point is a repeat)
            continue
        log.warning("trial %d's worker stopped (its heartbeat lapsed): its point is tried again: %s",
                    trial.number, point)


class Heartbeat:
    """Records, every HEARTBEAT_INTERVAL_S, that this worker's running trials are alive. Used as a
    context manager around a search; add() each trial when asked (it beats at once: a trial with
    no beat is never found stale), remove() it when told."""

    def __init__(self, study):
        self.storage = study._storage
        self.trial_ids: set[int] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat_until_stopped, name="pairgen-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stopped.set()
        self.thread.join()

    def add(self, trial_id: int) -> None:
        with self.lock:
            self.trial_ids.add(trial_id)
        self._beat(trial_id)

    def remove(self, trial_id: int) -> None:
        with self.lock:
            self.trial_ids.discard(trial_id)

    def _beat_until_stopped(self) -> None:
        while not self.stopped.wait(HEARTBEAT_INTERVAL_S):
            with self.lock:
                trial_ids = list(self.trial_ids)
            for trial_id in trial_ids:
                self._beat(trial_id)

    def _beat(self, trial_id: int) -> None:
        try:
            self.storage.record_heartbeat(trial_id)
        except Exception as exc:  # a database hiccup: the next beat may get through, within the grace period
            log.warning("could not record the heartbeat of trial id %d: %s", trial_id, _first_line(exc))
