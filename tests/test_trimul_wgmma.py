"""The triangle update's Hopper strategy (wgmma) on the CPU: its kernels compiling for sm_90a without
spills, its restrictions (sm_90 only, 16-bit only, whole chunks), the shared-memory contract, and
its folded LayerNorms: the packed weights, run through the kernels' arithmetic in float64 here,
reproduce the float64 reference within the 16-bit standard for every option set, padded widths,
heavy-tailed inputs and empty rows."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from helpers import feasible_defaults, switching_defaults
from pairgen import codegen, compiler
from pairgen.ops.trimul import TRIMUL
from pack_oracles import pack_wgmma_weights
from pairgen.ops.trimul.strategies.wgmma import REGISTER_VARIANTS_OFF, k_padded, wgmma_weight_offsets
from pairgen.spec import SIXTEEN_BIT_TOLERANCE, DeviceLimits, kernel_name
from pairgen.tuning.check import compare, reference64

SEED = {"P": 64, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1}
MODEL = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
ODD = {"P": 48, "H": 24, "outgoing": 0, "gate_normalized": 1, "bias": 1}   # k padded: H 24 -> 32
OPTION_SETS = [{"outgoing": o, "gate_normalized": g, "bias": b} for o, g, b in itertools.product((0, 1), (0, 1), (1, 0))]


def _sampled(widths: dict, precision: str, k: int = 1):
    return TRIMUL.at(precision).sample_plans("wgmma", widths, k, random.Random(f"wgmma{precision}{widths['P']}"))


def _fast_share(plans: list, widths: dict, precision: str) -> list:
    """Of _sampled's plans (the feasible defaults, then the sampled point): in bf16 the defaults that
    switch a feature as no earlier one does (helpers.switching_defaults) and the sampled point; in
    fp16 the sampled point (its defaults are bf16's code on the other 16-bit type, and its first
    default compiles without spills in test_trimul_mma.py)."""
    defaults = len(feasible_defaults(TRIMUL.at(precision), "wgmma", widths, precision))
    return (switching_defaults(plans[:defaults]) if precision == "bfloat16" else []) + plans[defaults:]


@pytest.fixture(scope="module", params=["fast-share", pytest.param("every-default", marks=pytest.mark.slow)])
def compiled_wgmma(request):
    """The sampled points of each width and 16-bit type, after the feasible defaults there: every
    one of them (every-default), or _fast_share's."""
    plans = [p for precision in ("bfloat16", "float16") for widths in (SEED, MODEL, ODD)
             for p in (_sampled(widths, precision) if request.param == "every-default"
                       else _fast_share(_sampled(widths, precision), widths, precision))]
    jobs = [(r.source, r.kernel_name, "sm_90") for r in map(codegen.render_plan, plans)]
    with compiler.compile_pool(2) as pool:
        return list(zip(plans, compiler.compile_many(jobs, pool)))


def test_sampled_points_compile_for_sm90a_without_spills(compiled_wgmma):
    assert {(plan.precision, plan.widths["P"]) for plan, _ in compiled_wgmma} == {
        (precision, P) for precision in ("bfloat16", "float16") for P in (64, 128, 48)}
    for plan, result in compiled_wgmma:
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        assert result.arch == "sm_90a"   # the template asks for Hopper's feature target
        assert set(result.kernels) == variant_kernels(plan)
        assert result.spill_bytes == 0, f"{plan.label}: {result.summary()}"


def test_the_feature_target_is_taken_only_where_a_source_asks_for_it():
    assert compiler.target_for(f"{compiler.ARCH_SPECIFIC_MARKER}\n__global__ void k() {{}}", "sm_90") == "sm_90a"
    assert compiler.target_for("__global__ void k() {}", "sm_90") == "sm_90"
    assert compiler.target_for(compiler.ARCH_SPECIFIC_MARKER, "sm_90a") == "sm_90a"


def test_restrictions_keep_it_on_hopper_in_16_bit_with_whole_chunks():
    plan = TRIMUL.plan("wgmma", next(p for s, p in TRIMUL.default_points if s == "wgmma"), MODEL, "bfloat16")
    assert not TRIMUL.infeasible(plan, DeviceLimits())
    assert TRIMUL.infeasible(plan, DeviceLimits(arch="sm_100")) == [
        "wgmma needs sm_90 (its sm_90a features do not run on later architectures)"]
    with pytest.raises(ValueError, match="does not compute in"):
        TRIMUL.plan("wgmma", plan.params, MODEL, "tf32x3")
    assert not TRIMUL.feasible_plans("wgmma", {**MODEL, "P": 44}, DeviceLimits(), "bfloat16")
    # at P = 48, H = 24 only 16-column output passes tile P and only 32-column projection passes 4H = 96
    assert all(p.params["o_wn"] == 16 and p.params["p_wn"] == 32
               for p in TRIMUL.feasible_plans("wgmma", ODD, DeviceLimits(), "bfloat16"))


