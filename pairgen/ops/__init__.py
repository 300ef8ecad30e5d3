"""The op registry: every op lives in pairgen/ops/<op>.py and registers its spec here."""
from __future__ import annotations

from .base import OpSpec


def _registry() -> dict[str, OpSpec]:
    from .contact import CONTACT

    return {spec.name: spec for spec in (CONTACT,)}


def all_ops() -> dict[str, OpSpec]:
    return _registry()


def get_op(name: str) -> OpSpec:
    ops = _registry()
    if name not in ops:
        raise ValueError(f"unknown op {name!r}; known: {sorted(ops)}")
    return ops[name]
