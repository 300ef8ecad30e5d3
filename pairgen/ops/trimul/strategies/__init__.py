"""The triangle update's strategies, one file each beside its template (templates/trimul/<name>.cu.j2):
its search space, restrictions, derived constants and kernels, the weights it packs, and what runs a
call (scratch, launches with named arguments, the cuBLAS product between them). A strategy file
binds torch (and what needs it) on its first call, so that the spec half (pairgen-tune --status, a
tuner's worker) loads quickly and without torch, and a call pays no import."""
from .bmm import BMM
from .fused import FUSED
from .mma import MMA
from .wgmma import WGMMA

__all__ = ["BMM", "FUSED", "MMA", "WGMMA"]
