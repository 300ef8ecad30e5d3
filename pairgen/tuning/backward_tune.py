"""`pairgen-tune --backward`: the closed forms' fused kernels tuned on this GPU (their search space
is pairgen/ops/backward_tuning.py's). Each shape's space is small (tens of points), so it is swept
whole, as an Optuna study like the forward tuner's (its journal under the same folder, or the same
--storage database; every point of the space a trial, the default first): every point's
training step (forward + backward of (out * g).sum(), L2 flushed, median of `reps`) is timed, its
gradients checked against the default point's (the default is held to the gradient standard
against float64 by the GPU tests; a launch shape changes only the order of a few partial sums), and
the fastest that agrees is written as an entry of tuned/<gpu>/<op>_backward.json. A sweep stopped
part way resumes where it stopped: the points its study holds are not timed again.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from ..ops import backward_tuning

#: Relative L2 within which a point's gradients must agree with the default point's: the
#: gradient standard of the step's dtype (a different launch shape only reorders partial sums).
AGREEMENT = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-2}


def sweep(points: list[dict], step_us: Callable[[dict], float], gradients: Callable[[dict], list],
          bound: float, study=None) -> dict:
    """Time and check every point (the first is the default, which the others are checked
    against), each a trial of `study` (default: one in memory), queued in order; points the study
    already holds a verdict for are read back, not timed again. Returns {"best": (params, µs) or
    None, "default_us", "timed": {label: µs}, "disagreed": [labels]}."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = study or optuna.create_study(direction="minimize")
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    held = {_label(t.params) for t in study.trials if t.state in finished}
    remaining = [p for p in points if _label(p) not in held]  # a point whose trial failed (a Ctrl-C) is run again
    space = {name: sorted({p[name] for p in points}) for name in points[0]}
    reference = []

    def objective(trial) -> float:
        params = {name: trial.suggest_categorical(name, choices) for name, choices in space.items()}
        if params != points[0]:
            if not reference:
                reference.append(gradients(points[0]))
            worst = _worst_disagreement(gradients(params), reference[0])
            if worst > bound:
                trial.set_user_attr("disagreed", worst)
                raise optuna.TrialPruned(f"gradients {worst:.2e} from the default's")
        return step_us(params)

    for params in remaining:  # the study's trials are exactly the space's points, the default first
        study.enqueue_trial(params)
    if remaining:
        study.optimize(objective, n_trials=len(remaining))
    return _result(study, points[0])


def _result(study, default: dict) -> dict:
    """What sweep() returns, read from the study's trials."""
    import optuna

    timed, disagreed, best = {}, [], None
    for trial in study.trials:
        label = _label(trial.params)
        if trial.state == optuna.trial.TrialState.PRUNED:
            disagreed.append(label)
        elif trial.state == optuna.trial.TrialState.COMPLETE:
            timed[label] = trial.value
            if best is None or trial.value < best[1]:
                best = (dict(trial.params), trial.value)
    return {"best": best, "default_us": timed.get(_label(default)), "timed": timed, "disagreed": disagreed}


def study_name(gpu_slug: str, op: str, kind: str, widths: dict, bucket: int) -> str:
    """The sweep's study: a template edit (its hash) starts a new one."""
    inner = "-".join(f"{k}{v}" for k, v in sorted(widths.items()))
    digest = backward_tuning.template_sha256(op, kind, widths)[:12]
    return f"{gpu_slug}-{backward_tuning.db_name(op)}-{kind}-{inner}-n{bucket}-t{digest}"


def _label(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(params.items()))


def _worst_disagreement(grads: list, reference: list) -> float:
    worst = 0.0
    for mine, theirs in zip(grads, reference):
        if mine is None or theirs is None:
            if (mine is None) != (theirs is None):
                return float("inf")
            continue
        diff = (mine.double() - theirs.double()).norm().item()
        worst = max(worst, diff / max(theirs.double().norm().item(), 1e-300))
    return worst


