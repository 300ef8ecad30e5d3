"""The scene-graph pair readout: a per-pair MLP, the masked max over partners, LayerNorm, residual.

reference.py  the reference module and its test inputs
spec.py       strategies, search space, restrictions, defaults, plans (no torch)
module.py     the drop-in module, its held scratch, and the strategies' runners
packs.py      the weight packs each call makes for the kernels

Importing the package imports only the spec; the torch half loads on first use.
"""
from ...spec import lazy_exports
from .spec import (GEMM_SCRATCH_ALIGN, PROLOGUE_COLS, PROLOGUE_ROWS, PROLOGUE_THREADS, READOUT, gemm_scratch_offsets,
                   pair_max_scratch, prologue_blocks, row_tiles, split_scratch_floats, weight_offsets)


def _torch_half():
    from .module import PairReadout
    from .reference import PairReadoutReference, make_inputs

    return PairReadoutReference, PairReadout, make_inputs, None


READOUT.bind(_torch_half)
__getattr__ = lazy_exports(__name__, {"PairReadout": "module", "PairReadoutReference": "reference",
                                      "make_inputs": "reference", "random_edge_mask": "reference"})

__all__ = ["GEMM_SCRATCH_ALIGN", "PROLOGUE_COLS", "PROLOGUE_ROWS", "PROLOGUE_THREADS", "READOUT", "PairReadout",
           "PairReadoutReference", "gemm_scratch_offsets", "make_inputs", "pair_max_scratch", "prologue_blocks",
           "random_edge_mask", "row_tiles", "split_scratch_floats", "weight_offsets"]
