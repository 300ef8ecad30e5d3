"""Dispatch: (op, dtype, widths, N) on this GPU -> tuned entry -> rendered source -> a compiled
variant -> its kernels bound to a call's shape. Each step is cached, so after the first call for a
length only dict lookups stand between a module and its launches. Every cache that depends on N
is bounded: in structure prediction every protein has its own N.

This is the one launch path: a variant's plan declares its kernels (pairgen.spec.Kernel), and
Variant.launches binds all of them for a (device, B, N) at once.
"""
from __future__ import annotations

import logging
import math
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache

from . import codegen, compiler, config, first_use
from .spec import DeviceLimits, OpSpec, Plan, n_bucket
from .tuned import TunedDB, databases_for_arch

log = logging.getLogger("pairgen")


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    slug: str
    arch: str
    limits: DeviceLimits
    capability: tuple[int, int] = (9, 0)


def slugify(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@lru_cache(maxsize=None)
def device_info(index: int = 0) -> DeviceInfo:
    import torch

    props = torch.cuda.get_device_properties(index)
    arch = config.arch_override() or f"sm_{props.major}{props.minor}"
    smem_block = getattr(props, "shared_memory_per_block_optin", DeviceLimits.max_smem_per_block)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", DeviceLimits.smem_per_sm)
    threads_sm = getattr(props, "max_threads_per_multi_processor", DeviceLimits.max_threads_per_sm)
    limits = DeviceLimits(smem_block, smem_sm, threads_sm, props.multi_processor_count, arch)
    return DeviceInfo(index, props.name, slugify(props.name), arch, limits, (props.major, props.minor))


def default_arch() -> str:
    """The arch to compile for here: PAIRGEN_ARCH, the current GPU's, else sm_90."""
    if config.arch_override():
        return config.arch_override()
    try:
        import torch

        if torch.cuda.is_available():
            return device_info(torch.cuda.current_device()).arch
    except Exception:  # no driver: compile for the default target
        pass
    return "sm_90"


class Variant:
    """One rendered and compiled point of the search space; its kernels load lazily per device,
    and bind per (device, B, N)."""

    #: (device, B, N) shapes kept bound per variant; past this the oldest half is dropped.
    MAX_BOUND_SHAPES = 64

    def __init__(self, plan: Plan, rendered: codegen.Rendered, compiled: compiler.Compiled):
        self.plan = plan
        self.rendered = rendered
        self.compiled = compiled
        self._loaded: dict[tuple, object] = {}  # (device index, kernel name) -> LoadedKernel
        self._bound: dict[tuple, tuple] = {}  # (device index, B, N, programmatic) -> BoundLaunch per kernel

    def kernel(self, device_index: int, name: str | None = None):
        """A declared kernel of this variant loaded on a device (the main kernel by default)."""
        decl = self.plan.main if name is None else next(k for k in self.plan.kernels if k.name == name)
        key = (device_index, decl.name)
        kernel = self._loaded.get(key)
        if kernel is None:
            from .launch import LoadedKernel

            kernel = self._loaded[key] = LoadedKernel(self.compiled, device_index, decl.smem_bytes, decl.threads,
                                                      decl.name)
        return kernel

    def launches(self, device_index: int, batch: int, n: int, programmatic: bool = True) -> tuple:
        """Every declared kernel bound to this shape, in the plan's order: call each by name
        (`launch.named(x=..., out=...)`: the pointers and any per-call ints, the shape tail filled
        in), or positionally with its pointers, then `*launch.tail`, then any per-call ints.
        programmatic=False launches kernels declared programmatic as plain ones; a kernel declared
        "cooperative_or_plain" is bound cooperatively where its grid fits on the GPU at once, else
        plainly (the launch's `mode` says which)."""
        key = (device_index, batch, n, programmatic)
        bound = self._bound.get(key)
        if bound is None:
            if len(self._bound) >= self.MAX_BOUND_SHAPES:
                for old in list(self._bound)[: self.MAX_BOUND_SHAPES // 2]:
                    del self._bound[old]
            bound = self._bound[key] = self._bind(device_index, batch, n, programmatic)
        return bound

    def _bind(self, device_index: int, batch: int, n: int, programmatic: bool) -> tuple:
        info = device_info(device_index)
        bound = []
        for decl in self.plan.kernels:
            kernel = self.kernel(device_index, decl.name)
            blocks, tail = decl.grid(batch, n, info.limits.sm_count, kernel.resident_per_sm)
            mode = decl.mode
            if mode == "programmatic" and not (programmatic and info.capability[0] >= 9):
                mode = "plain"
            elif mode == "cooperative_or_plain":
                mode = "cooperative" if blocks <= kernel.resident_per_sm * info.limits.sm_count else "plain"
            bound.append(kernel.bind(blocks, decl.threads, decl.smem_bytes, len(decl.args), mode, tuple(tail),
                                     decl.names))
        return tuple(bound)

    def __repr__(self) -> str:
        return f"Variant({self.plan.op}: {self.plan.label})"


def build_variant(plan: Plan, arch: str | None = None) -> Variant:
    rendered = codegen.render_plan(plan)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, arch or default_arch())
    return Variant(plan, rendered, compiled)


# ---- the tuned entries: which ones apply --------------------------------------------------------

def entry_state(spec: OpSpec, entry: dict, limits: DeviceLimits = DeviceLimits()) -> str:
    """"ok"; "stale" (today's code renders another source at its parameters); or "invalid: why"
    (its strategy or parameters are outside today's space, or break today's restrictions)."""
    try:
        plan = spec.plan(entry["strategy"], entry["params"], entry["key"]["widths"], entry["key"]["dtype"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"invalid: {exc}"
    reasons = spec.infeasible(plan, limits)
    if reasons:
        return f"invalid: {'; '.join(reasons)}"
    recorded = entry.get("source_sha256")
    try:
        today = codegen.render_plan(plan)
    except Exception as exc:  # a template gone or broken, a contract mismatch
        return f"invalid: cannot render ({type(exc).__name__}: {exc})"
    # The same code under another template hash, parameters added since or another kernel name is
    # the kernel the entry was measured with.
    return "ok" if any(recorded == h for h in codegen.hashes_as_tuned(today, entry)) else "stale"


@dataclass
class Choice:
    plan: Plan | None
    source: str  # "tuned", "tuned (nearest N bucket ...)", "... on <gpu> (same architecture)", "default", or why none
    entry: dict | None = None
    database: str | None = None  # the file the entry came from
    #: The default variant's source hash while it has no first-use verdict (see first_use.py).
    unchecked_source: str | None = None
    #: No plan because the reference measured faster (a first-use check, or the tuner against the
    #: best kernel of a tuned entry): said once, in the log.
    expected_reference: bool = False


def entries_for_key(db: TunedDB, dtype: str, widths: dict) -> list[dict]:
    """The database's entries for (dtype, widths), every N bucket, whatever their state."""
    want = {k: int(v) for k, v in widths.items()}
    return [e for e in db.entries() if e["key"]["dtype"] == dtype and e["key"]["widths"] == want]


def _usable(spec: OpSpec, db: TunedDB, dtype: str, widths: dict, limits: DeviceLimits) -> list[dict]:
    """The database's entries for (dtype, widths) that today's code can run as they were tuned;
    stale and invalid ones are skipped, each with a warning naming the file."""
    usable = []
    for entry in entries_for_key(db, dtype, widths):
        state = entry_state(spec, entry, limits)
        if state == "ok":
            usable.append(entry)
        else:
            warnings.warn(f"pairgen: skipping the {state.split(':')[0]} tuned entry for N bucket "
                          f"{entry['key']['n_bucket']} in {db.path} ({state}); `pairgen-tune --status` lists it")
    return usable


def _nearest(entries: list[dict], bucket: int) -> tuple[dict | None, bool]:
    """The entry of exactly this bucket, else the nearest one in log scale (ties: the smaller)."""
    for entry in entries:
        if entry["key"]["n_bucket"] == bucket:
            return entry, True
    if not entries:
        return None, False
    return min(entries, key=lambda e: (abs(math.log2(e["key"]["n_bucket"]) - math.log2(bucket)),
                                       e["key"]["n_bucket"])), False


def _same_arch_databases(db_name: str, info: DeviceInfo) -> list[TunedDB]:
    """Other GPUs' databases of this GPU's arch, folder by folder in lookup order (each folder's by name)."""
    return [db for root in config.tuned_read_dirs() for db in databases_for_arch(db_name, info.arch, info.slug, root)]


def _database_groups(db_name: str, info: DeviceInfo) -> list[list[TunedDB]]:
    """The databases a lookup reads, grouped: this GPU's in every read folder (config.tuned_read_dirs:
    the user's or PAIRGEN_TUNED_DIR's first, then the shipped results), then each same-architecture
    GPU's, in the order they are first met. A group is one overlay: an N bucket an earlier folder
    has hides the later folders' entry for it."""
    groups = [[TunedDB(db_name, info.slug, root) for root in config.tuned_read_dirs()]]
    by_slug: dict[str, list[TunedDB]] = {}
    for db in _same_arch_databases(db_name, info):
        by_slug.setdefault(db.gpu_slug, []).append(db)
    return groups + list(by_slug.values())


@dataclass
class Found:
    """An entry the lookup chain found, the database it came from and how ("tuned", "tuned
    (nearest N bucket ...)", either followed by " on <gpu> (same architecture, ...)")."""
    entry: dict
    database: TunedDB
    how: str


def find_entry(db_name: str, bucket: int, info: DeviceInfo, usable) -> Found | None:
    """The lookup chain every tuned kernel (forward or backward) goes through: this GPU's exact N
    bucket -> its nearest bucket -> a GPU of the same compute capability (same order). usable(db)
    gives a database's entries for the call's key that today's code can run as tuned; each GPU's
    entries are those of every read folder, the first folder's winning for a bucket two have."""
    for group in _database_groups(db_name, info):
        found: dict[int, tuple[dict, TunedDB]] = {}  # N bucket -> (entry, its database), first folder first
        for db in group:
            for entry in usable(db):
                found.setdefault(entry["key"]["n_bucket"], (entry, db))
        entry, exact = _nearest([e for e, _ in found.values()], bucket)
        if entry is None:
            continue
        db = found[entry["key"]["n_bucket"]][1]
        how = "tuned" if exact else f"tuned (nearest N bucket {entry['key']['n_bucket']})"
        if db.gpu_slug != info.slug:
            how += f" on {db.gpu_slug} (same architecture, {info.arch})"
        return Found(entry, db, how)
    return None


def choose(spec: OpSpec, dtype: str, widths: dict, n: int, info: DeviceInfo) -> Choice:
    """The lookup chain (find_entry), then the op's default params."""
    bucket = n_bucket(n)
    found = find_entry(spec.name, bucket, info, lambda db: _usable(spec, db, dtype, widths, info.limits))
    if found is not None:
        entry, how, path = found.entry, found.how, str(found.database.path)
        faster = faster_without_the_kernel(entry)
        if faster is not None:
            return Choice(None, f"{how}: {faster[0]} measured faster when it was tuned "
                                f"({faster[1]} µs against the best kernel's {entry['us']} µs)",
                          entry, path, expected_reference=True)
        return Choice(spec.plan(entry["strategy"], entry["params"], widths, dtype), how, entry, path)
    plan = spec.default_plan(widths, info.limits, dtype)
    if plan is None:
        in_dtype = "" if dtype == "float32" else f" in {dtype}"
        return Choice(None, f"no {spec.name} kernel{in_dtype} fits widths {widths}")
    return _default_choice(spec, plan, dtype, widths, bucket, info)


def faster_without_the_kernel(entry: dict) -> "tuple[str, float] | None":
    """What a module runs without the entry's kernel, where the tuner timed it faster than the
    entry's best kernel in the same run: (its name, its µs); the module then runs it, never slower
    than it. That is the closed form where the tuner timed one (a 16-bit forward without a kernel
    runs it: dispatch.closed_form_instead), else the PyTorch reference."""
    base, us = entry.get("baselines_us") or {}, entry.get("us")
    key, name = ("closed_form", "the closed form") if "closed_form" in base else ("eager", "the PyTorch reference")
    if us is None or base.get(key) is None or us <= base[key]:
        return None
    return name, base[key]


def _default_choice(spec: OpSpec, plan: Plan, dtype: str, widths: dict, bucket: int, info: DeviceInfo) -> Choice:
    """The default variant, or the reference where a first-use check found it faster."""
    source = codegen.render_plan(plan).source_sha256
    verdict = first_use.stored_verdict(spec.name, info.slug, dtype, widths, bucket, source)
    if verdict is None:
        return Choice(plan, "default", unchecked_source=source)
    rival = verdict.get("rival", first_use.REFERENCE_RIVAL)
    timing = (f"{verdict['kernel_us']} µs against {rival}'s {verdict['reference_us']} µs at first use, "
              f"{first_use.verdict_path(spec.name, info.slug)}")
    if verdict["winner"] == "reference":
        return Choice(None, f"a first-use check (the default {plan.label} was slower: {timing})",
                      expected_reference=True)
    return Choice(plan, f"default (faster than the reference: {timing})")


_selected: dict[tuple, Variant | None] = {}


def select(spec: OpSpec, dtype: str, widths: dict, n: int, device_index: int) -> "Variant | first_use.Pending | None":
    """The variant a module runs for length n (None: no kernel, run the reference; a
    first_use.Pending: the default variant, to be timed against the reference at its first call).
    Keyed by the N bucket: every length of a bucket runs the same variant."""
    key = (spec.name, device_index, dtype, tuple(sorted(widths.items())), n_bucket(n))
    if key in _selected:
        return _selected[key]
    # read here, once per (module, length), not on every call; and an option the op's kernels do
    # not take (a module width outside its width names) has none
    if config.disabled() or not set(widths) <= set(spec.all_width_names):
        _selected[key] = None
        return None
    info = device_info(device_index)
    choice = choose(spec, dtype, widths, n, info)
    variant = None
    if choice.plan is not None:
        variant = _by_plan(choice.plan, info.arch)
        log.info("pairgen %s N=%d: %s from %s", spec.name, n, choice.plan.label, choice.source)
        if choice.unchecked_source is not None and config.first_use_check():
            variant = first_use.Pending(variant, spec.name, info.slug, dtype, widths, n_bucket(n),
                                        choice.unchecked_source)
    elif choice.expected_reference:
        log.info("pairgen %s N=%d: %s", spec.name, n, choice.source)
    else:
        warnings.warn(f"pairgen: {choice.source}; running the PyTorch reference")
    _selected[key] = variant
    return variant


@dataclass
class Explanation:
    """What a module runs for one shape on one GPU, and why."""
    op: str
    gpu: str
    n: int
    n_bucket: int
    source: str        # tuned, nearest bucket, same-architecture GPU, default, disabled, or why none
    strategy: str | None
    params: dict | None
    measured_us: float | None
    database: str | None
    #: (label, route) of stand-in calls: what a module's calls of this length run and why
    #: (pairgen/module/dispatch.py; a module's explain() fills them in)
    routes: tuple = ()
    #: the other points its tune timed, fastest first (the entry's "timed"), where it kept them
    timed: tuple = ()

    def __str__(self) -> str:
        what = f"{self.strategy}({', '.join(f'{k}={v}' for k, v in sorted(self.params.items()))})" \
            if self.strategy else "the PyTorch reference"
        timing = f", measured {self.measured_us} us when tuned" if self.measured_us is not None else ""
        if timing and self.timed:
            timing += (f" (the fastest of {len(self.timed) + 1} points kept from its tune; the next "
                       f"{100 * (self.timed[0]['us'] / self.measured_us - 1):+.1f} %)")
        origin = f" [{self.database}]" if self.database else ""
        routes = "".join(f"\n  {label}: {route}" for label, route in self.routes)
        return (f"{self.op} N={self.n} (bucket {self.n_bucket}) on {self.gpu}: {what} from {self.source}{timing}{origin}"
                f"{routes}")


def explain(spec: OpSpec, dtype: str, widths: dict, n: int, device_index: int = 0,
            info: DeviceInfo | None = None) -> Explanation:
    """The variant a module would run for (widths, n) on this GPU (or on `info`, a GPU described
    by hand), where it came from, its parameters and the time measured when it was tuned."""
    info = info or device_info(device_index)
    if config.disabled():
        return Explanation(spec.name, info.slug, n, n_bucket(n), "disabled (PAIRGEN_DISABLE)", None, None, None, None)
    unknown = sorted(set(widths) - set(spec.all_width_names))
    if unknown:
        return Explanation(spec.name, info.slug, n, n_bucket(n), f"no kernel takes the option(s) {', '.join(unknown)}",
                           None, None, None, None)
    choice = choose(spec, dtype, widths, n, info)
    plan = choice.plan
    return Explanation(spec.name, info.slug, n, n_bucket(n), choice.source, plan.strategy if plan else None,
                       plan.params if plan else None, choice.entry.get("us") if choice.entry else None,
                       choice.database, timed=tuple(choice.entry.get("timed", ())) if choice.entry else ())


def explain_on_cpu(spec: OpSpec, n: int, why: str) -> Explanation:
    """explain for a call on the CPU (`why`: CPU tensors, or no CUDA GPU visible to torch): the
    reference, the only route there."""
    return Explanation(spec.name, "the CPU", n, n_bucket(n), why, None, None, None, None)


_variants: dict[tuple, Variant] = {}


def variant_of(plan: Plan, device_index: int) -> Variant:
    """The built variant of a plan for a device (built once per process)."""
    return _by_plan(plan, device_info(device_index).arch)


def _by_plan(plan: Plan, arch: str) -> Variant:
    key = (plan.build_key, arch)
    if key not in _variants:
        _variants[key] = build_variant(plan, arch)
    return _variants[key]


#: Bumped by clear_caches(): a one-element list, so that compiled code (the recorded calls of
#: pairgen/fastcall.py) can read it too.
GENERATION = [0]


def generation() -> int:
    """Bumped by clear_caches(); modules drop their cached choices when it changes."""
    return GENERATION[0]


def clear_caches() -> None:
    """Forget selections (after the tuned database changed, or PAIRGEN_DISABLE did)."""
    _selected.clear()
    GENERATION[0] += 1
