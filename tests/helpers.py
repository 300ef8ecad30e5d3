"""Shared test data and checks: sampled search-space points, shapes, inputs (the standard of docs/ops.md);
the GPU tests' compiled variants, cached float64 references and launches; copy and pickle."""
from __future__ import annotations

import contextlib
import copy
import ctypes
import io
import os
import random
from operator import attrgetter

import pytest
import torch

from pairgen import codegen, compiler, config, runtime
from pairgen.tuning.check import compare, reference64
from pairgen.tuning.evaluate import inputs_in_precision, module_in_precision
from pairgen.spec import MMA_KINDS, DeviceLimits
from pairgen.tuned import TunedDB

#: cuLaunchKernel's signature, for ctypes stand-ins of the driver in the fast-call tests.
CU_LAUNCH_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                                    ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)

SEED_WIDTHS = {"P": 64, "H": 32}
REAL_WIDTHS = ({"P": 128, "H": 128}, {"P": 128, "H": 64})
ODD_SHAPES = [(b, n) for n in (1, 7, 37, 64, 123) for b in (1, 3)]


def stand_in_gpu_for_tuning(monkeypatch, info, evaluator_class) -> None:
    """pairgen-tune on the CPU: a GPU described by `info` (runtime.DeviceInfo), evaluator_class in
    place of the GPU evaluator, no compile pool."""
    from pairgen.tuning import evaluate, tune_cli

    monkeypatch.setattr(tune_cli, "gpu_missing", lambda what: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(runtime, "device_info", lambda index=0: info)
    monkeypatch.setattr(evaluate, "GpuEvaluator", evaluator_class)
    monkeypatch.setattr(compiler, "compile_pool", lambda workers=None: contextlib.nullcontext())


def gpu_params(build) -> list:
    """The pytest params build() makes, where torch sees a GPU; elsewhere one placeholder, which the
    gpu marker skips. GPU test modules build their case lists through this: sampling and enumerating
    search spaces costs seconds that a machine without a GPU would spend only to skip the cases."""
    if torch.cuda.is_available():
        return build()
    return [pytest.param(None, id="no-gpu")]


_feasible_plans: dict = {}


def feasible_plans(spec, strategy: str, widths: dict, limits=DeviceLimits()) -> list:
    """spec.feasible_plans (an OpSpec, or a view in its precision), enumerated once per process
    for the same arguments: a space holds thousands of points, each made into a plan, and several
    tests read the same widths' plans (they only read them: a test that changes a plan makes its own)."""
    key = (spec.name, spec.precision, strategy, tuple(sorted(widths.items())), limits)
    if key not in _feasible_plans:
        _feasible_plans[key] = spec.feasible_plans(strategy, widths, limits)
    return list(_feasible_plans[key])


def sampled_plans(spec, strategy: str, widths: dict, k: int, seed: int = 0, limits=DeviceLimits()):
    """k feasible points of a strategy (a fixed random sample, defaults first)."""
    return spec.sample_plans(strategy, widths, k, random.Random(f"{seed}-{strategy}-{sorted(widths.items())}"), limits)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gradient_errors64(call, module, inputs: tuple, g: torch.Tensor) -> dict[str, float]:
    """Relative L2 error, per floating input and parameter, of the gradients `call` (the module, or
    a compiled form of it) gives for the loss (out * g).sum(), against float64 autograd of the
    reference on the same weights, inputs and upstream gradient (the gradient standard)."""
    module.zero_grad(set_to_none=True)
    leaves = [t.clone().requires_grad_() if t.dtype.is_floating_point else t for t in inputs]
    (call(*leaves) * g).sum().backward()
    reference = module.op.make_reference(module).double()
    leaves64 = [t.detach().double().requires_grad_() if t.dtype.is_floating_point else t for t in inputs]
    (reference(*leaves64) * g.double()).sum().backward()
    named = [(f"input {k}", a.grad, b.grad) for k, (a, b) in enumerate(zip(leaves, leaves64)) if a.dtype.is_floating_point]
    named += [(name, p.grad, q.grad) for (name, p), q in zip(module.named_parameters(), reference.parameters())]
    errors = {}
    for name, grad, grad64 in named:
        assert grad is not None, f"no gradient for {name}"
        errors[name] = ((grad.double() - grad64).norm() / grad64.norm().clamp_min(1e-300)).item()
    return errors


def assert_16_bit_gradients_meet_the_standard(module, inputs: tuple, g: torch.Tensor, ours: list,
                                              unwanted: tuple = ()) -> None:
    """The 16-bit gradient standard: each of `ours` (the gradients of the floating inputs, then of
    every parameter, of the loss (out * g).sum() for a 16-bit module) within relative L2
    max(2e-2, 1.5x the error of the PyTorch reference run in the same dtype) of float64 autograd.
    unwanted: the names ("input 1", ...) whose gradient nobody asked for, which must be None."""
    def grads(net, ins, g_in):
        leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in ins]
        (net(*leaves) * g_in).sum().backward()
        return [leaf.grad for leaf in leaves if leaf.is_floating_point()] + [p.grad for p in net.parameters()]

    spec = module.op
    exact = grads(spec.make_reference(module).double(), [t.double() if t.is_floating_point() else t for t in inputs],
                  g.double())
    same_dtype = grads(spec.make_reference(module).to(g.dtype), inputs, g)
    names = [f"input {k}" for k, t in enumerate(inputs) if t.is_floating_point()] + [n for n, _ in module.named_parameters()]
    assert len(ours) == len(names) == len(exact)
    for name, mine, theirs, e in zip(names, ours, same_dtype, exact):
        if name in unwanted:
            assert mine is None, f"{name}: a gradient nobody asked for"
            continue
        assert mine is not None and mine.dtype is g.dtype, f"gradient of {name}: {mine if mine is None else mine.dtype}"
        err, ref_err = ((mine.double() - e).norm() / e.norm()).item(), ((theirs.double() - e).norm() / e.norm()).item()
        assert err <= max(2e-2, 1.5 * ref_err), f"gradient of {name}: {err} (the {g.dtype} reference: {ref_err})"


