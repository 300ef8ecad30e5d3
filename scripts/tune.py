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
    from pairgen import runtime
    from pairgen.config import tuned_dir
    from pairgen.ops import get_op
    from pairgen.tuned import all_databases

    dbs = all_databases()
    if not dbs:
        print(f"no tuned entries under {tuned_dir()}")
        return 0
    totals = {"stale": 0, "invalid": 0}
    print("| gpu | op | shape | strategy | µs | × eager | × compile | state |\n|---|---|---|---|---|---|---|---|")
    for db in dbs:
        entries = db.entries()
        if db.problem:
            print(f"| {db.gpu_slug} | {db.op} | – | – | – | – | – | IGNORED: {db.problem} |")
        spec = get_op(db.op)
        for e in entries:
            state = runtime.entry_state(spec, e)  # "ok", "stale", or "invalid: why"
            kind = state.split(":")[0]
            if kind in totals:
                totals[kind] += 1
            base = e.get("baselines_us", {})
            ratio = lambda peer: f"{base[peer] / e['us']:.1f}×" if peer in base and e.get("us") else "–"  # noqa: E731
            print(f"| {db.gpu_slug} | {db.op} | {shape_label(e.get('shape', e['key']))} | {e['strategy']} "
                  f"| {e.get('us', '–')} | {ratio('eager')} | {ratio('compile')} | {_state_cell(state)} |")
    stale, invalid = totals["stale"], totals["invalid"]
    print(f"\n{stale} stale entr{'y' if stale == 1 else 'ies'}" + (f", {invalid} invalid" if invalid else "")
          + ("; re-tune them with: python scripts/tune.py --stale" if stale or invalid else ""))
    return 0


def _state_cell(state: str) -> str:
    if state == "stale":
        return "STALE (today's code renders another source)"
    return "INVALID" + state[len("invalid"):] if state.startswith("invalid") else state


# ---- --dry-run -----------------------------------------------------------------------------------

def dry_run(work) -> int:
    """Render and compile each strategy's default points and two sampled ones, per op and widths,
    printing each strategy/width set's rows as soon as it is compiled."""
    from pairgen import config, runtime

    arch = runtime.default_arch()
    sets = dry_run_sets(work)
    total = sum(len(plans) for plans in sets.values())
    workers = max(1, min(config.compile_workers(), total))
    # Said at once: a cold compile cache takes tens of seconds, which must not look like a hang.
    print(f"compiling {total} variants ({len(sets)} strategy/width sets) for {arch} on {workers} process(es)...",
          flush=True)
    print(f"| op | widths | variant | {arch} |\n|---|---|---|---|", flush=True)
    failed = 0
    for plans, results in compiled_sets(sets, arch, workers):
        failed += print_set(plans, results)
    print(f"\n{total - failed} of {total} variants rendered and compiled for {arch}")
    return 1 if failed else 0


def dry_run_sets(work) -> dict[tuple, list]:
    """(op, widths, strategy) -> the distinct plans to compile. Shapes that share widths share a
    set: the presets repeat widths with other B and N, and B and N change no kernel."""
    import random

    sets: dict[tuple, list] = {}
    for spec, shape in work:
        widths = spec.widths_of(shape)
        for strategy in spec.strategies:
            key = (spec.name, tuple(sorted(widths.items())), strategy)
            if key in sets:
                continue
            # Seeded by the strategy's name: the same points every run, so the cache answers a re-run.
            picked = spec.sample_plans(strategy, widths, 2, random.Random(strategy))
            if not picked:
                print(f"{spec.name} {strategy}: no feasible point for widths {widths}", flush=True)
                continue
            sets[key] = list({plan.label: plan for plan in picked}.values())  # a sample may equal a default
    return sets


def compiled_sets(sets: dict[tuple, list], arch: str, workers: int):
    """Yield (plans, results) per set, in order, as soon as the set is compiled. Every variant is
    queued at once, so all workers stay busy across sets; a result is a Compiled or the exception
    that stopped its compile."""
    from pairgen import compiler

    if not sets:
        return
    pool = compiler.compile_pool(workers)
    try:
        # One variant per task: a set can be printed when its own variants are done.
        futures = {key: [pool.submit(compiler.compile_many, [_job(plan, arch)]) for plan in plans]
                   for key, plans in sets.items()}
        for key, plans in sets.items():
            yield plans, [_result(future) for future in futures[key]]
    finally:
        pool.shutdown(cancel_futures=True)  # on Ctrl-C, do not sit through the queued compiles


def _job(plan, arch: str) -> tuple[str, str, str]:
    from pairgen import codegen

    rendered = codegen.render_plan(plan)
    return rendered.source, rendered.kernel_name, arch


def _result(future):
    try:
        return future.result()[0]
    except Exception as exc:  # a toolchain error (NVRTC not loadable...) is a FAILED row, not a traceback
        return exc


def print_set(plans: list, results: list) -> int:
    """Print a set's table rows (the full error of a failure on stderr); returns the failures."""
    failed = 0
    for plan, res in zip(plans, results):
        ok = not isinstance(res, Exception)
        failed += not ok
        text = res.summary() if ok else f"FAILED: {(str(res).splitlines() or [type(res).__name__])[0]}"
        print(f"| {plan.op} | {plan.widths} | {plan.label} | {text} |")
        if not ok:
            print(res, file=sys.stderr)
    sys.stdout.flush()  # a pipe (CI, tee) is block-buffered: without this the rows all come at the end
    return failed


# ---- tuning ---------------------------------------------------------------------------------------

def gpu_missing(what: str) -> bool:
    """True, having said so on stderr in one line, when torch sees no CUDA GPU."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"{what} needs a CUDA GPU; none is visible to torch (--dry-run and --status work without one)",
          file=sys.stderr)
    return True


def stale_work(args, parser):
    """This GPU's entries that lookups skip (stale or invalid against today's code), as (spec,
    shape) pairs: a re-tune writes a fresh entry over each."""
    from pairgen import runtime
    from pairgen.ops import get_op, op_names
    from pairgen.tuned import TunedDB

    info = runtime.device_info(0)
    work = []
    for op in args.op or op_names():
        spec = get_op(op)
        work += [(spec, dict(e["shape"])) for e in TunedDB(op, info.slug).entries()
                 if runtime.entry_state(spec, e, info.limits) != "ok"]
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


def starting_points(spec, db, shape: dict, info) -> list[tuple[str, dict]]:
    """The entry in use for the shape's key, and the one recorded for exactly its key even if a
    template edit made it stale (with each value of any parameter added since: spec.restarts),
    are tried first: a re-tune after an edit that grew the space then cannot come out worse than
    the old winner, as a re-tune once did (contact B1 N1024 on the H200: 588 us against 538
    before, the old point never sampled)."""
    from pairgen import runtime
    from pairgen.spec import n_bucket

    widths = spec.widths_of(shape)
    in_use = runtime.choose(spec, "float32", widths, shape["N"], info).entry
    points = []
    for entry in (in_use, db.previous("float32", widths, n_bucket(shape["N"]))):
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

    if gpu_missing("tuning"):
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
            extra = starting_points(spec, db, shape, info)
            evaluator = GpuEvaluator(spec, shape, info.index, args.seed, peers, pool)
            result = tune_shape(spec, shape, evaluator, info.slug, settings, extra)
            results.append(result)
            if result.best:
                db.upsert(tuned_entry(result, spec), arch=info.arch)
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
        # Stale entries are found per GPU (its slug names the folder), so the GPU comes first.
        if gpu_missing("re-tuning stale entries"):
            return 2
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
