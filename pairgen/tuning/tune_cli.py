"""Tune pairgen's kernels on this GPU and record the winners in the tuned database.

  pairgen-tune                   the main job (below): what users run, about 10 minutes on an H200
  pairgen-tune --seen            exactly the keys this GPU's processes ran without a tuned entry
                                 (their first-use records), in the precisions they ran
  pairgen-tune --op contact --shape B=4,N=64,P=64,H=32 --trials 32
  pairgen-tune --peers eager,compile   also time torch.compile (max-autotune: about a minute a shape)
  pairgen-tune --storage URL --devices all
                                 on each of several hosts: the studies in one database, every GPU
                                 of every host working on them (docs/multi-host.md)
  pairgen-tune --status          the tuned folders: what is tuned, for which GPU, and what is stale
  pairgen-tune --stale           re-tune exactly this GPU's stale entries
  pairgen-tune --dry-run         render and compile every strategy (no GPU needed)
  pairgen-tune --explain --op contact --shape B=1,N=300,P=128,H=128
                                 what a module runs for that shape on this GPU, and why
                                 (--gpu SLUG --arch sm_XY: on a GPU described by hand, no GPU needed)

The main job (no --shape, --preset or --precision; --op narrows it) is 19 shapes: first the
triangle update as the models run it (bf16, the output gate on the normalised input, no biases,
P = H = 128, both directions) at B = 1, N = 256, 512 and 768; then every op's fp32 seed and real
shapes (--preset all). Each shape gets 64 trials or 20 s of search, whichever comes first; running
it again continues each search where it stopped. Eager PyTorch is the peer every shape is compared
with. Each shape's line is printed as soon as it is done; Ctrl-C keeps the shapes that are done
(their entries are written) and prints their table. Other libraries' output (torch.compile's,
torch's warnings and logs) goes to a log file, which the report names at the end.

Results go to the user folder ($XDG_DATA_HOME/pairgen/tuned, else ~/.local/share/pairgen/tuned),
to <repo>/tuned when run from a checkout, or to PAIRGEN_TUNED_DIR when it is set.
(`python scripts/tune.py` is this command, from a checkout that is not installed.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from ..spec import precision_of
from .cli import add_selection_args, environment_problem, is_main_job, selected_shapes, shape_label
from .multi_gpu import compile_share, devices_of, tune_on_devices
from .tune_status import described_gpu, explain, status, this_gpu, what_runs

#: The main job's search time per shape. The search takes 12-22 s a shape at 64 trials on the H200
#: (the larger fp32 triangle updates more); 20 s keeps its 19 shapes near 10 minutes, and a re-run
#: resumes each study for the trials left.
MAIN_JOB_TIME_BUDGET_S = 20.0

#: The baselines a shape can be timed against. torch.compile (max-autotune) takes most of a minute
#: per shape and floods the log with its autotuning: asked for, not the default.
KNOWN_PEERS = ("eager", "compile")

#: The exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report one.
INTERRUPTED_EXIT = 130


def parse_args(argv=None):
    from pairgen.tuning.settings import SAMPLERS, TuneSettings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_selection_args(parser, main_job=True)
    parser.add_argument("--trials", type=int, default=64, help="distinct points checked and timed per shape (default 64)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="stop sampling a shape after this many seconds (default: none; "
                             f"{MAIN_JOB_TIME_BUDGET_S:.0f} for the main job)")
    parser.add_argument("--peers", default="eager",
                        help=f"baselines measured per shape, of {', '.join(KNOWN_PEERS)} (default eager; "
                             "eager,compile adds torch.compile, about a minute a shape)")
    parser.add_argument("--seed", type=int, default=0, help="sampler and input seed")
    parser.add_argument("--sampler", choices=SAMPLERS, default=TuneSettings.sampler,
                        help=f"how points are proposed (default {TuneSettings.sampler}; gp needs scipy)")
    parser.add_argument("--report", type=Path, help="also write the closing table (markdown) here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--devices", metavar="all|0,1,...",
                        help="tune on these GPUs at once: one worker process per GPU, all sharing each shape's "
                             "study (default: the current GPU alone)")
    parser.add_argument("--storage", metavar="URL",
                        help="a database for the studies, e.g. postgresql+psycopg://user:password@host:5432/pairgen: "
                             "workers on several hosts that name the same URL share each study, and need share "
                             "nothing else (docs/multi-host.md; default: a journal file per study under "
                             "PAIRGEN_CACHE_DIR)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--status", action="store_true", help="list tuned entries and whether they are stale")
    mode.add_argument("--stale", action="store_true", help="re-tune this GPU's stale entries")
    mode.add_argument("--seen", action="store_true",
                      help="tune exactly the keys this GPU's processes ran without a tuned entry (the first-use "
                           "records under the tuned folder's <gpu>/first-use/), each in the precision it ran, at "
                           "its N bucket with B = 1 (--op narrows them)")
    mode.add_argument("--dry-run", action="store_true", help="render and compile every strategy, then exit")
    mode.add_argument("--backward", action="store_true",
                      help="tune the training path instead: the closed forms' fused kernels (trimul, contact), every "
                           "point of their small space timed as a forward + backward step, the fastest whose "
                           "gradients agree with the defaults' written to tuned/<gpu>/<op>_backward.json")
    mode.add_argument("--explain", action="store_true",
                      help="say what a module runs for each selected shape on this GPU (or on --gpu/--arch): "
                           "tuned, nearest bucket, same-architecture GPU or default; its parameters, time and file")
    described = parser.add_argument_group("a GPU described by hand (--explain, --status; no GPU needed)")
    described.add_argument("--gpu", metavar="SLUG", help="the GPU's folder name in the tuned database, e.g. nvidia-h200")
    described.add_argument("--arch", metavar="sm_XY", help="its compute capability, e.g. sm_90")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if (args.gpu is None) != (args.arch is None):
        parser.error("--gpu and --arch go together: the GPU's folder name and its compute capability")
    if args.arch is not None and not _arch_pattern().fullmatch(args.arch):
        parser.error(f"--arch {args.arch!r} is not a GPU target such as sm_80, sm_90 or sm_100")
    if args.gpu is not None and not (args.explain or args.status):
        parser.error("--gpu and --arch describe a GPU for --explain and --status only")
    if args.devices is not None and args.devices != "all" and not re.fullmatch(r"\d+(,\d+)*", args.devices):
        parser.error(f"--devices takes 'all' or GPU indices such as 0,1; got {args.devices!r}")
    args.peers = _peers(args.peers, parser)
    if (args.seen or args.stale) and (args.shape or args.preset or args.precision):
        parser.error(f"--{'seen' if args.seen else 'stale'} picks its own keys: it takes --op, not --shape, "
                     "--preset or --precision")
    if args.time_budget is None and is_main_job(args) and not (args.seen or args.stale):
        args.time_budget = MAIN_JOB_TIME_BUDGET_S
    return parser, args


def _peers(text: str, parser) -> str:
    """--peers checked: known peer names, comma-separated, in order, each once."""
    peers = peer_names(text)
    unknown = [p for p in peers if p not in KNOWN_PEERS]
    if unknown:
        parser.error(f"--peers: no peer named {', '.join(map(repr, unknown))}; the peers are "
                     f"{', '.join(KNOWN_PEERS)} (e.g. --peers eager,compile)")
    return ",".join(peers)


def peer_names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))


def _arch_pattern():
    from pairgen.config import ARCH_PATTERN

    return ARCH_PATTERN


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
    print(f"{what} needs a CUDA GPU; none is visible to torch (--dry-run, --status, and --explain with "
          "--gpu/--arch work without one)", file=sys.stderr)
    return True


def stale_work(args, parser):
    """This GPU's entries that lookups skip (stale or invalid against today's code), as (spec,
    shape) pairs: a re-tune writes a fresh entry over each. Read in every tuned folder, the first
    folder's entry for a key hiding the later ones' (a stale shipped entry is re-tuned into the
    user folder, where it then comes first)."""
    from pairgen import config, runtime
    from pairgen.ops import get_op, op_names
    from pairgen.tuned import TunedDB

    info = runtime.device_info(0)
    work = []
    for op in args.op or op_names():
        spec = get_op(op)
        seen = set()
        for root in config.tuned_read_dirs():
            for e in TunedDB(op, info.slug, root).entries():
                key = repr(e["key"])
                if key in seen:
                    continue
                seen.add(key)
                if runtime.entry_state(spec, e, info.limits) != "ok" and e["key"]["dtype"] in spec.precisions:
                    work.append((spec.at(e["key"]["dtype"]), dict(e["shape"])))
    return work


def seen_work(ops=None) -> list[tuple]:
    """The keys this GPU's processes ran without a tuned entry, as (spec in the precision the key
    ran in, shape) pairs: one per first-use record (pairgen/first_use.py writes one the first time
    a process runs a key that has no tuned entry), at the key's N bucket with B = 1 (a record names
    the key, not the call's B and N). Keys tuned since are left out; what is picked, and left out,
    is said."""
    import torch

    from pairgen import first_use, runtime
    from pairgen.ops import get_op, op_names

    info = runtime.device_info(torch.cuda.current_device())
    work, tuned_since, unknown = [], 0, []
    for op in ops or op_names():
        path = first_use.verdict_path(op, info.slug)
        spec = get_op(op)
        for verdict in first_use.load_verdicts(path):
            key = verdict.get("key") or {}
            precision, widths, bucket = key.get("dtype"), key.get("widths"), key.get("n_bucket")
            if precision not in spec.precisions or not isinstance(widths, dict) or not isinstance(bucket, int):
                unknown.append(f"{path}: {json.dumps(key, sort_keys=True)}")
                continue
            if _tuned_here(spec, key, info):
                tuned_since += 1
                continue
            work.append((spec.at(precision), {"B": 1, "N": bucket, **widths}))
    root = first_use.verdict_path("any-op", info.slug).parent  # the folder every op's records are in
    for line in unknown:
        print(f"--seen: skipping a record this pairgen cannot tune (an unknown precision or a malformed key): {line}",
              file=sys.stderr)
    since = f"; {tuned_since} more tuned since they ran" if tuned_since else ""
    if not work:
        print(f"--seen: no key to tune: no first-use record of a key without a tuned entry under {root}{since}. "
              "A process records a key the first time it runs one that has no tuned entry (unless "
              "PAIRGEN_FIRST_USE_CHECK=0).")
    else:
        print(f"--seen: {len(work)} key(s) this GPU's processes ran without a tuned entry (records in {root}){since}")
    return work


def _tuned_here(spec, key: dict, info) -> bool:
    """Whether this GPU has a tuned entry for the key that lookups use (not stale or invalid)."""
    from pairgen import config, runtime
    from pairgen.tuned import TunedDB

    for root in config.tuned_read_dirs():
        for entry in TunedDB(spec.name, info.slug, root).entries():
            if entry["key"] == key:
                return runtime.entry_state(spec, entry, info.limits) == "ok"
    return False


@dataclasses.dataclass
class ShapeDone:
    """A tuned shape, as the report shows it: its precision, the search's result, whether its
    entry was written to the tuned database, and the recorded µs of the entry kept instead
    (KEEP_RECORDED_BELOW), if one was."""

    precision: str
    result: object  # tuner.TuneResult
    written: bool
    kept_us: float | None = None


def shape_line(number: int, total: int, done: ShapeDone, peers, trials: int | None = None) -> str:
    """The line printed as soon as a shape is done: op, shape, precision, best variant and its µs
    against each peer's; then how many points were timed ("40 of 64": the time budget stopped the
    search, which a re-run continues)."""
    r = done.result
    head = f"[{number}/{total}] {r.op} {shape_label(r.shape)} {done.precision}:"
    if not r.best:
        return f"{head} no variant passed; nothing written"
    us = r.best["us"]
    # (the closed form: what a 16-bit module runs without a kernel, timed beside the peers)
    against = "".join(f" against {name} {r.baselines[key]:.1f} µs ({r.baselines[key] / us:.1f}×)"
                      for key, name in [(peer, peer) for peer in peers] + [("closed_form", "the closed form")]
                      if key in r.baselines)
    runs = what_runs(us, r.baselines)
    instead = "" if runs == "the kernel" else f"; a module runs {runs}"
    written = "" if done.written else "; NOT WRITTEN (see above)"
    if done.kept_us is not None:
        written = f"; the entry in use kept ({done.kept_us:.1f} µs recorded; see above)"
    evaluated = r.counts.get("evaluated", 0)
    of = f" of {trials}" if trials and evaluated < trials else ""
    return (f"{head} `{r.best['label']}` {us:.1f} µs{against}{instead}; {evaluated}{of} trials in "
            f"{r.elapsed_s:.0f} s{written}")


def closing_table(done: list[ShapeDone], peers) -> str:
    head = ["op", "shape", "precision", "best variant", "best µs"] + [f"{p} µs" for p in peers]
    head += [f"× vs {p}" for p in peers] + ["a module runs", "trials (evaluated / failed / pruned)",
                                            "compile s / variant", "tune s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in done:
        r, best = d.result, d.result.best
        us = best["us"] if best else None
        cells = [r.op, shape_label(r.shape), d.precision, f"`{best['label']}`" if best else "none passed",
                 f"{us:.1f}" if us else "–"]
        cells += [f"{r.baselines[p]:.1f}" if p in r.baselines else "–" for p in peers]
        cells += [f"{r.baselines[p] / us:.1f}×" if us and p in r.baselines else "–" for p in peers]
        cells.append(what_runs(us, r.baselines) if d.kept_us is None else f"the entry in use, kept ({d.kept_us:.1f} µs recorded)")
        c = r.counts
        cells += [f"{c.get('evaluated', 0)} / {c.get('failed', 0)} / {c.get('pruned', 0)}",
                  f"{r.compile_s_mean:.2f}" if r.compile_s_mean else "–", f"{r.elapsed_s:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: Precisions whose winners are a tuning run's first guesses: exact fp32's for tf32x3 and tf32
#: (which may run the exact kernels), the other 16-bit dtype's for bf16 and fp16 (the same code in
#: another element type: bf16's large readout point beat fp16's 16-trial search by 1.3x).
RELATED_PRECISIONS = {"tf32x3": ("float32",), "tf32": ("float32",), "bfloat16": ("float16",), "float16": ("bfloat16",)}


def starting_points(spec, db, shape: dict, info) -> list[tuple[str, dict]]:
    """The entry in use for the shape's key, and the one recorded for exactly its key even if a
    template edit made it stale (with each value of any parameter added since: spec.restarts),
    are tried first: a re-tune after an edit that grew the space then cannot come out worse than
    the old winner. Then the winners at the same shape in the RELATED_PRECISIONS."""
    from pairgen import runtime
    from pairgen.spec import n_bucket

    widths = spec.widths_of(shape)
    precision = precision_of(spec)
    in_use = runtime.choose(spec, precision, widths, shape["N"], info).entry
    entries = [in_use, previous_entry(spec, db, widths, n_bucket(shape["N"]))]
    for other in RELATED_PRECISIONS.get(precision, ()):
        entry = runtime.choose(spec, other, widths, shape["N"], info).entry
        if entry is not None and entry["strategy"] in spec.strategies:
            entries.append(entry)
    points = []
    for entry in entries:
        for params in (spec.restarts(entry["strategy"], entry["params"]) if entry else []):
            if (entry["strategy"], params) not in points:
                points.append((entry["strategy"], params))
    return points


def previous_entry(spec, db, widths: dict, bucket: int) -> dict | None:
    """The entry recorded for exactly this key in the database tuning writes, else in the first
    other tuned folder that has one for this GPU (the shipped results, from an install)."""
    from pairgen import config
    from pairgen.tuned import TunedDB

    found = db.previous(precision_of(spec), widths, bucket)
    for root in config.tuned_read_dirs():
        if found is not None:
            break
        other = TunedDB(spec.name, db.gpu_slug, root)
        if other.path != db.path:
            found = other.previous(precision_of(spec), widths, bucket)
    return found


def tune(work, args) -> int:
    """Tune each (spec, shape) of `work`, write each winner as its shape finishes and say so in a
    line, then print the closing table. 0: every shape has a written winner; 1: some shape has none
    (or it could not be written); 130: stopped by Ctrl-C (the shapes done are kept)."""
    import torch

    from pairgen import config, runtime
    from pairgen.tuned import TunedDB
    from pairgen.tuning.timing import strict_fp32
    from pairgen.tuning.tuner import TuneSettings

    from .third_party_log import ThirdPartyLog

    if args.storage is not None and (problem := storage_problem(args.storage)) is not None:
        print(f"pairgen-tune: {problem}", file=sys.stderr)
        return 2
    if gpu_missing("tuning"):
        return 2
    info = runtime.device_info(torch.cuda.current_device())
    budget = f" or {args.time_budget:.0f} s of search" if args.time_budget else ""
    peers = ", ".join(peer_names(args.peers)) or "no peer"
    print(f"tuning {len(work)} shape(s) on {info.name} ({info.slug}, {info.arch}), {args.trials} trials{budget} "
          f"each, against {peers}; results go to {config.tuned_write_dir() / info.slug}", flush=True)
    settings = TuneSettings(trials=args.trials, time_budget_s=args.time_budget, seed=args.seed,
                            progress=not args.no_progress, sampler=args.sampler)
    devices = devices_of(args.devices, torch.cuda.device_count(), info.index)
    if len(devices) > 1:
        names = {torch.cuda.get_device_name(d) for d in devices}
        if len(names) > 1:
            print(f"--devices {args.devices}: the GPUs differ ({', '.join(sorted(names))}); a study is one GPU "
                  "model's: tune each model separately", file=sys.stderr)
            return 2
        print(f"{len(devices)} workers, one per GPU ({', '.join(map(str, devices))}), share each shape's study")
    with ThirdPartyLog(third_party_log_path(args)) as third_party:
        strict_fp32()  # inside: torch may warn about the settings it changes
        jobs = [(spec, shape, starting_points(spec, TunedDB(spec.name, info.slug), shape, info))
                for spec, shape in work]
        if len(devices) > 1:
            done, interrupted = _tune_on_devices_and_record(jobs, devices, settings, args, info, third_party.path)
        else:
            done, interrupted = _tune_here(jobs, settings, args, info, third_party)
        runtime.clear_caches()
    report(done, len(jobs), args, info, interrupted, third_party.summary())
    if interrupted:
        return INTERRUPTED_EXIT
    return 0 if all(d.result.best and d.written for d in done) else 1


def _tune_here(jobs, settings, args, info, third_party) -> tuple[list[ShapeDone], bool]:
    """Tune the jobs one after the other on this GPU, each shape's entry written and its line
    printed as soon as it is done. Returns the shapes done, and whether Ctrl-C stopped the run (the
    shape in progress then keeps its trials in its study, and a re-run resumes it)."""
    from pairgen import compiler
    from pairgen.tuning.evaluate import GpuEvaluator
    from pairgen.tuning.tuner import tune_shape

    peers = peer_names(args.peers)
    done: list[ShapeDone] = []
    try:
        with compiler.compile_pool(compile_share(1)) as pool:
            for spec, shape, extra in jobs:
                evaluator = third_party.quiet_peers(GpuEvaluator(spec, shape, info.index, args.seed, peers, pool))
                # With --storage, other hosts may work on the same studies: claim points first.
                result = tune_shape(spec, shape, evaluator, info.slug, settings, extra, dtype=precision_of(spec),
                                    shared=args.storage is not None, storage_url=args.storage)
                done.append(ShapeDone(precision_of(spec), result, *_record(spec, result, info)))
                say(shape_line(len(done), len(jobs), done[-1], peers, settings.trials))
    except KeyboardInterrupt:
        return done, True
    return done, False


def _tune_on_devices_and_record(jobs, devices, settings, args, info, log_path) -> tuple[list[ShapeDone], bool]:
    """--devices: the workers tune every shape; this process then writes each shape's entry and
    prints its line. Stopped by Ctrl-C, nothing is written (the studies keep every trial)."""
    peers = peer_names(args.peers)
    try:
        results = tune_on_devices(jobs, devices, settings, peers, info.slug, args.storage, log_path)
    except KeyboardInterrupt:
        return [], True
    done = []
    for (spec, _, _), result in zip(jobs, results):
        done.append(ShapeDone(precision_of(spec), result, *_record(spec, result, info)))  # once per shape, here alone
        say(shape_line(len(done), len(jobs), done[-1], peers, settings.trials))
    return done, False


def say(line: str) -> None:
    """A line of pairgen's on the terminal now, above any progress bar, flushed (a pipe, as to tee,
    is block-buffered: the line would otherwise come at the end)."""
    from tqdm import tqdm

    tqdm.write(line)
    sys.stdout.flush()


def third_party_log_path(args) -> Path:
    """Where other libraries' output goes: beside --report (its name, .third-party.log: a plain .log
    is where a user would send the command's own output), else a file per run under the cache
    folder's logs/."""
    import time

    from pairgen import config

    if args.report:
        return args.report.with_suffix(".third-party.log")
    return config.cache_dir() / "logs" / f"tune-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def report(done: list[ShapeDone], total: int, args, info, interrupted: bool, third_party: str) -> None:
    """The closing table (of the shapes done, when Ctrl-C stopped the run), to the terminal and to
    --report; then where other libraries' output went."""
    import torch

    if interrupted:
        print(f"\ninterrupted: {len(done)} of {total} shape(s) done, their entries written; a search cut short "
              "keeps its trials in its study, and running the same command again resumes it", flush=True)
    header = (f"{info.name}, torch {torch.__version__}, CUDA {torch.version.cuda}; fp32 with TF32 off unless a "
              "variant names its precision ([bfloat16], [tf32x3], ...; the peers then run in that dtype); "
              "µs = median module call, L2 flushed.\n\n")
    table = closing_table(done, peer_names(args.peers))
    print("\n" + header + table)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(header + table + "\n")
    print(f"\n{third_party}", flush=True)