def assert_emulated_16_bit_step_meets_the_standard(seed: int, N: int, watched: tuple, patches: tuple = ()) -> list:
    """A bf16 triangle update in the models' form, its closed-form gradients computed with every
    kernel on the CPU emulator (the fused kernels and the training projection kernels on, and
    `patches`: (object, name, value) each), within the 16-bit standard (a bool mask: no gradient).
    watched = (object, name): a function whose calls are recorded and returned, so that the caller
    can check its kernel ran."""
    from unittest import mock

    from emulator import emulated
    from pairgen.ops.trimul import TRIMUL, fused_backward
    from pairgen.ops.trimul.strategies import wgmma

    widths = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    gen = generator(seed)
    module = TRIMUL.make_module(widths, gen).bfloat16()
    x, mask = TRIMUL.make_inputs({"B": 1, "N": N, **widths}, gen, "cauchy")
    x, g = x.bfloat16(), torch.randn(x.shape, generator=gen).bfloat16()
    owner, name = watched
    calls, real = [], getattr(owner, name)
    with contextlib.ExitStack() as stack:
        stack.enter_context(emulated())
        for target, attribute, value in ((fused_backward, "enabled", lambda t: True),
                                         (wgmma, "TRAINING_PROJECTION_KERNELS", True), *patches):
            stack.enter_context(mock.patch.object(target, attribute, value))
        stack.enter_context(mock.patch.object(owner, name, lambda *a: calls.append(a) or real(*a)))
        ours = module.analytic_gradients([x, mask], [p.detach() for p in module.parameters()], g)
    assert ours[1] is None  # a bool mask has no gradient
    assert_16_bit_gradients_meet_the_standard(module, (x, mask), g, [ours[0], *ours[2:]])
    return calls


def closed_form_paths(module, run) -> list[str]:
    """Which closed-form backwards run() took through the module, in order: "saved" (the forward
    kept its intermediates: SavedClosedForm) or "recomputed" (the kernel forward, then the closed
    form from the inputs); a recomputation of the reference adds nothing."""
    used = []
    recomputed, saved = module.analytic_gradients, module.saved_gradients
    module.analytic_gradients = lambda *args, **kw: used.append("recomputed") or recomputed(*args, **kw)
    if saved is not None:
        module.saved_gradients = lambda *args, **kw: used.append("saved") or saved(*args, **kw)
    try:
        run()
    finally:
        del module.analytic_gradients
        if saved is not None:
            del module.saved_gradients
    return used


def assert_closed_form_meets_the_standard(module, inputs: tuple, grad_out: torch.Tensor, bound: float = 2e-5) -> None:
    """A training step through the module takes the closed-form backward its settings ask for
    (saved intermediates where the op keeps them, unless module.recompute_for_backward; else the
    kernel forward and the closed form from the inputs), not a recomputation of the reference,
    and every gradient is within `bound` (relative L2) of float64 autograd: the fp32 gradient
    standard by default."""
    errors = {}
    used = closed_form_paths(module, lambda: errors.update(gradient_errors64(module, module, inputs, grad_out)))
    saves = module.saving_forward is not None and not module.recompute_for_backward
    assert used == ["saved" if saves else "recomputed"], f"the closed form asked for, not {used}"
    worst = max(errors, key=errors.get)
    assert errors[worst] <= bound, f"gradient of {worst}: {errors}"