def test_paired_columns_stage_their_constants_and_keep_the_output_kernel_unspilled():
    """Paired columns reorder the epilogues' constants as they stage them in shared memory, so they
    need consts_smem; with 4 output warpgroups their 64-column passes spilled a register, so those
    are left out. Sampled paired points of the models' width compile without spills and
    renders no staging of its own where pairing is off (the unpaired source has no stmatrix)."""
    limits = DeviceLimits()
    base = {"p_groups": 4, "p_stages": 1, "p_wn": 64, "o_groups": 3, "o_wn": 64, "o_stages": 1, "swizzle": True,
            "consts_smem": True, "paired_columns": True}
    assert not TRIMUL.infeasible(TRIMUL.plan("wgmma", base, MODEL, "bfloat16"), limits)
    assert TRIMUL.infeasible(TRIMUL.plan("wgmma", {**base, "consts_smem": False}, MODEL, "bfloat16"), limits) == [
        "paired columns stage their constants in shared memory (consts_smem)"]
    four = {**base, "o_groups": 4, "o_stages": 1, "swizzle": False}  # (4 groups fit the shared memory at P = 64)
    assert "at most 128 accumulators per thread" in TRIMUL.infeasible(TRIMUL.plan("wgmma", four, SEED, "bfloat16"), limits)
    assert not TRIMUL.infeasible(TRIMUL.plan("wgmma", {**four, "o_wn": 32}, SEED, "bfloat16"), limits)
    assert not TRIMUL.infeasible(TRIMUL.plan("wgmma", {**four, "paired_columns": False}, SEED, "bfloat16"), limits)
    unpaired = codegen.render_plan(TRIMUL.plan("wgmma", {**base, "paired_columns": False}, MODEL, "bfloat16")).source
    assert "stmatrix" not in unpaired
    # the early x fetch is the one-stage projection's; off, no trace of it in the source
    two = {**base, "p_groups": 2, "p_stages": 2, "early_x_fetch": True}
    assert TRIMUL.infeasible(TRIMUL.plan("wgmma", two, MODEL, "bfloat16"), limits) == [
        "the early x fetch is for one x stage (p_stages 1)"]
    # x in registers: the paired one-stage projection's, without the early fetch (its own is earlier)
    xr = {**base, "p_groups": 3, "x_registers": True}
    assert not TRIMUL.infeasible(TRIMUL.plan("wgmma", xr, MODEL, "bfloat16"), limits)
    assert TRIMUL.infeasible(TRIMUL.plan("wgmma", {**xr, "early_x_fetch": True}, MODEL, "bfloat16"), limits)
    assert TRIMUL.infeasible(TRIMUL.plan("wgmma", {**xr, "paired_columns": False, "consts_smem": False}, MODEL,
                                         "bfloat16"), limits)
    early = codegen.render_plan(TRIMUL.plan("wgmma", {**base, "early_x_fetch": True}, MODEL, "bfloat16")).source
    assert "fetch_next_x(" in early and "fetch_next_x(" not in unpaired
    plans = [_random_feasible_plan(random.Random(3), MODEL, lambda params: params["paired_columns"])]
    # (the first default, paired, compiles in the fast-share sweep)
    jobs = [(r.source, r.kernel_name, "sm_90") for r in map(codegen.render_plan, plans)]
    with compiler.compile_pool(2) as pool:
        for plan, result in zip(plans, compiler.compile_many(jobs, pool)):
            assert not isinstance(result, Exception), f"{plan.label}: {result}"
            assert "stmatrix" in codegen.render_plan(plan).source
            assert result.spill_bytes == 0, f"{plan.label}: {result.summary()}"


def _random_feasible_plan(rng, widths: dict, wanted=lambda params: True):
    """A feasible bf16 wgmma plan at `widths` drawn uniformly from the space's points that pass
    `wanted` (drawn until one is feasible: enumerating every feasible point takes seconds)."""
    space = TRIMUL.strategies["wgmma"].space
    while True:
        params = {name: rng.choice(values) for name, values in space.items()}
        if wanted(params):
            plan = TRIMUL.plan("wgmma", params, widths, "bfloat16")
            if not TRIMUL.infeasible(plan, DeviceLimits()):
                return plan


def test_a_plan_whose_shared_memory_disagrees_with_its_template_does_not_build():
    plan = _random_feasible_plan(random.Random(4), MODEL)
    plan.context = {**plan.context, "o_smem": plan.context["o_smem"] + 16}
    rendered = codegen.render_template(plan.op, plan.strategy, plan.params, plan.widths, plan.context, plan.precision)
    with pytest.raises(compiler.CompileError, match="output shared memory differs"):
        compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90", use_cache=False)


def _sections(packed: torch.Tensor, P: int, H: int, dtype: torch.dtype) -> dict:
    off = wgmma_weight_offsets(P, H, torch.empty(0, dtype=dtype).element_size())
    assert packed.numel() == off["total"] and all(v % 16 == 0 for v in off.values())

    def matrix(name, rows, cols):
        n = rows * cols * torch.empty(0, dtype=dtype).element_size()
        return packed[off[name]: off[name] + n].view(dtype).reshape(rows, cols).double()

    def vector(name, size):
        return packed[off[name]: off[name] + 4 * size].view(torch.float32).double()

    return {"wp": matrix("wp", 4 * H, k_padded(P)), "wo": matrix("wo", P, k_padded(H)), "wg": matrix("wg", P, k_padded(P)),
            **{f"c{i}{s}": vector(f"c{i}{s}", 4 * H if s == "p" else P) for i in (1, 2) for s in "pog"}}


def _stats(rows: torch.Tensor):
    mean = rows.mean(dim=-1, keepdim=True)
    return mean, (((rows - mean) ** 2).mean(dim=-1, keepdim=True) + 1e-5).rsqrt()


