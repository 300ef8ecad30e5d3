"""The tuner's control flow on the CPU, with a fake evaluator standing in for NVRTC and the GPU."""
from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import optuna
import pytest

from pairgen.spec import DeviceLimits
from pairgen.ops.contact import CONTACT
from pairgen.compiler import CompileError
from pairgen.tuning.tuner import TuneSettings, _point_key, feasible_count, open_study, study_name, tune_shape

SHAPE = {"B": 4, "N": 64, "P": 64, "H": 32}
WIDTHS = {"P": 64, "H": 32}


class FakeEvaluator:
    """Cost is a made-up function of the params; some points fail to compile or fail the check."""

    limits = DeviceLimits()

    def __init__(self):
        self.compiled: list = []
        self.evaluated: list = []

    def baselines(self):
        return {"eager": 200.0, "compile": 150.0}

    def compile(self, plans):
        self.compiled += plans
        return [RuntimeError("nvrtc: synthetic error") if p.params.get("tile_rows") == 128 else p for p in plans]

    def evaluate(self, plan):
        self.evaluated.append(_point_key(plan.strategy, plan.params))
        if plan.strategy == "thread_per_pair" and plan.params["threads"] == 256:
            raise ValueError("synthetic check failure")
        return self.cost(plan)

    @staticmethod
    def cost(plan):
        p = plan.params
        base = {"thread_per_pair": 50.0, "tiled": 30.0, "symmetric_tiled": 20.0}[plan.strategy]
        return base + p["threads"] / 64 + (0 if p.get("weights_smem") else 1.5)


def _settings(trials, **kw):
    """The search alone (no finalists re-timed, unless a test asks), so each point is timed once."""
    return TuneSettings(trials=trials, batch=4, progress=False, **{"finalists": 0, **kw})


def test_tunes_to_the_trial_count_and_returns_the_best_seen(tmp_path):
    ev = FakeEvaluator()
    result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(24), storage_dir=tmp_path)
    assert result.counts["evaluated"] == 24
    assert len(ev.evaluated) == len(set(ev.evaluated)), "a point was compiled and timed twice"
    for plan in ev.compiled:
        assert not CONTACT.infeasible(plan, ev.limits), "an infeasible point reached the compiler"
    costs = [FakeEvaluator.cost(CONTACT.plan(*json.loads(k), WIDTHS)) for k in ev.evaluated
             if not (json.loads(k)[0] == "thread_per_pair" and json.loads(k)[1]["threads"] == 256)]
    assert result.best["us"] == pytest.approx(min(costs))
    assert result.baselines == {"eager": 200.0, "compile": 150.0}


class CountingEvaluator:
    """Times every point it is given (a distinct made-up time each), for any op."""

    limits = DeviceLimits()

    def __init__(self):
        self.evaluated: list = []

    def baselines(self):
        return {"eager": 1000.0}

    def compile(self, plans):
        return plans

    def evaluate(self, plan):
        self.evaluated.append(_point_key(plan.strategy, plan.params))
        return 100.0 + len(self.evaluated)


def test_a_search_where_few_points_are_feasible_still_times_the_trial_count(tmp_path):
    """The readout's bf16 space at D512 P512 H1024 holds 17 feasible points: nearly every proposal
    breaks a restriction. Each pruned proposal is answered with a feasible unseen point near it, so
    the search times the 16 points asked for (a sampler left to itself found 1 in its 320 asks)."""
    from pairgen.ops.readout import READOUT

    view, shape = READOUT.at("bfloat16"), {"B": 1, "N": 64, "D": 512, "P": 512, "H": 1024}
    ev = CountingEvaluator()
    result = tune_shape(view, shape, ev, "fake-gpu", _settings(16), storage_dir=tmp_path)
    assert feasible_count(view, shape, ev.limits) == 17
    assert result.counts["evaluated"] == 16 and result.counts["pruned"] > 0
    assert len(ev.evaluated) == len(set(ev.evaluated)), "a point was timed twice"


