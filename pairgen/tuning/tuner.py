"""The Optuna search: one study per (GPU, op, dtype, widths, N bucket), in journal storage, so an
interrupted run resumes and processes on several GPUs can share a study.

Control flow (tested on the CPU with a fake evaluator): ask a batch of trials; prune points that
break a restriction before anything is compiled; compile the rest in parallel; check and time
them one at a time on the GPU; tell. Failures are recorded with their reason and never cached.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .. import config
from ..ops.base import DeviceLimits, OpSpec, Plan, n_bucket

log = logging.getLogger("pairgen")


class Evaluator(Protocol):
    limits: DeviceLimits

    def baselines(self) -> dict[str, float]: ...

    def compile(self, plans: list[Plan]) -> list[object]: ...  # a runnable variant, or an Exception

    def evaluate(self, variant) -> float: ...  # median µs; raises when the check or launch fails


@dataclass
class TuneSettings:
    trials: int = 64                 # distinct points checked and timed (pruned points not counted)
    time_budget_s: float | None = None
    batch: int | None = None         # trials compiled together (default: compile workers)
    seed: int = 0
    progress: bool = True


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


def templates_digest(op: str) -> str:
    """12 hex digits over the op's strategies' template hashes: a template edit starts a new
    study, so a re-tune never answers a point from timings of the code before the edit."""
    from .. import codegen
    from ..ops import get_op

    digest = hashlib.sha256()
    for strategy in sorted(get_op(op).strategies):
        digest.update(f"{strategy}={codegen.template_hash(op, strategy)};".encode())
    return digest.hexdigest()[:12]


def study_name(gpu_slug: str, op: str, dtype: str, widths: dict, bucket: int) -> str:
    inner = "-".join(f"{k}{v}" for k, v in sorted(widths.items()))
    return f"{gpu_slug}-{op}-{dtype}-{inner}-n{bucket}-t{templates_digest(op)}"


def _storage(path: Path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def open_study(name: str, seed: int, storage_dir: Path | None = None):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage_dir = storage_dir or config.cache_dir() / "studies"
    sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True, n_startup_trials=16)
    return optuna.create_study(study_name=name, storage=_storage(storage_dir / f"{name}.journal"),
                               sampler=sampler, direction="minimize", load_if_exists=True)


def _point_key(strategy: str, params: dict) -> str:
    return json.dumps([strategy, params], sort_keys=True)


def enqueue_first(study, spec: OpSpec, widths: dict, limits: DeviceLimits, extra: list[tuple[str, dict]]) -> None:
    """Default params (and the current tuned entry) are the first trials of a new study."""
    if study.trials:
        return
    queued = set()
    for strategy, params in [*extra, *spec.default_points]:
        key = _point_key(strategy, params)
        if key in queued or spec.infeasible(spec.plan(strategy, params, widths), limits):
            continue
        queued.add(key)
        study.enqueue_trial({"strategy": strategy, **{f"{strategy}.{k}": v for k, v in params.items()}})


def suggest(trial, spec: OpSpec) -> tuple[str, dict]:
    strategy = trial.suggest_categorical("strategy", sorted(spec.strategies))
    space = spec.strategies[strategy].space
    return strategy, {name: trial.suggest_categorical(f"{strategy}.{name}", list(space[name])) for name in sorted(space)}


def feasible_points(spec: OpSpec, widths: dict, limits: DeviceLimits) -> list[tuple[str, dict]]:
    """Every point of the space that passes the restrictions (a few thousand at most)."""
    return [(name, plan.params) for name in spec.strategies for plan in spec.feasible_plans(name, widths, limits)]


def feasible_count(spec: OpSpec, widths: dict, limits: DeviceLimits) -> int:
    return len(feasible_points(spec, widths, limits))


def _enqueue_unseen(study, points: list[tuple[str, dict]], taken: set[str], rng) -> None:
    """TPE exploits hard on small categorical spaces and proposes seen points again; each such
    repeat is answered from memory, and an unseen feasible point is queued in its place."""
    unseen = [(s, p) for s, p in points if _point_key(s, p) not in taken]
    if unseen:
        strategy, params = rng.choice(unseen)
        study.enqueue_trial({"strategy": strategy, **{f"{strategy}.{k}": v for k, v in params.items()}})


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
               dtype: str = "float32") -> TuneResult:
    from optuna.trial import TrialState

    widths = spec.widths_of(shape)
    limits = evaluator.limits
    study = open_study(study_name(gpu_slug, spec.name, dtype, widths, n_bucket(shape["N"])), settings.seed, storage_dir)
    enqueue_first(study, spec, widths, limits, list(extra_points))
    baselines = evaluator.baselines()
    start = time.perf_counter()  # the time budget is the search's: baselines (torch.compile) are outside it

    seen: dict[str, tuple[float | None, str]] = {}  # point -> (µs, failure reason)
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
        if "point" in t.user_attrs:
            seen[t.user_attrs["point"]] = (t.value, t.user_attrs.get("fail_reason", ""))
    points = feasible_points(spec, widths, limits)
    target = min(settings.trials, len(points))
    rng = random.Random(settings.seed)
    batch_size = settings.batch or config.compile_workers()
    compile_times: list[float] = []
    failures: list[str] = []
    counts = {"evaluated": len(seen), "pruned": 0, "failed": 0, "repeated": 0}
    asks_left = 20 * max(1, settings.trials)  # sampling repeats or infeasible points cannot loop forever
    progress = _Progress(target, f"{spec.name} {' '.join(f'{k}{v}' for k, v in shape.items())}",
                         settings.progress, baselines.get("eager"))

    def best_us():
        values = [v for v, _ in seen.values() if v is not None]
        return min(values) if values else None

    progress.update(min(len(seen), target), best_us())
    while len(seen) < target and asks_left > 0:
        if settings.time_budget_s is not None and time.perf_counter() - start > settings.time_budget_s:
            log.warning("time budget of %.0f s reached after %d trials", settings.time_budget_s, len(seen))
            break
        batch: list[tuple[object, Plan, str]] = []
        in_batch: set[str] = set()
        while len(batch) < min(batch_size, target - len(seen)) and asks_left > 0:
            asks_left -= 1
            trial = study.ask()
            strategy, params = suggest(trial, spec)
            point = _point_key(strategy, params)
            trial.set_user_attr("point", point)
            plan = spec.plan(strategy, params, widths)
            reasons = spec.infeasible(plan, limits)
            if reasons:
                trial.set_user_attr("pruned_reason", "; ".join(reasons))
                study.tell(trial, state=TrialState.PRUNED)
                counts["pruned"] += 1
            elif point in seen or point in in_batch:
                value, reason = seen.get(point, (None, "repeated within a batch"))
                counts["repeated"] += 1
                if value is None:
                    trial.set_user_attr("fail_reason", reason or "repeated")
                    study.tell(trial, state=TrialState.FAIL)
                else:
                    study.tell(trial, value)
                _enqueue_unseen(study, points, set(seen) | in_batch, rng)
            else:
                in_batch.add(point)
                batch.append((trial, plan, point))
        compiled = evaluator.compile([plan for _, plan, _ in batch]) if batch else []
        for (trial, plan, point), variant in zip(batch, compiled):
            value, reason = _run_one(evaluator, variant, compile_times)
            if value is None:
                trial.set_user_attr("fail_reason", reason[:4000])
                study.tell(trial, state=TrialState.FAIL)
                counts["failed"] += 1
                failures.append(f"{plan.label}: {reason.splitlines()[0] if reason else '?'}")
            else:
                study.tell(trial, value)
            seen[point] = (value, reason)
            progress.update(min(len(seen), target), best_us())
    progress.close()
    counts["evaluated"] = len(seen)

    best = None
    try:
        trial = study.best_trial
        strategy, params = json.loads(trial.user_attrs["point"])
        best = {"strategy": strategy, "params": params, "us": trial.value,
                "label": spec.plan(strategy, params, widths).label}
    except ValueError:  # no completed trial
        pass
    return TuneResult(spec.name, dict(shape), best, baselines, counts,
                      sum(compile_times) / len(compile_times) if compile_times else None,
                      time.perf_counter() - start, failures)


def _run_one(evaluator: Evaluator, variant, compile_times: list[float]) -> tuple[float | None, str]:
    if isinstance(variant, Exception):
        return None, f"compile failed: {variant}"
    compile_s = getattr(getattr(variant, "compiled", None), "compile_s", None)
    if compile_s is not None:
        compile_times.append(compile_s)
        if compile_s > config.compile_budget_s():
            return None, f"compile took {compile_s:.1f} s, over the {config.compile_budget_s():.0f} s budget"
    try:
        return float(evaluator.evaluate(variant)), ""
    except Exception as exc:  # a failed check or launch fails the trial, with its reason
        return None, f"{type(exc).__name__}: {exc}"
