"""The pair readout's strategies, one file each beside its template (templates/readout/<name>.cu.j2):
its search space, restrictions, derived constants and kernels, the weights it packs, and what runs a
call (scratch, launches with named arguments, the cuBLAS product between them). What several share
(the node prologue, the pair-max kernel of direct, split and fused) is in ../common.py. A strategy
file binds torch (and what needs it) on its first call, so that the spec half (pairgen-tune
--status, a tuner's worker) loads quickly and without torch, and a call pays no import."""
from .direct import DIRECT
from .fused import FUSED
from .gemm import GEMM
from .mma import MMA
from .split import SPLIT
from .wgmma import WGMMA

__all__ = ["DIRECT", "FUSED", "GEMM", "MMA", "SPLIT", "WGMMA"]