def test_the_nearest_feasible_point_keeps_a_feasible_proposal_and_skips_taken_points():
    from pairgen.ops.trimul import TRIMUL
    from pairgen.tuning.tuner import nearest_unseen

    view, limits = TRIMUL.at("bfloat16"), DeviceLimits()
    widths = {"P": 128, "H": 128, "bias": 0, "gate_normalized": 1, "outgoing": 1}
    strategy, default = next((s, p) for s, p in view.default_points if s == "wgmma")
    default = view.complete_point(strategy, default) or default
    assert not view.infeasible(view.plan(strategy, default, widths), limits)
    assert nearest_unseen(view, widths, limits, strategy, default, set()) == default
    # taken: another feasible point, near it (most of its values kept)
    other = nearest_unseen(view, widths, limits, strategy, default, {_point_key(strategy, default)})
    assert other != default and not view.infeasible(view.plan(strategy, other, widths), limits)
    assert sum(other[k] == v for k, v in default.items()) >= len(default) - 2
    # a proposal that breaks a restriction (the first of a seeded draw) gets a feasible point
    space, rng = view.strategies[strategy].space, random.Random(0)
    broken = next(p for p in ({name: rng.choice(values) for name, values in space.items()} for _ in range(100))
                  if view.infeasible(view.plan(strategy, p, widths), limits))
    repaired = nearest_unseen(view, widths, limits, strategy, broken, set())
    assert not view.infeasible(view.plan(strategy, repaired, widths), limits)


def test_default_points_are_tried_first(tmp_path):
    ev = FakeEvaluator()
    tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(4), storage_dir=tmp_path)
    fp32 = [(s, p) for s, p in CONTACT.default_points if "float32" in CONTACT.strategies[s].precisions]
    assert len(fp32) < len(CONTACT.default_points)  # the tensor-core defaults belong to other precisions' studies
    first = [json.loads(k) for k in ev.evaluated[: len(fp32)]]
    assert first == [[s, p] for s, p in fp32]


def test_failures_are_recorded_with_their_reason_and_never_best(tmp_path):
    ev = FakeEvaluator()
    result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(60, seed=3), storage_dir=tmp_path)
    study = optuna.load_study(study_name=study_name("fake-gpu", "contact", "float32", WIDTHS, 64),
                              storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
                                  str(tmp_path / (study_name("fake-gpu", "contact", "float32", WIDTHS, 64) + ".journal")))))
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert failed, "the fake space has failing points; the sampler should have met one in 60 trials"
    assert all(t.user_attrs.get("fail_reason") for t in failed)
    reasons = " ".join(t.user_attrs["fail_reason"] for t in failed)
    assert "synthetic" in reasons
    best_strategy, best_params = result.best["strategy"], result.best["params"]
    assert not (best_strategy == "thread_per_pair" and best_params["threads"] == 256)
    assert best_params.get("tile_rows") != 128


def test_an_interrupted_study_resumes(tmp_path):
    first = FakeEvaluator()
    tune_shape(CONTACT, SHAPE, first, "fake-gpu", _settings(8), storage_dir=tmp_path)
    second = FakeEvaluator()
    result = tune_shape(CONTACT, SHAPE, second, "fake-gpu", _settings(20), storage_dir=tmp_path)
    assert result.counts["evaluated"] == 20
    assert len(second.compiled) == 12, "the resumed run should only try the missing trials"
    keys = lambda ev: {_point_key(p.strategy, p.params) for p in ev.compiled}  # noqa: E731
    assert not keys(first) & keys(second)


def _trials(tmp_path):
    """The finished trials of the fake study, in order."""
    name = study_name("fake-gpu", "contact", "float32", WIDTHS, 64)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / f"{name}.journal")))
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    return optuna.load_study(study_name=name, storage=storage).get_trials(states=states)


