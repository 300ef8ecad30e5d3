"""Whether a kernel switch pays: time the triangle update's module call with the wgmma strategy's
switches (its module-level booleans, e.g. PROJECTION_MASK_FOLD) set as each variant asks, on
this GPU's tuned bf16 params for the models' form (at P = H = 128, or the widths --widths
names), at several N. Every variant is checked against the float64 reference on the GPU first,
then the variants are timed in alternating rounds (a round's order reversed every other round),
so that a slow spell of the card falls on all of them.
Example (the first variant is the baseline the percentages refer to):

  python scripts/switch_study.py --variant none= --variant unfolded=PROJECTION_MASK_FOLD \\
      --n 768,1024,2048 --rounds 5 --json study.json

A variant may also change the tuned point's launch shape: `g3w64=:p_groups=3,p_wn=64`, or give a
module-level integer setting a value: `g3=output_backward.GROUPS=3` (with --training). With
--forward-only each variant runs three forward calls at each N instead, unchecked and untimed, for
a profiler (here the second call's projection):

  ncu -k regex:z_registers1$ -s 1 -c 1 --set full -o unfolded \\
      python scripts/switch_study.py --variant unfolded=PROJECTION_MASK_FOLD --n 1024 --forward-only

With --resources no GPU is needed: each variant's plan on the tuned point of this architecture
(PAIRGEN_ARCH, else sm_90) is checked for what it needs (shared memory, slices) and compiled, and
its kernels' registers and spills printed, so that a variant which cannot run or spills is found
before device time is spent on it (a switch-like param takes 0/1):

  PAIRGEN_ARCH=sm_90 python scripts/switch_study.py --resources --widths P=256,H=256 --n 512 \\
      --variant before= --variant og3w32=:o_groups=3,o_wn=32,o_staged_stores=0

With --training the variants are a bf16 module's training steps (forward and backward, the input
and every parameter wanting a gradient), for the switches a training call reads when it first runs
(the backward's, e.g. BACKWARD_POINTERS): each variant gets its own copy of one module, whose first
call, made with the variant's switches set, is recorded and then replayed as a model's steps are.
Each variant's gradients are compared with the first variant's first (relative L2 at most 1e-2,
the 16-bit standard's scale), then the steps are timed in alternating rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pairgen.ops.trimul import output_backward  # noqa: E402
from pairgen.ops.trimul.strategies import wgmma  # noqa: E402

#: Where switches live: the wgmma strategy's by their names, the others' as module.NAME.
SWITCH_MODULES = {"": wgmma, "output_backward.": output_backward}

MODELS_FORM = {"P": 128, "H": 128, "bias": 0, "gate_normalized": 1, "outgoing": 1}


#: The integer settings a variant may give a value (NAME=value): those a call reads where it builds
#: or looks up its kernel, so that a variant's own module copy takes them.
SETTINGS = ("GRADIENT_PASSES_AHEAD", "RESIDENT_BACKWARD_GROUPS", "output_backward.GROUPS",
            "output_backward.MAX_PASS_COLUMNS")


def switches() -> list[str]:
    """The kernel switches: the wgmma strategy's module-level booleans named in capitals, and the
    output side's backward's as output_backward.NAME."""
    return sorted(prefix + name for prefix, module in SWITCH_MODULES.items()
                  for name, value in vars(module).items() if name.isupper() and isinstance(value, bool))


def switch_owner(switch: str) -> tuple:
    """(the module a switch lives in, its name there)."""
    prefix, _, name = switch.rpartition(".")
    return SWITCH_MODULES[prefix + "." if prefix else ""], name


def switch_value(switch: str) -> bool | int:
    module, name = switch_owner(switch)
    return getattr(module, name)


def set_switch(switch: str, value: bool | int) -> None:
    module, name = switch_owner(switch)
    setattr(module, name, value)


def parse_variant(text: str) -> tuple[str, dict[str, bool | int], dict[str, int]]:
    """"name=SWITCH,SETTING=value,...:param=value,..." -> (name, the switches it turns to the other
    side and the integer settings it gives a value, the params it overrides)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a variant is name=SWITCH,...[:param=value,...], not {text!r}")
    flipped, _, overrides = rest.partition(":")
    known = switches()
    flips = {}
    for switch in filter(None, flipped.split(",")):
        setting, eq, value = switch.partition("=")
        if eq:
            if setting not in SETTINGS or not value.isdigit():
                raise argparse.ArgumentTypeError(f"{switch!r}: a setting is NAME=<integer>, the settings: "
                                                 f"{', '.join(SETTINGS)}")
            flips[setting] = int(value)
        elif switch not in known:
            raise argparse.ArgumentTypeError(f"no switch {switch!r}; the switches: {', '.join(known)}")
        else:
            flips[switch] = not switch_value(switch)
    params = dict(parse_override(item) for item in filter(None, overrides.split(",")))
    return name, flips, params


