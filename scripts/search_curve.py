"""How good a shorter search would have been: read a tuned shape's study and report the best point
among its first k evaluated trials (k = 64, 128, 256, ... and all), each re-timed now, in turns, so
the gaps are not one lucky measurement. Run it after a long search, e.g.

  pairgen-tune --op trimul --precision bfloat16 --shape B=1,N=256,P=128,H=128 --trials 640
  python scripts/search_curve.py --op trimul --precision bfloat16 --shape B=1,N=256,P=128,H=128

The first k trials of one long search are the trials a k-trial search with the same seed asks
(the sampler sees the same history up to there, timing noise aside).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pairgen.tuning.cli import add_selection_args, selected_shapes, shape_label  # noqa: E402


def best_after(tried: list, ks: list[int]) -> dict[int, tuple[str, float]]:
    """Per k, the point with the lowest value among the first k points tried (tuner.points_in_order:
    a point that failed its check counts, as the tuner counts it)."""
    out = {}
    for k in ks:
        timed = [pv for pv in tried[:k] if pv[1] is not None]
        if k <= len(tried) and timed:
            out[k] = min(timed, key=lambda pv: pv[1])
    return out


def main(argv=None) -> int:
    import torch

    from pairgen import runtime
    from pairgen.spec import n_bucket, precision_of
    from pairgen.tuning.evaluate import GpuEvaluator
    from pairgen.tuning.timing import strict_fp32
    from pairgen.tuning.tuner import open_study, points_in_order, retime_points, study_name

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_selection_args(parser)
    parser.add_argument("--seed", type=int, default=0, help="the study's seed (as given to pairgen-tune)")
    parser.add_argument("--ks", default="32,64,128,256", help="trial counts to report, besides all of them")
    parser.add_argument("--rounds", type=int, default=5, help="re-timing rounds (default 5)")
    args = parser.parse_args(argv)
    strict_fp32()
    info = runtime.device_info(torch.cuda.current_device())
    for spec, shape in selected_shapes(args, parser):
        dtype = precision_of(spec)
        study = open_study(study_name(info.slug, spec.name, dtype, spec.widths_of(shape), n_bucket(shape["N"])),
                           args.seed)
        tried = points_in_order(study)
        n_timed = len(tried)
        ks = sorted({*(int(k) for k in args.ks.split(",")), n_timed})
        best = best_after(tried, ks)
        points = list(dict.fromkeys(point for point, _ in best.values()))
        evaluator = GpuEvaluator(spec, shape, info.index, args.seed, peers=())
        widths = spec.widths_of(shape)
        now = retime_points(evaluator, spec, widths, points, args.rounds)
        if not now:
            print(f"{spec.name} {shape_label(shape)}: no point could be timed again", file=sys.stderr)
            continue
        overall = min(now.values())
        print(f"\n{spec.name} {shape_label(shape)} [{dtype}] on {info.name}: {n_timed} points tried in the study")
        print("| trials | best point | µs in the search | µs re-timed (median of "
              f"{args.rounds}) | gap to the best re-timed |")
        print("|---:|---|---:|---:|---:|")
        for k, (point, value) in best.items():
            label = spec.plan(*json.loads(point), widths).label
            again = f"{now[point]:.1f} | {100 * (now[point] / overall - 1):+.1f}%" if point in now else "failed | –"
            print(f"| {k} | {label} | {value:.1f} | {again} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
