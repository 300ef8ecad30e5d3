"""Peers scripts/bench.py times beside the triangle update's module: pairgen's own function
(pairgen.triangle_multiplicative_update) on the module's weights, called as the models call it."""
from __future__ import annotations

from ..functional import triangle_multiplicative_update
from ..ops.trimul.peers import af3_weights, cat

def functional_peer(name: str, module, inputs: tuple, train: bool = False):
    """pairgen.triangle_multiplicative_update on the module's weights: "functional" passes the same
    fused tensors on every call (as Boltz does), "functional-fresh" concatenates them anew on every
    call (as OpenFold 3 and Protenix do, torch.cat included in the time). The models' form only
    (the output gated on the normalised input, in input width)."""
    if not module.widths["gate_normalized"] or module.widths.get("gate_hidden"):
        return "the function computes the models' form (gate_on='normalized', gate in input width)"
    x, mask = inputs
    direction = "outgoing" if module.widths["outgoing"] else "incoming"
    same = af3_weights(module, cat)
    if name == "functional":
        return lambda: triangle_multiplicative_update(x, direction, mask, **same)
    return lambda: triangle_multiplicative_update(x, direction, mask, **af3_weights(module, cat))