def storage_problem(url: str) -> str | None:
    """Why the database at --storage cannot be used, in one line (unreachable, no such database, a
    driver missing, not a URL); None when it opens. Checked before any work starts."""
    from pairgen.tuning.storage import StorageError
    from pairgen.tuning.tuner import check_storage

    try:
        check_storage(url)
    except StorageError as exc:
        return str(exc)
    return None


#: A re-tune keeps the entry it would replace (same GPU, still current) where its best time is more
#: than this many times the time recorded for that entry: the incumbent is timed again beside the new
#: best, and it loses by that much only when the run's timings are off (docs/performance.md, session 51).
KEEP_RECORDED_BELOW = 1.25


def _kept_instead(spec, db, entry: dict) -> dict | None:
    """The entry recorded for `entry`'s key that a re-tune keeps instead of it (KEEP_RECORDED_BELOW),
    else None."""
    from pairgen import runtime

    key = entry["key"]
    old = db.previous(key["dtype"], key["widths"], key["n_bucket"])
    if old is None or not old.get("us") or entry["us"] <= KEEP_RECORDED_BELOW * old["us"]:
        return None
    return old if runtime.entry_state(spec, old) == "ok" else None


def _record(spec, result, info) -> tuple[bool, float | None]:
    """Write a shape's winner to the tuned database (or say why there is none, or keep the entry in
    use: KEEP_RECORDED_BELOW). Returns (written, the kept entry's recorded µs or None); written is
    False when the winner could not be written: said in one line, and the run goes on with the
    other shapes."""
    from pairgen.tuned import TunedDB, TunedDBError
    from pairgen.tuning.evaluate import tuned_entry

    written = True
    if result.best:
        db = TunedDB(spec.name, info.slug)
        entry = tuned_entry(result, spec)
        if (kept := _kept_instead(spec, db, entry)) is not None:
            print(f"{spec.name} {shape_label(result.shape)}: kept the entry in use ({kept['us']:.1f} µs, recorded "
                  f"{kept.get('date', 'earlier')}): this run's best, {entry['us']:.1f} µs, is over "
                  f"{KEEP_RECORDED_BELOW:g}x that, so this run's timings are taken to be off (the GPU or the host "
                  "busy, or not yet warm); run the shape again to time it anew", flush=True)
            return True, kept["us"]
        try:
            db.upsert(entry, arch=info.arch)
        except (OSError, TunedDBError) as exc:  # a read-only folder, a full disk, a file a person must fix
            written = False
            print(f"{spec.name} {shape_label(result.shape)}: cannot write the tuned entry to {db.path} ({exc}). "
                  "The trials are kept in the shape's study: re-running this command once that is fixed writes it "
                  "without timing those points again (the peers and the finalists are re-timed). The winner: "
                  f"{result.best['strategy']} {json.dumps(result.best['params'], sort_keys=True)}, "
                  f"{result.best['us']:.1f} µs", file=sys.stderr)
    else:
        print(f"{spec.name} {shape_label(result.shape)}: no variant passed; nothing written", file=sys.stderr)
    for line in result.failures[:5]:
        print(f"  failed: {line}", file=sys.stderr)
    return written, None


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    if (problem := environment_problem()) is not None:
        print(f"pairgen-tune: {problem}", file=sys.stderr)
        return 2
    if args.status:
        return status(described_gpu(args))
    if args.stale:
        # Stale entries are found per GPU (its slug names the folder), so the GPU comes first.
        if gpu_missing("re-tuning stale entries"):
            return 2
        work = stale_work(args, parser)
        if not work:
            print("nothing is stale for this GPU")
            return 0
        return tune(work, args)
    if args.seen:
        if gpu_missing("tuning the keys this GPU ran"):
            return 2
        work = seen_work(args.op)
        if not work:
            return 0
        return tune(work, args)
    if args.backward:
        if gpu_missing("tuning the training path"):
            return 2
        from .backward_tune import main as tune_backward

        return tune_backward(selected_shapes(args, parser, without_kernels=("bfloat16", "float16")),
                             storage_url=args.storage)
    work = selected_shapes(args, parser, main_job=True)
    if args.explain:
        info = described_gpu(args) or this_gpu()
        if info is None:
            print("--explain needs a CUDA GPU, or one described with --gpu SLUG --arch sm_XY "
                  "(e.g. --gpu nvidia-h200 --arch sm_90); none is visible to torch", file=sys.stderr)
            return 2
        return explain(work, info)
    if args.dry_run:
        return dry_run(work)
    return tune(work, args)


if __name__ == "__main__":
    sys.exit(main())
