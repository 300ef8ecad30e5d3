"""Tuning on several GPUs of one host (`pairgen-tune --devices`): a worker process per GPU, every
worker taking every shape in turn on the shape's study, which they share (their points claimed in
it, so no point is timed twice); this process watches their progress, re-times each study's
finalists on one GPU and reads the results back from the studies. Also the split of the host's CPUs
into compile processes per tuning worker, which a single-GPU run uses too."""
from __future__ import annotations

import os
import sys

from ..spec import precision_of


def compile_share(workers: int) -> int:
    """Compile processes per tuning worker: the CPUs split among the workers, less one core for the
    worker itself, which times kernels while the next ones compile (a host starved of its core
    would lengthen the host-bound calls of small shapes)."""
    from pairgen import config

    return max(1, config.compile_workers() // workers - 1)


def devices_of(text: str | None, count: int, current: int) -> list[int]:
    """--devices as GPU indices (none given: the current GPU alone)."""
    if text is None:
        return [current]
    wanted = list(range(count)) if text == "all" else [int(d) for d in text.split(",")]
    missing = [d for d in wanted if d >= count]
    if missing:
        raise SystemExit(f"--devices {text}: no GPU {missing} (this machine has {count})")
    return list(dict.fromkeys(wanted))


def device_worker(job: dict) -> None:
    """One GPU's worker (a spawned process: it imports torch itself). It takes every shape in turn,
    on the shape's study shared with the other workers, and moves to the next shape once every
    point of the study is taken and judged: the workers run out of points to ask for at the same
    moment and wait only for each other's last few, or for a dead worker's heartbeat to lapse
    (its point is then tried again)."""
    import torch

    from pairgen import compiler
    from pairgen.ops import get_op
    from pairgen.tuning.evaluate import GpuEvaluator
    from pairgen.tuning.timing import strict_fp32
    from pairgen.tuning.tuner import TuneSettings, tune_shape

    from .third_party_log import ThirdPartyLog

    third_party = ThirdPartyLog(job["log"]) if job.get("log") else None
    if third_party is not None:
        third_party.__enter__()  # for the worker's life: the process ends with it
    strict_fp32()
    os.environ["PAIRGEN_COMPILE_WORKERS"] = str(job["compile_workers"])  # the CPUs are shared by the workers
    torch.cuda.set_device(job["device"])
    settings = TuneSettings(**{**job["settings"], "progress": False})
    with compiler.compile_pool(job["compile_workers"]) as pool:
        for task in job["tasks"]:
            spec = get_op(task["op"]).at(task["precision"])
            evaluator = GpuEvaluator(spec, task["shape"], job["device"], settings.seed, tuple(job["peers"]), pool)
            if third_party is not None:
                evaluator = third_party.quiet_peers(evaluator)
            result = tune_shape(spec, task["shape"], evaluator, job["slug"], settings, task["extra"],
                                dtype=task["precision"], shared=True, storage_url=job["storage"])
            for line in result.failures[:5]:
                print(f"  GPU {job['device']} failed: {line}", file=sys.stderr)


def tune_on_devices(jobs, devices, settings, peers, slug, storage_url, log_path=None) -> list:
    """One worker process per GPU, each taking every shape in turn on the shape's shared study;
    this process shows their joint progress and reads each result back from its study once they
    are done (results do not depend on the number of workers)."""
    import dataclasses
    import multiprocessing

    from pairgen.spec import n_bucket
    from pairgen.tuning.tuner import result_from_study, study_name

    tasks = [{"op": spec.name, "precision": precision_of(spec), "shape": dict(shape), "extra": list(extra)}
             for spec, shape, extra in jobs]
    names = [study_name(slug, spec.name, precision_of(spec), spec.widths_of(shape), n_bucket(shape["N"]))
             for spec, shape, _ in jobs]
    compile_workers = compile_share(len(devices))
    ctx = multiprocessing.get_context("spawn")
    workers = []
    for k, device in enumerate(devices):
        job = {"tasks": tasks, "device": device, "slug": slug, "storage": storage_url,
               "compile_workers": compile_workers, "log": log_path,  # other libraries' output (third_party_log)
               "peers": list(peers) if k == 0 else [],  # the peers are timed once, by the first worker
               # Distinct samplers; the finalists are re-timed here, once every worker is done.
               "settings": {**dataclasses.asdict(settings), "seed": settings.seed + k, "finalists": 0}}
        workers.append(ctx.Process(target=device_worker, args=(job,)))
    for w in workers:
        w.start()
    try:
        watch(workers, names, settings, len(devices), storage_url)
    except KeyboardInterrupt:
        # A terminal's Ctrl-C reached the workers too; a signal sent to this process alone did not.
        for w in workers:
            w.terminate()
            w.join()
        raise
    dead = [d for d, w in zip(devices, workers) if w.exitcode != 0]
    if dead:
        print(f"workers on GPU(s) {dead} stopped with an error; the points they held were tried again by the "
              "workers still running (or will be by the next run)", file=sys.stderr)
    retime_on(devices[0], jobs, settings, slug, storage_url)
    return [result_from_study(spec, shape, slug, precision_of(spec), settings.seed, storage_url=storage_url)
            for spec, shape, _ in jobs]


def retime_on(device: int, jobs, settings, slug: str, storage_url: str | None) -> None:
    """The finalists of every shape's study timed again on one GPU (tuner.retime_finalists), as a
    single-GPU run does at the end of each shape."""
    from pairgen import compiler
    from pairgen.spec import n_bucket
    from pairgen.tuning.evaluate import GpuEvaluator
    from pairgen.tuning.tuner import open_study, retime_finalists, study_name

    import torch

    if settings.finalists < 2:
        return
    # The modules launch on the current device's stream: make it the one the variants are timed on.
    with compiler.compile_pool(settings.finalists) as pool, torch.cuda.device(device):
        for spec, shape, _ in jobs:
            widths = spec.widths_of(shape)
            study = open_study(study_name(slug, spec.name, precision_of(spec), widths, n_bucket(shape["N"])),
                               settings.seed, None, storage_url)
            evaluator = GpuEvaluator(spec, shape, device, settings.seed, (), pool)
            retime_finalists(study, spec, widths, evaluator, settings)


def watch(workers, names: list[str], settings, n_devices: int, storage_url: str | None) -> None:
    """Wait for the workers, with one progress bar over every shape's study (verdicts so far)."""
    from multiprocessing.connection import wait

    from pairgen.tuning.tuner import open_study, past_outcomes

    bar = None
    if settings.progress:
        from tqdm import tqdm

        bar = tqdm(total=settings.trials * len(names), desc=f"{len(names)} shape(s) on {n_devices} GPUs", unit="trial")
    done = [0] * len(names)
    while any(w.is_alive() for w in workers):
        wait([w.sentinel for w in workers if w.is_alive()], timeout=2.0)  # back at once when one ends
        if bar is None:
            continue
        for i, name in enumerate(names):
            if done[i] >= settings.trials:
                continue
            try:
                study = open_study(name, settings.seed, None, storage_url)
                done[i] = min(settings.trials, len(past_outcomes(study)[0]))
            except Exception:  # the study may not exist yet
                pass
        bar.n = sum(done)
        bar.refresh()
    if bar is not None:
        bar.close()
