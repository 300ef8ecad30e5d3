"""The scene-graph pair readout: a per-pair MLP, the masked max over partners, LayerNorm, residual.

reference.py  the reference module and its test inputs
spec.py       the op's widths, presets, tolerances, defaults and cost (no torch)
strategies/   one file per strategy: space, restrictions, kernels, its pack, what runs a call
common.py     what the strategies share: the fp32 offsets, the node prologue, the pair-max kernel
module.py     the drop-in module (validation, the scratch it holds; the call's strategy runs it)
packs.py      the fp32 kernels' weight pack
backward.py   the closed-form gradients

Importing the package imports only the spec; the torch half loads on first use.
"""
from ...spec import lazy_exports
from .common import (PROLOGUE_COLS, PROLOGUE_ROWS, PROLOGUE_THREADS, pair_max_scratch, prologue_blocks, row_tiles,
                     split_scratch_floats, weight_offsets)
from .spec import READOUT
from .strategies.gemm import GEMM_SCRATCH_ALIGN, gemm_scratch_offsets


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