def closed_form_errors(module, inputs: tuple, grad_out: torch.Tensor) -> dict[str, float]:
    """Relative L2 error of each gradient module.analytic_gradients gives (inputs it has one for:
    "input 0", ...; every parameter by name) against float64 autograd of the reference on the same
    weights, inputs and upstream gradient."""
    names = [name for name, _ in module.named_parameters()]
    ours = module.analytic_gradients(list(inputs), [p.detach() for p in module.parameters()], grad_out)
    assert ours is not None and ours[0] is not None, "no closed form for this call"
    assert len(ours) == len(inputs) + len(names)
    # A custom operator may return no tensor that aliases another return or an input.
    storages = [g.untyped_storage().data_ptr() for g in ours if g is not None]
    held = {t.untyped_storage().data_ptr() for t in (*inputs, grad_out)}
    assert len(set(storages)) == len(storages) and not held & set(storages), "gradients that alias"
    reference = module.op.make_reference(module).double()
    leaves = [t.double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    (reference(*leaves) * grad_out.double()).sum().backward()
    pairs = [(f"input {k}", g, leaf.grad) for k, (g, leaf) in enumerate(zip(ours, leaves)) if g is not None]
    pairs += [(name, g, p.grad) for name, g, p in zip(names, ours[len(inputs):], reference.parameters())]
    return {name: ((g.double() - e).norm() / e.norm()).item() for name, g, e in pairs}


def sampled_cases(spec, widths_list, k: int, label=None) -> list:
    """pytest params of k sampled plans of every strategy for each widths dict, with ids
    "<label(widths)>-<plan.label>" (label defaults to P..H.. from the widths)."""
    label = label or "P{P}H{H}".format_map
    return [pytest.param(plan, id=f"{label(widths)}-{plan.label}")
            for widths in widths_list
            for strategy in spec.strategies
            for plan in sampled_plans(spec, strategy, widths, k)]


def feasible_defaults(spec, strategy: str, widths: dict, precision: str, limits=DeviceLimits()) -> list:
    """The op's default points of `strategy` at these widths in `precision` that pass the
    restrictions, in the order the defaults are tried."""
    plans = (spec.plan(strategy, params, widths, precision) for s, params in spec.default_points if s == strategy)
    return [plan for plan in plans if not spec.infeasible(plan, limits)]


def switching_defaults(defaults: list) -> list:
    """Of an op's default plans of one strategy, in order: the first, and each later one that sets
    a switch as no earlier one does. A switch is a boolean parameter's value, or whether a count is
    0 (a count of 0 turns its feature off: no staged rows, no grouped LayerNorm lanes, one block per
    tile); the defaults left out differ from those kept in their tile and thread counts alone."""
    def switches(plan) -> set:
        return {(name, bool(value)) for name, value in plan.params.items() if isinstance(value, int)}

    kept, seen = [], set()
    for plan in defaults:
        if not kept or switches(plan) - seen:
            kept.append(plan)
            seen |= switches(plan)
    return kept


def assert_tensor_core_defaults_compile(spec, strategy: str, widths_list: list, arch: str, min_defaults: int,
                                        every_pair: bool = False) -> None:
    """The first feasible default of `strategy` compiles for `arch` without spills, and a sampled
    point compiles: for every (widths, tensor-core precision) pair with every_pair (a slow test);
    else for each precision at the first widths and each widths at one precision in turn (a widths'
    shared-memory and register budget and a precision's operand type are what make a kernel fail)."""
    limits = DeviceLimits(arch=arch)
    kinds = list(MMA_KINDS)
    pairs = [(w, p) for w in range(len(widths_list)) for p in range(len(kinds))
             if every_pair or w == 0 or p == w % len(kinds)]
    plans = []
    for w, p in pairs:
        widths, precision = widths_list[w], kinds[p]
        plans += [(plan, True) for plan in feasible_defaults(spec, strategy, widths, precision, limits)[:1]]
        if (w + p) % len(widths_list) == 0:
            plans += [(plan, False) for plan in sampled_plans(spec.at(precision), strategy, widths, 1, seed=9)[-1:]]
    assert len([plan for plan, default in plans if default]) >= min_defaults
    rendered = [codegen.render_plan(plan) for plan, _ in plans]
    results = compiler.compile_many([(r.source, r.kernel_name, arch) for r in rendered])
    for (plan, default), result in zip(plans, results):
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        if default:
            assert (result.spill_bytes, result.stack_bytes) == (0, 0), f"{plan.label} {plan.widths}: {result.summary()}"


#: Cases a compile process of compile_plans takes at least (fewer processes than that for a short list).
CASES_PER_COMPILE_PROCESS = 16


def compile_plans(plans) -> dict:
    """Every plan rendered and compiled in parallel once: {id(plan): Variant, or the exception
    its compilation raised}. A long list (a GPU file's cases) takes up to half the machine's cores
    whatever the xdist worker's share: on a cold NVRTC cache that one fixture is otherwise the
    suite's longest chain, compiling on one process while the other workers sit idle."""
    rendered = [codegen.render_plan(p) for p in plans]
    arch = runtime.default_arch()
    jobs = [(r.source, r.kernel_name, arch) for r in rendered]
    processes = min(len(plans) // CASES_PER_COMPILE_PROCESS, (os.cpu_count() or 1) // 2)
    if processes > config.compile_workers():
        with compiler.compile_pool(processes) as pool:
            results = compiler.compile_many(jobs, pool)
    else:
        results = compiler.compile_many(jobs)
    return {id(plan): res if isinstance(res, Exception) else runtime.Variant(plan, rend, res)
            for plan, rend, res in zip(plans, rendered, results)}


def compiled_cases(cases: list):
    """A module-scoped fixture: compile_plans over the plans of pytest params `cases` that a
    selected test takes (a run narrowed by -k compiles only its own cases: every case of a GPU
    file is hundreds of compiles on a machine with a cold NVRTC cache)."""

    @pytest.fixture(scope="module")
    def variants(request):
        taken = {id(value) for item in request.session.items
                 for value in getattr(getattr(item, "callspec", None), "params", {}).values()}
        return compile_plans([c.values[0] for c in cases if id(c.values[0]) in taken])

    return variants


def compiled_variant(variants: dict, plan):
    """The plan's variant from compile_plans, raising its compilation error if it had one."""
    variant = variants[id(plan)]
    if isinstance(variant, Exception):
        raise variant
    return variant


_reference_cases: dict = {}


def reference_case(spec, widths: dict, batch: int, n: int, seed: int, precision: str = "float32") -> tuple:
    """(module with random weights, inputs, their float64 reference), on the GPU and cached per
    op, widths, shape, seed and precision (bfloat16/float16: module and inputs in that dtype, the
    reference on the same rounded values; tf32x3/tf32: the module's precision=); normal inputs for
    an even seed, cauchy for an odd one."""
    key = (spec.name, tuple(sorted(widths.items())), batch, n, seed, precision)
    if key not in _reference_cases:
        gen = generator(seed)
        module = module_in_precision(spec, widths, gen, precision, "cuda")
        inputs = spec.make_inputs({"B": batch, "N": n, **widths}, gen, "cauchy" if seed % 2 else "normal")
        inputs = inputs_in_precision(inputs, precision, "cuda")
        _reference_cases[key] = (module, inputs, reference64(module, inputs))
    return _reference_cases[key]


def run_variant(module, inputs: tuple, variant, shape) -> torch.Tensor:
    """The module's kernel launched with this variant into a NaN-prefilled output of `shape`
    (the op's output shape: the float64 reference's), synchronized."""
    out = torch.full(tuple(shape), float("nan"), device="cuda", dtype=inputs[0].dtype)
    with torch.no_grad():
        module._launch(*inputs, out=out, variant=variant)
    torch.cuda.synchronize()
    return out



def assert_variant_matches_float64(spec, plan, variant, shapes, skip=None, also=None) -> None:
    """The variant against the float64 reference of reference_case(spec, plan.widths, B, N, seed=k)
    for the k-th (B, N) of shapes, but those skip(B, N) passes over; every failing shape is reported
    at once. also(module, inputs, variant, k) returns further failures (strings) of op-specific checks."""
    tol = spec.tolerance[plan.precision]
    failures = []
    for k, (batch, n) in enumerate(shapes):
        if skip is not None and skip(batch, n):
            continue
        module, inputs, ref = reference_case(spec, plan.widths, batch, n, seed=k, precision=plan.precision)
        result = compare(run_variant(module, inputs, variant, ref.shape), ref, tol)
        if not result.ok:
            failures.append(f"B={batch} N={n}: {result}")
        if also is not None:
            failures += [f"B={batch} N={n}: {failure}" for failure in also(module, inputs, variant, k)]
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


def capture_graph(module, inputs: tuple):
    """(graph, captured output): the module's forward warmed up (compile, pack, allocate) and
    captured into a CUDA graph on a side stream. A launch outside the current stream (the legacy
    default stream) breaks capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        module(*inputs)  # warm: compile, pack and allocate outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def replay_nan_filled(graph, out: torch.Tensor, replays: int = 1) -> torch.Tensor:
    out.fill_(float("nan"))
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return out


def run_under_graph_capture(module, inputs: tuple, replays: int = 1) -> torch.Tensor:
    """The module captured (capture_graph), its output NaN-filled, replayed `replays` times."""
    return replay_nan_filled(*capture_graph(module, inputs), replays)


def assert_graph_survives_larger_calls(module, small: tuple, ref_small, large: tuple, ref_large, tol) -> None:
    """The graph captures its scratch pointers: later, larger eager calls (each with new, larger
    scratch from the allocator) must not free or reuse them, so its replays stay right."""
    graph, captured = capture_graph(module, small)
    with torch.no_grad():
        for _ in range(3):
            assert compare(module(*large), ref_large, tol).ok
    assert compare(replay_nan_filled(graph, captured), ref_small, tol).ok


def check_tuned_entries(spec) -> None:
    """Every tuned entry of the op for this GPU builds and matches the float64 reference at
    B=1 N=37 (skipped where the GPU has none)."""
    info = runtime.device_info(0)
    db = TunedDB(spec.name, info.slug)
    entries = db.entries()
    if not entries:
        pytest.skip(f"no tuned {spec.name} entries for {info.slug} in {db.path}")
    for entry in entries:
        widths, precision = spec.widths_of(entry["shape"]), entry["key"]["dtype"]
        variant = runtime.build_variant(spec.plan(entry["strategy"], entry["params"], widths, precision))
        module, inputs, ref = reference_case(spec, widths, 1, 37, seed=21, precision=precision)
        result = compare(run_variant(module, inputs, variant, ref.shape), ref, spec.tolerance[precision])
        assert result.ok, f"tuned {entry['strategy']} {entry['params']}: {result}"


def assert_state_dicts_interchange(module, reference) -> None:
    """The drop-in module and its reference have the same state_dict keys, in order, and each
    loads the other's state_dict to equal tensors."""
    assert list(module.state_dict()) == list(reference.state_dict())
    module.load_state_dict(reference.state_dict())
    reference.load_state_dict(module.state_dict())
    for name, p in module.state_dict().items():
        assert torch.equal(p, reference.state_dict()[name]), name


class Unpicklable:
    """Stands in for runtime state that cannot be pickled (a loaded kernel, device memory)."""

    def __reduce__(self):
        raise TypeError("a loaded kernel cannot be pickled")


def deepcopy_dropping_runtime_state(module, state: dict):
    """Sets each (dotted) attribute of `state` on the module, stand-ins for its runtime state (loaded
    kernels, device buffers, cache keys), deep-copies the module and asserts that the copy has
    dropped every one of them (None there); returns the copy."""
    for path, value in state.items():
        owner, _, name = path.rpartition(".")
        setattr(attrgetter(owner)(module) if owner else module, name, value)
    clone = copy.deepcopy(module)
    for path in state:
        assert attrgetter(path)(clone) is None, f"the copy kept {path}"
    return clone


def assert_copy_and_pickle_compute_the_reference(module, clone, inputs: tuple) -> None:
    """The module survives torch.save/torch.load, and both the loaded module and `clone` (its
    deepcopy) compute the module's reference exactly."""
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    expected = module.reference_forward(*inputs)
    torch.testing.assert_close(loaded(*inputs), expected, rtol=0, atol=0)
    torch.testing.assert_close(clone(*inputs), expected, rtol=0, atol=0)


def main_grid(plan, B: int, N: int, sms: int, resident: int) -> tuple[int, int]:
    """The plan's main kernel at (B, N): its blocks, and the work it loops over (the last of the
    shape arguments its grid function gives: tiles, pairs)."""
    blocks, tail = plan.main.grid(B, N, sms, resident)
    return blocks, tail[-1]


def trimul_inputs_with_an_empty_row(widths: dict, B: int, N: int, seed: int, dtype=torch.float32) -> tuple:
    """The triangle update's x (in `dtype`, Cauchy-tailed) and a float mask whose middle row of the
    first batch entry is empty, on the GPU."""
    from pairgen.ops.trimul import TRIMUL

    x, mask = TRIMUL.make_inputs({"B": B, "N": N, **widths}, generator(seed), "cauchy")
    mask = mask.float()
    mask[0, N // 2, :] = 0.0
    return x.to(dtype).cuda(), mask.cuda()


def assert_readout_max_kernels_match_pytorch(device: str, dtype, B: int, N: int, D: int, P: int, seed: int) -> None:
    """The readout's 16-bit closed-form kernels (pairgen/ops/readout/fused_backward.py) on `device`
    (the GPU, or the CPU under the emulator) against PyTorch's way: the first layer's rows equal
    torch.cat's; the max equals torch.amax over the masked messages (0 for an isolated node) and its
    winner counts the edges that reach it; its gradient equals torch.amax's backward computed in
    fp32 and rounded once, the ties' shares within one 16-bit rounding (the kernel divides to 2 ulp:
    one 16-bit ulp, subnormals' spacing at least); the sum of what the winners took equals the
    gradient's column sums; a NaN message on an edge makes its channel's max NaN, with no winner."""
    from pairgen.ops.readout import fused_backward

    gen = torch.Generator(device=device).manual_seed(seed)
    nodes = torch.randn(B, N, D, device=device, generator=gen).to(dtype)
    pair = torch.randn(B, N, N, P, device=device, generator=gen).to(dtype)
    rows = fused_backward.first_layer_rows(nodes, pair)
    expected = torch.cat([nodes.unsqueeze(2).expand(B, N, N, D), nodes.unsqueeze(1).expand(B, N, N, D), pair], dim=-1)
    assert torch.equal(rows, expected.view(-1, 2 * D + P))

    # few distinct values: ties in most channels
    m = (torch.randint(-3, 4, (B, N, N, D), device=device, generator=gen) * 0.5).to(dtype)
    edge = torch.rand(B, N, N, device=device, generator=gen) < 0.7
    edge[0, 3] = False                        # node 3 of batch 0: no edge
    edge[B - 1, 5] = False
    edge[B - 1, 5, N - 1] = True              # node 5 of the last batch: one edge
    isolated = ~edge.any(dim=2)
    reference = m.masked_fill(~edge.unsqueeze(-1), float("-inf")).amax(dim=2).masked_fill(isolated.unsqueeze(-1), 0)
    pooled, winners = fused_backward.max_pool(m, edge, P)
    assert torch.equal(pooled, reference)
    reached = ((m == pooled.unsqueeze(2)) & edge.unsqueeze(-1)).sum(dim=2)
    assert winners.dtype is torch.int32 and torch.equal(winners, reached.to(torch.int32))

    d_pooled = torch.randn(B, N, D, device=device, generator=gen)
    m32 = m.float().requires_grad_()
    m32.masked_fill(~edge.unsqueeze(-1), float("-inf")).amax(dim=2).backward(d_pooled.masked_fill(isolated.unsqueeze(-1), 0))
    exact = m32.grad.view(-1, D)
    d_m, taken = fused_backward.max_pool_backward(m, edge, pooled, winners, d_pooled, P)
    assert d_m.dtype is dtype and d_m.shape == exact.shape
    tied = (reached.unsqueeze(2).expand(B, N, N, D) > 1).reshape(-1, D)
    assert tied.any() and (~tied & (exact != 0)).any(), "the case has tied and single winners"
    assert torch.equal(d_m[~tied], exact.to(dtype)[~tied])
    ulp = 2.0**-7 if dtype is torch.bfloat16 else 2.0**-10  # relative, and its floor among subnormals
    within = (d_m.float() - exact).abs() <= ulp * (exact.abs() + torch.finfo(dtype).smallest_normal)
    assert within[tied].all()
    torch.testing.assert_close(taken, exact.sum(0), rtol=1e-5, atol=1e-5)

    m[0, 1, 2, 0] = float("nan")
    edge[0, 1, 2] = True
    nan_pooled, nan_winners = fused_backward.max_pool(m, edge, P)
    assert nan_pooled[0, 1, 0].isnan() and nan_pooled.isnan().sum() == 1 and nan_winners[0, 1, 0] == 0


def assert_max_act_grad_is_max_grad_then_act_grad(device: str, dtype, B: int, N: int, D: int, H: int,
                                                  seed: int) -> None:
    """fused_backward.max_act_gradient on `device` (the GPU, or the CPU under the emulator) equals
    max_pool_backward followed by act_gradient bit for bit: d_m, d_pre, d_u and the winners' column
    sums, for messages with ties in most channels, a node with no edge, a node with one, a NaN
    message on an edge (its channel's max NaN, no winner), +0 and -0 messages (equal as floats:
    both win), and a NaN in pre that reaches only its element."""
    from pairgen.ops.readout import fused_backward

    P = 16  # the pair width: only the kernels' rendering takes it
    gen = torch.Generator(device=device).manual_seed(seed)
    m = (torch.randint(-3, 4, (B, N, N, D), device=device, generator=gen) * 0.5).to(dtype)
    m[0, 0, :, 1] = 0.0
    m[0, 0, 1::2, 1] = -0.0
    m[0, 0, :, 1:].clamp_(max=0.0)            # node 0's channel 1 peaks at +-0
    edge = torch.rand(B, N, N, device=device, generator=gen) < 0.7
    edge[0, min(3, N - 1)] = False            # no edge
    edge[B - 1, N - 1] = False
    edge[B - 1, N - 1, 0] = True              # one edge
    m[0, 1, 2, 0] = float("nan")
    edge[0, 1, 2] = True
    pooled, winners = fused_backward.max_pool(m, edge, P)
    d_pooled = torch.randn(B, N, D, device=device, generator=gen)
    w2 = (torch.randn(D, H, device=device, generator=gen) / D ** 0.5).to(dtype)
    pre = (torch.randn(B, N, N, H, device=device, generator=gen) * 3).clamp(-12, 12).to(dtype)
    pre.view(-1)[7] = float("nan")

    d_m, taken = fused_backward.max_pool_backward(m, edge, pooled, winners, d_pooled, P)
    d_pre, d_u = fused_backward.act_gradient(d_m, w2, pre.clone(), P)
    f_pre, f_u, f_m, f_taken = fused_backward.max_act_gradient(m, edge, pooled, winners, d_pooled, w2, pre.clone(), P)
    assert (d_m != 0).any() and pooled[0, 1, 0].isnan(), "the case has winners and a NaN max"
    for name, ours, theirs in (("d_m", f_m, d_m), ("d_pre", f_pre, d_pre), ("d_u", f_u, d_u)):
        assert ours.shape == theirs.shape and ours.dtype is theirs.dtype, name
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), f"{name} differs bit for bit"
    assert torch.equal(f_taken, taken)


def assert_pair_gradient_matches_float64(device: str, dtype, B: int, N: int, P: int, H: int, seed: int,
                                         wp: bool = False) -> None:
    """pair_grad.pair_gradient (wp: weight_gradient) on `device` (the GPU, or the CPU under the
    emulator) against float64 of the same 16-bit d_pre and W_p (pair features): d_pair = d_pre W_p
    (d W_p = the sum over rows of d_pre^T pair) and d_v = d_pre summed over i, each within the
    16-bit standard (relative L2 1e-2) and, element by element, one 16-bit rounding of the exact
    value (plus fp32 summation's error, bounded by the terms' magnitudes); a NaN in d_pre reaches
    its pair's row of d_pair (its channel's row of d W_p) and its own element of d_v only;
    heavy-tailed d_pre."""
    from pairgen.ops.readout import pair_grad

    gen = torch.Generator(device=device).manual_seed(seed)
    d_pre = (torch.randn(B, N, N, H, device=device, generator=gen)
             * torch.rand(B, N, N, 1, device=device, generator=gen).pow(-1.5).clamp(max=50)).to(dtype)
    other = (torch.randn(B, N, N, P, device=device, generator=gen) if wp
             else torch.randn(H, P, device=device, generator=gen) / H ** 0.5).to(dtype)
    nan_b, nan_i, nan_j, nan_h = B - 1, N // 2, N - 1, H - 3
    d_pre[nan_b, nan_i, nan_j, nan_h] = float("nan")
    product, d_v = pair_grad.weight_gradient(d_pre, other) if wp else pair_grad.pair_gradient(d_pre, other)
    exact64, other64 = d_pre.double(), other.double()
    if wp:
        rows, other_rows = exact64.view(-1, H), other64.view(-1, P)
        exact_product, magnitude = rows.t() @ other_rows, rows.abs().t() @ other_rows.abs()
        product_nan = torch.zeros(H, P, dtype=torch.bool)
        product_nan[nan_h] = True
    else:
        exact_product, magnitude = exact64 @ other64, exact64.abs() @ other64.abs()
        product_nan = torch.zeros(B, N, N, P, dtype=torch.bool)
        product_nan[nan_b, nan_i, nan_j] = True
    assert product.shape == exact_product.shape and product.dtype is dtype
    assert d_v.shape == (B, N, H) and d_v.dtype is dtype
    d_v_nan = torch.zeros(B, N, H, dtype=torch.bool)
    d_v_nan[nan_b, nan_j, nan_h] = True
    ulp = 2.0**-8 if dtype is torch.bfloat16 else 2.0**-11  # half a 16-bit step, relative
    for name, ours, exact, size, nan in (("product", product.double(), exact_product, magnitude, product_nan),
                                         ("d_v", d_v.double(), exact64.sum(1), exact64.abs().sum(1), d_v_nan)):
        nan = nan.to(ours.device)
        assert torch.equal(ours.isnan(), nan), f"{name}: NaN reaches exactly its row / element"
        ours, exact, size = ours[~nan], exact[~nan], size[~nan]
        error = ((ours - exact).norm() / exact.norm()).item()
        assert error <= 1e-2, f"{name}: relative L2 {error}"
        bound = ulp * exact.abs() + 2.0**-20 * size + torch.finfo(dtype).smallest_normal
        worst = ((ours - exact).abs() / bound).max().item()
        assert worst <= 1.0, f"{name}: an element {worst:.2f}x past one rounding of the exact value"


def assert_the_first_layer_kernel_rounds_once(device: str, dtype, B: int, N: int, D: int, P: int, H: int,
                                              seed: int) -> None:
    """The readout's first layer kernel (pairgen/ops/readout/first_layer.py) on `device` (the GPU,
    or the CPU under the emulator) against float64 of the single product over the concatenated
    rows: pre is that sum rounded once (equal to its rounding for nearly every element, never a
    16-bit step away), act the SiLU of the stored pre rounded, and a NaN in one pair row reaches
    that row's pre and act only."""
    from pairgen.ops.readout import first_layer

    gen = generator(seed)
    nodes = torch.randn(B, N, D, generator=gen).to(dtype)
    pair = (torch.randn(B, N, N, P, generator=gen) * 2).to(dtype)
    pair[B - 1, 3 % N, 5 % N, 2] = float("nan")
    w1 = (torch.randn(H, 2 * D + P, generator=gen) / (2 * D + P) ** 0.5).to(dtype)
    b1 = torch.randn(H, generator=gen).to(dtype)
    rows = torch.cat([nodes.unsqueeze(2).expand(B, N, N, D), nodes.unsqueeze(1).expand(B, N, N, D), pair], dim=-1)
    exact = rows.double() @ w1.double().t() + b1.double()
    on = [t.to(device) for t in (nodes, pair, w1, b1)]
    assert first_layer.fits(on[0], on[1], H)
    pre, act = (t.cpu() for t in first_layer.first_layer(*on))
    assert pre.shape == act.shape == (B, N, N, H) and pre.dtype is act.dtype is dtype
    nan_row = torch.isnan(pair).any(-1)
    assert torch.isnan(pre[nan_row]).all() and torch.isnan(act[nan_row]).all(), "the NaN's row is NaN"
    ok = ~nan_row
    assert torch.isfinite(pre[ok]).all() and torch.isfinite(act[ok]).all(), "no other row is touched"
    step = 2.0 ** (-7 if dtype is torch.bfloat16 else -10)  # a 16-bit step, relative
    got, want = pre[ok].double(), exact[ok]
    # The fp32 sum that is rounded once is itself within K fp32 steps of the terms' magnitudes (as the
    # single product's accumulator is): where the terms cancel, that is more than a 16-bit step of
    # the small sum. Near zero a 16-bit step is the subnormals' spacing.
    magnitude = rows.double().abs() @ w1.double().abs().t() + b1.double().abs()
    fp32_sum = (2 * D + P + 3) * 2.0**-24 * magnitude[ok]
    excess = (got - want).abs() - step * (want.abs() + torch.finfo(dtype).smallest_normal) - fp32_sum
    assert (excess <= 0).all(), f"within a step of the exact sum: {int((excess > 0).sum())} off, by up to {excess.max():.3g}"
    assert (pre[ok] == want.to(dtype)).double().mean() >= 0.99, "rounded once: the exact sum's rounding"
    x = pre[ok].double()
    silu = x * torch.sigmoid(x)
    assert ((act[ok].double() - silu).abs() <= step * silu.abs() + 1e-6).all(), "act = silu(pre), rounded"


@contextlib.contextmanager
def cuda_autocast(dtype):
    """CUDA's autocast state set as torch.autocast("cuda") sets it (the CPU build keeps the flags)."""
    enabled, before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", dtype is not None)
    if dtype is not None:
        torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", before)
