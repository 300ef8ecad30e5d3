"""Argument helpers shared by scripts/tune.py and scripts/bench.py."""
from __future__ import annotations

import argparse

from .ops import get_op, op_names


def parse_shape(text: str) -> dict:
    """"B=4,N=64,P=64,H=32" -> {"B": 4, "N": 64, "P": 64, "H": 32}."""
    shape = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"bad shape {text!r}: expected NAME=POSITIVE_INT pairs, e.g. B=4,N=64,P=64,H=32")
        shape[name.strip()] = int(value)
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
        for shape in args.shape:
            if set(shape) != need:
                parser.error(f"--shape for {spec.name} needs exactly {sorted(need)}, got {sorted(shape)}")
        return [(spec, shape) for shape in args.shape]
    presets = ("seed", "real") if args.preset == "all" else (args.preset,)
    return [(spec, dict(shape)) for spec in ops for p in presets for shape in spec.presets[p]]


_SHAPE_ORDER = ("B", "N", "D", "P", "H")  # as OPS.md writes shapes


def shape_label(shape: dict) -> str:
    keys = sorted(shape, key=lambda k: (_SHAPE_ORDER.index(k) if k in _SHAPE_ORDER else len(_SHAPE_ORDER), k))
    return " ".join(f"{k}{shape[k]}" for k in keys)
