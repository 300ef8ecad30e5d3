"""The pair readout on the CPU: reference against an independent formula, the split first layer
and the gemm strategy's pipeline from the packed weights (b2 after the max, exactly), the
drop-in module against the reference (masks, isolated nodes, NaN), state_dict compatibility,
and input validation."""
from __future__ import annotations

import re

import pytest
import torch

from helpers import (Unpicklable, assert_copy_and_pickle_compute_the_reference, assert_state_dicts_interchange,
                     deepcopy_dropping_runtime_state, generator)
from pairgen import PairReadout, PairReadoutReference
from pairgen.ops.readout import READOUT, random_edge_mask, weight_offsets

WIDTHS = {"D": 16, "P": 8, "H": 24}


def independent_readout(nodes, pair, mask, w1, b1, w2, b2, gamma, beta):
    """The readout's definition (docs/ops.md) written out by hand in float64, node by node."""
    B, N, D = nodes.shape
    out = torch.empty(B, N, D, dtype=torch.float64)
    for b in range(B):
        for i in range(N):
            messages = []
            for j in range(N):
                if mask[b, i, j]:
                    x = torch.cat([nodes[b, i], nodes[b, j], pair[b, i, j]])
                    z = w1 @ x + b1
                    messages.append(w2 @ (z / (1 + torch.exp(-z))) + b2)
            pooled = torch.stack(messages).max(dim=0).values if messages else torch.zeros(D, dtype=torch.float64)
            mean = pooled.sum() / D
            var = ((pooled - mean) ** 2).sum() / D
            out[b, i] = nodes[b, i] + (pooled - mean) / torch.sqrt(var + 1e-5) * gamma + beta
    return out


def _module_and_inputs(shape, seed, distribution="normal"):
    gen = generator(seed)
    module = READOUT.make_module(READOUT.widths_of(shape), gen)
    return module, READOUT.make_inputs(shape, gen, distribution)


def test_reference_matches_an_independent_formula():
    module, (nodes, pair, mask) = _module_and_inputs({"B": 2, "N": 6, **WIDTHS}, 1, "cauchy")
    module = module.double()
    nodes, pair = nodes.double(), pair.double()
    l1, l2 = module.fuse[0], module.fuse[2]
    expected = independent_readout(nodes, pair, mask, l1.weight, l1.bias, l2.weight, l2.bias,
                                   module.norm.weight, module.norm.bias)
    with torch.no_grad():
        got = module.reference_forward(nodes, pair, mask)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_split_first_layer_from_the_packed_weights_is_the_first_linear():
    """What the split kernels compute (U = nodes W_i^T + b1, V = nodes W_j^T, U_i + V_j + W_p p),
    read from the packed buffer at the offsets the templates use."""
    D, P, H = WIDTHS["D"], WIDTHS["P"], WIDTHS["H"]
    module, (nodes, pair, _) = _module_and_inputs({"B": 2, "N": 5, **WIDTHS}, 2)
    packed = module.packed_weights().double()
    off = weight_offsets(D, P, H)
    wuvt = packed[off["wuvt"]: off["wuvt"] + D * 2 * H].view(D, 2 * H)
    wpt = packed[off["wpt"]: off["wpt"] + P * H].view(P, H)
    b1 = packed[off["b1"]: off["b1"] + H]
    uv = nodes.double() @ wuvt
    U, V = uv[..., :H] + b1, uv[..., H:]
    split = U[:, :, None, :] + V[:, None, :, :] + pair.double() @ wpt
    N = nodes.shape[1]
    cat = torch.cat([nodes.unsqueeze(2).expand(-1, -1, N, -1), nodes.unsqueeze(1).expand(-1, N, -1, -1), pair], -1)
    direct = module.fuse[0].double()(cat.double())
    torch.testing.assert_close(split, direct, rtol=1e-12, atol=1e-12)
    w2t = packed[off["w2t"]: off["w2t"] + H * D].view(H, D)
    torch.testing.assert_close(w2t, module.fuse[2].weight.double().t(), rtol=0, atol=0)
    for name, p in (("b2", module.fuse[2].bias), ("gamma", module.norm.weight), ("beta", module.norm.bias)):
        torch.testing.assert_close(packed[off[name]: off[name] + D], p.double(), rtol=0, atol=0)


