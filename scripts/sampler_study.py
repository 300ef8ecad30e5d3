"""Which sampler, at how many trials: run the tuner's own search on a shape with each sampler
(fresh studies, the same seed) and one long search, then time again, in turns, every point that
any run would have kept as a finalist (the tuner's three best single timings after its first k
trials, for each k), and print where each sampler lands at each k against the long search's best.

A k-trial search lands on the best re-timed of its three best single timings (the tuner re-times
its finalists in the same way). The first k trials of a run are what a k-trial search with the same
seed asks (the sampler sees the same history up to there, timing noise aside). Example (H200):

  python scripts/sampler_study.py --op trimul --precision bfloat16 \\
      --shape B=1,N=256,P=128,H=128,outgoing=1,gate_normalized=1,bias=0 --json study.json

docs/performance.md has the table this printed for the three largest spaces.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pairgen.tuning.cli import add_selection_args, selected_shapes, shape_label  # noqa: E402

KS = (32, 64, 128)
FINALISTS = 3


def finalists_after(tried: list, k: int) -> list[str]:
    """The points a k-trial search re-times: its FINALISTS best single timings among the first k."""
    timed = [(point, value) for point, value in tried[:k] if value is not None]
    return [point for point, _ in sorted(timed, key=lambda pv: pv[1])[:FINALISTS]]


def landing(retimed: dict, finalists: list[str]) -> tuple[str, float] | None:
    """The finalist with the best re-timed median, as the tuner keeps it."""
    known = [(point, retimed[point]) for point in finalists if point in retimed]
    return min(known, key=lambda pv: pv[1]) if known else None


def sampler_trials(default: int):
    """--samplers' items: "gp" (at `default` trials) or "gp:64"."""
    def parse(item: str) -> tuple[str, int]:
        name, _, trials = item.partition(":")
        return name, int(trials) if trials else default
    return parse


def run_search(spec, shape, evaluator, slug: str, sampler: str, trials: int, seed: int, directory: Path) -> dict:
    from pairgen.spec import n_bucket, precision_of
    from pairgen.tuning.tuner import TuneSettings, open_study, points_in_order, study_name, tune_shape

    settings = TuneSettings(trials=trials, seed=seed, progress=False, finalists=0, sampler=sampler)
    dtype = precision_of(spec)
    start = time.perf_counter()
    tune_shape(spec, shape, evaluator, slug, settings, dtype=dtype, storage_dir=directory)
    study = open_study(study_name(slug, spec.name, dtype, spec.widths_of(shape), n_bucket(shape["N"])), seed,
                       directory, sampler=sampler)
    return {"sampler": sampler, "trials": trials, "seconds": round(time.perf_counter() - start, 1),
            "tried": points_in_order(study)}


def main(argv=None) -> int:
    import torch

    from pairgen import compiler, runtime
    from pairgen.tuning.evaluate import GpuEvaluator
    from pairgen.tuning.timing import strict_fp32
    from pairgen.tuning.tuner import SAMPLERS, retime_points

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_selection_args(parser)
    parser.add_argument("--samplers", default=",".join(SAMPLERS),
                        help="samplers compared, each as NAME or NAME:TRIALS (default all, at --trials)")
    parser.add_argument("--trials", type=int, default=max(KS), help="trials per sampler (default 128)")
    parser.add_argument("--long", type=int, default=640, help="trials of the long search (default 640)")
    parser.add_argument("--long-sampler", default="tpe", choices=SAMPLERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5, help="re-timing rounds (default 5)")
    parser.add_argument("--json", type=Path, help="write every run's trials and the re-timings here")
    args = parser.parse_args(argv)
    strict_fp32()
    info = runtime.device_info(torch.cuda.current_device())
    results = []
    with compiler.compile_pool() as pool:
        for spec, shape in selected_shapes(args, parser):
            widths = spec.widths_of(shape)
            evaluator = GpuEvaluator(spec, shape, info.index, args.seed, peers=(), pool=pool)
            runs = []
            for sampler, trials in [(args.long_sampler, args.long), *map(sampler_trials(args.trials), args.samplers.split(","))]:
                with tempfile.TemporaryDirectory() as directory:
                    try:
                        runs.append(run_search(spec, shape, evaluator, info.slug, sampler, trials, args.seed,
                                               Path(directory)))
                    except ImportError as exc:  # the GP sampler without scipy
                        print(f"{sampler}: not available here ({exc})", file=sys.stderr)
                        continue
                print(f"{spec.name} {shape_label(shape)}: {sampler} {trials} trials in {runs[-1]['seconds']} s",
                      file=sys.stderr, flush=True)
            long_run, short_runs = runs[0], runs[1:]
            wanted = finalists_after(long_run["tried"], len(long_run["tried"]))
            for run in short_runs:
                wanted += [p for k in KS for p in finalists_after(run["tried"], k)]
            retimed = retime_points(evaluator, spec, widths, list(dict.fromkeys(wanted)), args.rounds)
            results.append(report(spec, shape, widths, long_run, short_runs, retimed, args))
            if args.json:  # after each shape: a run cut short keeps the shapes it finished
                args.json.write_text(json.dumps({"gpu": info.name, "torch": torch.__version__,
                                                 "cuda": torch.version.cuda, "results": results}, indent=1))
    return 0


def report(spec, shape, widths, long_run, short_runs, retimed, args) -> dict:
    from pairgen.spec import precision_of

    long_point = landing(retimed, finalists_after(long_run["tried"], len(long_run["tried"])))
    head = f"\n{spec.name} {shape_label(shape)} [{precision_of(spec)}]: long search {long_run['sampler']}, " \
           f"{len(long_run['tried'])} points"
    print(f"{head}, best re-timed {long_point[1]:.1f} µs ({spec.plan(*json.loads(long_point[0]), widths).label})"
          if long_point else f"{head}: nothing timed", flush=True)
    best = min(retimed.values()) if retimed else None
    print(f"| sampler | {' | '.join(f'{k} trials' for k in KS)} |")
    print("|---|" + "---:|" * len(KS))
    rows = {}
    for run in short_runs:
        cells = []
        for k in KS:
            got = landing(retimed, finalists_after(run["tried"], k)) if k <= len(run["tried"]) else None
            cells.append(f"{got[1]:.1f} µs ({100 * (got[1] / long_point[1] - 1):+.1f}%)" if got and long_point else "–")
            rows.setdefault(run["sampler"], {})[k] = got
        print(f"| {run['sampler']} | {' | '.join(cells)} |", flush=True)
    return {"op": spec.name, "shape": shape, "precision": precision_of(spec), "long": long_run, "runs": short_runs,
            "retimed": retimed, "long_best": long_point, "best_retimed": best, "landings": rows}


if __name__ == "__main__":
    sys.exit(main())
