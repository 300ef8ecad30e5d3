"""The Optuna search: one study per (GPU, op, dtype, widths, N bucket), in a journal file or a
database (storage.py), so an interrupted run resumes and workers on several GPUs or hosts can share
a study.

Control flow (tested on the CPU with a fake evaluator): ask for trials; prune points that break a
restriction before anything is compiled; compile the rest in parallel, in the background; check
and time each on the GPU as its compile finishes, one at a time; tell; ask for the next. Failures are recorded with their reason and never cached.

What is asked, in order: the default points (and the tuned entry in use); then, whenever nothing
queued is waiting, the neighbourhood of the best point timed so far (every feasible change of one
kernel's parameter group, Strategy.groups) once per best point; the sampler's proposals between
and after (a proposal that breaks a restriction answered with the nearest feasible unseen point).

A failed trial is a verdict on its point (never tried again in this study) unless the failure came
from the machine rather than the point (a compile over the budget, NVRTC not loadable, a compile
worker killed, an interrupted batch): those carry the user attr env_failure=True, and a later run
tries the point again, first. So does a trial failed because its worker died (its heartbeat
lapsed: storage.py), which fails with no reason at all; a live worker tries its point again at once.

Workers that share a study claim a point by holding a RUNNING trial for it (_Search.ask_batch).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import random
import shutil
import statistics
import time
from collections import deque
from concurrent.futures import BrokenExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

from .. import config, files
from . import storage
from ..spec import DeviceLimits, OpSpec, Plan, n_bucket, precision_of
from .settings import SAMPLERS, TuneSettings  # noqa: F401 (importers take them from here too)

log = logging.getLogger("pairgen")


class Evaluator(Protocol):
    limits: DeviceLimits

    def baselines(self) -> dict[str, float]: ...

    def compile(self, plans: list[Plan]) -> list[object]: ...  # a runnable variant, or an Exception

    def evaluate(self, variant) -> float: ...  # median µs; raises when the check or launch fails


@dataclass
class TuneResult:
    op: str
    shape: dict
    best: dict | None                # {"strategy", "params", "us", "label"}
    baselines: dict[str, float]
    counts: dict[str, int] = field(default_factory=dict)
    compile_s_mean: float | None = None
    elapsed_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    #: the other points timed, fastest first, as the entry keeps them (timed_points)
    timed: list[dict] = field(default_factory=list)


def templates_digest(op: str) -> str:
    """12 hex digits over what renders the op's kernels: its strategies' templates and its spec
    module (where plans derive the templates' constants). An edit to either starts a new study, so
    a re-tune never answers a point from timings of the code before the edit."""
    import inspect

    from .. import codegen
    from ..ops import get_op

    spec = get_op(op)
    digest = hashlib.sha256(inspect.getsource(inspect.getmodule(type(spec))).encode())
    for strategy in sorted(spec.strategies):
        digest.update(f"{strategy}={codegen.template_hash(op, strategy)};".encode())
    return digest.hexdigest()[:12]


def study_name(gpu_slug: str, op: str, dtype: str, widths: dict, bucket: int) -> str:
    inner = "-".join(f"{k}{v}" for k, v in sorted(widths.items()))
    return f"{gpu_slug}-{op}-{dtype}-{inner}-n{bucket}-t{templates_digest(op)}"


def _journal(path: Path) -> storage.HeartbeatJournalStorage:
    from optuna.storages.journal import JournalFileBackend

    path.parent.mkdir(parents=True, exist_ok=True)
    repair_journal(path)
    return storage.HeartbeatJournalStorage(JournalFileBackend(str(path)))


# ---- torn journals --------------------------------------------------------------------------------
# Optuna appends each batch of records as JSON lines. A process killed mid-write, or a full disk,
# leaves half a line at the end. Optuna skips it when reading, but the next append lands on the
# same line, and from then on every load of the study fails with a JSONDecodeError naming no file.
# So each journal is checked before Optuna opens it.

def repair_journal(path: Path) -> bool:
    """Keep the journal's leading records that parse; move the whole file aside first when any
    record does not. Returns True when it repaired the journal."""
    from optuna.storages.journal import JournalFileSymlinkLock

    if not path.exists():
        return False
    # The lock Optuna's JournalFileBackend takes to append: another process sharing the study
    # cannot be mid-append (its record looking torn) while the file is read and rewritten.
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        data = path.read_bytes()
        records = _parseable_records(data)
        kept = b"".join(line + b"\n" for line in records)
        if kept == data:
            return False
        aside = _aside_path(path)
        shutil.copyfile(path, aside)
        files.write_atomic(path, kept, durable=True)
    finally:
        lock.release()
    log.warning("%s: a record did not parse (a torn write?); moved the journal to %s and kept the %d "
                "records before it (%d bytes dropped)", path, aside, len(records), len(data) - len(kept))
    return True


def _parseable_records(data: bytes) -> list[bytes]:
    """The journal's lines, up to the first that is not a JSON object. Not the good lines after a
    bad one: Optuna replays records in order, numbering trials as it creates them, so a record
    after a lost one could land on the wrong trial."""
    records = []
    for line in data.split(b"\n"):
        try:
            if not isinstance(json.loads(line), dict):
                break
        except ValueError:  # JSONDecodeError, UnicodeDecodeError; also the empty piece after the last newline
            break
        records.append(line)
    return records


def _aside_path(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():  # a second repair within the same second
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    return aside


def make_sampler(name: str, seed: int):
    """Optuna's sampler called `name` (SAMPLERS). TPE with the constant liar: points other workers
    are timing count as bad until told, so workers sharing a study do not all ask for the same
    region. The GP sampler needs scipy."""
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True, n_startup_trials=16)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=16)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}: one of {', '.join(SAMPLERS)}")


def open_study(name: str, seed: int, storage_dir: Path | None = None, storage_url: str | None = None,
               sampler: str = "random"):
    """The study `name`: in its journal file under storage_dir (default: the cache directory), or in
    the database at storage_url (e.g. postgresql+psycopg://...: how workers on several hosts share;
    storage.StorageError where it cannot be opened); points proposed by `sampler` (SAMPLERS)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage_dir = storage_dir or config.cache_dir() / "studies"
    sampler = make_sampler(sampler, seed)
    if storage_url is not None:
        where = storage.database_storage(storage_url)
    else:
        where = _journal(storage_dir / f"{name}.journal")
    return optuna.create_study(study_name=name, storage=where, sampler=sampler, direction="minimize",
                               load_if_exists=True)


def check_storage(url: str) -> None:
    """Open the database at url as the workers will: storage.StorageError, in one line, where it
    cannot be (a command says so before it starts any work)."""
    storage.database_storage(url)


def _point_key(strategy: str, params: dict) -> str:
    return json.dumps([strategy, params], sort_keys=True)


def _trial_params(strategy: str, params: dict) -> dict:
    """A point as the study's parameters (suggest's names), for enqueue_trial."""
    return {"strategy": strategy, **{f"{strategy}.{k}": v for k, v in params.items()}}


def _enqueue(study, strategy: str, params: dict) -> None:
    """Queue a point as the next trial asked. The waiting trial says which point it is (attr
    queued_point: enqueue_points skips points already waiting); its point attr, the claim, is
    written by the worker that asks it, after the trial's first heartbeat (_Search._ask)."""
    study.enqueue_trial(_trial_params(strategy, params), user_attrs={"queued_point": _point_key(strategy, params)})


def enqueue_first(study, spec: OpSpec, widths: dict, limits: DeviceLimits, extra: list[tuple[str, dict]]) -> None:
    """Default params (and the current tuned entry) are the first trials of a new study. The first
    of `extra` (the entry in use, tune_cli.starting_points) is the study's incumbent, and the first
    feasible default point its default; retime_finalists always times both again."""
    if study.trials:
        return
    queued, first_default = set(), None
    defaults = [(strategy, spec.complete_point(strategy, params) or params) for strategy, params in spec.default_points]
    for strategy, params in [*extra, *defaults]:
        # (whole points: a parameter left out of an enqueued trial is the sampler's to draw)
        key = _point_key(strategy, params)
        if key in queued or spec.infeasible(spec.plan(strategy, params, widths), limits):
            continue
        queued.add(key)
        _enqueue(study, strategy, params)
        if first_default is None and (strategy, params) in defaults:
            first_default = key
    if extra and _point_key(*extra[0]) in queued:
        study.set_user_attr("incumbent", _point_key(*extra[0]))
    if first_default is not None:
        study.set_user_attr("first_default", first_default)


def suggest(trial, spec: OpSpec) -> tuple[str, dict]:
    strategy = trial.suggest_categorical("strategy", sorted(spec.strategies))
    space = spec.strategies[strategy].space
    return strategy, {name: trial.suggest_categorical(f"{strategy}.{name}", list(space[name])) for name in sorted(space)}


def in_one_precision(spec: OpSpec, precision: str | None = None):
    """The op seen in the precision it tunes (`precision`, else the view's, else exact fp32): a
    study holds the points of the strategies that compute in it, never another precision's."""
    return spec if spec.precision else spec.at(precision or precision_of(spec))


def feasible_points(spec: OpSpec, widths: dict, limits: DeviceLimits) -> list[tuple[str, dict]]:
    """Every point of the space that passes the restrictions (up to about ten thousand)."""
    return [(strategy, params) for _, strategy, params in _keyed_feasible_points(spec, widths, limits)]


def _keyed_feasible_points(spec: OpSpec, widths: dict, limits: DeviceLimits) -> tuple:
    """feasible_points as (_point_key, strategy, params), computed once per op, precision, widths
    and limits in a process: enumerating a space takes up to a second, and a process tunes a
    shape's study more than once (a re-run, each worker of a pool of shapes)."""
    view = in_one_precision(spec)
    return _enumerate_feasible(view.op_spec, view.precision, tuple(sorted(widths.items())), limits)


@functools.lru_cache(maxsize=64)
def _enumerate_feasible(op: OpSpec, precision: str, widths: tuple, limits: DeviceLimits) -> tuple:
    view = op.at(precision)
    return tuple((_point_key(name, plan.params), name, plan.params)
                 for name in view.strategies for plan in view.feasible_plans(name, dict(widths), limits))


def feasible_count(spec: OpSpec, widths: dict, limits: DeviceLimits) -> int:
    return len(_keyed_feasible_points(spec, widths, limits))


def feasible_count_up_to(spec: OpSpec, widths: dict, limits: DeviceLimits, most: int) -> int:
    """min(most, feasible_count) without enumerating the whole space where it holds that many: a
    search's target needs only this, and a 16-bit space takes seconds to enumerate whole."""
    view = in_one_precision(spec)
    plans = itertools.chain.from_iterable(view.iter_feasible_plans(name, widths, limits) for name in view.strategies)
    return sum(1 for _ in itertools.islice(plans, most))


def nearest_unseen(spec: OpSpec, widths: dict, limits: DeviceLimits, strategy: str, params: dict,
                   taken: set[str]) -> dict | None:
    """A feasible point of the strategy near `params` that is not in `taken` (_point_key's keys),
    or None where every one is taken. A sampler's proposal that breaks a restriction is answered
    with it: in the 16-bit spaces nearly every point breaks one (at P = H = 512, 360 of the wgmma
    space's 28 M points are feasible), and a sampler that only proposes would seldom find another.
    First the spec's quick repair (nearest_feasible); where it finds none, the feasible point that
    keeps the most of `params`' values (ties: the first in the space's order), from the feasible
    points enumerated once per widths (seconds)."""
    import numpy as np

    view = in_one_precision(spec)
    repaired = view.nearest_feasible(strategy, params, widths, limits,
                                     accept=lambda point: _point_key(strategy, point) not in taken)
    if repaired is not None:
        return repaired
    keys, names, index, values = _feasible_matrix(view.op_spec, view.precision, tuple(sorted(widths.items())),
                                                  limits, strategy)
    proposal = np.array([index[name][repr(params[name])] for name in names], dtype=values.dtype)
    kept = (values == proposal).sum(axis=1)
    for row in np.argsort(-kept, kind="stable"):
        if keys[row] not in taken:
            return json.loads(keys[row])[1]
    return None


def group_neighbours(spec: OpSpec, widths: dict, limits: DeviceLimits, strategy: str,
                     params: dict) -> list[list[dict]]:
    """Per parameter group of the strategy (Strategy.groups: one kernel's shape), the feasible
    points that differ from `params` only in that group's values, every combination of them: the
    neighbourhood the search times around its best point (_Search._expand_best)."""
    view = in_one_precision(spec)
    chosen = view.strategies[strategy]
    per_group, keys = [], {_point_key(strategy, params)}
    for group in chosen.groups:
        names = [name for name in group if name in chosen.space]
        points = []
        for values in itertools.product(*(chosen.space[name] for name in names)):
            point = {**params, **dict(zip(names, values))}
            key = _point_key(strategy, point)
            if key not in keys and not view.infeasible(view.plan(strategy, point, widths), limits):
                keys.add(key)
                points.append(point)
        per_group.append(points)
    return per_group


@functools.lru_cache(maxsize=64)
def _feasible_matrix(op: OpSpec, precision: str, widths: tuple, limits: DeviceLimits, strategy: str) -> tuple:
    """The strategy's feasible points (_enumerate_feasible) as their keys (the space's parameters
    only, as suggest names a point) and a matrix of each one's value indices (`index`: a value's, by
    its repr, so that True and 1 stay apart), for nearest_unseen."""
    import numpy as np

    space = op.at(precision).strategies[strategy].space
    names = sorted(space)
    index = {name: {repr(v): k for k, v in enumerate(space[name])} for name in names}
    points = [{name: params[name] for name in names}
              for _, s, params in _enumerate_feasible(op, precision, widths, limits) if s == strategy]
    values = np.array([[index[name][repr(p[name])] for name in names] for p in points], dtype=np.int16)
    return [_point_key(strategy, p) for p in points], names, index, values.reshape(len(points), len(names))


def _enqueue_unseen(study, points: tuple, taken: set[str], rng) -> None:
    """A sampler proposes seen points again (TPE exploits hard on small categorical spaces; random
    sampling draws with replacement); each such repeat is answered from memory, and an unseen
    feasible point (of `points`, _keyed_feasible_points) is queued in its place."""
    unseen = [(s, p) for key, s, p in points if key not in taken]
    if unseen:
        _enqueue(study, *rng.choice(unseen))


def enqueue_points(study, points: list[str]) -> None:
    """Queue points (as _point_key writes them) to be the next trials asked, but not a point that
    is waiting already (queued by another worker, or for a trial whose worker died)."""
    from optuna.trial import TrialState

    waiting = {t.user_attrs.get("queued_point") for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))}
    for point in dict.fromkeys(points):
        if point not in waiting:
            _enqueue(study, *json.loads(point))


