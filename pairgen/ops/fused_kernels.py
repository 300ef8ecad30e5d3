"""Launching the fused elementwise templates of the closed forms (passes over pair-sized tensors
that replace chains of PyTorch kernels) and the weight packs: a template rendered per storage type
and context as a Plan, its kernels checked by argument name and kind, compiled once per device as a
runtime.Variant, and each launch bound once per grid (a bounded cache: every length N has its own
grids)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

from .. import codegen, runtime
from ..precision import STORAGE_KINDS
from ..spec import Kernel, Plan, kernel_base_name

if TYPE_CHECKING:  # annotations only: the launches take torch tensors, rendering needs no torch
    import torch

#: Storage types the templates are rendered for (`kind` in their context), by torch dtype name
#: (STORAGE_KINDS): rendering and `pairgen-tune --status` import this module where torch is not
#: installed.
_KIND_OF_DTYPE = STORAGE_KINDS


def storage_kind(dtype) -> str | None:
    """The templates' storage kind for a torch dtype; None where they have none."""
    return _KIND_OF_DTYPE.get(str(dtype))

THREADS = 256
#: Launches FusedTemplate.launch keeps by its call key (every length N may have its own grids).
MAX_FAST_LAUNCHES = 256


def sm_count(device_index: int) -> int:
    """The device's SMs (runtime.device_info's, read once per device)."""
    return runtime.device_info(device_index).limits.sm_count


#: Blocks per SM of the grid-stride kernels that give each row (or pair) a warp.
WARP_KERNEL_BLOCKS_PER_SM = 4


def warp_per_item_blocks(t: torch.Tensor, items: int, blocks_per_sm: int = WARP_KERNEL_BLOCKS_PER_SM) -> int:
    """Blocks for a warp per item (a row, a pair) on t's device, up to blocks_per_sm per SM, past
    which the kernels loop (grid-stride)."""
    return max(1, min(-(-items // (THREADS // 32)), sm_count(t.device.index) * blocks_per_sm))


def _blocks_per_call(batch: int, n: int, sm_count: int, resident: int):
    """A fused kernel's grid function: it has none of (B, N); each launch gives its block count,
    worked out from its tensors (FusedTemplate.launch)."""
    raise TypeError("a fused kernel is launched with the block count of its call (FusedTemplate.launch)")


class FusedTemplate:
    """templates/<op>/<name>.cu.j2, whose kernels are `pairgen_<op>_<name>` plus "_<suffix>"
    (suffix "" names the base kernel). kernels(context) gives each suffix's arguments as "kind name"
    (spec.Kernel.args), in the order launch() passes them.

    A rendering is a Plan (strategy: the template's name; its context; a Kernel per suffix), so it
    takes the forward kernels' path: codegen's contract check by name and kind, a runtime.Variant
    compiled for the device's arch, its kernels loaded and bound by the Variant. What differs is
    the grid: each launch gives its block count, worked out from the call's tensors."""

    def __init__(self, op: str, name: str, kernels: Callable[[dict], dict]):
        self.op, self.name, self.kernels = op, name, kernels
        self._variants = functools.lru_cache(maxsize=None)(self._variant)
        self._bound = functools.lru_cache(maxsize=256)(self._bind)
        self._launches: dict = {}  # launch()'s own key -> the bound launch (see launch)

    def plan(self, kind: str, **context) -> Plan:
        """The plan of one storage type and context: a Kernel per suffix, THREADS threads each (or
        the context's "threads")."""
        context = {"kind": kind, "threads": THREADS, **context}
        declared = tuple(Kernel(self.kernel_name(suffix), context["threads"], 0, tuple(args), _blocks_per_call)
                         for suffix, args in self.kernels(context).items())
        return Plan(self.op, self.name, {}, {}, context, declared, precision=kind)

    def render(self, kind: str, **context) -> codegen.Rendered:
        """The source for one storage type and context, its kernels checked against the plan's."""
        return codegen.render_plan(self.plan(kind, **context))

    def kernel_name(self, suffix: str) -> str:
        base = kernel_base_name(self.op, self.name)
        return f"{base}_{suffix}" if suffix else base

    def launch(self, like: torch.Tensor, suffix: str, blocks: int, *args: int, smem: int = 0, **context) -> None:
        """Launch kernel `suffix` for tensors like `like` (its dtype and device) on the current
        stream, with THREADS threads per block (or the context's "threads")."""
        # A training step launches several of these per call: the bound launch is looked up by the
        # call's own key first (its context in the caller's order, no sorting, no dtype name), at a
        # few µs of host time less than the canonical key below.
        fast_key = (like.dtype, like.device.index, suffix, blocks, smem, len(args), *context.items())
        bound = self._launches.get(fast_key)
        if bound is None:
            if len(self._launches) >= MAX_FAST_LAUNCHES:
                self._launches.clear()
            key = tuple(sorted(context.items()))
            bound = self._launches[fast_key] = self._bound(storage_kind(like.dtype), like.device.index, key, suffix,
                                                           blocks, smem, len(args))
        bound(*args)

    def _variant(self, kind: str, device_index: int, context_items: tuple) -> runtime.Variant:
        return runtime.build_variant(self.plan(kind, **dict(context_items)), runtime.device_info(device_index).arch)

    def _bind(self, kind, device_index, context_items, suffix, blocks, smem, arg_count):
        variant = self._variants(kind, device_index, context_items)
        threads = dict(context_items).get("threads", THREADS)
        return variant.kernel(device_index, self.kernel_name(suffix)).bind(blocks, threads, smem, arg_count)