class BrokenMachine(FakeEvaluator):
    """Every compile fails the way a machine (not a point) fails: `how` is "slow" (5 s each,
    over the 1 s budget the test sets), "returned" (an OSError per variant: NVRTC's library
    missing) or "raised" (the whole compile call raises, as compile_many does for an ImportError)."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def compile(self, plans):
        self.compiled += plans
        if self.how == "raised":
            raise ImportError("cuda.bindings: synthetic toolchain failure")
        if self.how == "returned":
            return [OSError("libnvrtc.so.12: cannot open shared object file (synthetic)") for _ in plans]
        return [SimpleNamespace(plan=p, compiled=SimpleNamespace(compile_s=5.0)) for p in plans]


@pytest.mark.parametrize("how", ["slow", "returned", "raised"])
def test_environment_failures_are_tried_again_by_the_next_run(tmp_path, monkeypatch, how):
    """Run 1 fails every point for a reason of the machine; run 2, on a sane machine, must time
    those points (first), not answer them from run 1's failures."""
    monkeypatch.setenv("PAIRGEN_COMPILE_BUDGET_S", "1")
    broken = BrokenMachine(how)
    first = None
    if how == "raised":
        with pytest.raises(ImportError):
            tune_shape(CONTACT, SHAPE, broken, "fake-gpu", _settings(4), storage_dir=tmp_path)
    else:
        first = tune_shape(CONTACT, SHAPE, broken, "fake-gpu", _settings(4), storage_dir=tmp_path)
        assert first.best is None
    failed_points = [t.user_attrs["point"] for t in _trials(tmp_path)]
    assert len(failed_points) == 4

    monkeypatch.setenv("PAIRGEN_COMPILE_BUDGET_S", "60")
    sane = FakeEvaluator()
    result = tune_shape(CONTACT, SHAPE, sane, "fake-gpu", _settings(4), storage_dir=tmp_path)
    assert [_point_key(p.strategy, p.params) for p in sane.compiled] == failed_points
    assert result.counts["evaluated"] == 4 and result.best is not None
    # Run 1's trials say why they failed, and that the machine did.
    assert all(t.user_attrs.get("env_failure") is True and t.user_attrs["fail_reason"] for t in _trials(tmp_path)[:4])
    assert first is None or first.counts["env_failed"] == 4


@pytest.mark.parametrize("failure", ["check", "compile error"])
def test_a_genuine_failure_stays_a_verdict(tmp_path, failure):
    """A point NVRTC rejects, or whose output is wrong, is not compiled again by a later run."""

    class Failing(FakeEvaluator):
        def compile(self, plans):
            self.compiled += plans
            if failure == "compile error":
                return [CompileError("k.cu(1): error: synthetic", "int x;", "k.cu") for _ in plans]
            return list(plans)

        def evaluate(self, plan):
            raise ValueError("synthetic check failure")

    first = Failing()
    result = tune_shape(CONTACT, SHAPE, first, "fake-gpu", _settings(4), storage_dir=tmp_path)
    assert result.counts["failed"] == 4 and not result.counts.get("env_failed")
    assert not any(t.user_attrs.get("env_failure") for t in _trials(tmp_path))
    second = FakeEvaluator()
    result = tune_shape(CONTACT, SHAPE, second, "fake-gpu", _settings(4), storage_dir=tmp_path)
    assert result.counts["evaluated"] == 4 and not second.compiled


def test_time_budget_stops_sampling(tmp_path):
    ev = FakeEvaluator()
    result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(64, time_budget_s=0.0), storage_dir=tmp_path)
    assert result.counts["evaluated"] == 0 and result.best is None


def test_trials_capped_by_the_feasible_space(tmp_path):
    # The tuner enumerates every feasible point to queue unseen ones: 8550 at the seed widths
    # since ln_lanes (0.85 s here); a space that grows far past that needs another approach.
    n = feasible_count(CONTACT, WIDTHS, DeviceLimits())
    assert 0 < n < 20000


def test_a_template_edit_starts_a_new_study(monkeypatch):
    """Otherwise a re-tune after the edit would answer points from the old code's timings."""
    from pairgen import codegen

    before = study_name("fake-gpu", "contact", "float32", WIDTHS, 64)
    real_hash = codegen.template_hash
    monkeypatch.setattr(codegen, "template_hash", lambda op, s: "edited" if s == "tiled" else real_hash(op, s))
    after = study_name("fake-gpu", "contact", "float32", WIDTHS, 64)
    assert before != after and before.rsplit("-t", 1)[0] == after.rsplit("-t", 1)[0]


