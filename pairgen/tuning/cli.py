"""Argument helpers shared by scripts/tune.py and scripts/bench.py."""
from __future__ import annotations

import argparse

from ..ops import get_op, op_names


_SHAPE_ORDER = ("B", "N", "D", "P", "H")  # sizes, in the order docs/ops.md writes shapes; other keys are op options


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


def add_selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", choices=op_names(), action="append",
                        help="op to work on (repeatable; default: every op)")
    parser.add_argument("--shape", type=parse_shape, action="append", default=[],
                        help="a shape such as B=4,N=64,P=64,H=32 (repeatable; needs exactly one --op)")
    parser.add_argument("--preset", choices=("seed", "real", "all"), default="all",
                        help="the op's default shapes to use when no --shape is given (default: all)")


def selected_shapes(args, parser: argparse.ArgumentParser) -> list[tuple]:
    """(OpSpec, shape) pairs from --op/--shape/--preset."""
    ops = [get_op(name) for name in (args.op or op_names())]
    if args.shape:
        if len(ops) != 1:
            parser.error("--shape needs exactly one --op")
        spec = ops[0]
        need = {"B", "N", *spec.width_names}
        shapes = [{**spec.width_defaults, **shape} for shape in args.shape]
        for shape in shapes:
            if set(shape) != need:
                optional = f" ({', '.join(f'{k}={v}' for k, v in spec.width_defaults.items())} by default)" \
                    if spec.width_defaults else ""
                parser.error(f"--shape for {spec.name} needs exactly {sorted(need)}{optional}, got {sorted(shape)}")
        return [(spec, shape) for shape in shapes]
    presets = ("seed", "real") if args.preset == "all" else (args.preset,)
    return [(spec, dict(shape)) for spec in ops for p in presets for shape in spec.presets[p]]


def shape_label(shape: dict) -> str:
    """"B1 N256 P128 H128", then any op options as name=value."""
    sizes = [f"{k}{shape[k]}" for k in _SHAPE_ORDER if k in shape]
    return " ".join(sizes + [f"{k}={shape[k]}" for k in sorted(shape) if k not in _SHAPE_ORDER])
