"""Argument helpers shared by scripts/tune.py and scripts/bench.py."""
from __future__ import annotations

import argparse
import json

from ..ops import get_op, op_names


_SHAPE_ORDER = ("B", "N", "D", "P", "H")
#: The precisions a tuned entry can be keyed by ("float32" is exact fp32).
PRECISIONS = ("float32", "bfloat16", "float16", "tf32x3", "tf32")  # sizes, in the order docs/ops.md writes shapes; other keys are op options


def parse_shape(text: str) -> dict:
    """"B=4,N=64,P=64,H=32" -> {"B": 4, "N": 64, "P": 64, "H": 32}. Sizes are >= 1; an op's
    options (trimul's outgoing=1, bias=0) are non-negative ints."""
    shape = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"bad shape {text!r}: expected NAME=INT pairs, e.g. B=4,N=64,P=64,H=32")
        if name in _SHAPE_ORDER and int(value) < 1:
            raise argparse.ArgumentTypeError(f"bad shape {text!r}: {name} must be at least 1")
        shape[name] = int(value)
    return shape


def environment_problem() -> str | None:
    """The first environment variable pairgen parses whose value is bad, as one line naming it, its
    value and the valid values; None when all are good. The commands check before any work: a typo
    then ends them at once with that line, not with a traceback from a compile or a trial."""
    from .. import config

    for read in (config.arch_override, config.compile_workers, config.compile_budget_s, config.fastcall_enabled):
        try:
            read()
        except ValueError as exc:
            return str(exc)
    return None


def add_selection_args(parser: argparse.ArgumentParser, main_job: bool = False) -> None:
    """--op, --shape, --preset, --precision. main_job: with neither --shape, --preset nor
    --precision, the command selects the main job (main_job_shapes; pairgen-tune), not the
    seed and real shapes in fp32 (pairgen-bench)."""
    parser.add_argument("--op", choices=op_names(), action="append",
                        help="op to work on (repeatable; default: every op)")
    parser.add_argument("--shape", type=parse_shape, action="append", default=[],
                        help="a shape such as B=4,N=64,P=64,H=32 (repeatable; needs exactly one --op)")
    default = ("the main job (above); all: seed and real" if main_job else "all, i.e. seed and real")
    parser.add_argument("--preset", choices=("seed", "real", "models", "wide", "classes", "hidden", "gpumode", "all"),
                        default=None if main_job else "all",
                        help=f"the op's default shapes to use when no --shape is given (default: {default}; "
                             "models: the options the AlphaFold 3 family runs, where an op has them; wide: "
                             "that form at pair widths 256, 384 and 768; classes: that form at the wider pair and hidden widths "
                             "together (P / H 256 / 256, 384 / 256, 384 / 384, N512); hidden: lucidrains' form, the out gate "
                             "in hidden width; gpumode: GPU MODE's TriMul benchmark shapes, outgoing, in the "
                             "models' form)")
    parser.add_argument("--precision", action="append", choices=PRECISIONS,
                        help="what the kernels compute in (repeatable; default float32, exact): bfloat16 and "
                             "float16 (modules in those dtypes, and autocast), tf32x3 and tf32 (fp32 modules' "
                             "precision=); ops without kernels in a precision are skipped")


#: The precision and the lengths (B = 1, as inference runs) of the main job's first shapes: the
#: ops with a "models" preset (the triangle update) in the models' own form and dtype.
MODELS_PRECISION = "bfloat16"
MODELS_LENGTHS = (256, 512, 768)


def is_main_job(args) -> bool:
    """No --shape, --preset or --precision: pairgen-tune's default selection."""
    return not args.shape and args.preset is None and not args.precision


def main_job_shapes(names) -> list[tuple]:
    """What `pairgen-tune` tunes by default, for the ops `names`: first what the models run, each
    op's "models" preset form (the triangle update: the output gate on the normalised input, no
    biases, P = H = 128, both directions) in bf16 at N = 256, 512 and 768 (a user's first run then
    has those even if it is cut short); then every op's fp32 seed and real shapes."""
    work = []
    for name in names:
        spec = get_op(name)
        if "models" not in spec.presets or MODELS_PRECISION not in spec.precisions:
            continue
        forms = list({json.dumps(spec.widths_of(shape), sort_keys=True): spec.widths_of(shape)
                      for shape in spec.presets["models"]}.values())
        work += [(spec.at(MODELS_PRECISION), {"B": 1, "N": n, **widths}) for n in MODELS_LENGTHS for widths in forms]
    return work + [(get_op(name).at("float32"), dict(shape)) for name in names for preset in ("seed", "real")
                   for shape in get_op(name).presets.get(preset, ())]


def selected_shapes(args, parser: argparse.ArgumentParser, without_kernels: tuple = (),
                    main_job: bool = False) -> list[tuple]:
    """(op spec in a precision, shape) pairs from --op/--shape/--preset/--precision. An op named
    with --op must have kernels in every --precision but those of `without_kernels` (the bench
    measures modules in those dtypes whatever they run); unnamed ops without them are left out.
    main_job: the default selection is main_job_shapes (else, as with --preset all, the seed and
    real shapes in each --precision)."""
    if main_job and is_main_job(args):
        return main_job_shapes(args.op or op_names())
    precisions = args.precision or ["float32"]

    def taken(name: str, precision: str) -> bool:
        return precision in get_op(name).precisions or precision in without_kernels

    if args.op:
        for name in args.op:
            missing = [p for p in precisions if not taken(name, p)]
            if missing:
                parser.error(f"{name} has no kernels in {', '.join(missing)}; it has {', '.join(get_op(name).precisions)}")
    ops = [get_op(name).at(p, require_kernels=False) for p in precisions for name in (args.op or op_names())
           if taken(name, p)]
    if not ops:
        parser.error(f"no op has kernels in {', '.join(precisions)}")
    if args.shape:
        if not args.op or len(args.op) != 1:
            parser.error("--shape needs exactly one --op")
        spec = ops[0]  # the specs of one op in each precision share their widths
        need, optional = {"B", "N", *spec.width_names}, set(spec.optional_widths)
        shapes = [{**spec.width_defaults, **shape} for shape in args.shape]
        for shape in shapes:
            if not need <= set(shape) <= need | optional:
                defaults = f" ({', '.join(f'{k}={v}' for k, v in spec.width_defaults.items())} by default)" \
                    if spec.width_defaults else ""
                also = f", and may name {sorted(optional)}" if optional else ""
                parser.error(f"--shape for {spec.name} needs exactly {sorted(need)}{defaults}{also}, got {sorted(shape)}")
        return [(spec, shape) for spec in ops for shape in shapes]
    presets = ("seed", "real") if args.preset in ("all", None) else (args.preset,)
    return [(spec, dict(shape)) for spec in ops for p in presets for shape in spec.presets.get(p, ())]


def shape_label(shape: dict) -> str:
    """"B1 N256 P128 H128", then any op options as name=value."""
    sizes = [f"{k}{shape[k]}" for k in _SHAPE_ORDER if k in shape]
    return " ".join(sizes + [f"{k}={shape[k]}" for k in sorted(shape) if k not in _SHAPE_ORDER])
