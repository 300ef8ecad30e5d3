"""Whether a kernel switch pays: time the triangle update's module call with the wgmma strategy's
switches (its module-level booleans, e.g. PROJECTION_DEFERRED_STORE) set as each variant asks, on
this GPU's tuned bf16 params for the models' form, at several N. Every variant is checked against
the float64 reference on the GPU first, then the variants are timed in alternating rounds (a
round's order reversed every other round), so that a slow spell of the card falls on all of them.
Example (the first variant is the baseline the percentages refer to):

  python scripts/switch_study.py --variant none= --variant deferred=PROJECTION_DEFERRED_STORE \\
      --n 768,1024,2048 --rounds 5 --json study.json

A variant may also change the tuned point's launch shape: `g3w64=:p_groups=3,p_wn=64`. With
--forward-only each variant runs three forward calls at each N instead, unchecked and untimed, for
a profiler (here the second call's projection):

  ncu -k regex:z_registers1$ -s 1 -c 1 --set full -o deferred \\
      python scripts/switch_study.py --variant deferred=PROJECTION_DEFERRED_STORE --n 1024 --forward-only
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pairgen.ops.trimul.strategies import wgmma  # noqa: E402

MODELS_FORM = {"P": 128, "H": 128, "bias": 0, "gate_normalized": 1, "outgoing": 1}


def switches() -> list[str]:
    """The wgmma strategy's kernel switches: its module-level booleans named in capitals."""
    return sorted(name for name, value in vars(wgmma).items() if name.isupper() and isinstance(value, bool))


def parse_variant(text: str) -> tuple[str, dict[str, bool], dict[str, int]]:
    """"name=SWITCH,SWITCH:param=value,..." -> (name, the switches it turns to the other side, the
    params it overrides)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a variant is name=SWITCH,...[:param=value,...], not {text!r}")
    flipped, _, overrides = rest.partition(":")
    known = switches()
    flips = {}
    for switch in filter(None, flipped.split(",")):
        if switch not in known:
            raise argparse.ArgumentTypeError(f"no switch {switch!r}; the wgmma switches: {', '.join(known)}")
        flips[switch] = not getattr(wgmma, switch)
    params = {}
    for item in filter(None, overrides.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"a param override is name=integer, not {item!r}")
        params[key] = int(value)
    return name, flips, params


def alternating_order(names: list[str], round_index: int) -> list[str]:
    """The variants' order in a round: as given in even rounds, reversed in odd ones."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def summary(times: dict[str, list[float]]) -> list[str]:
    """One line a variant: its median, its runs and its change from the first variant's median."""
    medians = {name: statistics.median(runs) for name, runs in times.items()}
    base = next(iter(medians.values()), None)
    return [f"{name}: median {median:.1f} us, runs {[round(t, 1) for t in times[name]]}"
            + (f" ({100 * (median / base - 1):+.1f} %)" if base else "") for name, median in medians.items()]


def plan_for(spec, params: dict, flips: dict[str, bool], overrides: dict[str, int], widths: dict):
    """The plan with the variant's switches set while it is made (a plan keeps the render context
    it was made with) and restored after."""
    saved = {name: getattr(wgmma, name) for name in flips}
    try:
        for name, value in flips.items():
            setattr(wgmma, name, value)
        return spec.plan("wgmma", {**params, **overrides}, widths)
    finally:
        for name, value in saved.items():
            setattr(wgmma, name, value)


def tuned_params(n: int, widths: dict) -> dict:
    """This GPU's tuned wgmma params for the models' form at n's N bucket, as a module looks them up
    (else the nearest bucket tuned)."""
    import torch

    from pairgen import runtime
    from pairgen.spec import n_bucket
    from pairgen.tuned import TunedDB, databases_for_arch

    info = runtime.device_info(torch.cuda.current_device())
    databases = [TunedDB("trimul", info.slug), *databases_for_arch("trimul", info.arch, info.slug)]
    entries = [entry for db in databases for entry in db.entries()
               if entry["key"]["dtype"] == "bfloat16" and entry["key"]["widths"] == widths
               and entry.get("strategy") == "wgmma"]
    if not entries:
        raise SystemExit(f"no tuned wgmma entry for {widths} in bfloat16 on {info.slug}: tune it first")
    bucket = n_bucket(n)
    return min(entries, key=lambda entry: abs(math.log2(entry["key"]["n_bucket"] / bucket)))["params"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--variant", action="append", type=parse_variant, required=True,
                        help="name=SWITCH,...[:param=value,...] (repeatable; the first is the baseline)")
    parser.add_argument("--n", default="512,1024", help="comma-separated N (B = 1)")
    parser.add_argument("--incoming", action="store_true", help="the incoming direction (default outgoing)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write every run's time here")
    parser.add_argument("--forward-only", action="store_true",
                        help="run each variant's forward three times, unchecked and untimed (for Nsight Compute)")
    args = parser.parse_args(argv)

    import torch

    from pairgen import codegen, compiler, runtime
    from pairgen.ops.trimul import TRIMUL
    from pairgen.tuning.evaluate import GpuEvaluator

    if not torch.cuda.is_available():
        raise SystemExit("switch_study times kernels: it needs a CUDA GPU")
    widths = {**MODELS_FORM, "outgoing": 0 if args.incoming else 1}
    spec, ns = TRIMUL.at("bfloat16"), [int(n) for n in args.n.split(",")]
    plans = {(n, name): plan_for(spec, tuned_params(n, widths), flips, overrides, widths)
             for n in ns for name, flips, overrides in args.variant}
    start, arch = time.perf_counter(), runtime.device_info(torch.cuda.current_device()).arch
    rendered = [codegen.render_plan(plan) for plan in plans.values()]
    compiler.compile_many([(r.source, r.kernel_name, arch) for r in rendered], compiler.compile_pool())
    print(f"{len(plans)} variants compiled in {time.perf_counter() - start:.0f} s", flush=True)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "widths": widths, "times": {}}
    for n in ns:
        evaluator = GpuEvaluator(spec, {"B": 1, "N": n, **widths}, peers=())
        variants = {}
        for name, _, _ in args.variant:
            (variant,) = evaluator.compile([plans[(n, name)]])  # from the compile cache
            if isinstance(variant, Exception):
                raise SystemExit(f"N{n} {name}: {variant}")
            if not args.forward_only:  # (a profiler then counts the forward calls' launches alone)
                evaluator.check(variant)  # raises CheckFailed: no timing of a wrong kernel
            variants[name] = variant
        if args.forward_only:
            for name, variant in variants.items():
                evaluator.module.force_variant(variant)
                with torch.inference_mode():
                    for _ in range(3):
                        evaluator.module(*evaluator.inputs)
            evaluator.module.force_variant(None)
            torch.cuda.synchronize()
            continue
        times = {name: [] for name in variants}
        for round_index in range(args.rounds):
            for name in alternating_order(list(variants), round_index):
                times[name].append(evaluator.evaluate(variants[name]))
        report["times"][n] = times
        for line in summary(times):
            print(f"N{n} {line}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
