"""The pair contact head: LayerNorm per pair, symmetrised, a 3-layer MLP, sigmoid.

reference.py  the reference module and its test inputs
spec.py       the op's widths, presets, tolerances, defaults and cost (no torch)
strategies/   one file per strategy: space, restrictions, kernel, its pack, what runs a call
common.py     what the fp32 strategies share: weight offsets, context, restrictions, runner
module.py     the drop-in module (validation; the call's strategy runs it)
packs.py      the fp32 kernels' pack
backward.py   the closed-form gradients (fused_backward.py: their fused passes)

Importing the package imports only the spec; the torch half loads on first use.
"""
from ...spec import lazy_exports
from .common import weight_offsets
from .spec import CONTACT


def _torch_half():
    from .module import ContactHead
    from .reference import ContactHeadReference, make_inputs

    return ContactHeadReference, ContactHead, make_inputs, None


CONTACT.bind(_torch_half)
__getattr__ = lazy_exports(__name__, {"ContactHead": "module", "ContactHeadReference": "reference",
                                      "make_inputs": "reference"})

__all__ = ["CONTACT", "ContactHead", "ContactHeadReference", "make_inputs", "weight_offsets"]
