"""The op registry: every op lives in pairgen/ops/<op>.py and is named here. Names are known
without importing the ops (and torch), so `scripts/tune.py --status` runs anywhere."""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import OpSpec

#: op name -> (module, spec attribute)
OPS = {"contact": ("pairgen.ops.contact", "CONTACT"), "readout": ("pairgen.ops.readout", "READOUT"),
       "trimul": ("pairgen.ops.trimul", "TRIMUL")}


def op_names() -> list[str]:
    return sorted(OPS)


def get_op(name: str) -> "OpSpec":
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; known: {op_names()}")
    module, attribute = OPS[name]
    return getattr(import_module(module), attribute)