def parse_override(item: str) -> tuple[str, int | bool]:
    """"param=value" of the wgmma strategy's space, as the space's type (a switch-like param takes
    0/1 or false/true): a name or value the space lacks fails here, before any compile or GPU time."""
    space = wgmma.WGMMA.space
    key, eq, value = item.partition("=")
    if not eq or key not in space:
        raise argparse.ArgumentTypeError(f"a param override is name=value with a name of the wgmma space "
                                         f"({', '.join(sorted(space))}), not {item!r}")
    if all(isinstance(choice, bool) for choice in space[key]):
        words = {"0": False, "false": False, "1": True, "true": True}
        if value.lower() not in words:
            raise argparse.ArgumentTypeError(f"{key} is 0/1 (or false/true), not {value!r}")
        return key, words[value.lower()]
    if not value.lstrip("-").isdigit() or int(value) not in space[key]:
        raise argparse.ArgumentTypeError(f"{key} is one of {space[key]}, not {value!r}")
    return key, int(value)


def parse_widths(text: str) -> dict[str, int]:
    """P=..,H=.. (either or both) as {"P": .., "H": ..}."""
    widths = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in ("P", "H") or not value.isdigit() or int(value) % 16 or not int(value):
            raise argparse.ArgumentTypeError(f"{item!r}: the widths are P=<positive multiple of 16> and "
                                             "H=<positive multiple of 16>")
        widths[name] = int(value)
    return widths


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
    with switched(flips):
        return spec.plan("wgmma", {**params, **overrides}, widths)


@contextlib.contextmanager
def switched(flips: dict[str, bool]):
    """The switches set as `flips` asks while open (a training call reads the backward's when it
    first runs), restored after."""
    saved = {name: switch_value(name) for name in flips}
    try:
        for name, value in flips.items():
            set_switch(name, value)
        yield
    finally:
        for name, value in saved.items():
            set_switch(name, value)


def relative_error(mine, theirs) -> float:
    return ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item()


def training_study(variants: list, ns: list[int], widths: dict, rounds: int, steps: int = 5) -> dict:
    """{N: {variant: [µs a step, one per round]}}: each variant's own copy of one bf16 module,
    recorded under its switches, its gradients checked against the first variant's."""
    import torch

    from pairgen.ops.trimul import TRIMUL

    gen = torch.Generator().manual_seed(0)
    base = TRIMUL.make_module(widths, gen).cuda().to(torch.bfloat16)
    report = {}
    for n in ns:
        x, mask = TRIMUL.make_inputs({"B": 1, "N": n, **widths}, gen, "normal")
        x, mask = x.cuda().to(torch.bfloat16), mask.cuda()
        g = torch.randn(x.shape, generator=gen).cuda().to(torch.bfloat16)
        modules = {name: copy.deepcopy(base) for name, _, _ in variants}
        flips_of = {name: flips for name, flips, _ in variants}

        def step(name):
            module = modules[name]
            module.zero_grad(set_to_none=True)
            leaf = x.detach().requires_grad_()
            module(leaf, mask).backward(g)
            return [leaf.grad, *(p.grad for p in module.parameters())]

        first = None
        for name in modules:
            with switched(flips_of[name]):
                grads = step(name)  # recorded under the variant's switches
                grads = step(name)  # and replayed
            torch.cuda.synchronize()
            if first is None:
                first = [t.clone() for t in grads]
                continue
            worst = max(relative_error(mine, theirs) for mine, theirs in zip(grads, first))
            if not worst <= 1e-2:
                raise SystemExit(f"N{n} {name}: a gradient differs from {variants[0][0]}'s by {worst:.2e} (relative L2)")
        times = {name: [] for name in modules}
        for round_index in range(rounds):
            for name in alternating_order(list(modules), round_index):
                with switched(flips_of[name]):
                    step(name)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(steps):
                        step(name)
                    end.record()
                    end.synchronize()
                times[name].append(1e3 * start.elapsed_time(end) / steps)
        report[n] = times
        for line in summary(times):
            print(f"N{n} training step {line}", flush=True)
    return report


def tuned_params(n: int, widths: dict) -> dict:
    """This GPU's tuned wgmma params for `widths` at n's N bucket (tuned_entry)."""
    return tuned_entry(n, widths)["params"]


def tuned_entry(n: int, widths: dict, slug: str | None = None, arch: str | None = None) -> dict:
    """The tuned bf16 wgmma entry for `widths` at n's N bucket, as a module looks it up (else the
    nearest bucket tuned; an entry of another GPU of the same architecture where this one has none).
    By default this GPU's; with `arch` (and no GPU: slug None) any GPU's of that architecture."""
    from pairgen.spec import n_bucket
    from pairgen.tuned import TunedDB, databases_for_arch

    if arch is None:
        import torch

        from pairgen import runtime

        info = runtime.device_info(torch.cuda.current_device())
        slug, arch = info.slug, info.arch
    databases = ([TunedDB("trimul", slug)] if slug else []) + databases_for_arch("trimul", arch, slug)
    entries = [entry for db in databases for entry in db.entries()
               if entry["key"]["dtype"] == "bfloat16" and entry["key"]["widths"] == widths
               and entry.get("strategy") == "wgmma"]
    if not entries:
        raise SystemExit(f"no tuned wgmma entry for {widths} in bfloat16 for {slug or arch}: tune it first")
    bucket = n_bucket(n)
    return min(entries, key=lambda entry: abs(math.log2(entry["key"]["n_bucket"] / bucket)))