def entry(op: str, kind: str, widths: dict, shape: dict, result: dict) -> dict:
    """The tuned/ record of a sweep's winner."""
    import cuda.core
    import torch

    from .. import __version__
    from ..compiler import nvrtc_version
    from ..spec import n_bucket
    from ..tuned import make_key

    params, us = result["best"]
    return {
        "key": make_key(kind, widths, n_bucket(shape["N"])),
        "shape": shape,
        "strategy": backward_tuning.STRATEGY,
        "params": params,
        "template_sha256": backward_tuning.template_sha256(op, kind, widths),
        "source_sha256": backward_tuning.sources_sha256(op, kind, params, widths),
        "us": round(us, 2),
        "baselines_us": {"default": round(result["default_us"], 2)},
        "trials": {"timed": len(result["timed"]), "disagreed": len(result["disagreed"])},
        "date": time.strftime("%Y-%m-%d"),
        "versions": {"pairgen": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "nvrtc": nvrtc_version(), "cuda.core": cuda.core.__version__},
    }


def tune_shape(spec, shape: dict, precision: str, reps: int = 20, storage_url: str | None = None,
               storage_dir=None) -> tuple[dict, str, dict]:
    """Sweep one shape on the current GPU, its study in the forward tuner's storage (a journal in
    storage_dir, default the cache's studies folder, or the database at storage_url): (the sweep's
    result, the storage kind, the widths)."""
    import torch

    from .. import runtime
    from ..ops.fused_kernels import storage_kind
    from ..spec import n_bucket
    from .tuner import open_study
    from .evaluate import inputs_in_precision, module_in_precision
    from .timing import time_cuda

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    module = module_in_precision(spec, spec.widths_of(shape), gen, precision, device)
    module.backward_mode = "closed_form"
    inputs = inputs_in_precision(spec.make_inputs(shape, gen), precision, device)
    x = inputs[0].detach().requires_grad_()
    train_inputs = (x, *inputs[1:])
    with torch.no_grad():
        g = torch.randn(module(*inputs).shape, generator=gen).to(device, x.dtype)
    params = list(module.parameters())

    def step(tuning: dict):
        module._backward_tuning = tuning
        x.grad = None
        for p in params:
            p.grad = None
        (module(*train_inputs) * g).sum().backward()

    def gradients(tuning: dict) -> list:
        step(tuning)
        return [t.grad.clone() if t.grad is not None else None for t in (x, *params)]

    def step_us(tuning: dict) -> float:
        step(tuning)  # compiles this point's kernels outside the timing
        return time_cuda(lambda: step(tuning), device, reps=reps).median_us

    kind = storage_kind(next(p.dtype for p in params))
    name = study_name(runtime.device_info(device.index).slug, spec.name, kind, module.widths, n_bucket(shape["N"]))
    study = open_study(name, 0, storage_dir, storage_url)
    try:
        result = sweep(backward_tuning.points(spec.name), step_us, gradients, AGREEMENT[kind], study)
    finally:
        module.__dict__.pop("_backward_tuning", None)
    return result, kind, module.widths


def main(work: list, reps: int = 20, storage_url: str | None = None) -> int:
    """Sweep each (spec, shape) of `work` whose op has fused closed-form kernels, and record it."""
    from .. import runtime
    from ..tuned import TunedDB
    from .cli import shape_label

    info = runtime.device_info()
    chosen = [(spec, shape) for spec, shape in work if spec.name in backward_tuning.OPS]
    if not chosen:
        print("no selected op has fused closed-form kernels to tune (those that do: "
              f"{', '.join(sorted(backward_tuning.OPS))})", file=sys.stderr)
        return 2
    for spec, shape in chosen:
        precision = spec.precision or "float32"
        started = time.perf_counter()
        result, kind, widths = tune_shape(spec, shape, precision, reps, storage_url)
        if result["best"] is None:
            print(f"{spec.name} {shape_label(shape)} {kind}: no point agreed; nothing written", file=sys.stderr)
            continue
        TunedDB(backward_tuning.db_name(spec.name), info.slug).upsert(
            entry(spec.name, kind, widths, shape, result), arch=info.arch)
        params, us = result["best"]
        print(f"{spec.name} {shape_label(shape)} {kind} backward: {us:.1f} µs per step at {params} "
              f"(defaults {result['default_us']:.1f} µs; {len(result['timed'])} points timed, "
              f"{len(result['disagreed'])} disagreed; {time.perf_counter() - started:.0f} s)", flush=True)
    return 0
