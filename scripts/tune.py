#!/usr/bin/env python3
"""Tune pairgen's kernels on this GPU and record the winners in tuned/<gpu>/<op>.json.

  python scripts/tune.py                   every op, its default shapes (seed + real), 64 trials each
  python scripts/tune.py --op contact --shape B=4,N=64,P=64,H=32 --trials 32
  python scripts/tune.py --status          what is tuned, for which GPU, and what is stale
  python scripts/tune.py --stale           re-tune exactly this GPU's stale entries
  python scripts/tune.py --dry-run         render and compile every strategy (no GPU needed)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pairgen.tuning.cli import add_selection_args, selected_shapes, shape_label  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_selection_args(parser)
    parser.add_argument("--trials", type=int, default=64, help="distinct points checked and timed per shape (default 64)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="stop sampling a shape after this many seconds")
    parser.add_argument("--peers", default="eager,compile", help="baselines measured per shape (default eager,compile)")
    parser.add_argument("--seed", type=int, default=0, help="sampler and input seed")
    parser.add_argument("--report", type=Path, help="also write the closing table (markdown) here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--status", action="store_true", help="list tuned entries and whether they are stale")
    mode.add_argument("--stale", action="store_true", help="re-tune this GPU's stale entries")
    mode.add_argument("--dry-run", action="store_true", help="render and compile every strategy, then exit")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    return parser, args


# ---- --status ----------------------------------------------------------------------------------

def status() -> int:
    from pairgen.config import tuned_dir
    from pairgen.tuned import all_databases

    dbs = all_databases()
    if not dbs:
        print(f"no tuned entries under {tuned_dir()}")
        return 0
    stale_total = 0
    print("| gpu | op | shape | strategy | µs | × eager | × compile | state |\n|---|---|---|---|---|---|---|---|")
    for db in dbs:
        entries = db.entries()
        if db.problem:
            print(f"| {db.gpu_slug} | {db.op} | – | – | – | – | – | IGNORED: {db.problem} |")
        for e in entries:
            stale = db.is_stale(e)
            stale_total += stale
            base = e.get("baselines_us", {})
            ratio = lambda peer: f"{base[peer] / e['us']:.1f}×" if peer in base and e.get("us") else "–"  # noqa: E731
            print(f"| {db.gpu_slug} | {db.op} | {shape_label(e.get('shape', e['key']))} | {e['strategy']} "
                  f"| {e.get('us', '–')} | {ratio('eager')} | {ratio('compile')} "
                  f"| {'STALE (template changed)' if stale else 'ok'} |")
    print(f"\n{stale_total} stale entr{'y' if stale_total == 1 else 'ies'}"
          + ("; re-tune them with: python scripts/tune.py --stale" if stale_total else ""))
    return 0


# ---- --dry-run -----------------------------------------------------------------------------------

def dry_run(work) -> int:
    import random

    from pairgen import compiler, runtime

    arch = runtime.default_arch()
    plans = []
    for spec, shape in work:
        widths = spec.widths_of(shape)
        for name in spec.strategies:
            picked = spec.sample_plans(name, widths, 2, random.Random(name))
            if not picked:
                print(f"{spec.name} {name}: no feasible point for widths {widths}")
            plans += [(spec, shape, p) for p in picked]
    rendered = [runtime.render_plan(p) for _, _, p in plans]
    results = compiler.compile_many([(r.source, r.kernel_name, arch) for r in rendered])
    failed = 0
    print(f"| op | widths | variant | {arch} |\n|---|---|---|---|")
    for (spec, shape, plan), res in zip(plans, results):
        ok = not isinstance(res, Exception)
        failed += not ok
        text = res.summary() if ok else f"FAILED: {str(res).splitlines()[0]}"
        print(f"| {spec.name} | {plan.widths} | {plan.label} | {text} |")
        if not ok:
            print(res, file=sys.stderr)
    print(f"\n{len(results) - failed} of {len(results)} variants rendered and compiled for {arch}")
    return 1 if failed else 0


# ---- tuning ---------------------------------------------------------------------------------------

def stale_work(args, parser):
    from pairgen import runtime
    from pairgen.ops import get_op
    from pairgen.tuned import TunedDB

    slug = runtime.device_info(0).slug
    from pairgen.ops import op_names

    ops = args.op or op_names()
    work = []
    for op in ops:
        db = TunedDB(op, slug)
        work += [(get_op(op), dict(e["shape"])) for e in db.entries() if db.is_stale(e)]
    return work


def closing_table(results, peers) -> str:
    head = ["op", "shape", "best variant", "best µs"] + [f"{p} µs" for p in peers] + [f"× vs {p}" for p in peers]
    head += ["trials (evaluated / failed / pruned)", "compile s / variant", "tune s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        best = r.best
        us = best["us"] if best else None
        cells = [r.op, shape_label(r.shape), f"`{best['label']}`" if best else "none passed", f"{us:.1f}" if us else "–"]
        cells += [f"{r.baselines[p]:.1f}" if p in r.baselines else "–" for p in peers]
        cells += [f"{r.baselines[p] / us:.1f}×" if us and p in r.baselines else "–" for p in peers]
        c = r.counts
        cells += [f"{c.get('evaluated', 0)} / {c.get('failed', 0)} / {c.get('pruned', 0)}",
                  f"{r.compile_s_mean:.2f}" if r.compile_s_mean else "–", f"{r.elapsed_s:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def starting_points(spec, db, shape: dict) -> list[tuple[str, dict]]:
    """The entry in use for the shape's key, and the one recorded for exactly its key even if a
    template edit made it stale (with each value of any parameter added since: spec.restarts),
    are tried first: a re-tune after an edit that grew the space then cannot come out worse than
    the old winner, as it did in run 17 (contact B1 N1024: 588 us against 538 before, the old
    point never sampled)."""
    from pairgen import runtime

    key = ("float32", spec.widths_of(shape), runtime.n_bucket(shape["N"]))
    points = []
    for entry in (db.lookup(*key)[0], db.previous(*key)):
        for params in (spec.restarts(entry["strategy"], entry["params"]) if entry else []):
            if (entry["strategy"], params) not in points:
                points.append((entry["strategy"], params))
    return points


def tune(work, args) -> int:
    import torch

    from pairgen import compiler, runtime
    from pairgen.tuning.evaluate import GpuEvaluator, tuned_entry
    from pairgen.tuning.timing import strict_fp32
    from pairgen.tuned import TunedDB
    from pairgen.tuning.tuner import TuneSettings, tune_shape

    if not torch.cuda.is_available():
        print("tuning needs a CUDA GPU; none is visible to torch (--dry-run and --status work without one)",
              file=sys.stderr)
        return 2
    strict_fp32()
    peers = tuple(p for p in args.peers.split(",") if p)
    info = runtime.device_info(torch.cuda.current_device())
    print(f"tuning {len(work)} shape(s) on {info.name} ({info.slug}, {info.arch}), {args.trials} trials each")
    settings = TuneSettings(trials=args.trials, time_budget_s=args.time_budget, seed=args.seed,
                            progress=not args.no_progress)
    results = []
    with compiler.compile_pool() as pool:
        for spec, shape in work:
            db = TunedDB(spec.name, info.slug)
            extra = starting_points(spec, db, shape)
            evaluator = GpuEvaluator(spec, shape, info.index, args.seed, peers, pool)
            result = tune_shape(spec, shape, evaluator, info.slug, settings, extra)
            results.append(result)
            if result.best:
                db.upsert(tuned_entry(result, spec))
            else:
                print(f"{spec.name} {shape_label(shape)}: no variant passed; nothing written", file=sys.stderr)
            for line in result.failures[:5]:
                print(f"  failed: {line}", file=sys.stderr)
    runtime.clear_caches()
    table = closing_table(results, peers)
    header = (f"{info.name}, torch {torch.__version__}, CUDA {torch.version.cuda}; fp32, TF32 off; "
              "µs = median module call, L2 flushed.\n\n")
    print("\n" + header + table)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(header + table + "\n")
    return 0 if all(r.best for r in results) else 1


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    if args.status:
        return status()
    if args.stale:
        work = stale_work(args, parser)
        if not work:
            print("nothing is stale for this GPU")
            return 0
        return tune(work, args)
    work = selected_shapes(args, parser)
    if args.dry_run:
        return dry_run(work)
    return tune(work, args)


if __name__ == "__main__":
    sys.exit(main())