def kernel_role(name: str) -> str:
    """A rendered kernel's role from its name: the main kernel is the projection, the others end in
    their role (_output, _stats)."""
    role = name.rsplit("_", 1)[-1]
    return role if role in ("output", "stats") else "projection"


def record_of(entry: dict, flips: dict, overrides: dict) -> str:
    """What the tuned entry's tune measured of a variant: the entry's own time, a point it timed
    (the entry's "timed"), or that it kept none such (a switch changes the source: never in it)."""
    changes = {k: v for k, v in overrides.items() if entry["params"].get(k) != v}
    if flips:
        return "a switch: not in the tune's records"
    if not changes:
        return f"the tuned point, {entry['us']:.1f} us"
    for record in entry.get("timed", ()):
        if "strategy" not in record and record["changes"] == changes:
            return f"timed by its tune: {record['us']:.1f} us, {100 * (record['us'] / entry['us'] - 1):+.1f} %"
    if "timed" not in entry:
        return "its tune kept no record of other points"
    return f"not among the {len(entry['timed'])} other points its tune kept"


def resources_report(variants: list, ns: list[int], widths: dict) -> list[str]:
    """Without a GPU: each variant's plan on the tuned point of this architecture (PAIRGEN_ARCH, else
    sm_90), whether it can run, its kernels' shared memory and slices, and what NVRTC says of them
    (registers, spills, wgmma products serialized), so that a variant which cannot run or spills is
    found before any device time is spent on it."""
    from pairgen import codegen, compiler, runtime
    from pairgen.ops.trimul import TRIMUL
    from pairgen.spec import DeviceLimits

    spec, arch, lines = TRIMUL.at("bfloat16"), runtime.default_arch(), []
    for n in ns:
        entry = tuned_entry(n, widths, slug=None, arch=arch)
        for name, flips, overrides in variants:
            plan = plan_for(spec, entry["params"], flips, overrides, widths)
            head = f"N{n} {name} ({record_of(entry, flips, overrides)}):"
            reasons = spec.infeasible(plan, DeviceLimits())
            if reasons:
                lines.append(f"{head} cannot run ({'; '.join(reasons)})")
                continue
            rendered = codegen.render_plan(plan)
            compiled = compiler.compile_source(rendered.source, rendered.kernel_name, arch)
            context = plan.context
            kernels = ", ".join(f"{kernel_role(kernel)} {k['registers']} regs"
                                + (f" ({k['spill_bytes']} B spilled)" if k["spill_bytes"] else "")
                                for kernel, k in sorted(compiled.kernels.items(), key=lambda item: kernel_role(item[0])))
            lines.append(f"{head} projection {context['p_smem']} B shared in {context['p_slices'] or 1} slice(s), "
                         f"output {context['o_smem']} B in {context['o_slices'] or 1}; {kernels}"
                         + ("; wgmma products serialized by ptxas" if compiled.wgmma_serialized else ""))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--variant", action="append", type=parse_variant, required=True,
                        help="name=SWITCH,...[:param=value,...] (repeatable; the first is the baseline)")
    parser.add_argument("--n", default="512,1024", help="comma-separated N (B = 1)")
    parser.add_argument("--incoming", action="store_true", help="the incoming direction (default outgoing)")
    parser.add_argument("--widths", type=parse_widths, default={},
                        help="the pair and hidden widths, e.g. P=256,H=256 (default 128 each: the models' form)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write every run's time here")
    parser.add_argument("--training", action="store_true",
                        help="time training steps (forward + backward) for the switches a training call reads")
    parser.add_argument("--forward-only", action="store_true",
                        help="run each variant's forward three times, unchecked and untimed (for Nsight Compute)")
    parser.add_argument("--resources", action="store_true",
                        help="no GPU: each variant's shared memory, slices, registers and spills (NVRTC)")
    args = parser.parse_args(argv)
    ns = [int(n) for n in args.n.split(",")]
    widths = {**MODELS_FORM, **args.widths, "outgoing": 0 if args.incoming else 1}
    if args.resources:
        for line in resources_report(args.variant, ns, widths):
            print(line, flush=True)
        return 0

    import torch

    from pairgen import codegen, compiler, runtime
    from pairgen.ops.trimul import TRIMUL
    from pairgen.tuning.evaluate import GpuEvaluator

    if not torch.cuda.is_available():
        raise SystemExit("switch_study times kernels: it needs a CUDA GPU")
    spec = TRIMUL.at("bfloat16")
    if args.training:
        report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "widths": widths,
                  "training": training_study(args.variant, ns, widths, args.rounds)}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
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
