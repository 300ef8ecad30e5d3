"""The contact head's strategies, one file each beside its template (templates/contact/<name>.cu.j2):
its search space, restrictions, derived constants and kernel, the weights it packs, and what runs a
call. A strategy file binds torch (and what needs it) on its first call, so that the spec half
(pairgen-tune --status, a tuner's worker) loads quickly and without torch, and a call pays no
import."""
from .mma import MMA
from .symmetric_tiled import SYMMETRIC_TILED
from .thread_per_pair import THREAD_PER_PAIR
from .tiled import TILED
from .wgmma import WGMMA

__all__ = ["MMA", "SYMMETRIC_TILED", "THREAD_PER_PAIR", "TILED", "WGMMA"]