class _Progress:
    def __init__(self, total: int, label: str, enabled: bool, eager_us: float | None):
        self.eager_us = eager_us
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="trial", dynamic_ncols=True)

    def update(self, done: int, best_us: float | None) -> None:
        if self.bar is None:
            return
        self.bar.n = done
        post = {}
        if best_us is not None:
            post["best"] = f"{best_us:.1f}us"
            if self.eager_us:
                post["vs_eager"] = f"{self.eager_us / best_us:.1f}x"
        self.bar.set_postfix(post, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tune_shape(spec: OpSpec, shape: dict, evaluator: Evaluator, gpu_slug: str, settings: TuneSettings,
               extra_points: list[tuple[str, dict]] = (), storage_dir: Path | None = None,
               dtype: str = "float32", shared: bool = False, storage_url: str | None = None) -> TuneResult:
    """Tune one shape to `settings.trials` distinct evaluated points. shared: other processes (one
    per GPU, or per host) run the same study at the same time: each worker claims a point by holding
    a RUNNING trial for it (kept alive by a heartbeat), counts the others' verdicts and claims, asks
    only for the points not yet taken, and leaves once every point taken has its verdict. A dead
    worker's claim lapses with its heartbeat, and a worker still on the study tries its point again."""
    spec = in_one_precision(spec, dtype)
    widths = spec.widths_of(shape)
    limits = evaluator.limits
    name = study_name(gpu_slug, spec.name, dtype, widths, n_bucket(shape["N"]))
    # Workers sharing a study on several hosts are all given the same --seed: each draws its own
    # points (a random sampler with one seed would propose the same sequence in every worker).
    seed = settings.seed + os.getpid() if shared else settings.seed
    study = open_study(name, seed, storage_dir, storage_url, settings.sampler)
    storage.take_over_lapsed(study, enqueue_points)  # an earlier run's worker killed mid-trial: its points queued again
    enqueue_first(study, spec, widths, limits, list(extra_points))
    seen, retry = past_outcomes(study)
    if retry:
        log.info("%d point(s) failed only for environment reasons in an earlier run; trying them again first", len(retry))
        enqueue_points(study, retry)
    baselines = evaluator.baselines()
    if baselines:  # for whoever reads the study's result (a parent of shared workers)
        study.set_user_attr("baselines", baselines)
    # The feasible points, enumerated whole only where a sampler repeats itself (then once per widths
    # in a process: seconds for the 16-bit spaces); the target counts them only up to the trials.
    points = functools.partial(_keyed_feasible_points, spec, widths, limits)
    target = feasible_count_up_to(spec, widths, limits, settings.trials)
    # The time budget is the search's: the baselines (torch.compile) and the enumeration are outside it.
    start = time.perf_counter()
    progress = _Progress(target, f"{spec.name} {' '.join(f'{k}{v}' for k, v in shape.items())}",
                         settings.progress, baselines.get("eager"))
    window = settings.batch or config.compile_workers()

    warned = []

    def time_is_up() -> bool:
        if settings.time_budget_s is None or time.perf_counter() - start <= settings.time_budget_s:
            return False
        if not warned:
            warned.append(log.warning("time budget of %.0f s reached after %d trials", settings.time_budget_s, len(seen)))
        return True

    with storage.Heartbeat(study) as heartbeat:
        search = _Search(study, spec, widths, evaluator, seen, points, target, progress, random.Random(seed),
                         asks_left=20 * max(1, settings.trials),  # sampling repeats or infeasible points cannot loop forever
                         heartbeat=heartbeat, shared=shared)
        search.show_progress()
        try:
            search.run(window, time_is_up)
        except BaseException as exc:  # Ctrl-C, a compile pool that broke, a toolchain that would not load
            search.abandon_running(exc)
            raise
        finally:
            progress.close()
    retime_finalists(study, spec, widths, evaluator, settings)
    counts = {"evaluated": len(seen), **search.counts}
    compile_s_mean = sum(search.compile_times) / len(search.compile_times) if search.compile_times else None
    best = _best(study, spec, widths)
    return TuneResult(spec.name, dict(shape), best, baselines, counts, compile_s_mean,
                      time.perf_counter() - start, search.failures, timed_points(study, best))


def result_from_study(spec: OpSpec, shape: dict, gpu_slug: str, dtype: str, seed: int,
                      storage_dir: Path | None = None, storage_url: str | None = None) -> TuneResult:
    """What shared workers tuned, read back from their study (by the process that writes the entry).
    Its time is the span of the study's trials: from the first start to the last finish."""
    widths = spec.widths_of(shape)
    study = open_study(study_name(gpu_slug, spec.name, dtype, widths, n_bucket(shape["N"])), seed, storage_dir,
                       storage_url)
    verdicts, _ = past_outcomes(study)
    failed = sum(1 for o in verdicts.values() if o.value is None)
    starts = [t.datetime_start for t in study.get_trials(deepcopy=False) if t.datetime_start]
    ends = [t.datetime_complete for t in study.get_trials(deepcopy=False) if t.datetime_complete]
    elapsed_s = (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0
    best = _best(study, spec, widths)
    return TuneResult(spec.name, dict(shape), best, study.user_attrs.get("baselines", {}),
                      {"evaluated": len(verdicts), "failed": failed}, None, elapsed_s, timed=timed_points(study, best))


def retime_points(evaluator: Evaluator, spec: OpSpec, widths: dict, points: list[str], rounds: int) -> dict[str, float]:
    """Each point's median over `rounds` timings, the points timed in turns (so a slow spell of the
    GPU or host falls on all of them alike). A point that fails to compile or to run again is left
    out, with a warning."""
    variants = evaluator.compile([spec.plan(*json.loads(point), widths) for point in points])
    times = {point: [] for point, variant in zip(points, variants) if not isinstance(variant, Exception)}
    for _ in range(rounds):
        for point, variant in zip(points, variants):
            if point in times:
                try:
                    times[point].append(float(evaluator.evaluate(variant)))
                except Exception as exc:  # it passed once: say so, and leave it out
                    log.warning("re-timing %s failed: %s", point, exc)
                    del times[point]
    return {point: statistics.median(runs) for point, runs in times.items() if runs}


def retime_finalists(study, spec: OpSpec, widths: dict, evaluator: Evaluator, settings: TuneSettings) -> dict:
    """Time the best few points again, `retime_rounds` times each, in turns, and keep each one's
    median on the study (user attr "retimed", which _best prefers). The search times a point once,
    and one timing of a short call can be well off: the search's minimum is
    then partly luck, and a longer search only finds luckier timings."""
    from optuna.trial import TrialState

    once: dict[str, float] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        point = t.user_attrs.get("point")
        if point is not None and not t.user_attrs.get("repeat"):
            once[point] = min(once.get(point, float("inf")), t.value)
    finalists = sorted(once, key=once.get)[:settings.finalists]
    # The incumbent and the first default too, wherever their one timing placed them: the search
    # times points while the next ones compile on every core, and a call timed then can lose to
    # points timed once the compiles are done; a re-tune must not replace the old winner, nor pass
    # over the op's best-known point (the kernels' newest variants start there), on such a timing.
    for seeded in (study.user_attrs.get("incumbent"), study.user_attrs.get("first_default")):
        if settings.finalists and seeded in once and seeded not in finalists:
            finalists.append(seeded)
    if len(finalists) < 2:
        if study.user_attrs.get("retimed"):  # an earlier run's: it would hide this run's new points
            study.set_user_attr("retimed", {})
        return {}
    retimed = retime_points(evaluator, spec, widths, finalists, settings.retime_rounds)
    if retimed:
        study.set_user_attr("retimed", retimed)
    return retimed


def _best(study, spec: OpSpec, widths: dict) -> dict | None:
    """The point with the best re-timed median (retime_finalists), else the best single timing."""
    retimed = study.user_attrs.get("retimed") or {}
    if retimed:
        point = min(retimed, key=retimed.get)
        strategy, params = json.loads(point)
        return {"strategy": strategy, "params": params, "us": retimed[point],
                "label": spec.plan(strategy, params, widths).label}
    try:
        trial = study.best_trial
    except ValueError:  # no completed trial
        return None
    strategy, params = json.loads(trial.user_attrs["point"])
    return {"strategy": strategy, "params": params, "us": trial.value,
            "label": spec.plan(strategy, params, widths).label}


#: How many of the points a tune timed besides its winner the tuned entry keeps (the fastest): what
#: the search covered around the winner, so that a point can be looked up before a GPU times it
#: again (scripts/switch_study.py --resources), at a few kilobytes an entry.
TIMED_KEPT = 48


def timed_points(study, best: dict | None) -> list[dict]:
    """The points the study timed besides the winner, fastest first (at most TIMED_KEPT): each one's
    µs (a finalist's re-timed median, as the winner's, else its single timing) and how it differs
    from the winner: "changes", the params whose values differ (all of them where "strategy", its
    strategy, is not the winner's). Failed points are left out."""
    if best is None:
        return []
    verdicts, _ = past_outcomes(study)
    times = {point: outcome.value for point, outcome in verdicts.items() if outcome.value is not None}
    times.update(study.user_attrs.get("retimed") or {})
    winner = _point_key(best["strategy"], best["params"])
    kept = []
    for point in sorted((p for p in times if p != winner), key=times.get)[:TIMED_KEPT]:
        strategy, params = json.loads(point)
        record = {"us": round(times[point], 2)}
        if strategy != best["strategy"]:
            record.update(strategy=strategy, changes=params)
        else:
            record["changes"] = {k: v for k, v in params.items() if best["params"].get(k) != v}
        kept.append(record)
    return kept


# ---- outcomes: verdicts on points, and failures of the machine --------------------------------------

class Outcome(NamedTuple):
    """What trying a point gave: its median µs, or None and why it failed."""

    value: float | None
    reason: str = ""
    #: The machine failed, not the point: no verdict, so a later run tries the point again.
    env_failure: bool = False


#: Exceptions that say the machine failed rather than the point: the toolchain would not load
#: (ImportError; OSError, e.g. NVRTC's library missing), a compile worker died (BrokenExecutor),
#: the host ran out of memory. NVRTC rejecting the source (CompileError), a failed accuracy check
#: and a launch error are none of these: they are verdicts on the point.
ENVIRONMENT_ERRORS = (OSError, ImportError, MemoryError, BrokenExecutor)


def past_outcomes(study) -> tuple[dict[str, Outcome], list[str]]:
    """Per point, the verdict earlier runs of the study reached; and the points to try again:
    those whose only failures were environment failures (a compile over a budget since raised,
    a toolchain since fixed)."""
    from optuna.trial import TrialState

    return _outcomes(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)))


