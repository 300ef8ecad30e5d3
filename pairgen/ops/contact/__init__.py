"""The pair contact head: LayerNorm per pair, symmetrised, a 3-layer MLP, sigmoid.

reference.py  the reference module and its test inputs
spec.py       strategies, search space, restrictions, defaults, plans (no torch)
module.py     the drop-in module and the strategies' runners
"""
from .module import ContactHead
from .reference import ContactHeadReference, make_inputs
from .spec import CONTACT, weight_offsets

CONTACT.bind(ContactHeadReference, ContactHead, make_inputs)

__all__ = ["CONTACT", "ContactHead", "ContactHeadReference", "make_inputs", "weight_offsets"]