class BackgroundEvaluator(FakeEvaluator):
    """Compiles in background threads (as GpuEvaluator does on its process pool), slowly; records
    when each compile finished and each evaluation started."""

    def __init__(self, pool):
        super().__init__()
        self.pool, self.events = pool, []

    def start_compiles(self, plans):
        def compile_one(plan):
            time.sleep(0.02)
            self.events.append(("compiled", _point_key(plan.strategy, plan.params)))
            return self.compile([plan])[0]

        futures = [self.pool.submit(compile_one, p) for p in plans]
        return [f.result for f in futures]

    def evaluate(self, plan):
        self.events.append(("timed", _point_key(plan.strategy, plan.params)))
        time.sleep(0.01)
        return super().evaluate(plan)


def test_points_are_timed_while_later_ones_compile(tmp_path):
    """The GPU does not wait for a whole batch to compile, nor the compiler for the GPU: the first
    point is timed before the last of the first window has compiled; no point is timed twice, none
    before its compile finished, and the study stops at the trial count."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        ev = BackgroundEvaluator(pool)
        result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(16), storage_dir=tmp_path)
    assert result.counts["evaluated"] == 16
    timed = [p for kind, p in ev.events if kind == "timed"]
    assert len(timed) == len(set(timed)), "a point was timed twice"
    order = {(kind, p): k for k, (kind, p) in enumerate(ev.events)}
    assert all(order[("compiled", p)] < order[("timed", p)] for p in timed), "timed before its compile finished"
    compiled = [p for kind, p in ev.events if kind == "compiled"]
    assert order[("timed", timed[0])] < order[("compiled", compiled[3])], "the first point waited for the window"


class LuckyFirstEvaluator(FakeEvaluator):
    """The first point timed is measured 100 µs faster than it is, once (a lucky timing)."""

    def evaluate(self, plan):
        value = super().evaluate(plan)
        return value - 100.0 if len(self.evaluated) == 1 else value


def test_the_finalists_are_timed_again_and_a_lucky_timing_does_not_win(tmp_path):
    ev = LuckyFirstEvaluator()
    result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(12, finalists=3), storage_dir=tmp_path)
    lucky = ev.evaluated[0]
    study = open_study(study_name("fake-gpu", "contact", "float32", WIDTHS, 64), 0, tmp_path)
    retimed = study.user_attrs["retimed"]
    assert len(retimed) == 3 and lucky in retimed, "the lucky point is a finalist"
    true_cost = {p: FakeEvaluator.cost(CONTACT.plan(*json.loads(p), WIDTHS)) for p in retimed}
    assert retimed == true_cost, "each finalist's median is its true cost, the lucky timing outvoted"
    assert result.best["us"] == min(true_cost.values()) and result.best["us"] > 0
    assert ev.evaluated.count(lucky) == 1 + 5, "timed once by the search, five times as a finalist"


def test_the_result_keeps_the_other_points_timed_fastest_first_as_changes_from_the_winner(tmp_path):
    """timed_points: every timed point but the winner and the failed ones, fastest first, each as
    the params that differ from the winner's (all of them, with its strategy, where that differs),
    a finalist at its re-timed median; the entry check accepts the record and refuses a broken one."""
    from pairgen.tuned import entry_problem
    from pairgen.tuning.tuner import TIMED_KEPT

    ev = LuckyFirstEvaluator()
    result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(12, finalists=3), storage_dir=tmp_path)
    best, timed = result.best, result.timed
    failed = {p for p in set(ev.evaluated)
              if json.loads(p)[0] == "thread_per_pair" and json.loads(p)[1]["threads"] == 256}
    assert len(timed) == min(TIMED_KEPT, len(set(ev.evaluated)) - 1 - len(failed))
    assert [r["us"] for r in timed] == sorted(r["us"] for r in timed) and timed[0]["us"] >= best["us"]
    for record in timed:
        if "strategy" in record:
            assert record["strategy"] != best["strategy"]
            params, strategy = record["changes"], record["strategy"]
        else:
            assert record["changes"], "the winner itself is not among the others"
            params, strategy = {**best["params"], **record["changes"]}, best["strategy"]
        # the lucky first timing was outvoted where it became a finalist: each record is the true cost
        assert record["us"] == pytest.approx(FakeEvaluator.cost(CONTACT.plan(strategy, params, WIDTHS)), abs=0.01)
    entry = {"key": {"dtype": "float32", "widths": WIDTHS, "n_bucket": 64}, "strategy": best["strategy"],
             "params": best["params"], "template_sha256": "0" * 64, "timed": timed}
    assert entry_problem(entry) is None
    assert "timed" in entry_problem({**entry, "timed": [{"us": "fast", "changes": {}}]})
    assert "timed" in entry_problem({**entry, "timed": [{"us": 1.0, "changes": {}, "extra": 1}]})


class UnluckyFirstEvaluator(FakeEvaluator):
    """`best` (a point) is the fastest of the space by 0.5 µs, and the first point timed is measured
    100 µs slower than it is, once (timed while every core compiled the next points)."""

    def __init__(self, best):
        super().__init__()
        self.best = _point_key(*best)

    def evaluate(self, plan):
        value = super().evaluate(plan) - (0.5 if self.evaluated[-1] == self.best else 0.0)
        return value + 100.0 if len(self.evaluated) == 1 else value


def test_a_retune_times_the_incumbent_again_however_its_one_timing_went(tmp_path):
    from pairgen.tuning.tuner import feasible_points

    cheapest = min(feasible_points(CONTACT.at("float32"), WIDTHS, DeviceLimits()),
                   key=lambda point: FakeEvaluator.cost(CONTACT.plan(*point, WIDTHS)))
    ev = UnluckyFirstEvaluator(cheapest)
    result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(8, finalists=2), extra_points=[cheapest],
                        storage_dir=tmp_path)
    incumbent = _point_key(*cheapest)
    assert ev.evaluated[0] == incumbent, "the incumbent is the first point timed"
    study = open_study(study_name("fake-gpu", "contact", "float32", WIDTHS, 64), 0, tmp_path)
    assert len(study.user_attrs["retimed"]) == 3 and incumbent in study.user_attrs["retimed"]
    assert [result.best["strategy"], result.best["params"]] == json.loads(incumbent)
    assert result.best["us"] == FakeEvaluator.cost(CONTACT.plan(*cheapest, WIDTHS)) - 0.5


def test_the_first_default_is_timed_again_however_its_one_timing_went(tmp_path):
    """The op's first feasible default point is queued first and re-timed among the finalists even
    where its one timing (taken while the next points compiled) left it out of them."""
    first = next((s, p) for s, p in CONTACT.at("float32").default_points
                 if not CONTACT.infeasible(CONTACT.plan(s, p, WIDTHS), DeviceLimits()))
    ev = UnluckyFirstEvaluator(first)
    result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(8, finalists=1), storage_dir=tmp_path)
    default = _point_key(*first)
    assert ev.evaluated[0] == default, "the first default is the first point timed"
    study = open_study(study_name("fake-gpu", "contact", "float32", WIDTHS, 64), 0, tmp_path)
    assert study.user_attrs["first_default"] == default and default in study.user_attrs["retimed"]
    assert len(study.user_attrs["retimed"]) == 2
    assert result.best["us"] <= FakeEvaluator.cost(CONTACT.plan(*first, WIDTHS)) - 0.5


def test_a_run_without_finalists_forgets_an_earlier_runs_retiming(tmp_path):
    tune_shape(CONTACT, SHAPE, LuckyFirstEvaluator(), "fake-gpu", _settings(6, finalists=3), storage_dir=tmp_path)
    study = open_study(study_name("fake-gpu", "contact", "float32", WIDTHS, 64), 0, tmp_path)
    assert study.user_attrs["retimed"]
    result = tune_shape(CONTACT, SHAPE, FakeEvaluator(), "fake-gpu", _settings(12), storage_dir=tmp_path)
    study = open_study(study_name("fake-gpu", "contact", "float32", WIDTHS, 64), 0, tmp_path)
    assert not study.user_attrs["retimed"] and result.best["us"] == study.best_trial.value


@pytest.mark.parametrize("sampler", ["tpe", "gp"])  # random: the default, in every other test
def test_every_sampler_tunes_to_the_trial_count_without_timing_a_point_twice(tmp_path, sampler):
    if sampler == "gp":
        pytest.importorskip("scipy", reason="the GP sampler needs scipy: pip install scipy")
    ev = FakeEvaluator()
    result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(20, sampler=sampler), storage_dir=tmp_path)
    assert result.counts["evaluated"] == 20
    assert len(ev.evaluated) == len(set(ev.evaluated))
    assert result.best["us"] == pytest.approx(min(FakeEvaluator.cost(CONTACT.plan(*json.loads(k), WIDTHS))
                                                  for k in ev.evaluated
                                                  if not (json.loads(k)[0] == "thread_per_pair"
                                                          and json.loads(k)[1]["threads"] == 256)))


def test_an_unknown_sampler_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown sampler 'anneal'.*random, tpe, gp"):
        tune_shape(CONTACT, SHAPE, FakeEvaluator(), "fake-gpu", _settings(4, sampler="anneal"), storage_dir=tmp_path)


def test_the_sampler_study_lands_on_the_best_retimed_of_a_runs_three_best_single_timings():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "sampler_study.py"
    loaded = importlib.util.spec_from_file_location("sampler_study", path)
    study = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(study)
    tried = [("a", 30.0), ("b", None), ("c", 20.0), ("d", 25.0), ("e", 21.0), ("f", 10.0)]
    assert study.finalists_after(tried, 4) == ["c", "d", "a"]  # a failed check is tried, never a finalist
    assert study.finalists_after(tried, 6) == ["f", "c", "e"]
    # re-timed, the single-timing winner is not the best: the tuner keeps the best median
    assert study.landing({"f": 24.0, "c": 21.0, "e": 22.5, "a": 1.0}, ["f", "c", "e"]) == ("c", 21.0)
    assert study.landing({}, ["f"]) is None


def test_points_in_order_are_the_points_judged_in_the_order_asked(tmp_path):
    from pairgen.tuning.tuner import points_in_order

    ev = FakeEvaluator()
    result = tune_shape(CONTACT, SHAPE, ev, "fake-gpu", _settings(40, seed=3), storage_dir=tmp_path)
    study = open_study(study_name("fake-gpu", "contact", "float32", WIDTHS, 64), 3, tmp_path)
    tried = points_in_order(study)
    points = [point for point, _ in tried]
    assert len(points) == len(set(points)) == result.counts["evaluated"]  # repeats answered from the study are not tried
    assert set(points) == {_point_key(p.strategy, p.params) for p in ev.compiled}  # compile failures are judged too
    assert {point for point, value in tried if value is not None} <= set(ev.evaluated)
    assert any(value is None for _, value in tried)
    numbers = {t.user_attrs.get("point"): t.number for t in study.trials if not t.user_attrs.get("repeat")}
    assert [numbers[p] for p in points] == sorted(numbers[p] for p in points)  # in the order asked


def test_default_points_are_queued_whole():
    """A default point names only some of today's parameters (those added since take the values that
    reproduce its kernel); it is queued completed, not with the rest left to the sampler, and the
    first feasible one is the study's first default."""
    import optuna

    from pairgen.ops.trimul import TRIMUL
    from pairgen.tuning.tuner import _point_key, enqueue_first

    view = TRIMUL.at("bfloat16")
    widths = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    study = optuna.create_study()
    enqueue_first(study, view, widths, DeviceLimits(), [])
    queued = [t.system_attrs["fixed_params"] for t in study.get_trials(deepcopy=False)]
    space = view.strategies["wgmma"].space
    wgmma = [q for q in queued if q["strategy"] == "wgmma"]
    assert wgmma and all(set(q) == {"strategy", *(f"wgmma.{k}" for k in space)} for q in wgmma)
    first = next(p for s, p in view.default_points if s == "wgmma")
    assert study.user_attrs["first_default"] == _point_key("wgmma", view.complete_point("wgmma", first))