def gemm_pipeline(module, nodes, pair, mask):
    """The gemm strategy's steps (gemm.cu.j2) in float64 from the packed weights: U, V per node;
    every pair's hidden layer; messages = hidden @ W2^T read where the module's torch.mm reads it
    (packed[_w2t_at:], no bias); the masked max over j, then + b2, LayerNorm, residual; nodes
    without a valid edge pool to 0."""
    D, P, H = (module.widths[k] for k in ("D", "P", "H"))
    packed = module.packed_weights().double()
    off = weight_offsets(D, P, H)
    section = lambda name, size: packed[off[name]: off[name] + size]  # noqa: E731
    nodes, pair = nodes.double(), pair.double()
    uv = nodes @ section("wuvt", D * 2 * H).view(D, 2 * H)
    U, V = uv[..., :H] + section("b1", H), uv[..., H:]
    hidden = torch.nn.functional.silu(U[:, :, None, :] + V[:, None, :, :] + pair @ section("wpt", P * H).view(P, H))
    messages = hidden @ packed[module._w2t_at: module._w2t_at + H * D].view(H, D)
    pooled = torch.where(mask[..., None], messages, float("-inf")).amax(dim=2) + section("b2", D)
    pooled = torch.where(mask.any(dim=2)[..., None], pooled, 0.0)
    normed = torch.nn.functional.layer_norm(pooled, (D,), eps=1e-5)
    return nodes + normed * section("gamma", D) + section("beta", D)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 9)])
def test_gemm_pipeline_from_the_packed_weights_is_the_reference(shape):
    B, N = shape
    module, (nodes, pair, mask) = _module_and_inputs({"B": B, "N": N, **WIDTHS}, 7, "cauchy")
    with torch.no_grad():
        expected = module.double().reference_forward(nodes.double(), pair.double(), mask)
        module.float()
        got = gemm_pipeline(module, nodes, pair, mask)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_b2_after_the_masked_max_is_exact_in_fp32():
    """The gemm pool adds b2 after the max: rounding is monotone, so max_j fl(m_j + b2) equals
    fl(max_j m_j + b2) bit for bit, NaN at a valid edge included (an edgeless row is -inf both ways,
    then pools to 0)."""
    gen = generator(8)
    m = torch.randn((3, 11, 11, 40), generator=gen) * torch.rand((3, 11, 11, 40), generator=gen) ** -2
    b2 = torch.randn(40, generator=gen) * 10
    mask = random_edge_mask(3, 11, gen)
    m[0, 3, 4, 7] = float("nan")
    mask[0, 3, 4] = True
    m[1, 2, 5, 9] = float("nan")
    mask[1, 2, 5] = False
    masked = lambda x: torch.where(mask[..., None], x, float("-inf")).amax(dim=2)  # noqa: E731
    torch.testing.assert_close(masked(m) + b2, masked(m + b2), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(masked(m)[0, 3, 7]) and not torch.isnan(masked(m)[1, 2]).any()


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 37)])
def test_module_on_cpu_equals_the_reference(shape):
    B, N = shape
    module, inputs = _module_and_inputs({"B": B, "N": N, **WIDTHS}, 3)
    reference = PairReadoutReference(WIDTHS["D"], WIDTHS["P"], WIDTHS["H"])
    reference.load_state_dict(module.state_dict())
    torch.testing.assert_close(module(*inputs), reference(*inputs), rtol=0, atol=0)


def test_bool_and_float_masks_agree():
    module, (nodes, pair, mask) = _module_and_inputs({"B": 2, "N": 9, **WIDTHS}, 4)
    expected = module(nodes, pair, mask)
    for dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(module(nodes, pair, mask.to(dtype)), expected, rtol=0, atol=0)


