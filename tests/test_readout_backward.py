"""The pair readout's closed-form gradients (pairgen/ops/readout/backward.py) against float64
autograd of the reference, on the CPU: nodes, pair features and every parameter, with isolated
nodes, a node with a single edge and a node nobody reads (the test masks), odd sizes, heavy
tails; the fp32 gradient standard (relative L2 <= 2e-5 per tensor), and ties in the max shared
as the reference shares them."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers import (assert_16_bit_gradients_meet_the_standard, assert_max_act_grad_is_max_grad_then_act_grad,
                     assert_pair_gradient_matches_float64, assert_readout_max_kernels_match_pytorch,
                     assert_the_first_layer_kernel_rounds_once,
                     closed_form_errors, generator, gradient_errors64)
from pairgen.module.autograd import SavedClosedForm
from pairgen.module.dispatch import pairs
from pairgen import compiler
from pairgen.ops.readout import READOUT, backward, first_layer, fused_backward, pair_grad
from pairgen.spec import SIXTEEN_BIT_TOLERANCE
from pairgen.tuning.check import compare, reference64


@pytest.mark.parametrize("widths,B,N,distribution", [({"D": 24, "P": 8, "H": 40}, 2, 11, "normal"),
                                                     ({"D": 16, "P": 12, "H": 32}, 3, 9, "cauchy")])
def test_closed_form_gradients_meet_the_fp32_standard(widths, B, N, distribution):
    gen = generator(70 + N)
    module = READOUT.make_module(widths, gen)
    inputs = READOUT.make_inputs({"B": B, "N": N, **widths}, gen, distribution)
    errors = closed_form_errors(module, inputs, torch.randn((B, N, widths["D"]), generator=gen))
    assert {"input 0", "input 1"} <= set(errors), "gradients for nodes and pair features"
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2e-5, f"gradient of {worst}: {errors}"


def _16_bit_case(dtype, widths, B, N, seed, distribution="normal"):
    gen = generator(seed)
    module = READOUT.make_module(widths, gen).to(dtype)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t
                   for t in READOUT.make_inputs({"B": B, "N": N, **widths}, gen, distribution))
    return module, inputs, torch.randn((B, N, widths["D"]), generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("widths,B,N,seed,distribution", [({"D": 24, "P": 8, "H": 40}, 2, 11, 61, "normal"),
                                                          ({"D": 16, "P": 12, "H": 32}, 3, 37, 62, "cauchy")])
def test_a_16_bit_module_meets_the_16_bit_standard(dtype, widths, B, N, seed, distribution):
    """Computed in the module's dtype (16-bit products, the first layer on the concatenated rows
    as the reference rounds it, the max's gradient dense, fp32 LayerNorm statistics), isolated
    nodes included (the test masks)."""
    module, inputs, g = _16_bit_case(dtype, widths, B, N, seed, distribution)
    ours = module.analytic_gradients(list(inputs), [p.detach() for p in module.parameters()], g)
    assert module.backward_precision(inputs[0], None) == str(dtype).removeprefix("torch.")
    assert_16_bit_gradients_meet_the_standard(module, inputs, g, [t for t in ours if t is not None])


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("act_grad,max_act_grad", [(True, True), (True, False), (False, False)],
                         ids=["max_act_grad", "act_grad", "product"])
@pytest.mark.parametrize("dtype,widths,B,N", [(torch.bfloat16, {"D": 24, "P": 16, "H": 128}, 2, 11),
                                              (torch.float16, {"D": 16, "P": 12, "H": 128}, 1, 9)])
def test_16_bit_gradients_through_the_fused_kernels_meet_the_standard_emulated(dtype, widths, B, N, act_grad,
                                                                               max_act_grad, monkeypatch):
    """The 16-bit closed form with its GPU kernels (the first layer split and rounded once where P
    takes it, else the rows; the max and its gradient; max_act_grad (the max's gradient made inside
    act_grad), act_grad after the max's gradient kernel, or, with ACT_GRAD_KERNEL off, the dense
    product and PyTorch's SiLU backward; then d_pair and d_v from one pass where P takes it, else
    cuBLAS and PyTorch's sum) run on the CPU emulator: every gradient within the 16-bit standard,
    isolated nodes included, and each kernel ran once or not at all."""
    from unittest import mock

    from emulator import emulated

    monkeypatch.setattr(fused_backward, "ACT_GRAD_KERNEL", act_grad)
    monkeypatch.setattr(fused_backward, "MAX_ACT_GRAD_KERNEL", max_act_grad)
    module, inputs, g = _16_bit_case(dtype, widths, B, N, 63, "cauchy")
    runs, layers = [], []
    real_layer, real_pair = first_layer.first_layer, pair_grad.pair_gradient

    def counted(name):
        real = getattr(fused_backward, name)
        return mock.patch.object(fused_backward, name, lambda *a: runs.append(name) or real(*a))

    with emulated(), mock.patch.object(fused_backward, "applies", lambda nodes: True), \
            mock.patch.object(first_layer, "applies", first_layer.fits), \
            mock.patch.object(pair_grad, "applies", pair_grad.fits), \
            mock.patch.object(first_layer, "first_layer", lambda *a: layers.append(1) or real_layer(*a)), \
            counted("act_gradient"), counted("max_act_gradient"), counted("max_pool_backward"), \
            mock.patch.object(pair_grad, "pair_gradient", lambda *a: runs.append("pair_gradient") or real_pair(*a)):
        ours = module.analytic_gradients(list(inputs), [p.detach() for p in module.parameters()], g)
    assert runs == (["max_act_gradient"] if max_act_grad else
                    ["max_pool_backward", "act_gradient"] if act_grad else ["max_pool_backward"]) + \
        (["pair_gradient"] if widths["P"] % 8 == 0 else [])
    assert layers == ([1] if widths["P"] % 8 == 0 else [])
    assert_16_bit_gradients_meet_the_standard(module, inputs, g, [t for t in ours if t is not None])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_saving_forward_meets_the_16_bit_standards(dtype):
    """The training path that keeps its intermediates, in 16 bits: the output within the 16-bit
    forward standard of float64, the gradients within the 16-bit gradient standard."""
    widths = {"D": 24, "P": 8, "H": 40}
    module, inputs, g = _16_bit_case(dtype, widths, 2, 13, 64, "cauchy")
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = SavedClosedForm.run(module, leaves)
    (out * g).sum().backward()
    result = compare(out.detach(), reference64(module, inputs), SIXTEEN_BIT_TOLERANCE)
    assert out.dtype is dtype and result.ok, result
    ours = [leaf.grad for leaf in leaves if leaf.is_floating_point()] + [p.grad for p in module.parameters()]
    assert_16_bit_gradients_meet_the_standard(module, inputs, g, ours)


def test_pair_features_that_want_no_gradient_skip_its_product_and_change_nothing_else():
    """A training call whose pair features do not require grad (data, not a model's output): its
    backward is told so (frozen holds "pair_feats"), computes no gradient for them, and gives the
    nodes and every parameter the same gradients, bit for bit, as a call whose pair features want
    one."""
    from unittest import mock

    module, inputs, g = _16_bit_case(torch.bfloat16, {"D": 24, "P": 8, "H": 40}, 2, 13, 65)
    real, seen, results = type(module).saved_gradients, [], {}
    spy = staticmethod(lambda m, saved, grad_out, frozen: seen.append(frozen) or real(m, saved, grad_out, frozen))
    for wanted in (True, False):
        leaves = [inputs[0].clone().requires_grad_(), inputs[1].clone().requires_grad_(wanted), inputs[2]]
        module.zero_grad(set_to_none=True)
        with mock.patch.object(type(module), "saved_gradients", spy):
            (SavedClosedForm.run(module, leaves) * g).sum().backward()
        assert (leaves[1].grad is not None) == wanted
        results[wanted] = [leaves[0].grad] + [p.grad for p in module.parameters()]
    assert seen == [frozenset(), frozenset({"pair_feats"})]
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
def test_a_training_call_on_pair_data_takes_the_weight_gradient_kernel_emulated():
    """A 16-bit training call whose pair features want no gradient, with the GPU kernels on the
    CPU emulator: d W_p and d_v come from pair_grad's weight-gradient pass (no product for the pair
    features), and the nodes' and every parameter's gradient meet the 16-bit standard."""
    from unittest import mock

    from emulator import emulated

    # (the widths and dtype of the fused kernels' test above: the same emulated kernels)
    module, inputs, g = _16_bit_case(torch.bfloat16, {"D": 24, "P": 16, "H": 128}, 2, 11, 66, "cauchy")
    runs, real = [], pair_grad.weight_gradient
    leaves = [inputs[0].clone().requires_grad_(), inputs[1], inputs[2]]
    with emulated(), mock.patch.object(fused_backward, "applies", lambda nodes: True), \
            mock.patch.object(first_layer, "applies", first_layer.fits), \
            mock.patch.object(pair_grad, "applies", pair_grad.fits), \
            mock.patch.object(pair_grad, "weight_gradient", lambda *a: runs.append(1) or real(*a)):
        (SavedClosedForm.run(module, leaves) * g).sum().backward()
    assert runs == [1]
    ours = [leaves[0].grad, None] + [p.grad for p in module.parameters()]
    assert_16_bit_gradients_meet_the_standard(module, inputs, g, ours, unwanted=("input 1",))


def test_the_dense_max_gradient_is_the_sparse_one():
    """The 16-bit path's dense gradient of the max against the fp32 path's sparse one, with ties
    (equal messages) and an isolated node: the same matrix, the same sums over rows."""
    gen = generator(65)
    B, N, D = 2, 7, 5
    masked = torch.randn(B, N, N, D, generator=gen).round()  # few values: many ties
    edge = torch.rand(B, N, N, 1, generator=gen) > 0.3
    edge[1, 2] = False                                        # node (1, 2) reads no partner
    masked.masked_fill_(~edge, float("-inf"))
    isolated = ~edge.squeeze(-1).any(dim=2)
    pooled = masked.amax(dim=2).masked_fill(isolated.unsqueeze(-1), 0.0)
    d_pooled = torch.randn(B, N, D, generator=gen).masked_fill(isolated.unsqueeze(-1), 0.0)
    sparse = backward._max_gradient(masked, pooled, edge, d_pooled)
    dense = backward._dense_max_gradient(masked, pooled, edge, d_pooled)
    assert torch.equal(dense.d_m, sparse.by_pair.to_dense())
    assert torch.allclose(dense.column_sums, sparse.column_sums, atol=1e-6)
    rows = torch.randn(B * N * N, 3, generator=gen)
    assert torch.allclose(dense.transposed_times(rows, torch.matmul), sparse.transposed_times(rows, None), atol=1e-5)


def test_ties_in_the_max_share_the_gradient_as_the_reference_does():
    """Equal pair features and a zero node term make every partner of a node tie."""
    widths = {"D": 8, "P": 4, "H": 16}
    gen = generator(80)
    module = READOUT.make_module(widths, gen)
    nodes, pair_feats, mask = READOUT.make_inputs({"B": 1, "N": 6, **widths}, gen)
    with torch.no_grad():
        module.fuse[0].weight[:, 8:16] = 0.0  # node j's term: 0, so partners j differ only by their pair row
    pair_feats = pair_feats[:, :, :1].expand(-1, -1, 6, -1).contiguous()  # one pair row for all j
    errors = closed_form_errors(module, (nodes, pair_feats, mask), torch.randn((1, 6, 8), generator=gen))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2e-5, f"gradient of {worst}: {errors}"


def test_the_saving_forward_is_exact_and_its_gradients_meet_the_standard():
    """The training path that keeps its intermediates (SavedClosedForm): the output within the
    fp32 forward standard of float64, every gradient within 2e-5, isolated nodes included; a
    second backward through the same call is refused with what to do."""
    widths = {"D": 24, "P": 8, "H": 40}
    gen = generator(81)
    module = READOUT.make_module(widths, gen)
    nodes, pair_feats, mask = READOUT.make_inputs({"B": 2, "N": 11, **widths}, gen, "cauchy")

    def call(*inputs):
        return SavedClosedForm.run(module, inputs)

    with torch.no_grad():
        out = call(nodes, pair_feats, mask)
        exact = READOUT.make_reference(module).double()(nodes.double(), pair_feats.double(), mask)
    assert out.dtype is torch.float32 and ((out.double() - exact).norm() / exact.norm()).item() <= 1e-5
    errors = gradient_errors64(call, module, (nodes, pair_feats, mask), torch.randn(nodes.shape, generator=gen))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2e-5, f"gradient of {worst}: {errors}"
    twice = call(nodes.clone().requires_grad_(), pair_feats, mask)
    twice.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute_for_backward = True"):
        twice.sum().backward()


def test_16_bit_forwards_take_the_fp32_kernels_up_to_the_measured_size():
    module = READOUT.make_module({"D": 8, "P": 4, "H": 8}, generator(63)).bfloat16()
    assert module.routing.fp32_kernel_max_pairs == 2**15
    for B, N, takes in ((8, 64, True), (16, 128, False), (9, 64, False)):
        nodes = torch.empty(B, N, 8, dtype=torch.bfloat16)
        assert (pairs(nodes) <= module.routing.fp32_kernel_max_pairs) is takes, (B, N)
    assert module.routing.closed_form_min_pairs is None, "a 16-bit forward without a kernel never takes it"


def test_auto_trains_16_bit_readouts_through_the_closed_form_from_the_measured_size(monkeypatch):
    """From 2^18 pairs (B16 N128 measured 18-29 % faster than the bf16 reference), below the reference
    (B16 N96: slower, bound by the host); with or without the fused backward kernels (their
    PyTorch passes measured faster than the reference there too); fp32 always takes the closed
    form."""
    module = READOUT.make_module({"D": 8, "P": 4, "H": 8}, generator(64)).bfloat16()
    below, at = torch.empty(16, 96, 8), torch.empty(16, 128, 8)
    assert pairs(below) < module.routing.closed_form_16_bit_training_min_pairs == pairs(at)
    for precision in ("bfloat16", "float16"):
        assert module.trains_through_reference(precision, (below,))
        assert not module.trains_through_reference(precision, (at,))
    assert not module.trains_through_reference("float32", (below,))
    monkeypatch.setenv("PAIRGEN_FUSED_BACKWARD", "0")
    assert not module.trains_through_reference("bfloat16", (at,))
    monkeypatch.delenv("PAIRGEN_FUSED_BACKWARD")
    module.backward_mode = "reference"
    assert module.trains_through_reference("bfloat16", (at,))


@pytest.mark.parametrize("kind,D,P,H", [("bfloat16", 256, 64, 512), ("float16", 10, 6, 0), ("bfloat16", 7, 3, 0),
                                         ("float16", 96, 40, 192)])
def test_the_16_bit_closed_form_kernels_render_to_their_signatures_and_compile(kind, D, P, H):
    """The first layer's rows and the max over partners (fused_backward.py), in both 16-bit types,
    at widths that take 16-byte accesses and at odd ones that take 2- and 1-element ones, and with
    the hidden width the act_grad kernel: their signatures are the launches', and NVRTC compiles
    them for sm_90 without spills."""
    rendered = fused_backward.render(kind, D, P, H)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    kernels = {f"{rendered.kernel_name}_{s}" for s in ("rows", "max", "max_grad")}
    hidden = {f"{rendered.kernel_name}_{s}" for s in ("act_grad", "max_act_grad")} if H else set()
    assert set(compiled.kernels) >= kernels | hidden
    assert not compiled.spill_bytes


def test_act_grad_takes_even_d_and_h_in_whole_lane_words_up_to_its_registers_and_shared_memory(monkeypatch):
    """act_grad_applies: off with ACT_GRAD_KERNEL; on, D even up to ACT_GRAD_MAX_D and H a multiple
    of 64 up to ACT_GRAD_MAX_H, whose rendering at both limits compiles without spills (its warps'
    sums fit a block's static shared memory, its rows of d_m the registers)."""
    monkeypatch.setattr(fused_backward, "ACT_GRAD_KERNEL", True)
    max_d, max_h = fused_backward.ACT_GRAD_MAX_D, fused_backward.ACT_GRAD_MAX_H
    assert fused_backward.act_grad_applies(256, 512) and fused_backward.act_grad_applies(2, 64)
    assert fused_backward.act_grad_applies(max_d, max_h)
    assert not any(fused_backward.act_grad_applies(D, H) for D, H in ((7, 64), (256, 96), (256, 0), (0, 64),
                                                                      (256, max_h + 64), (max_d + 2, 64)))
    rendered = fused_backward.render("bfloat16", max_d, 64, max_h)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert {f"{rendered.kernel_name}_{s}" for s in ("act_grad", "max_act_grad")} <= set(compiled.kernels)
    assert compiled.spill_bytes == 0, compiled.summary()
    monkeypatch.setattr(fused_backward, "ACT_GRAD_KERNEL", False)
    assert not fused_backward.act_grad_applies(256, 512)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("dtype,B,N,D,P", [(torch.bfloat16, 2, 13, 24, 8), (torch.float16, 2, 9, 7, 3)])
def test_the_16_bit_closed_form_kernels_match_pytorch_emulated(dtype, B, N, D, P):
    """The rows, the max with its winner counts (ties in most channels, an isolated node, a node
    with one edge, a NaN) and the max's gradient in one walk from those counts, on the CPU
    emulator, at 16-byte and 1-element accesses (helpers.assert_readout_max_kernels_match_pytorch)."""
    from emulator import emulated

    with emulated():
        assert_readout_max_kernels_match_pytorch("cpu", dtype, B, N, D, P, B * 1000 + N)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("dtype,B,N,D,H,blocks_per_sm", [(torch.bfloat16, 2, 7, 24, 128, 1), (torch.float16, 1, 5, 96, 64, 1),
                                                         (torch.bfloat16, 3, 3, 70, 192, 1),
                                                         (torch.bfloat16, 2, 19, 40, 64, None)])
def test_the_act_grad_kernel_matches_float64_emulated(dtype, B, N, D, H, blocks_per_sm, monkeypatch):
    """d_pre = (d_m W2) silu'(pre) and d_u (each node's rows of d_pre summed) from the act_grad kernel
    on the CPU emulator, against float64 of the same 16-bit d_m, W2 and pre: the 16-bit standard
    (relative L2 1e-2), with rows that have no winner, one, several and a tie (two channels' shares
    in one word, a channel past the last whole warp of words at D = 70), a NaN in pre that must
    reach only its own element, and heavy-tailed pre. d_u sums d_pre as stored (16-bit values in
    fp32). With a block an emulated SM (3) each block takes several nodes (a warp's next row is
    then the next node's); at N = 19, with the default grid, a block a node and a warp several rows
    of it (its next row the node's own)."""
    from emulator import emulated

    gen = generator(900 + D + H)
    rows = B * N * N
    d_m = torch.zeros(rows, D)
    for r in range(rows):  # 0 to 3 winning channels a row, random shares
        k = int(torch.randint(0, 4, (), generator=gen))
        d_m[r, torch.randperm(D, generator=gen)[:k]] = torch.randn(k, generator=gen)
    d_m[0, :2] = torch.tensor([0.75, -1.5])  # both channels of one word
    d_m[1, D - 1] = 2.0                       # the last channel
    d_m = d_m.to(dtype)
    w2 = (torch.randn(D, H, generator=gen) / D ** 0.5).to(dtype)
    pre = (torch.randn(B, N, N, H, generator=gen) * 3).clamp(-12, 12).to(dtype)
    pre.view(-1)[5] = float("nan")
    pre64 = pre.double()
    sig = torch.sigmoid(pre64)
    exact = (d_m.double() @ w2.double()).view(B, N, N, H) * sig * (1 + pre64 * (1 - sig))
    if blocks_per_sm is not None:
        monkeypatch.setattr(fused_backward, "ACT_GRAD_BLOCKS_PER_SM", blocks_per_sm)
    with emulated():
        d_pre, d_u = fused_backward.act_gradient(d_m, w2, pre.clone(), P=8)
    d_pre = d_pre.view(B, N, N, H)
    assert torch.isnan(d_pre.view(-1)[5]) and torch.isnan(d_u[0, 0, 5]), "NaN reaches its element and its node's sum"
    finite = torch.isfinite(exact)
    assert int(finite.logical_not().sum()) == 1 and torch.isfinite(d_pre[finite]).all()
    error = ((d_pre.double()[finite] - exact[finite]).norm() / exact[finite].norm()).item()
    assert error <= 1e-2, f"d_pre: {error}"
    ours, stored_sums, exact_sums = d_u.double(), d_pre.double().sum(2), exact.sum(2)
    for t in (ours, stored_sums, exact_sums):
        t[0, 0, 5] = 0  # the NaN's node and channel, checked above
    assert torch.isfinite(ours).all()
    error = ((ours - exact_sums).norm() / exact_sums.norm()).item()
    assert error <= 1e-2, f"d_u: {error}"
    assert torch.allclose(ours, stored_sums, rtol=1e-2, atol=1e-3 * stored_sums.abs().max().item()), "d_pre's sums"


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("dtype,B,N,D,H,blocks_per_sm", [(torch.bfloat16, 2, 7, 24, 128, 1),
                                                         (torch.float16, 1, 19, 70, 64, None)])
def test_max_act_grad_is_max_grad_then_act_grad_emulated(dtype, B, N, D, H, blocks_per_sm, monkeypatch):
    """The max's gradient made inside act_grad, on the CPU emulator, equals the two kernels bit for
    bit (helpers.assert_max_act_grad_is_max_grad_then_act_grad): with a block an emulated SM each
    block takes several nodes (its next row the next node's, whose shares it loads); at D = 70 a
    lane's last word is past the row for some lanes."""
    from emulator import emulated

    if blocks_per_sm is not None:
        monkeypatch.setattr(fused_backward, "ACT_GRAD_BLOCKS_PER_SM", blocks_per_sm)
    with emulated():
        assert_max_act_grad_is_max_grad_then_act_grad("cpu", dtype, B, N, D, H, 1100 + D)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("wp", [False, True], ids=["pair_gradient", "weight_gradient"])
@pytest.mark.parametrize("dtype,B,N,P,H,splits", [(torch.bfloat16, 2, 19, 16, 128, 1), (torch.float16, 1, 21, 16, 256, 3),
                                                  (torch.bfloat16, 1, 16, 16, 128, 16)])
def test_the_pair_gradient_kernels_match_float64_emulated(dtype, B, N, P, H, splits, wp, monkeypatch):
    """d_v = d_pre summed over i with d_pair = d_pre W_p, or with the sum over rows of d_pre^T pair,
    from one pass (pair_grad.py) on the CPU emulator (helpers.assert_pair_gradient_matches_float64):
    a last tile of partners past N (19, 21), the rows of i in one range (their sums rounded in the
    kernel), in three (fp32 partial sums added after) and in one range an i (16); a warp's slice of
    H one k-step (H 128) and two (H 256)."""
    from emulator import emulated

    monkeypatch.setattr(pair_grad, "splits_for", lambda batches, n, sms: splits)
    with emulated():
        assert_pair_gradient_matches_float64("cpu", dtype, B, N, P, H, 1200 + N, wp)


@pytest.mark.parametrize("wp", [False, True], ids=["pair_gradient", "weight_gradient"])
@pytest.mark.parametrize("kind,P,H", [("bfloat16", 64, 512), ("float16", 16, 128), ("float16", 48, 384)])
def test_the_pair_gradient_kernels_compile_without_spills(kind, P, H, wp):
    """pair_grad.py's kernels at the readout's training widths (their registers' limit), the
    narrowest and an odd P: NVRTC compiles them for sm_90 without spills, and the widths outside
    what they take are refused."""
    assert pair_grad.takes_widths(P, H, wp)
    rendered = pair_grad.render(kind, P, H, wp)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert compiled.spill_bytes == 0, compiled.summary()
    assert not any(pair_grad.takes_widths(p, h, wp) for p, h in ((64, 1024), (128, 512), (12, 128), (64, 64), (64, 192)))
    assert pair_grad.takes_widths(8, 128) and not pair_grad.takes_widths(8, 128, wp=True)


def test_vector_width_takes_the_widest_access_both_widths_divide_into():
    assert [fused_backward.vector_width(2, D, P) for D, P in ((256, 64), (96, 40), (10, 6), (7, 3))] == [8, 8, 2, 1]
    assert fused_backward.vector_width(4, 256, 64) == 4


def test_the_rows_kernel_takes_only_inputs_that_start_on_a_vector():
    """A contiguous view that starts mid-vector goes to torch.cat (first_layer_rows answers None)."""
    whole = torch.zeros(3, 16, dtype=torch.bfloat16)
    assert fused_backward.starts_aligned(whole, 8) and fused_backward.starts_aligned(whole[1:], 8)
    assert not fused_backward.starts_aligned(whole.view(-1)[1:], 8) and fused_backward.starts_aligned(whole.view(-1)[1:], 1)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("dtype,B,N,D,P,H,blocks_per_sm", [(torch.bfloat16, 2, 23, 20, 24, 128, 1),
                                                          (torch.float16, 1, 9, 16, 16, 64, None)])
def test_the_first_layer_kernel_rounds_once_emulated(dtype, B, N, D, P, H, blocks_per_sm, monkeypatch):
    """first_layer.py on the CPU emulator (helpers.assert_the_first_layer_kernel_rounds_once). A
    batch's i and j end mid-tile (N = 23: 7 of a tile's 8 i and 16 j; N = 9: 9 of 16 j); P = 24 pads
    the k-steps; with a block an emulated SM (3) a block takes four of the 12 tiles through both row
    buffers, H = 128 two column passes."""
    from emulator import emulated

    if blocks_per_sm is not None:
        monkeypatch.setattr(first_layer, "BLOCKS_PER_SM", blocks_per_sm)
    with emulated():
        assert_the_first_layer_kernel_rounds_once("cpu", dtype, B, N, D, P, H, 1000 + N + P)


@pytest.mark.parametrize("kind,P,H", [("bfloat16", 64, 512), ("float16", 64, 512), ("bfloat16", 24, 128),
                                      ("float16", 8, 64)])
def test_the_first_layer_kernel_renders_to_its_signature_and_compiles_without_spills(kind, P, H):
    rendered = first_layer.render(kind, P, H)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert set(compiled.kernels) == {rendered.kernel_name}
    assert compiled.spill_bytes == 0 and compiled.stack_bytes == 0, compiled.summary()


def test_the_first_layer_kernel_takes_16_bit_pair_rows_of_whole_pieces_and_widths_its_block_holds():
    """fits: one 16-bit dtype, P % 8 == 0, a contiguous aligned pair tensor, H a multiple of
    COLUMNS, W_p and two tiles within a block's shared memory; applies: on a CUDA tensor only."""
    from emulator import EMULATED_DEVICE, emulated

    def case(dtype=torch.bfloat16, P=64, H=512, pair_dtype=None, transpose=False):
        nodes = torch.zeros(1, 4, 8, dtype=dtype)
        pair = torch.zeros(1, 4, 4, P, dtype=pair_dtype or dtype)
        return first_layer.fits(nodes, pair.transpose(1, 2) if transpose else pair, H)

    with emulated():
        assert case() and case(torch.float16, 8, 64)
        assert not any([case(torch.float32), case(P=12), case(H=96), case(pair_dtype=torch.float16),
                        case(transpose=True)])
        largest = EMULATED_DEVICE.limits.max_smem_per_block
        assert first_layer.smem_bytes(128, 1024) > largest and not case(P=128, H=1024)
        assert not first_layer.applies(torch.zeros(1, 4, 8, dtype=torch.bfloat16),
                                       torch.zeros(1, 4, 4, 64, dtype=torch.bfloat16), 512), "a CPU tensor"