WIDE_MODEL = {"P": 384, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}


def test_a_groups_neighbours_change_only_that_groups_values_and_are_feasible():
    """group_neighbours: around a point, per parameter group of the strategy (one kernel's shape),
    every feasible combination of that group's values with the rest of the point kept, the point
    itself left out. Around the wide default of session 44, the narrower tuned point's output
    shape (2 warpgroups of 32-column passes) is among them; a strategy without groups has none."""
    from pairgen.ops.trimul import TRIMUL
    from pairgen.tuning.tuner import group_neighbours

    view, limits = TRIMUL.at("bfloat16"), DeviceLimits()
    point = view.default_plan(WIDE_MODEL, limits).params
    groups = view.strategies["wgmma"].groups
    per_group = group_neighbours(view, WIDE_MODEL, limits, "wgmma", point)
    assert len(per_group) == len(groups) and all(per_group)
    keys = set()
    for group, points in zip(groups, per_group):
        for neighbour in points:
            changed = {name for name in point if neighbour[name] != point[name]}
            assert changed and changed <= set(group), changed
            assert not view.infeasible(view.plan("wgmma", neighbour, WIDE_MODEL), limits)
            keys.add(_point_key("wgmma", neighbour))
    assert len(keys) == sum(map(len, per_group))  # each once
    narrower = {**point, "o_groups": 2, "o_wn": 32, "o_staged_stores": False}
    assert _point_key("wgmma", narrower) in keys
    assert group_neighbours(CONTACT, WIDTHS, limits, "tiled", {}) == []


