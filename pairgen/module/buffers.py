"""Buffers a module keeps between calls (scratch, counters), grown when a call needs more and
never freed under a captured CUDA graph."""
from __future__ import annotations

from typing import NamedTuple

import torch

#: The buffers a module packs its weights into (KernelModule._pack_buffer), by role: a call's main
#: pack, and a second one where a strategy makes two (the readout's tf32x3 product operand).
PACK_SLOTS = ("_pack_weights", "_pack_second")


class HeldBuffer(NamedTuple):
    """A buffer a module keeps between calls on one device (index -1: the CPU), with the buffers
    it replaced (kept alive: a captured CUDA graph may still point at them), its length and its
    data pointer (read once, not per call)."""
    index: int
    live: torch.Tensor
    retired: list
    capacity: int
    ptr: int


def grow_held(held: HeldBuffer | None, index: int, count: int, dtype: torch.dtype,
              zeroed: bool) -> tuple[HeldBuffer, int]:
    """A buffer of at least `count` elements on device `index` for this call: (what the module
    holds from now on, the pointer this call uses). The new buffer is at least twice the one it
    replaces, so growth is rare. Under CUDA-graph capture a zero fill is recorded, not run: the new
    buffer is then zeroed only by the graph's replays, so it is the graph's (kept alive in
    `retired`, its pointer used by the captured launch), and the eager calls keep the one they had."""
    device = torch.device("cpu") if index < 0 else torch.device("cuda", index)
    if held is None or held.index != index:  # none yet, or the module moved to another device
        live, retired = None, [] if held is None else held.retired + [held.live]
    else:
        live, retired = held.live, held.retired
    size = max(count, 2 * (0 if live is None else live.numel()))
    fresh = (torch.zeros if zeroed else torch.empty)(size, device=device, dtype=dtype)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if live is None:
            live = torch.empty(0, device=device, dtype=dtype)
        return HeldBuffer(index, live, retired + [fresh], live.numel(), live.data_ptr()), fresh.data_ptr()
    return (HeldBuffer(index, fresh, retired + ([] if live is None else [live]), fresh.numel(), fresh.data_ptr()),
            fresh.data_ptr())