def _kernels_in_float64(s: dict, x: torch.Tensor, mask: torch.Tensor, widths: dict, dtype: torch.dtype):
    """The two kernels' arithmetic (wgmma.cu.j2) and the contraction between them, in float64, with
    the roundings the GPU applies (a, b and the triangle sums stored in `dtype`)."""
    P, H = widths["P"], widths["H"]
    x = x.double()
    mean, rstd = _stats(x)
    xp = torch.nn.functional.pad(x, (0, k_padded(P) - P))
    pg = (rstd * (xp @ s["wp"].T - mean * s["c1p"]) + s["c2p"]).unflatten(-1, (H, 4))
    m = mask.double().unsqueeze(-1)
    a = (pg[..., 0] * torch.sigmoid(pg[..., 1]) * m).to(dtype).double()
    b = (pg[..., 2] * torch.sigmoid(pg[..., 3]) * m).to(dtype).double()
    eq = "bikh,bjkh->bijh" if widths["outgoing"] else "bkih,bkjh->bijh"
    z = torch.einsum(eq, a, b).to(dtype).double()
    zmean, zrstd = _stats(z)
    zp = torch.nn.functional.pad(z, (0, k_padded(H) - H))
    o = zrstd * (zp @ s["wo"].T - zmean * s["c1o"]) + s["c2o"]
    xmean, xrstd = _stats(x) if widths["gate_normalized"] else (0.0, 1.0)
    g = xrstd * (xp @ s["wg"].T - xmean * s["c1g"]) + s["c2g"]
    return o * torch.sigmoid(g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_folded_layer_norms_reproduce_the_reference(dtype, options):
    """Heavy-tailed inputs with an offset (the mean's share must cancel), a masked row, a padded k."""
    widths = {"P": 48, "H": 24, **options}
    gen = torch.Generator().manual_seed(7)
    module = TRIMUL.make_module(widths, gen).to(dtype)
    x, mask = TRIMUL.make_inputs({"B": 2, "N": 11, **widths}, gen)
    x = (x + 3.0 * torch.empty_like(x).cauchy_(generator=gen).clamp(-50, 50) + 4.0).to(dtype)
    mask[1, 4, :] = False
    packed = pack_wgmma_weights(dict(module.named_parameters()), 48, 24, bool(options["bias"]),
                                bool(options["gate_normalized"]), dtype)
    out = _kernels_in_float64(_sections(packed, 48, 24, dtype), x, mask, widths, dtype)
    result = compare(out.to(dtype), reference64(module, (x, mask)), SIXTEEN_BIT_TOLERANCE)
    assert result.ok and result.rel_l2 < 5e-3, str(result)


def test_packing_folds_gamma_and_sums_c1_from_the_rounded_matrix():
    widths = {"P": 48, "H": 24, **OPTION_SETS[0]}
    module = TRIMUL.make_module(widths, torch.Generator().manual_seed(1))
    params = dict(module.named_parameters())
    s = _sections(pack_wgmma_weights(params, 48, 24, True, True, torch.bfloat16), 48, 24, torch.bfloat16)
    gamma, beta = params["layer_norm_out.weight"].detach().double(), params["layer_norm_out.bias"].detach().double()
    wo = params["out_proj.weight"].detach().double()
    assert torch.equal(s["wo"][:, :24], (wo * gamma).to(torch.bfloat16).double())
    assert torch.equal(s["wo"][:, 24:], torch.zeros(48, 8, dtype=torch.float64))   # k padding
    assert torch.allclose(s["c1o"], s["wo"].sum(dim=1).float().double())
    assert torch.allclose(s["c2o"], (wo @ beta + params["out_proj.bias"].detach().double()).float().double())


def test_default_points_keep_their_products_asynchronous():
    """ptxas serializes every wgmma of a kernel (a wait after each) when it cannot prove that no
    other instruction touches an accumulator while its product runs, and says so only as a remark
    (C7514): the projection's two accumulator sets overlap the tensor cores with the epilogue only
    as long as that remark stays away."""
    for precision, widths in (("bfloat16", MODEL), ("float16", SEED)):   # one dtype per width: the same code
        plan = TRIMUL.default_plan(widths, DeviceLimits(), precision)
        assert plan.strategy == "wgmma"
        rendered = codegen.render_plan(plan)
        result = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
        assert result.arch == "sm_90a" and not result.wgmma_serialized, result.summary()


def variant_kernels(plan) -> set:
    """The two kernels, named after the variant (a profile tells the points apart), and the rows'
    statistics kernel where a kernel is sliced."""
    name = kernel_name("trimul", "wgmma", plan.precision, plan.params)
    assert name.startswith("pairgen_trimul_wgmma_") and all(f"{k}{int(v)}" in name for k, v in plan.params.items())
    sliced = plan.context["p_slices"] > 1 or plan.context["o_slices"] > 1
    return {name, f"{name}_output"} | ({f"{name}_stats"} if sliced else set())


def assert_compiled_without_spills(plans: list, asynchronous: list) -> None:
    """Each plan's variant builds (its kernels named after it) without spills; the `asynchronous`
    ones keep their products asynchronous too (no C7514 remark: see the test above; the compile
    keeps that verdict beside its cubin, so each source compiles once)."""
    jobs = [(r.source, r.kernel_name, "sm_90") for r in map(codegen.render_plan, plans)]
    with compiler.compile_pool(2) as pool:
        for plan, result in zip(plans, compiler.compile_many(jobs, pool)):
            assert not isinstance(result, Exception), f"{plan.label}: {result}"
            assert set(result.kernels) == variant_kernels(plan)
            assert (result.spill_bytes, result.stack_bytes) == (0, 0), f"{plan.label}: {result.summary()}"
            if any(plan is checked for checked in asynchronous):
                assert not result.wgmma_serialized, f"{plan.label}: ptxas serialized its products"


WIDE = {"P": 384, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
SQUARE_256 = {"P": 256, "H": 256, "outgoing": 0, "gate_normalized": 1, "bias": 0}
#: A point whose blocks fit both widths above with a quarter of each kernel's weight rows (a
#: default point, after the wide passes' ones).
SLICED = {"p_groups": 2, "p_stages": 1, "p_wn": 64, "o_groups": 2, "o_wn": 32, "o_stages": 1, "swizzle": True,
          "consts_smem": True, "paired_columns": True, "z_registers": True}


def test_column_slices_fit_the_wide_widths_and_compile_asynchronous_without_spills():
    """At P = 384 (H = 128) and P = H = 256 no block holds a kernel's whole weights; a point takes
    the fewest slices of them per block that fit (p_slices, o_slices 0: here a quarter), with a
    third kernel for the rows' statistics. They compile without spills and with their products
    asynchronous; counts a point names are whole passes of the paired kernels (not with x in
    registers, nor the gate in hidden width); at P = H = 128 nothing is sliced, and no trace of
    slices is rendered. The default point at these widths is the wide passes' (128 columns a pass
    in both kernels, one output warpgroup), sliced too: it compiles likewise."""
    limits = DeviceLimits()
    defaults = []
    for widths in (WIDE, SQUARE_256):
        for precision in ("bfloat16", "float16"):
            first = TRIMUL.plan("wgmma", next(p for s, p in TRIMUL.default_points if s == "wgmma"), widths, precision)
            assert "shared memory exceeds the per-block limit" in TRIMUL.infeasible(first, limits)
            plan = TRIMUL.plan("wgmma", SLICED, widths, precision)
            assert not TRIMUL.infeasible(plan, limits) and plan.context["p_slices"] == plan.context["o_slices"] == 4
            unpaired = TRIMUL.plan("wgmma", {**SLICED, "paired_columns": False, "consts_smem": False}, widths, precision)
            assert "shared memory exceeds the per-block limit" in TRIMUL.infeasible(unpaired, limits)
            assert [k.name for k in plan.kernels][0].endswith("_stats")
            assert [k.names for k in plan.kernels][1:] == [
                ("x", "mask", "w", "ar", "br", "stats", "B", "N", "num_tiles", "mask_is_float"),
                ("x", "z", "w", "out", "stats", "B", "N", "num_tiles")]
            default = TRIMUL.default_plan(widths, limits, precision)  # the default point for wide widths
            wide_passes = {"p_groups": 2, "p_wn": 128, "o_groups": 1, "o_wn": 128, "early_x_fetch": True,
                           "o_staged_stores": True, "z_registers": True, "paired_columns": True}
            assert default.strategy == "wgmma" and {k: default.params[k] for k in wide_passes} == wide_passes
            assert default.context["p_slices"] == 4 and default.context["o_slices"] == widths["P"] // 128
            assert [k.name for k in default.kernels][0].endswith("_stats")
            defaults.append(default)
    plans = [TRIMUL.plan("wgmma", SLICED, w, "bfloat16") for w in (WIDE, SQUARE_256)]
    assert_compiled_without_spills(plans + defaults, asynchronous=plans + defaults[::2])
    reasons = lambda params, widths=MODEL: TRIMUL.infeasible(TRIMUL.plan("wgmma", params, widths, "bfloat16"), limits)
    named = {**SLICED, "p_slices": 4, "o_slices": 4}
    assert not reasons(named)
    why = ("column slices are whole passes of the paired kernels (a sliced projection with x in shared memory, "
           "a sliced output with the gate on P)")
    assert why in reasons({**named, "o_slices": 0}, SEED)   # 4H = 128: not 4 slices of 64-column passes
    assert why in reasons({**named, "paired_columns": False, "consts_smem": False})
    assert why in reasons({**named, "x_registers": True})
    assert why in reasons({**named, "p_slices": 0}, {**MODEL, "gate_hidden": 1})
    assert "x in registers is for P up to 128" in reasons({**SLICED, "x_registers": True}, WIDE)
    assert TRIMUL.plan("wgmma", SLICED, MODEL, "bfloat16").context["p_slices"] == 1
    unsliced = codegen.render_plan(TRIMUL.default_plan(MODEL, limits, "bfloat16")).source
    assert "_stats(" not in unsliced.replace("row_stats(", "") and "SLICES" not in unsliced and "__ldg(stats" not in unsliced


#: The projection with Wp in registers (its products' operands swapped), beside the first
#: default's output kernel.
W_REGISTERS = {**next(p for s, p in TRIMUL.default_points if s == "wgmma"), "x_registers": False,
               "w_registers": True, "p_groups": 2, "p_stages": 2, "p_mask_early": False, **REGISTER_VARIANTS_OFF}


@pytest.mark.slow  # (about 7 s of NVRTC; no tuned entry runs Wp in registers, its emulated cases stay fast)
def test_weights_in_registers_swap_the_projections_operands_and_compile_without_spills():
    """w_registers: each of the projection's 2 warpgroups holds its half of Wp's 64-row blocks as A
    fragments in registers, and the block's warpgroups share each x tile (B): the kernel's shared
    memory is two x tiles and the pairs' statistics, its blocks take whole tiles, its arguments are
    the projection's. At wide widths each block holds a slice of the row blocks (the fewest whose
    fragments fit: 2 at P = 256 or H = 256, 4 at P = 384, H = 128 and P = H = 256), with the rows'
    statistics from their kernel. It compiles for the models' widths, the wide ones and small ones
    without spills and with its products asynchronous; where the fragments do not fit beside the
    accumulators (4 warpgroups, P = 768), or the row blocks do not share evenly, or with one x stage,
    unpaired or with x in registers, the restriction says so; the points without it render no trace
    of it."""
    from pairgen.ops.trimul.common import PROJECT_ARGS
    from pairgen.ops.trimul.strategies.wgmma import w_registers_fragments

    limits = DeviceLimits()
    plans = []
    for precision in ("bfloat16", "float16"):
        for widths, params in ((MODEL, W_REGISTERS), ({**MODEL, "outgoing": 0, "H": 64}, {**W_REGISTERS, "p_groups": 1}),
                               (ODD, {**W_REGISTERS, "swizzle": False, "o_wn": 16, "o_groups": 2})):
            widths = {**widths, "H": 32} if widths is ODD else widths   # H a multiple of 16
            plan = TRIMUL.plan("wgmma", params, widths, precision)
            assert not TRIMUL.infeasible(plan, limits), (widths, params, TRIMUL.infeasible(plan, limits))
            project = plan.kernels[0]
            x_tile = 64 * k_padded(widths["P"]) * 2
            assert project.threads == 128 * params["p_groups"] and project.args == PROJECT_ARGS
            assert project.smem_bytes == 2 * x_tile + 1024
            blocks, _ = project.grid(1, 512, 132, 1)
            assert blocks == 132 and project.grid(1, 8, 132, 1)[0] == 1   # whole tiles a block
            plans.append(plan)
    wide_output = {"o_groups": 2, "o_wn": 32}
    for widths, slices in ((WIDE, 4), (SQUARE_256, 4), ({**MODEL, "P": 256}, 2), ({**MODEL, "H": 256}, 2)):
        plan = TRIMUL.plan("wgmma", {**W_REGISTERS, **wide_output}, widths, "bfloat16")
        assert not TRIMUL.infeasible(plan, limits) and plan.context["p_slices"] == slices, (widths, plan.context)
        assert plan.kernels[0].name.endswith("_stats") and "stats" in plan.kernels[1].names
        assert plan.kernels[1].grid(1, 512, 132, 1)[0] == 132 // slices * slices
        plans.append(plan)
    assert w_registers_fragments(128, 128, 2) == 128 and w_registers_fragments(128, 64, 1) == 128
    assert w_registers_fragments(384, 128, 2, 4) == 96
    # fp16 differs from bf16 in its element type only: compiled at the models' widths, planned at all
    assert_compiled_without_spills(plans[:4] + plans[6:], asynchronous=plans[:1])
    reasons = lambda params, widths=MODEL: TRIMUL.infeasible(TRIMUL.plan("wgmma", params, widths, "bfloat16"), limits)
    why = ("Wp in registers: paired columns, H / 16 row blocks shared evenly by at most 2 warpgroups and the slices, "
           "their fragments at most 128 registers a thread, two x stages, not with x in registers")
    assert why in reasons({**W_REGISTERS, "paired_columns": False, "z_registers": False})
    assert why in reasons({**W_REGISTERS, "p_groups": 4})
    one_group = TRIMUL.plan("wgmma", {**W_REGISTERS, "p_groups": 1}, MODEL, "bfloat16")   # 256 fragment registers
    assert not TRIMUL.infeasible(one_group, limits) and one_group.context["p_slices"] == 2   # ... in 2 slices
    assert why in reasons({**W_REGISTERS, "p_stages": 1})
    assert why in reasons({**W_REGISTERS, "x_registers": True})
    assert why in reasons({**W_REGISTERS, "p_slices": 2}, {**MODEL, "H": 32})   # 2 row blocks, 2 groups x 2 slices
    assert why in reasons(W_REGISTERS, {**WIDE, "P": 768})                  # 192 registers a row block
    assert why in reasons(W_REGISTERS, {**MODEL, "H": 24, "P": 48})          # H not a multiple of 16
    assert why in reasons({**W_REGISTERS, "p_groups": 3}, {**MODEL, "H": 32})   # 2 row blocks for 3 groups
    plain = codegen.render_plan(TRIMUL.default_plan(MODEL, limits, "bfloat16")).source
    assert "w_registers_epilogue" not in plain and "wgmma_rs_n64_first" not in plain


def test_the_output_kernels_x_in_registers_compiles_without_spills_where_it_is_allowed():
    """o_x_registers: the output kernel's x rows, like its triangle sums, as A fragments in registers
    (the gate product's operand; the rows' statistics from them; the tile refetched at once). It
    compiles for the models' widths (3 warpgroups, 16- and 32-bit outputs, beside Wp in registers
    too) and small ones without spills and with its products asynchronous; it needs the sums in
    registers, one x stage, at most 3 warpgroups and P up to 128; points without it render as
    before."""
    limits = DeviceLimits()
    first = {**next(p for s, p in TRIMUL.default_points if s == "wgmma"), **REGISTER_VARIANTS_OFF}
    point = {**first, "o_x_registers": True}
    plans = [TRIMUL.plan("wgmma", params, widths, precision)
             for precision in ("bfloat16", "float16")
             for params, widths in ((point, MODEL), ({**W_REGISTERS, "o_x_registers": True}, MODEL),
                                    ({**point, "swizzle": False, "o_wn": 16}, {**SEED, "gate_normalized": 1}))]
    for plan in plans:
        assert not TRIMUL.infeasible(plan, limits), (plan.label, TRIMUL.infeasible(plan, limits))
    # fp16 differs from bf16 in its element type only: compiled at the models' widths, planned at all
    assert_compiled_without_spills(plans[:4], asynchronous=plans[:1])
    reasons = lambda params, widths=MODEL: TRIMUL.infeasible(TRIMUL.plan("wgmma", params, widths, "bfloat16"), limits)
    why = ("the output's x in registers goes with its sums in registers, one x stage, P up to 128, at most 3 warpgroups "
           "(2 with 128-column passes)")
    assert why in reasons({**point, "o_wn": 128})
    assert why in reasons({**point, "z_registers": False})
    assert why in reasons({**point, "o_stages": 2})
    assert why in reasons({**point, "o_groups": 4, "o_wn": 32})
    assert why in reasons(point, WIDE)
    assert not reasons(point, {**MODEL, "out_fp32": 1})
    plain = codegen.render_plan(TRIMUL.plan("wgmma", first, MODEL, "bfloat16")).source
    assert "(x in registers)" not in plain and "fragment_row_stats<P>(xa, xmean" not in plain


def test_calls_past_the_paired_offsets_run_the_same_point_unpaired():
    """Paired columns keep a warp's offset into a and b in 16-byte units in 32 bits: a call with
    B*H*N*N >= 2^34 elements there runs the same point unpaired (64-bit store offsets), one below
    it the paired plan itself; unpaired plans are never swapped."""
    from pairgen.ops.trimul.strategies.wgmma import PAIRED_MAX_AB_ELEMENTS, for_call

    paired = TRIMUL.plan("wgmma", {"p_groups": 4, "p_stages": 1, "p_wn": 64, "o_groups": 3, "o_wn": 64,
                                   "o_stages": 1, "swizzle": True, "consts_smem": True, "paired_columns": True,
                                   "early_x_fetch": True}, MODEL, "bfloat16")
    H = MODEL["H"]
    assert PAIRED_MAX_AB_ELEMENTS == 2**34
    assert for_call(TRIMUL, paired, 1, 11585) is None          # 128 * 11585^2 < 2^34
    instead = for_call(TRIMUL, paired, 1, 11586)               # 128 * 11586^2 >= 2^34
    assert instead is not None and H * 11586**2 >= 2**34 > H * 11585**2
    assert instead.params == {**paired.params, "paired_columns": False}
    assert instead.widths == paired.widths and instead.precision == "bfloat16"
    assert not TRIMUL.infeasible(instead, DeviceLimits())
    assert for_call(TRIMUL, paired, 2, 8192) is not None       # B counts: 2 * 128 * 8192^2 = 2^34
    # x in registers is the paired projection's: it falls back with the pairing, to a feasible plan
    in_registers = TRIMUL.plan("wgmma", {**paired.params, "early_x_fetch": False, "x_registers": True, "p_wn": 32},
                               MODEL, "bfloat16")
    assert not TRIMUL.infeasible(in_registers, DeviceLimits())
    instead = for_call(TRIMUL, in_registers, 1, 11586)
    assert instead.params == {**in_registers.params, "paired_columns": False, "x_registers": False}
    assert not TRIMUL.infeasible(instead, DeviceLimits())
    unpaired = TRIMUL.plan("wgmma", instead.params, MODEL, "bfloat16")
    assert for_call(TRIMUL, unpaired, 4, 16384) is None
    # so are Wp and the output's x in registers: the projection falls back to resident weights
    swapped = TRIMUL.plan("wgmma", {**W_REGISTERS, "o_x_registers": True}, MODEL, "bfloat16")
    instead = for_call(TRIMUL, swapped, 1, 11586)
    assert not instead.params["w_registers"] and not instead.params["o_x_registers"]
    assert not TRIMUL.infeasible(instead, DeviceLimits())


def test_restrictions_marked_on_point_read_only_the_point():
    """feasible_plans prunes by the on_point restrictions before building a plan (spec.PointProbe):
    on sampled points of every width kind, each such restriction answers the probe as it answers
    the built plan, and the pruned enumeration keeps exactly the feasible points."""
    from pairgen.spec import PointProbe

    limits = DeviceLimits()
    on_point = [r for r in TRIMUL.strategies["wgmma"].restrictions if r.on_point]
    assert len(on_point) >= 7
    rng = random.Random(11)
    space = TRIMUL.strategies["wgmma"].space
    draw = lambda: {name: rng.choice(values) for name, values in space.items()}  # noqa: E731
    for widths in (MODEL, {"P": 48, "H": 24, "outgoing": 0, "gate_normalized": 0, "bias": 1},
                   {"P": 128, "H": 64, "outgoing": 1, "gate_normalized": 1, "bias": 0, "gate_hidden": 1}):
        for params in (draw() for _ in range(300)):
            plan = TRIMUL.plan("wgmma", params, widths, "bfloat16")
            probe = PointProbe(plan.params, plan.widths)
            assert [r.holds(probe, limits) for r in on_point] == [r.holds(plan, limits) for r in on_point], params
    small = {"P": 48, "H": 24, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    kept_plans = TRIMUL.feasible_plans("wgmma", small, limits, "bfloat16")
    kept = {p.kernel_name for p in kept_plans}

    def flipped():  # a kept point with one parameter redrawn: feasible or not, near the boundary
        params = dict(rng.choice(kept_plans).params)
        name = rng.choice(sorted(space))
        params[name] = rng.choice(space[name])
        return params

    # (a uniform draw is rarely feasible in a space of 28 M points: half the draws are kept points' neighbours)
    subset = [TRIMUL.plan("wgmma", point, small, "bfloat16")
              for point in [draw() for _ in range(10000)] + [flipped() for _ in range(10000)]]
    feasible = {p.kernel_name for p in subset if not TRIMUL.infeasible(p, limits)}
    assert feasible and feasible == kept & {p.kernel_name for p in subset}
    assert any(TRIMUL.infeasible(p, limits) for p in subset[10000:])


@pytest.mark.parametrize("widths", [pytest.param(MODEL, marks=pytest.mark.slow), pytest.param(WIDE, marks=pytest.mark.slow),
                                    ODD], ids=["models", "wide", "odd"])
def test_the_pruned_enumeration_passes_exactly_the_points_each_on_point_restriction_passes(widths):
    """points_passing_on_point assigns the parameters one at a time and prunes a partial point a
    restriction already fails: a point drawn at random, or a passing point with one parameter
    redrawn (near the boundary: few uniform draws pass at the odd widths), passes every on_point
    restriction exactly when the enumeration yields it, and the enumeration keeps points()'s order.
    At the odd widths about 700 points pass; with --slow also the wide and the models' widths
    (about 160,000 and 130,000 points, 10-20 s each)."""
    limits = DeviceLimits()
    rng = random.Random(5)
    space = TRIMUL.strategies["wgmma"].space
    order = sorted(space)
    passing = list(TRIMUL.points_passing_on_point("wgmma", widths, limits))
    rank = lambda p: tuple(space[n].index(p[n]) for n in order)  # noqa: E731
    assert passing and [rank(p) for p in passing] == sorted(rank(p) for p in passing)
    keys = {tuple(p[n] for n in order) for p in passing}
    may_hold = TRIMUL._point_filter("wgmma", widths, limits)

    def neighbour():
        point = dict(rng.choice(passing))
        name = rng.choice(order)
        point[name] = rng.choice(space[name])
        return point

    drawn = [{name: rng.choice(values) for name, values in space.items()} for _ in range(4000)]
    drawn += [neighbour() for _ in range(4000)]
    verdicts = [may_hold(p) for p in drawn]
    assert any(verdicts) and not all(verdicts)
    assert all(verdict == (tuple(p[n] for n in order) in keys) for p, verdict in zip(drawn, verdicts))


def _fp32_output_plans() -> list:
    """Plans whose output kernels store in each of the template's three places: paired columns with
    the sums in registers, unpaired, and the gate in hidden width."""
    paired = TRIMUL.plan("wgmma", {"p_groups": 4, "p_stages": 1, "p_wn": 32, "o_groups": 3, "o_wn": 64, "o_stages": 1,
                                   "swizzle": True, "consts_smem": True, "paired_columns": True, "x_registers": True,
                                   "z_registers": True}, MODEL, "bfloat16")
    unpaired = TRIMUL.plan("wgmma", {**paired.params, "paired_columns": False, "x_registers": False,
                                     "z_registers": False}, MODEL, "float16")
    hidden = TRIMUL.plan("wgmma", {**unpaired.params, "consts_smem": False}, {**MODEL, "gate_hidden": 1}, "bfloat16")
    return [paired, unpaired, hidden]


def test_an_fp32_output_changes_only_the_output_kernels_stores_and_compiles():
    """for_call's fp32-output plan (out_fp32) differs from its tuned plan only where the output
    kernel declares and stores `out`, compiles for sm_90a without spills; the mma strategy refuses
    the option (its kernels store the operand type), and a call that wants none is left alone."""
    from pairgen.ops.trimul.strategies.wgmma import for_call

    plans, jobs = _fp32_output_plans(), []
    for plan in plans:
        assert for_call(TRIMUL, plan, 1, 64) is None
        wide = for_call(TRIMUL, plan, 1, 64, fp32_output=True)
        assert wide.widths == {**plan.widths, "out_fp32": 1} and wide.params == plan.params
        before, after = (codegen.render_plan(p).source.splitlines() for p in (plan, wide))
        changed = [(a, b) for a, b in zip(before, after) if a != b and not a.startswith("// widths")]
        assert len(before) == len(after) and 1 < len(changed) <= 4, changed
        for old, new in changed:  # the signature's out, or a store into out
            assert ("elem_t* __restrict__ out" in old and "float* __restrict__ out" in new) or (
                "reinterpret_cast<unsigned*>(out +" in old and "reinterpret_cast<float2*>(out +" in new) or (
                old.strip().startswith("pack2(") and new.strip().startswith("make_float2(")), (old, new)
        rendered = codegen.render_plan(wide)
        jobs.append((rendered.source, rendered.kernel_name, "sm_90"))
    with compiler.compile_pool(2) as pool:
        for plan, result in zip(plans, compiler.compile_many(jobs, pool)):
            assert not isinstance(result, Exception), f"{plan.label}: {result}"
            assert result.spill_bytes == 0, f"{plan.label}: {result.summary()}"
    mma = TRIMUL.feasible_plans("mma", MODEL, DeviceLimits(), "bfloat16")[0]
    refused = TRIMUL.plan("mma", mma.params, {**MODEL, "out_fp32": 1}, "bfloat16")
    assert "an fp32 output (out_fp32) is the wgmma strategy's" in TRIMUL.infeasible(refused, DeviceLimits())


def test_an_fp32_input_is_read_by_the_projections_that_hold_x_in_registers_and_compiles(monkeypatch):
    """for_call's fp32-input plan (x_fp32, a call under autocast): the projection with x in
    registers reads x in fp32 and writes the rounded copy (`xh`) the output kernel reads, alone or
    with an fp32 output; its products stay asynchronous, without spills. Other points (x in shared
    memory, Wp in registers) leave the cast to the caller (a sliced point's statistics kernel rounds
    x instead: the test below), and the output kernel is the tuned plan's."""
    from pairgen.ops.trimul.strategies import wgmma
    from pairgen.ops.trimul.strategies.wgmma import for_call

    assert for_call(TRIMUL, _fp32_output_plans()[0], 1, 64, fp32_input=True) is None  # off by default
    monkeypatch.setattr(wgmma, "READ_FP32_X", True)
    paired, unpaired, hidden = _fp32_output_plans()
    first_default = TRIMUL.default_plan(MODEL, DeviceLimits(), "bfloat16")
    swapped = TRIMUL.plan("wgmma", W_REGISTERS, MODEL, "bfloat16")
    for plan in (unpaired, hidden, swapped):
        assert for_call(TRIMUL, plan, 1, 64, fp32_input=True) is None, plan.label
    reading = []
    for plan in (paired, first_default):
        derived = for_call(TRIMUL, plan, 1, 64, fp32_input=True)
        assert derived.widths == {**plan.widths, "x_fp32": 1} and derived.params == plan.params
        projection, output = derived.kernels
        assert projection.args == (*plan.kernels[0].args[:5], "ptr xh", *plan.kernels[0].args[5:])
        assert output.args == plan.kernels[1].args
        source = codegen.render_plan(derived).source
        assert "x32_step(xv, pass," in source and "const float* __restrict__ x, const void* __restrict__ mask" in source
        reading.append(derived)
    both = for_call(TRIMUL, first_default, 1, 64, fp32_output=True, fp32_input=True)
    assert both.widths == {**first_default.widths, "x_fp32": 1, "out_fp32": 1}
    assert_compiled_without_spills([both], asynchronous=[both])  # (the tuned entries' point, fp32 in and out)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_sliced_points_statistics_kernel_rounds_an_fp32_x_and_compiles(precision):
    """stats_cast: a sliced point (its rows' statistics kernel first) given an fp32 x (a call under
    autocast) has that kernel read x in fp32 and write the rounded rows (`xh`) the projection and the
    output kernel read as their x: no cast before the kernels, whatever READ_FP32_X says (it is the
    projection's switch). The two other kernels are the tuned plan's, bit for bit in their source;
    the point without an fp32 x renders no trace of it; both compile without spills."""
    from pairgen.ops.trimul.strategies.wgmma import for_call

    sliced = TRIMUL.plan("wgmma", SLICED, WIDE, precision)
    assert sliced.context["p_slices"] > 1 or sliced.context["o_slices"] > 1
    derived = for_call(TRIMUL, sliced, 1, 64, fp32_input=True)
    assert derived.widths == {**sliced.widths, "x_fp32": 1} and derived.params == sliced.params
    statistics, projection, output = derived.kernels
    assert statistics.args == ("ptr x", "ptr stats", "ptr xh", "i32 B", "i32 N", "i32 num_tiles")
    assert (projection.args, output.args) == (sliced.kernels[1].args, sliced.kernels[2].args)
    source, before = codegen.render_plan(derived).source, codegen.render_plan(sliced).source
    assert "_stats(const float* __restrict__ x, float* __restrict__ stats, elem_t* __restrict__ xh," in source
    assert "_stats(const elem_t* __restrict__ x, float* __restrict__ stats, int B" in before and "xh" not in before
    assert "x32_step" not in source  # the projection reads the rounded rows, as without an fp32 x
    both = for_call(TRIMUL, sliced, 1, 64, fp32_output=True, fp32_input=True)
    assert both.widths == {**sliced.widths, "x_fp32": 1, "out_fp32": 1}
    assert_compiled_without_spills([derived, both], asynchronous=[])


def test_a_call_derives_its_fp32_output_variant_once(monkeypatch):
    """variant_for_call plans and builds the variant a call runs instead (an fp32 output, unpaired
    past the offsets) once per tuned variant, not on every call (a plan costs host time); a call
    that wants neither runs the tuned variant itself."""
    from pairgen import runtime
    from pairgen.ops.trimul.strategies import wgmma

    built = []
    monkeypatch.setattr(runtime, "variant_of", lambda plan, index: built.append(plan) or object())

    class Tuned:  # a stand-in of runtime.Variant: its plan is what the derivation reads
        plan = _fp32_output_plans()[0]

    tuned = Tuned()
    assert wgmma.variant_for_call(TRIMUL, tuned, 1, 64, False, 0) is tuned
    first = wgmma.variant_for_call(TRIMUL, tuned, 1, 64, True, 0)
    assert wgmma.variant_for_call(TRIMUL, tuned, 2, 96, True, 0) is first
    assert [plan.widths.get("out_fp32") for plan in built] == [1]
    unpaired = wgmma.variant_for_call(TRIMUL, tuned, 1, 11586, True, 0)   # past 2^34 elements of a and b
    assert unpaired is not first and built[-1].params["paired_columns"] is False and len(built) == 2
    assert wgmma.variant_for_call(TRIMUL, tuned, 1, 64, True, 0, True) is first  # x_fp32 off: the cast
    monkeypatch.setattr(wgmma, "READ_FP32_X", True)
    reading = wgmma.variant_for_call(TRIMUL, tuned, 1, 64, True, 0, True)  # an fp32 x too
    assert wgmma.variant_for_call(TRIMUL, tuned, 2, 96, True, 0, True) is reading is not first
    assert built[-1].widths["x_fp32"] == 1 and len(built) == 3
    # past the offsets the unpaired point has x in shared memory: it reads the cast x, as before
    assert wgmma.variant_for_call(TRIMUL, tuned, 1, 11586, True, 0, True) is not reading
    assert not built[-1].widths.get("x_fp32") and len(built) == 4


def test_normalized_operands_compile_without_spills_and_go_with_their_registers():
    """p_normalized_x, o_normalized: the projection's x and the output's sums and x normalised in
    registers before the products (c2 through a bias k-step, the weights behind a half halved once
    per block). The first default has both: it and small points compile without spills and with
    their products asynchronous, in both 16-bit types and with a 32-bit output; each needs its
    kernel's operands in registers, unsliced (the output's also the gate on P); their bias tiles
    (16 k a column) are the shared memory they add; points without them render no trace of them."""
    limits = DeviceLimits()
    first = next(p for s, p in TRIMUL.default_points if s == "wgmma")
    assert first["p_normalized_x"] and first["o_normalized"]
    small = {"p_groups": 2, "p_stages": 1, "p_wn": 32, "o_groups": 2, "o_wn": 16, "o_stages": 1, "swizzle": False,
             "consts_smem": True, "paired_columns": True, "x_registers": True, "z_registers": True,
             "o_x_registers": True, "p_normalized_x": True, "o_normalized": True}
    plans = [TRIMUL.plan("wgmma", params, widths, precision)
             for params, widths, precision in ((first, MODEL, "bfloat16"), (first, MODEL, "float16"),
                                               (first, {**MODEL, "out_fp32": 1}, "bfloat16"),
                                               (small, {**ODD, "H": 16}, "bfloat16"), (small, {**SEED, "H": 16}, "float16"))]
    for plan in plans:
        assert not TRIMUL.infeasible(plan, limits), (plan.label, TRIMUL.infeasible(plan, limits))
    assert_compiled_without_spills(plans, asynchronous=plans[:1])
    without = TRIMUL.plan("wgmma", {**first, "p_normalized_x": False, "o_normalized": False}, MODEL, "bfloat16")
    assert plans[0].context["p_smem"] - without.context["p_smem"] == 4 * 128 * 16 * 2
    assert plans[0].context["o_smem"] - without.context["o_smem"] == 2 * 128 * 16 * 2
    reasons = lambda params, widths=MODEL: TRIMUL.infeasible(TRIMUL.plan("wgmma", params, widths, "bfloat16"), limits)
    projection = "x normalised in registers is a variant of x in registers, unsliced"
    output = "the output's operands normalised in registers are a variant of its x in registers, unsliced, gate on P"
    assert projection in reasons({**first, "x_registers": False, "o_normalized": False})
    assert output in reasons({**first, "o_x_registers": False, "p_normalized_x": False})
    assert output in reasons({**small, "o_slices": 2, "p_normalized_x": False}, SEED)
    assert output in reasons({**first, "p_normalized_x": False}, {**MODEL, "H": 64, "gate_hidden": 1})
    plain = codegen.render_plan(without).source
    assert "normalize_fragments" not in plain and "BIAS_KC" not in plain and "halve_chunk" not in plain


def test_staged_output_stores_compile_without_spills_and_go_with_the_sums_in_registers():
    """o_staged_stores: the paired output kernel (sums in registers) writes 16-bit rows through a
    per-warp staging of 16 rows x 24 elements, 16 bytes a lane. It compiles with the first default,
    the sums alone at 4 warpgroups and a small sliced point without spills; it needs the sums in
    registers; an fp32 output (whole sectors already) renders and plans without the staging."""
    limits = DeviceLimits()
    first = next(p for s, p in TRIMUL.default_points if s == "wgmma")
    alone = {**first, "p_normalized_x": False, "o_normalized": False, "o_x_registers": False, "o_groups": 4, "o_wn": 32}
    small = {"p_groups": 2, "p_stages": 1, "p_wn": 32, "o_groups": 2, "o_wn": 16, "o_stages": 1, "swizzle": False,
             "consts_smem": True, "paired_columns": True, "z_registers": True, "o_slices": 2}
    plans = [TRIMUL.plan("wgmma", {**params, "o_staged_stores": True}, widths, precision)
             for params, widths, precision in ((first, MODEL, "bfloat16"), (alone, {**MODEL, "outgoing": 0}, "float16"),
                                               (small, SEED, "bfloat16"))]
    for plan in plans:
        assert not TRIMUL.infeasible(plan, limits), (plan.label, TRIMUL.infeasible(plan, limits))
    assert_compiled_without_spills(plans, asynchronous=plans[:1])
    staged, plain = (TRIMUL.plan("wgmma", {**first, "o_staged_stores": on}, MODEL, "bfloat16") for on in (True, False))
    assert staged.context["o_smem"] - plain.context["o_smem"] == first["o_groups"] * 4 * 16 * 24 * 2  # (3 KB a group)
    assert "store_output_rows" in codegen.render_plan(staged).source
    assert "store_output_rows" not in codegen.render_plan(plain).source
    fp32 = TRIMUL.plan("wgmma", {**first, "o_staged_stores": True}, {**MODEL, "out_fp32": 1}, "bfloat16")
    assert fp32.context["o_smem"] == TRIMUL.plan("wgmma", first, {**MODEL, "out_fp32": 1}, "bfloat16").context["o_smem"]
    assert "store_output_rows" not in codegen.render_plan(fp32).source
    why = "the output's staged stores are a variant of its sums in registers"
    assert why in TRIMUL.infeasible(TRIMUL.plan("wgmma", {**small, "z_registers": False, "o_staged_stores": True}, SEED,
                                                "bfloat16"), limits)


def test_unrolled_copies_render_only_where_on_and_apply_where_the_rows_unroll():
    """o_unrolled_fetch: the output kernel's tile copies at constant offsets a thread (the
    projection's keep their loop). A point without it renders no trace of it (its kernels as tuned
    before); it is refused where it would change nothing: x rows whose 16-byte chunks and 16 do not
    divide one another (P = 48: 6 chunks). The first default point has it
    (test_default_points_keep_their_products_asynchronous compiles it), beside Wp in registers too."""
    limits = DeviceLimits()
    first = next(p for s, p in TRIMUL.default_points if s == "wgmma")
    assert first["o_unrolled_fetch"]
    off = {**first, "o_unrolled_fetch": False}
    assert "fetch_rows<" not in codegen.render_plan(TRIMUL.plan("wgmma", off, MODEL, "bfloat16")).source
    source = codegen.render_plan(TRIMUL.plan("wgmma", first, MODEL, "bfloat16")).source
    # the output kernel's copies ask for the unrolled path; the projection's take the default, the loop
    assert "fetch_rows<" in source and "bool UNROLLED = false>" in source
    assert "X_SWZ, true>" in source.split("// ================================== output")[1]
    assert "fetch_tile<XC, XC_DATA, X_SWZ>(" in source.split("// ================================== output")[0]
    why = "the unrolled copies are for unpadded x rows of 16-byte chunks that 16 divides or that divide 16"
    reasons = lambda params, widths=MODEL: TRIMUL.infeasible(TRIMUL.plan("wgmma", params, widths, "bfloat16"), limits)
    assert why in reasons(first, ODD)       # P = 48
    assert why not in reasons({**W_REGISTERS, "o_unrolled_fetch": True})