class RewardingEvaluator(CountingEvaluator):
    """Times the point `winner` 50 µs, every other point 100 µs and more."""

    def __init__(self, winner: str):
        super().__init__()
        self.winner = winner

    def evaluate(self, plan):
        time_us = super().evaluate(plan)
        return 50.0 if self.evaluated[-1] == self.winner else time_us


def test_the_search_times_the_best_points_neighbourhood_after_the_defaults(tmp_path):
    """After the default points, the search queues the neighbourhood of the best one (every
    feasible change of one kernel's parameter group), the groups in turn, before the sampler's
    proposals: a point that needs three of a kernel's parameters changed at once is found within
    the defaults and that neighbourhood. The expansion is recorded in the study; the sampler asks
    again after it, and no point is timed twice."""
    from pairgen.ops.trimul import TRIMUL
    from pairgen.tuning.tuner import group_neighbours

    view, limits = TRIMUL.at("bfloat16"), DeviceLimits()
    shape = {"B": 1, "N": 64, **WIDE_MODEL}
    first = view.default_plan(WIDE_MODEL, limits).params
    winner = {**first, "o_groups": 2, "o_wn": 32, "o_staged_stores": False}  # (three output parameters)
    ev = RewardingEvaluator(_point_key("wgmma", winner))
    neighbourhood = group_neighbours(view, WIDE_MODEL, limits, "wgmma", first)
    completed = ((s, view.complete_point(s, p) or p) for s, p in view.default_points)
    defaults = {_point_key(s, p) for s, p in completed if not view.infeasible(view.plan(s, p, WIDE_MODEL), limits)}
    window = 4  # (_settings' batch: points asked ahead of the timings, the sampler's until the first is timed)
    trials = len(defaults) + sum(map(len, neighbourhood)) + 2 * window
    result = tune_shape(view, shape, ev, "fake-gpu", _settings(trials), storage_dir=tmp_path, dtype="bfloat16")
    assert result.best["params"] == winner and result.best["us"] == 50.0
    assert len(ev.evaluated) == len(set(ev.evaluated)) == trials
    assert set(ev.evaluated[:len(defaults)]) == defaults  # (the first of them the best: times grow)
    # (a default point may be a neighbour too: the second wide one differs in o_wn alone)
    keys = [{_point_key("wgmma", p) for p in points} - defaults for points in neighbourhood]
    ahead = ev.evaluated[len(defaults):len(defaults) + sum(map(len, neighbourhood)) + window]
    assert set().union(*keys) <= set(ahead)  # the whole neighbourhood, next
    in_order = [point for point in ahead if point in set().union(*keys)]
    assert in_order[0] in keys[0] and in_order[1] in keys[1]  # the groups in turn
    assert not set(ev.evaluated[-window:]) & set().union(*keys, defaults)  # then the sampler's proposals
    study = open_study(study_name("fake-gpu", "trimul", "bfloat16", view.widths_of(shape), 64), 0, tmp_path)
    expanded = study.user_attrs["expanded"]
    assert _point_key("wgmma", first) in expanded and _point_key("wgmma", winner) in expanded