def _outcomes(trials) -> tuple[dict[str, Outcome], list[str]]:
    """past_outcomes of these trials (those not finished are skipped)."""
    from optuna.trial import TrialState

    seen: dict[str, Outcome] = {}
    env_failed: list[str] = []
    for t in trials:
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL):
            continue
        point = t.user_attrs.get("point")
        # A repeat was answered from memory: the trial it repeated holds the verdict (a repeat
        # of a point in flight was told before the original was timed, and would read as a failure).
        if point is None or t.user_attrs.get("repeat"):
            continue
        if t.user_attrs.get("env_failure") or _lapsed(t):
            env_failed.append(point)
        else:
            seen[point] = Outcome(t.value, t.user_attrs.get("fail_reason", ""))
    retry = list(dict.fromkeys(p for p in env_failed if p not in seen))
    return seen, retry


def points_in_order(study) -> list[tuple[str, float | None]]:
    """(point, its single timing, or None where it failed) of each point the study judged, in the
    order the points were asked: what a search of the first k trials saw. Repeats answered from the
    study, pruned proposals, machine failures and dead workers' trials are not points tried."""
    from optuna.trial import TrialState

    trials = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)),
                    key=lambda t: t.number)
    return [(t.user_attrs["point"], t.value) for t in trials
            if "point" in t.user_attrs and not t.user_attrs.get("repeat") and not t.user_attrs.get("env_failure")
            and not _lapsed(t)]


