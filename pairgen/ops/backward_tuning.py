"""Tuned launch shapes of the closed forms' fused kernels: the training path's own search space.

An op whose closed form runs fused kernels (`pairgen/ops/<op>/fused_backward.py`) declares
`TUNING_SPACE` (parameter -> its choices), `TUNING_DEFAULT`, and `tuning_sources(kind, tuning,
widths)` (the rendered sources those kernels run). `pairgen-tune --backward`
(pairgen/tuning/backward_tune.py) times a training step at every point of the space and keeps the
fastest whose gradients agree with the default's, as an entry of `tuned/<gpu>/<op>_backward.json`
keyed as forward entries are: the storage dtype the fused kernels run in ("float32", "bfloat16",
"float16"), the module's widths, the N bucket. An entry is stale when today's sources at its
parameters hash differently from the ones it was tuned with, invalid when its parameters are outside
today's space: either way the lookup skips it (a warning names the file once), and `pairgen-tune
--status` lists it. Lookups go through the forward kernels' chain (runtime.find_entry): this GPU's
exact N bucket, its nearest, a same-architecture GPU's entries, else the defaults.
"""
from __future__ import annotations

import hashlib
import importlib
import itertools
import warnings

from .. import runtime
from ..spec import n_bucket

#: Ops with fused closed-form kernels -> the module declaring their tuning.
OPS = {"trimul": "pairgen.ops.trimul.fused_backward", "contact": "pairgen.ops.contact.fused_backward"}
#: The strategy name backward entries carry (the tuned database's schema wants one).
STRATEGY = "fused_backward"
#: Lookups remembered per process (one per op, dtype, widths, bucket and device): bounded, since
#: every protein has its own N; past it the oldest half is forgotten.
MAX_CACHED = 256

_cache: dict[tuple, dict] = {}
_warned: set[str] = set()


def db_name(op: str) -> str:
    """The tuned database of an op's backward entries (tuned/<gpu>/<op>_backward.json)."""
    return f"{op}_backward"


def declared(op: str):
    """The module declaring an op's TUNING_SPACE, TUNING_DEFAULT and tuning_sources."""
    return importlib.import_module(OPS[op])


def points(op: str) -> list[dict]:
    """Every point of the op's space, the default first."""
    space, default = declared(op).TUNING_SPACE, declared(op).TUNING_DEFAULT
    names = sorted(space)
    rest = [dict(zip(names, values)) for values in itertools.product(*(space[n] for n in names))]
    return [dict(default)] + [p for p in rest if p != default]


def sources_sha256(op: str, kind: str, tuning: dict, widths: dict, with_template_hash: bool = False) -> str:
    """sha256 over the rendered sources the tuning's kernels run, each without its header's hash of
    the template files (a comment): what staleness compares. So an edit of the templates that
    leaves these sources as they were (code behind a condition these calls do not meet) leaves an
    entry current, as the forward entries' check does (codegen.source_hash_as_tuned).
    with_template_hash: over the sources whole, as entries recorded before 2026-12-04 hashed them."""
    digest = hashlib.sha256()
    for rendered in declared(op).tuning_sources(kind, tuning, widths):
        first, newline, rest = rendered.source.partition("\n")
        if not with_template_hash:
            first = first.replace(f" (sha256 {rendered.template_sha256[:16]})", "", 1)
        digest.update((first + newline + rest).encode() + b"\0")
    return digest.hexdigest()


def template_sha256(op: str, kind: str, widths: dict) -> str:
    """sha256 over the templates (and what they include) those sources come from."""
    digest = hashlib.sha256()
    for rendered in declared(op).tuning_sources(kind, declared(op).TUNING_DEFAULT, widths):
        digest.update(rendered.template_sha256.encode())
    return digest.hexdigest()


def entry_state(op: str, entry: dict) -> str:
    """"ok", "stale" (today's sources at its parameters differ) or "invalid" (parameters outside
    today's space, or not all of them)."""
    space, params = declared(op).TUNING_SPACE, entry["params"]
    if set(params) != set(space) or any(params[k] not in space[k] for k in space):
        return "invalid"
    key = entry["key"]
    recorded = entry.get("source_sha256")
    if recorded != sources_sha256(op, key["dtype"], params, key["widths"]) and \
            recorded != sources_sha256(op, key["dtype"], params, key["widths"], with_template_hash=True):
        return "stale"
    return "ok"


def _usable(op: str, db, kind: str, widths: dict) -> list[dict]:
    """The database's entries for (kind, widths) whose sources are today's; a stale or invalid one
    is skipped, with a warning naming the file once."""
    usable = []
    for entry in runtime.entries_for_key(db, kind, widths):
        state = entry_state(op, entry)
        if state == "ok":
            usable.append(entry)
        elif str(db.path) not in _warned:
            _warned.add(str(db.path))
            warnings.warn(f"pairgen: {db.path}: a backward entry for {kind} {widths} is {state}; it is skipped "
                          "(re-tune with pairgen-tune --backward)")
    return usable


def lookup(op: str, kind: str, widths: dict, n: int, info) -> tuple[dict, dict | None, str]:
    """(the tuning a call runs, the entry it came from or None, where it came from): the forward
    kernels' lookup chain (runtime.find_entry: exact N bucket, nearest, a same-architecture GPU's),
    else the defaults ("default")."""
    found = runtime.find_entry(db_name(op), n_bucket(n), info, lambda db: _usable(op, db, kind, widths))
    if found is None:
        return dict(declared(op).TUNING_DEFAULT), None, "default"
    return dict(found.entry["params"]), found.entry, found.how


def tuning_for(op: str, kind: str, widths: dict, n: int, device_index: int) -> dict:
    """The tuning a training call of this op, dtype, widths and length runs on this device
    (cached per N bucket; runtime.clear_caches() forgets it)."""
    key = (op, kind, tuple(sorted(widths.items())), n_bucket(n), device_index, runtime.generation())
    found = _cache.get(key)
    if found is None:
        if len(_cache) >= MAX_CACHED:
            for old in list(_cache)[: MAX_CACHED // 2]:
                del _cache[old]
        found = _cache[key] = lookup(op, kind, widths, n, runtime.device_info(device_index))[0]
    return found


def for_call(module, x, dtype=None) -> dict:
    """The tuning of a closed form's call on x computing in `dtype` (default: x's; x's rows are
    in the compute dtype, or fp32 read as they are): the module's forced one (the tuner's
    `_backward_tuning`), else the tuned entry's on a GPU, else the defaults."""
    forced = module.__dict__.get("_backward_tuning")
    if forced is not None:
        return forced
    from .fused_kernels import storage_kind

    op = module.op.name
    kind = storage_kind(dtype or x.dtype)
    if not x.is_cuda or kind is None:
        return declared(op).TUNING_DEFAULT
    return tuning_for(op, kind, module.widths, x.shape[1], x.device.index)


def describe(op: str, kind: str, widths: dict, n: int, info) -> str:
    """The fused backward kernels a training call of this op, storage kind, widths and length
    runs on `info`'s GPU, their launch shapes and where those came from (for explain)."""
    from .. import codegen

    params, entry, source = lookup(op, kind, widths, n, info)
    origin = f"{source}, {entry['us']} us per step when tuned" if entry and entry.get("us") else source
    shape = ", ".join(f"{k}={v}" for k, v in sorted(params.items()))
    kernels = [name for rendered in declared(op).tuning_sources(kind, params, widths)
               for name in codegen.signatures(rendered.source)]
    return f"fused backward kernels ({shape}; {origin}): {', '.join(kernels)}"
