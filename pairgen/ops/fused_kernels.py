"""Launching the fused elementwise templates of the closed forms (passes over pair-sized tensors
that replace chains of PyTorch kernels): a template rendered per storage type and context, its
kernels' signatures checked against what the launches pass, compiled once per device, and each
launch bound once per grid (a bounded cache: every length N has its own grids)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

from .. import codegen, compiler, runtime
from ..precision import STORAGE_KINDS

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


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: Blocks per SM of the grid-stride kernels that give each row (or pair) a warp.
WARP_KERNEL_BLOCKS_PER_SM = 4


def warp_per_item_blocks(t: torch.Tensor, items: int, blocks_per_sm: int = WARP_KERNEL_BLOCKS_PER_SM) -> int:
    """Blocks for a warp per item (a row, a pair) on t's device, up to blocks_per_sm per SM, past
    which the kernels loop (grid-stride)."""
    return max(1, min(-(-items // (THREADS // 32)), sm_count(t.device.index) * blocks_per_sm))


class FusedTemplate:
    """templates/<op>/<name>.cu.j2, whose kernels are `pairgen_<op>_<name>` plus "_<suffix>"
    (suffix "" names the base kernel). signatures(context) gives each suffix's argument kinds, in
    the order launch() passes them."""

    def __init__(self, op: str, name: str, signatures: Callable[[dict], dict]):
        self.op, self.name, self.signatures = op, name, signatures
        self._kernels = functools.lru_cache(maxsize=None)(self._load)
        self._bound = functools.lru_cache(maxsize=256)(self._bind)

    def render(self, kind: str, **context) -> codegen.Rendered:
        """The source for one storage type and context, its signatures checked."""
        context = {"kind": kind, "threads": THREADS, **context}
        rendered = codegen.render_template(self.op, self.name, {}, {}, context, precision=kind)
        found = codegen.signatures(rendered.source)
        for suffix, kinds in self.signatures(context).items():
            name = self.kernel_name(rendered, suffix)
            if found.get(name) != kinds:
                raise codegen.ContractError(f"{rendered.template}: kernel {name} takes {found.get(name)} in the "
                                            f"source but the launch passes {kinds}")
        return rendered

    @staticmethod
    def kernel_name(rendered: codegen.Rendered, suffix: str) -> str:
        return f"{rendered.kernel_name}_{suffix}" if suffix else rendered.kernel_name

    def launch(self, like: torch.Tensor, suffix: str, blocks: int, *args: int, smem: int = 0, **context) -> None:
        """Launch kernel `suffix` for tensors like `like` (its dtype and device) on the current
        stream, with THREADS threads per block."""
        key = tuple(sorted(context.items()))
        self._bound(storage_kind(like.dtype), like.device.index, key, suffix, blocks, smem, len(args))(*args)

    def _load(self, kind: str, device_index: int, context_items: tuple) -> dict:
        from ..launch import LoadedKernel

        context = dict(context_items)
        rendered = self.render(kind, **context)
        compiled = compiler.compile_source(rendered.source, rendered.kernel_name, runtime.device_info(device_index).arch)
        return {suffix: LoadedKernel(compiled, device_index, 0, THREADS, self.kernel_name(rendered, suffix))
                for suffix in self.signatures({"kind": kind, **context})}

    def _bind(self, kind, device_index, context_items, suffix, blocks, smem, arg_count):
        return self._kernels(kind, device_index, context_items)[suffix].bind(blocks, THREADS, smem, arg_count)