def test_isolated_nodes_give_nodes_plus_norm_bias():
    module, (nodes, pair, mask) = _module_and_inputs({"B": 2, "N": 7, **WIDTHS}, 5)
    mask[1] = False  # a whole graph without edges
    out = module(nodes, pair, mask)
    assert not mask[:, 0].any(), "make_inputs isolates node 0"
    torch.testing.assert_close(out[:, 0], nodes[:, 0] + module.norm.bias, rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], nodes[1] + module.norm.bias, rtol=0, atol=1e-6)
    assert torch.isfinite(out).all()


def test_a_single_valid_edge_pools_its_own_message():
    module, (nodes, pair, mask) = _module_and_inputs({"B": 1, "N": 6, **WIDTHS}, 6)
    assert mask[0, 1].sum() == 1 and mask[0, 1, 5], "make_inputs gives node 1 one edge, to the last node"
    with torch.no_grad():
        message = module.fuse(torch.cat([nodes[0, 1], nodes[0, 5], pair[0, 1, 5]]))
        expected = nodes[0, 1] + module.norm(message)
        torch.testing.assert_close(module(nodes, pair, mask)[0, 1], expected, rtol=1e-6, atol=1e-6)


def test_n_equal_one():
    module, (nodes, pair, mask) = _module_and_inputs({"B": 3, "N": 1, **WIDTHS}, 7)
    assert not mask.any(), "the only node is isolated"
    mask[1, 0, 0] = True  # a self edge in one graph
    out = module(nodes, pair, mask)
    torch.testing.assert_close(out[0], nodes[0] + module.norm.bias, rtol=0, atol=1e-6)
    with torch.no_grad():
        message = module.fuse(torch.cat([nodes[1, 0], nodes[1, 0], pair[1, 0, 0]]))
        torch.testing.assert_close(out[1, 0], nodes[1, 0] + module.norm(message), rtol=1e-6, atol=1e-6)


def test_nan_propagates_from_valid_edges_only():
    module, (nodes, pair, mask) = _module_and_inputs({"B": 1, "N": 8, **WIDTHS}, 8)
    mask[0, 2] = False
    mask[0, 2, 3] = True
    mask[0, 4, 3] = False
    pair[0, 2, 3, 0] = float("nan")  # at node 2's only edge: its row is NaN
    pair[0, 4, 3, 0] = float("nan")  # at a masked pair: ignored
    out = module(nodes, pair, mask)
    assert torch.isnan(out[0, 2]).all()
    assert torch.isfinite(out[0, [i for i in range(8) if i != 2]]).all()
    nodes[0, 6, 0] = float("nan")  # a NaN node: its own row, and every row with an edge to it
    out = module(nodes, pair, mask)
    assert torch.isnan(out[0, 6]).all()
    for i in range(8):
        if i not in (2, 6):
            assert bool(torch.isnan(out[0, i]).all()) == bool(mask[0, i, 6]), i


def test_state_dict_keys_and_round_trip():
    reference = PairReadoutReference(16, 8, 24)
    module = PairReadout(16, 8, 24)
    assert_state_dicts_interchange(module, reference)


def test_non_contiguous_inputs_and_other_dtypes_run_the_reference():
    module, (nodes, pair, mask) = _module_and_inputs({"B": 2, "N": 9, **WIDTHS}, 9)
    pair_t = pair.transpose(1, 2)
    mask_t = mask.transpose(1, 2)
    expected = module.reference_forward(nodes, pair_t.contiguous(), mask_t.contiguous())
    torch.testing.assert_close(module(nodes, pair_t, mask_t), expected, rtol=0, atol=0)
    module64 = module.double()
    torch.testing.assert_close(module64(nodes.double(), pair.double(), mask),
                               module64.reference_forward(nodes.double(), pair.double(), mask), rtol=0, atol=0)


def _good():
    return torch.randn(2, 5, 16), torch.randn(2, 5, 5, 8), torch.ones(2, 5, 5, dtype=torch.bool)


