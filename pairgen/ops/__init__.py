"""The op registry: every op lives in pairgen/ops/<op>/ (the same name as templates/<op>/ and
tests/test_<op>_*.py) and is named here. Names are known without importing the ops (and torch),
so `pairgen-tune --status` runs anywhere."""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..codegen import Rendered
    from ..spec import OpSpec

#: op name -> the attribute of pairgen.ops.<op> holding its bound spec
OPS = {"contact": "CONTACT", "readout": "READOUT", "trimul": "TRIMUL"}
_PACKAGES = {"contact": "pairgen.ops.contact", "readout": "pairgen.ops.readout", "trimul": "pairgen.ops.trimul"}


def op_names() -> list[str]:
    return sorted(OPS)


def get_op(name: str) -> "OpSpec":
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; known: {op_names()}")
    return getattr(import_module(_PACKAGES[name]), OPS[name])


def render(op: str, strategy: str, params: dict, widths: dict) -> "Rendered":
    """Render one point of an op's search space: the CUDA source (checked against the plan's
    declared kernels) and its hashes."""
    from ..codegen import render_plan

    return render_plan(get_op(op).plan(strategy, params, widths))