def _lapsed(trial) -> bool:
    """Failed by storage.take_over_lapsed (its worker died holding it): the tuner gives every
    failure it records a fail_reason, and a trial failed for a lapsed heartbeat has none."""
    from optuna.trial import TrialState

    return trial.state == TrialState.FAIL and "fail_reason" not in trial.user_attrs


def _start_compiles(evaluator: Evaluator, plans: list[Plan]) -> list[Callable[[], object]]:
    """Compiles started in the background where the evaluator can (start_compiles), else done now;
    each as a call that waits for its variant (or its compile error)."""
    if not plans:
        return []
    start = getattr(evaluator, "start_compiles", None)
    if start is not None:
        return start(plans)
    return [lambda variant=variant: variant for variant in evaluator.compile(plans)]


def _run_one(evaluator: Evaluator, variant, compile_times: list[float]) -> Outcome:
    if isinstance(variant, Exception):
        return Outcome(None, f"compile failed: {variant}", isinstance(variant, ENVIRONMENT_ERRORS))
    compile_s = getattr(getattr(variant, "compiled", None), "compile_s", None)
    if compile_s is not None:
        compile_times.append(compile_s)
        if compile_s > config.compile_budget_s():
            # The budget is a setting of this run (and a loaded machine compiles slowly): a run
            # with a larger budget must still get to time the point.
            return Outcome(None, f"compile took {compile_s:.1f} s, over the {config.compile_budget_s():.0f} s budget",
                           env_failure=True)
    try:
        return Outcome(float(evaluator.evaluate(variant)))
    except Exception as exc:  # a failed check or launch fails the trial, with its reason
        return Outcome(None, f"{type(exc).__name__}: {exc}", isinstance(exc, ENVIRONMENT_ERRORS))


