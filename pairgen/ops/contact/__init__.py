"""The pair contact head: LayerNorm per pair, symmetrised, a 3-layer MLP, sigmoid.

reference.py  the reference module and its test inputs
spec.py       strategies, search space, restrictions, defaults, plans (no torch)
module.py     the drop-in module and the strategies' runners
packs.py      the weight packs each call makes for the kernels

Importing the package imports only the spec; the torch half loads on first use.
"""
from ...spec import lazy_exports
from .spec import CONTACT, weight_offsets


def _torch_half():
    from .module import ContactHead
    from .reference import ContactHeadReference, make_inputs

    return ContactHeadReference, ContactHead, make_inputs, None


CONTACT.bind(_torch_half)
__getattr__ = lazy_exports(__name__, {"ContactHead": "module", "ContactHeadReference": "reference",
                                      "make_inputs": "reference"})

__all__ = ["CONTACT", "ContactHead", "ContactHeadReference", "make_inputs", "weight_offsets"]
