"""Dispatch: (op, dtype, widths, N) on this GPU -> tuned entry -> rendered source -> a compiled,
launchable kernel. Each step is cached, so after the first call for a length only a dict
lookup stands between the module and the launch."""
from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache

from . import codegen, compiler, config
from .ops.base import DeviceLimits, OpSpec, Plan, n_bucket

log = logging.getLogger("pairgen")


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    slug: str
    arch: str
    limits: DeviceLimits


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
    limits = DeviceLimits(smem_block, smem_sm, threads_sm, props.multi_processor_count)
    return DeviceInfo(index, props.name, slugify(props.name), arch, limits)


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
    """One rendered and compiled point of the search space; loads lazily per device."""

    def __init__(self, plan: Plan, rendered: codegen.Rendered, compiled: compiler.Compiled):
        self.plan = plan
        self.rendered = rendered
        self.compiled = compiled
        self._loaded: dict[tuple, object] = {}  # (device index, kernel name or None) -> LoadedKernel
        self._bound: dict[tuple, tuple] = {}  # (device index, batch, n) -> (BoundLaunch, trailing arguments)

    def kernel(self, device_index: int, name: str | None = None, threads: int | None = None,
               smem_bytes: int | None = None):
        """A __global__ function of this variant's cubin loaded on a device: the plan's main kernel
        by default; another kernel of the same source by name, with its own block shape (used for
        the occupancy query and the dynamic shared-memory opt-in)."""
        key = (device_index, name)
        kernel = self._loaded.get(key)
        if kernel is None:
            from .launch import LoadedKernel

            threads = self.plan.threads if threads is None else threads
            smem_bytes = self.plan.smem_bytes if smem_bytes is None else smem_bytes
            kernel = LoadedKernel(self.compiled, device_index, smem_bytes, threads, name)
            self._loaded[key] = kernel
        return kernel

    def launch(self, device_index: int, batch: int, n: int, *pointers: int) -> None:
        """The main kernel on (pointers..., batch, n, tiles), its grid from the plan at this shape."""
        bound = self._bound.get((device_index, batch, n))
        if bound is None:
            bound = self._bind(device_index, batch, n, len(pointers))
        bound[0](*pointers, *bound[1])

    def _bind(self, device_index: int, batch: int, n: int, pointer_count: int) -> tuple:
        kernel = self.kernel(device_index)
        blocks, tiles = self.plan.grid(batch, n, device_info(device_index).limits.sm_count, kernel.resident_per_sm)
        bound = self._bound[(device_index, batch, n)] = (
            kernel.bind(blocks, self.plan.threads, self.plan.smem_bytes, pointer_count + 3), (batch, n, tiles))
        return bound

    def __repr__(self) -> str:
        return f"Variant({self.plan.op}: {self.plan.label})"


def render_plan(plan: Plan) -> codegen.Rendered:
    return codegen.render_template(plan.op, plan.strategy, plan.params, plan.widths, plan.context)


def build_variant(plan: Plan, arch: str | None = None) -> Variant:
    rendered = render_plan(plan)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, arch or default_arch())
    return Variant(plan, rendered, compiled)


@dataclass
class Choice:
    plan: Plan | None
    source: str  # "tuned", "tuned (nearest N bucket ...)", "default", or why there is no kernel


def choose(spec: OpSpec, dtype: str, widths: dict, n: int, info: DeviceInfo) -> Choice:
    """The lookup chain: exact tuned entry -> nearest N bucket -> the op's default params."""
    from .tuned import TunedDB

    entry, how = TunedDB(spec.name, info.slug).lookup(dtype, widths, n_bucket(n))
    if entry is not None:
        plan = spec.plan(entry["strategy"], entry["params"], widths)
        if not spec.infeasible(plan, info.limits):
            return Choice(plan, how)
        warnings.warn(f"pairgen: tuned {spec.name} entry {plan.label} does not fit this GPU; using defaults")
    plan = spec.default_plan(widths, info.limits)
    return Choice(plan, "default" if plan else f"no {spec.name} kernel fits widths {widths}")


_selected: dict[tuple, Variant | None] = {}


def select(spec: OpSpec, dtype: str, widths: dict, n: int, device_index: int) -> Variant | None:
    """The variant a module runs for length n (None: no kernel, run the reference)."""
    key = (spec.name, device_index, dtype, tuple(sorted(widths.items())), n)
    if key in _selected:
        return _selected[key]
    if config.disabled():  # read here, once per (module, length), not on every call
        _selected[key] = None
        return None
    info = device_info(device_index)
    choice = choose(spec, dtype, widths, n, info)
    variant = None
    if choice.plan is not None:
        variant = _by_plan(choice.plan, info.arch)
        log.info("pairgen %s N=%d: %s from %s", spec.name, n, choice.plan.label, choice.source)
    else:
        warnings.warn(f"pairgen: {choice.source}; running the PyTorch reference")
    _selected[key] = variant
    return variant


_variants: dict[tuple, Variant] = {}


def _by_plan(plan: Plan, arch: str) -> Variant:
    key = (plan.op, plan.strategy, tuple(sorted(plan.params.items())), tuple(sorted(plan.widths.items())), arch)
    if key not in _variants:
        _variants[key] = build_variant(plan, arch)
    return _variants[key]


_generation = 0


def generation() -> int:
    """Bumped by clear_caches(); modules drop their cached choices when it changes."""
    return _generation


def clear_caches() -> None:
    """Forget selections (after the tuned database changed)."""
    global _generation
    _selected.clear()
    _generation += 1