class _Claims(NamedTuple):
    """A shared study at one look: what the workers have judged, and what they hold."""

    verdicts: dict[str, Outcome]      # per point, the verdict a worker reached
    running: dict[str, list[int]]     # per point, the ids of the RUNNING trials that claim it
    retries: set[str]                 # points with no verdict whose worker died (or whose machine failed them)


def _read_claims(study) -> _Claims:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    running: dict[str, list[int]] = {}
    for t in trials:
        point = t.user_attrs.get("point")
        if t.state == TrialState.RUNNING and point is not None:
            running.setdefault(point, []).append(_trial_id(t))
    verdicts, retries = _outcomes(trials)
    return _Claims(verdicts, running, set(retries))


def _trial_id(trial) -> int:
    """The trial's id in its storage: unique across the studies of a database, and given in the
    order trials are created (Optuna keeps it as the private _trial_id of Trial and FrozenTrial)."""
    return trial._trial_id


class _Search:
    """One tune_shape call's asking and telling: what is known per point (`seen`, shared with the
    caller), the trials asked and not yet told, the counts.

    In a shared study (other workers on it at the same time) a trial is this worker's claim on its
    point: RUNNING, its point attr written, its heartbeat kept. A worker reads the study after
    writing its claim, and keeps the point only where no earlier claim holds it (_claim_holds): no
    point is timed twice. `points()` gives the widths' feasible points (_keyed_feasible_points),
    asked for only when the sampler repeats a point."""

    def __init__(self, study, spec: OpSpec, widths: dict, evaluator: Evaluator, seen: dict[str, Outcome],
                 points, target: int, progress: _Progress, rng: random.Random,
                 asks_left: int, heartbeat: storage.Heartbeat, shared: bool = False):
        self.study, self.spec, self.widths, self.evaluator = study, spec, widths, evaluator
        self.heartbeat, self.shared = heartbeat, shared
        self.seen, self.points, self.target, self.progress, self.rng = seen, points, target, progress, rng
        self.asks_left = asks_left
        self.running: dict[int, object] = {}  # trial number -> trial asked and not yet told
        self.in_flight: set[str] = set()  # points asked for and compiling or waiting to be timed
        self.queued: set[str] = set()  # points queued for pruned proposals (_queue_nearest) and neighbourhoods
        self.expanded: set[str] = set()  # best points whose neighbourhood is queued (_expand_best)
        self.counts = {"pruned": 0, "failed": 0, "env_failed": 0, "repeated": 0, "taken": 0}
        self.compile_times: list[float] = []
        self.failures: list[str] = []
        self.lapses_checked_at = time.monotonic()  # tune_shape checked just before the search

    def ask_batch(self, size: int) -> list[tuple[object, Plan, str]]:
        """Up to `size` trials of distinct unseen feasible points. Proposals that break a
        restriction are pruned, and repeats answered from memory, without compiling anything."""
        from optuna.trial import TrialState

        self._expand_best()
        batch: list[tuple[object, Plan, str]] = []
        while len(batch) < size and self.asks_left > 0:
            self.asks_left -= 1
            trial = self._ask()
            strategy, params = suggest(trial, self.spec)
            point = _point_key(strategy, params)
            trial.set_user_attr("point", point)  # in a shared study, the claim
            plan = self.spec.plan(strategy, params, self.widths)
            reasons = self.spec.infeasible(plan, self.evaluator.limits)
            if reasons:
                trial.set_user_attr("pruned_reason", "; ".join(reasons))
                self._tell(trial, state=TrialState.PRUNED)
                self.counts["pruned"] += 1
                self._queue_nearest(strategy, params)
                continue
            holds = not self.shared or self._claim_holds(trial, point)  # also learns the others' verdicts
            if point in self.seen or point in self.in_flight:
                trial.set_user_attr("repeat", True)
                self._tell_outcome(trial, self.seen.get(point, Outcome(None, "repeated while in flight")))
                self.counts["repeated"] += 1
                _enqueue_unseen(self.study, self.points(), set(self.seen) | self.in_flight, self.rng)
            elif not holds:
                trial.set_user_attr("taken", True)  # another worker has it, or the target is reached: no verdict here
                self._tell(trial, state=TrialState.PRUNED)
                self.counts["taken"] += 1
                break  # the others may have taken every point left: the caller counts again
            else:
                self.in_flight.add(point)
                batch.append((trial, plan, point))
        return batch

    def _expand_best(self) -> None:
        """Once no queued point is waiting (the default points, repairs, retries go first), queue
        the unseen points of the best point's neighbourhood (group_neighbours), the groups in turn
        and each group's points in a random order, once per best point: a local search beside the
        sampler, whose proposals are asked again once the neighbourhood is. The points expanded are
        kept in the study (`expanded`), so a resumed run or another worker on a shared study does
        not queue them again."""
        from optuna.trial import TrialState

        timed = [(outcome.value, point) for point, outcome in self.seen.items() if outcome.value is not None]
        if not timed:
            return
        best = min(timed)[1]
        strategy, params = json.loads(best)
        if best in self.expanded or not self.spec.strategies[strategy].groups:
            return
        self.expanded.update(self.study.user_attrs.get("expanded", ()))
        if best in self.expanded or self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return
        self.expanded.add(best)
        self.study.set_user_attr("expanded", sorted(self.expanded))
        taken = set(self.seen) | self.in_flight | self.queued
        per_group = []
        for points in group_neighbours(self.spec, self.widths, self.evaluator.limits, strategy, params):
            points = [point for point in points if _point_key(strategy, point) not in taken]
            self.rng.shuffle(points)
            per_group.append(points)
        # the groups in turn, so that a search cut short has tried every kernel's shapes alike
        for point in itertools.chain.from_iterable(itertools.zip_longest(*per_group)):
            if point is not None:
                self.queued.add(_point_key(strategy, point))
                _enqueue(self.study, strategy, point)

    def _queue_nearest(self, strategy: str, params: dict) -> None:
        """The nearest feasible point to a pruned proposal (nearest_unseen), queued as the next
        trial asked, unless it is seen, in flight or queued already."""
        taken = set(self.seen) | self.in_flight | self.queued
        nearest = nearest_unseen(self.spec, self.widths, self.evaluator.limits, strategy, params, taken)
        if nearest is not None:
            self.queued.add(_point_key(strategy, nearest))
            _enqueue(self.study, strategy, nearest)

    def _claim_holds(self, trial, point: str) -> bool:
        """Whether this trial keeps its claim on `point` in a shared study (False: it gives it up).

        The claim (this RUNNING trial, its point attr written) is made before the study is read,
        so of two claims on a point the later-read one sees the other. The earlier trial (lower id)
        keeps the point: a later one gives it up on seeing it, and one that read the study before
        this claim was made times the point, so this one waits for it and then finds its verdict.
        The claim is also given up when the verdicts and the earlier claims on other points fill
        the study's target (a worker that counted the points left before they were made would
        ask for one too many), unless the point is a dead worker's: it was counted in the target
        when it was claimed, and is tried again whatever the count."""
        mine = _trial_id(trial)
        pause = 0.05
        while True:
            claims = _read_claims(self.study)
            self.seen.update(claims.verdicts)
            others = [other for other in claims.running.get(point, ()) if other != mine]
            if point in self.seen or any(other < mine for other in others):
                return False
            if not others:
                break
            time.sleep(pause)  # later claims on the point: they give it up, or time it
            pause = min(2 * pause, 1.0)
            self._take_over_lapsed_now_and_then()  # one of them may be a dead worker's
        if point in claims.retries:
            return True
        earlier = {p for p, ids in claims.running.items() if p != point and min(ids) < mine}
        return len(set(self.seen) | earlier) < self.target

    def points_left(self, in_flight: int) -> int:
        """How many points are still to be asked for: the target less the points with a verdict and
        those claimed (`in_flight` by this worker; shared, by any live worker, whose claims the
        study holds). A point whose worker died is claimed until its heartbeat lapses, then free."""
        if not self.shared:
            return self.target - len(self.seen) - in_flight
        self._take_over_lapsed_now_and_then()
        claims = _read_claims(self.study)
        self.seen.update(claims.verdicts)
        return self.target - len(set(self.seen) | set(claims.running))

    def _take_over_lapsed_now_and_then(self) -> None:
        """storage.take_over_lapsed, twice a heartbeat interval at most: it is a query of its own."""
        if time.monotonic() - self.lapses_checked_at >= storage.HEARTBEAT_INTERVAL_S / 2:
            self.lapses_checked_at = time.monotonic()
            storage.take_over_lapsed(self.study, enqueue_points)

    def others_running(self) -> bool:
        """Whether other workers still hold points of this shared study (this worker holds none
        when it asks). The study is not done before their verdicts are in, and one of them may be a
        dead worker's, to be taken over when its heartbeat lapses."""
        return self.shared and bool(_read_claims(self.study).running)

    def run(self, window: int, time_is_up: Callable[[], bool]) -> None:
        """Keep up to `window` points compiling, and check and time each (on the GPU, one at a
        time, oldest first) as soon as its compile is done, asking for the next point as one
        finishes. The CPUs compile while the GPU times: with compiles in batches, each waited for
        the other, and the compile of a batch did not get shorter with more GPUs on the study.
        Shared, it returns once no worker holds a point of the study: the workers run out of points
        to ask for at the same moment, so they wait for each other's last few points only."""
        pending: deque[tuple[tuple[object, Plan, str], Callable[[], object]]] = deque()
        while True:
            # points_left reads the study (shared): only when there is room to ask
            room = window - len(pending)
            if room > 0:
                room = min(room, self.points_left(len(pending)))
            if room > 0 and self.asks_left > 0 and not time_is_up():
                batch = self.ask_batch(room)
                pending.extend(zip(batch, _start_compiles(self.evaluator, [plan for _, plan, _ in batch])))
                if len(batch) < room:
                    continue  # stopped at a point another worker took (or out of asks): count again
            if not pending:
                if not self.others_running():
                    return
                time.sleep(min(1.0, storage.HEARTBEAT_INTERVAL_S / 2))
                continue
            (trial, plan, point), variant = pending.popleft()
            outcome = _run_one(self.evaluator, variant(), self.compile_times)
            self._tell_outcome(trial, outcome)
            self._record(plan, point, outcome)

    def abandon_running(self, exc: BaseException) -> None:
        """Fail the trials asked and not told as environment failures. Left running they would
        hold their points until their heartbeat lapsed, and the sampler (constant liar) would count
        them as bad points meanwhile; failed as env failures, a later run tries them again."""
        reason = f"not evaluated: the run stopped ({type(exc).__name__}: {exc})"
        for trial in list(self.running.values()):
            try:
                self._tell_outcome(trial, Outcome(None, reason, env_failure=True))
            except Exception as tell_exc:  # the storage itself may be what failed; keep the original error
                log.warning("could not record trial %d as abandoned: %s", trial.number, tell_exc)

    def show_progress(self) -> None:
        values = [o.value for o in self.seen.values() if o.value is not None]
        self.progress.update(min(len(self.seen), self.target), min(values) if values else None)

    def _ask(self):
        with storage.quiet_heartbeat_warnings():
            trial = self.study.ask()
        self.running[trial.number] = trial
        # Before the claim (the point attr) is written: a claim without a heartbeat would never be
        # found stale, and would hold its point, and the workers waiting on it, for ever.
        self.heartbeat.add(_trial_id(trial))
        return trial

    def _tell_outcome(self, trial, outcome: Outcome) -> None:
        from optuna.trial import TrialState

        if outcome.value is not None:
            self._tell(trial, outcome.value)
            return
        trial.set_user_attr("fail_reason", outcome.reason[:4000] or "?")
        if outcome.env_failure:
            trial.set_user_attr("env_failure", True)
        self._tell(trial, state=TrialState.FAIL)

    def _tell(self, trial, value: float | None = None, state=None) -> None:
        self.study.tell(trial, value, state=state)
        del self.running[trial.number]
        self.heartbeat.remove(_trial_id(trial))

    def _record(self, plan: Plan, point: str, outcome: Outcome) -> None:
        # In this run an env-failed point counts as seen too: the same machine would fail it again.
        # (It is no verdict for the other workers on a shared study: one of them may try it.)
        self.seen[point] = outcome
        self.in_flight.discard(point)
        if outcome.value is None:
            self.counts["failed"] += 1
            self.counts["env_failed"] += outcome.env_failure
            first_line = outcome.reason.splitlines()[0] if outcome.reason else "?"
            self.failures.append(f"{plan.label}: {first_line}"
                                 + (" (environment: tried again next run)" if outcome.env_failure else ""))
        self.show_progress()