@pytest.mark.parametrize("which, bad, message", [
    (0, torch.randn(2, 5), "nodes must have 3 dimensions"),
    (0, torch.randn(2, 5, 12), "nodes must have shape (B, N, 16)"),
    (0, torch.ones(2, 5, 16, dtype=torch.int64), "nodes must be a floating-point tensor"),
    (0, [[1.0]], "nodes must be a torch.Tensor"),
    (1, torch.randn(2, 5, 5), "pair_feats must have 4 dimensions"),
    (1, torch.randn(2, 5, 6, 8), "pair_feats must have shape (B, N, N, 8) = (2, 5, 5, 8)"),
    (1, torch.randn(2, 5, 5, 4), "pair_feats must have shape (B, N, N, 8)"),
    (1, torch.randn(2, 5, 5, 8, dtype=torch.float64), "pair_feats has dtype torch.float64"),
    (1, lambda: torch.randn(2, 5, 5, 8, device="meta"), "pair_feats is on meta"),  # built by the test (lambda)
    (2, torch.ones(2, 5, 6, dtype=torch.bool), "edge_mask must have shape (B, N, N) = (2, 5, 5)"),
    (2, torch.ones(2, 5, 5, dtype=torch.complex64), "edge_mask must be bool, integer or floating point"),
    (2, lambda: torch.ones(2, 5, 5, dtype=torch.bool, device="meta"), "edge_mask is on meta but the inputs are on cpu"),
    (2, None, "edge_mask must be a torch.Tensor"),
])
def test_bad_input_raises_a_value_error_saying_what_was_expected(which, bad, message):
    module = PairReadout(16, 8, 24)
    inputs = list(_good())
    # the meta tensors are made here, not at collection: a process's first one is slow to make
    inputs[which] = bad() if callable(bad) else bad
    with pytest.raises(ValueError, match=re.escape(message)):
        module(*inputs)


def test_gradients_flow_on_cpu():
    module = PairReadout(16, 8, 24)
    nodes, pair, mask = _good()
    nodes.requires_grad_()
    pair.requires_grad_()
    module(nodes, pair, mask).sum().backward()
    assert nodes.grad is not None and pair.grad is not None and module.fuse[0].weight.grad is not None


def test_copies_and_pickles_drop_runtime_state():
    module, inputs = _module_and_inputs({"B": 1, "N": 5, **WIDTHS}, 10)
    clone = deepcopy_dropping_runtime_state(module, {"_variant_cache": {"generation": 0, (0, 5): Unpicklable()},
                                                     "_slots._params": Unpicklable(),
                                                     "_counters": Unpicklable(), "_scratch": Unpicklable()})
    assert clone._slots.weights().tensors[0] is clone.fuse[0].weight, "the copy packs its own parameters"
    assert clone._slots.anchor() is clone.fuse[0].weight, "the copy validates against its own parameters"
    assert_copy_and_pickle_compute_the_reference(module, clone, inputs)


def test_packed_weights_follow_parameter_changes():
    module = PairReadout(16, 8, 24)
    off = weight_offsets(16, 8, 24)
    first = module.packed_weights()
    with torch.no_grad():
        module.fuse[2].weight.mul_(-1.0)  # in place, as an optimizer step does
    second = module.packed_weights()
    torch.testing.assert_close(second[off["w2t"]: off["w2t"] + 24 * 16], -first[off["w2t"]: off["w2t"] + 24 * 16],
                               rtol=0, atol=0)
    module.norm.bias = torch.nn.Parameter(torch.full((16,), 3.0))  # replaced by assignment
    assert bool((module.packed_weights()[off["beta"]: off["beta"] + 16] == 3.0).all())


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_random_edge_mask_has_the_promised_rows(n):
    mask = random_edge_mask(3, n, generator(11))
    assert mask.dtype is torch.bool and mask.shape == (3, n, n)
    assert not mask[:, 0].any()
    if n > 1:
        assert (mask[:, 1].sum(-1) == 1).all()

