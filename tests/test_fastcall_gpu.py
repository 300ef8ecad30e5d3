"""Recorded calls replayed in compiled code (pairgen/fastcall.py) on the GPU: every strategy that
records, each op's tuned seed call, a replay's output against the float64 reference (its memory
NaN-filled beforehand), the refusals that must send a call back to the Python path (a parameter
updated in place, another length), and CUDA-graph capture of a replayed call."""
from __future__ import annotations

import pytest
import torch

from helpers import generator, replay_nan_filled, capture_graph, sampled_plans, trimul_inputs_with_an_empty_row
from pairgen import native, runtime
from pairgen.ops.contact import CONTACT
from pairgen.ops.readout import READOUT
from pairgen.ops.trimul import TRIMUL
from pairgen.spec import AUTOCAST_TOLERANCE
from pairgen.tuning.check import compare, reference64
from pairgen.tuning.evaluate import inputs_in_precision, module_in_precision

pytestmark = pytest.mark.gpu

SPECS = {"contact": CONTACT, "trimul": TRIMUL, "readout": READOUT}
SEEDS = {name: spec.presets["seed"][0] for name, spec in SPECS.items()}
#: Each op's strategies that record, with a shape no tuning used (odd B and N).
RECORDING = [(name, strategy.name) for name, spec in SPECS.items()
             for strategy in spec.strategies.values() if strategy.precisions[0] in strategy.records]


@pytest.fixture(scope="module", autouse=True)
def compiled_fast_path():
    if native.fastcall(wait=True) is None:
        pytest.skip(f"the compiled fast path: {native.status()}")


def case(name: str, shape: dict, seed: int, precision: str = "float32"):
    spec = SPECS[name]
    gen = generator(seed)
    module = module_in_precision(spec, spec.widths_of(shape), gen, precision, "cuda")
    return spec, module, gen


def fresh_inputs(spec, shape: dict, gen, k: int, precision: str = "float32") -> tuple:
    return inputs_in_precision(spec.make_inputs(shape, gen, "cauchy" if k % 2 else "normal"), precision, "cuda")


def replay(module, *inputs):
    """The module's replay of a recorded call on these inputs and its parameters as they are now,
    or None (its forward's first step)."""
    return module._fast_forward(*inputs, *module._slots.weights().tensors)


def call_on_nan_memory(module, inputs: tuple, out_shape) -> torch.Tensor:
    """The module's output, allocated (by the replay or the Python path) from caching-allocator
    memory just filled with NaN: an element the kernels leave unwritten shows."""
    poison = torch.full(tuple(out_shape), float("nan"), device="cuda")
    del poison
    with torch.no_grad():
        out = module(*inputs)
    torch.cuda.synchronize()
    return out


def assert_replays_match_float64(spec, module, shape: dict, gen, precision: str = "float32") -> None:
    tol = spec.tolerance[precision]
    cases = [fresh_inputs(spec, shape, gen, k, precision) for k in range(3)]  # normal, heavy-tailed, normal
    refs = [reference64(module, inputs) for inputs in cases]
    assert compare(call_on_nan_memory(module, cases[0], refs[0].shape), refs[0], tol).ok
    assert module._fast_calls, "the kernel call was not recorded"
    for k in (1, 2):  # new values, the recorded shapes
        with torch.no_grad():
            assert replay(module, *cases[k]) is not None, "a matching call was not replayed"
        result = compare(call_on_nan_memory(module, cases[k], refs[k].shape), refs[k], tol)
        assert result.ok, f"replay {k}: {result}"


@pytest.mark.parametrize("name,strategy", RECORDING)
def test_every_recording_strategy_replays_exactly(name, strategy):
    shape = {**SEEDS[name], "B": 3, "N": 37}
    precision = SPECS[name].strategies[strategy].precisions[0]  # a tensor-core strategy: a 16-bit module
    spec, module, gen = case(name, shape, seed=11, precision=precision)
    plan = sampled_plans(spec.at(precision), strategy, spec.widths_of(shape), 1, seed=5)[0]
    module.force_variant(runtime.build_variant(plan))
    assert_replays_match_float64(spec, module, shape, gen, precision)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
@pytest.mark.parametrize("strategy", ["mma", "wgmma"])
def test_16_bit_triangle_update_replays_with_its_product(strategy, precision):
    """The 16-bit tensor-core strategies run a cuBLAS product between their kernels; a replay runs
    it too (fastcall.note_product), on the new inputs."""
    shape = {**SEEDS["trimul"], "B": 3, "N": 37}
    spec, module, gen = case("trimul", shape, seed=17, precision=precision)
    plan = sampled_plans(spec.at(precision), strategy, spec.widths_of(shape), 1, seed=5)[0]
    module.force_variant(runtime.build_variant(plan))
    assert_replays_match_float64(spec, module, shape, gen, precision)


def test_models_form_bf16_call_replays():
    """The models' form (gate on the normalised input, no biases) at P = H = 128 in bf16, N128."""
    shape = {"B": 1, "N": 128, "P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    spec, module, gen = case("trimul", shape, seed=19, precision="bfloat16")
    assert module._records(module.variant_for(128, 0, "bfloat16"))
    assert_replays_match_float64(spec, module, shape, gen, "bfloat16")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tuned_seed_calls_replay(name):
    """The seed shapes are where host time decides a call's speed: their tuned strategies record."""
    spec, module, gen = case(name, SEEDS[name], seed=3)
    variant = module.variant_for(SEEDS[name]["N"], 0)
    assert module._records(variant), f"the tuned seed strategy {variant.plan.strategy} does not record"
    assert_replays_match_float64(spec, module, SEEDS[name], gen)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_parameter_updates_replay_and_other_lengths_record_again(name):
    """The parameters are inputs of a replay, packed again by it: an in-place update, one through
    `.data` (an EMA) and a replaced parameter are all read as they are; another length records
    again and both lengths are kept."""
    spec, module, gen = case(name, SEEDS[name], seed=7)
    tol = spec.tolerance["float32"]
    inputs = fresh_inputs(spec, SEEDS[name], gen, 0)
    with torch.no_grad():
        module(*inputs)
        assert replay(module, *inputs) is not None
        first = next(module.parameters())
        first.add_(0.25)  # in place, as an optimizer step
        first.data.mul_(0.5)  # through .data, as an EMA update: no version counter moves
    ref = reference64(module, inputs)
    assert compare(call_on_nan_memory(module, inputs, ref.shape), ref, tol).ok
    path, _, attr = module._slots.names[-1].rpartition(".")
    owner = module.get_submodule(path)
    setattr(owner, attr, torch.nn.Parameter(getattr(owner, attr).detach() * 1.5 + 0.1))  # replaced
    ref = reference64(module, inputs)
    with torch.no_grad():
        assert replay(module, *inputs) is not None, "a replaced parameter is another input, not another call"
    assert compare(call_on_nan_memory(module, inputs, ref.shape), ref, tol).ok
    other = {**SEEDS[name], "N": SEEDS[name]["N"] + 5}
    longer = fresh_inputs(spec, other, gen, 1)
    ref, ref_longer = reference64(module, inputs), reference64(module, longer)
    assert compare(call_on_nan_memory(module, longer, ref_longer.shape), ref_longer, tol).ok
    assert compare(call_on_nan_memory(module, inputs, ref.shape), ref, tol).ok
    with torch.no_grad():  # both lengths are kept
        assert replay(module, *inputs) is not None and replay(module, *longer) is not None


@pytest.mark.parametrize("name", sorted(SPECS))
def test_training_calls_are_not_replayed(name):
    spec, module, gen = case(name, SEEDS[name], seed=9)
    inputs = fresh_inputs(spec, SEEDS[name], gen, 0)
    with torch.no_grad():
        module(*inputs)
    out = module(*inputs)  # grad enabled, parameters that want gradients: autograd records it
    assert out.requires_grad and out.grad_fn is not None


@pytest.mark.parametrize("name", sorted(SPECS))
def test_graph_capture_of_a_replayed_call(name):
    spec, module, gen = case(name, SEEDS[name], seed=13)
    inputs = fresh_inputs(spec, SEEDS[name], gen, 1)
    with torch.no_grad():
        module(*inputs)  # recorded: the captured call below is a replay
        assert replay(module, *inputs) is not None
    graph, out = capture_graph(module, inputs)
    ref = reference64(module, inputs)
    assert compare(replay_nan_filled(graph, out, replays=2), ref, spec.tolerance["float32"]).ok


@pytest.mark.parametrize("name", ["contact", "readout"])
def test_a_replayed_seed_call_allocates_only_its_output(name):
    """The weights are packed on every call into bytes the module holds: a replay at the seed shape
    (where host time is most of a call) allocates its output and nothing else."""
    spec, module, gen = case(name, SEEDS[name], seed=17)
    inputs = fresh_inputs(spec, SEEDS[name], gen, 0)
    with torch.no_grad():
        module(*inputs)
        assert replay(module, *inputs) is not None
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        outs = [module(*inputs) for _ in range(5)]
        allocated = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    assert allocated == len(outs), f"{allocated} allocations in {len(outs)} replayed calls"
    ref = reference64(module, inputs)
    assert all(compare(out, ref, spec.tolerance["float32"]).ok for out in outs)


@pytest.mark.parametrize("output_dtype", [None, torch.float32])
def test_autocast_calls_replay_with_their_cast(output_dtype):
    """An fp32 model under autocast (GPU MODE's contract: fp32 in, bf16 inside): the cast of x to
    bf16 is replayed with the kernels (fastcall.note_copy). Replays of new values equal the Python
    path's output bit for bit and meet the autocast standard against float64; outside the autocast
    the recording does not apply."""
    widths = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    module = TRIMUL.make_module(widths, generator(21)).cuda()
    module.output_dtype = output_dtype
    cases = [trimul_inputs_with_an_empty_row(widths, 2, 61, seed=k) for k in range(3)]
    refs = [reference64(module, inputs) for inputs in cases]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with torch.no_grad():
            module(*cases[0])
        assert module._fast_calls, "the autocast call was not recorded"
        for k in (1, 2):
            with torch.no_grad():
                assert replay(module, *cases[k]) is not None, "a matching autocast call was not replayed"
            replayed = call_on_nan_memory(module, cases[k], cases[k][0].shape)
            assert replayed.dtype == (output_dtype or torch.bfloat16)
            result = compare(replayed, refs[k], AUTOCAST_TOLERANCE)
            assert result.ok, f"replay {k}: {result}"
            module.forget_fast_calls()
            python_path = call_on_nan_memory(module, cases[k], cases[k][0].shape)
            assert torch.equal(replayed, python_path), "the replay differs from the Python path"
    with torch.no_grad():
        assert replay(module, *cases[1]) is None, "an autocast recording replayed without autocast"


#: Each op's 16-bit tensor-core strategies (their runners cast an fp32 input under autocast).
HALF_RECORDING = [(name, strategy.name) for name, spec in SPECS.items() for strategy in spec.strategies.values()
                  if "bfloat16" in strategy.records]


@pytest.mark.parametrize("name,strategy", HALF_RECORDING)
def test_every_16_bit_strategy_replays_under_autocast(name, strategy):
    """An fp32 module under a bf16 autocast on a 16-bit kernel: its runner's casts (and the readout's
    widening of its 16-bit result into the fp32 output) are noted, so the call is recorded, and a
    replay of new values equals the Python path's output bit for bit and meets the autocast
    standard against float64."""
    shape = {**SEEDS[name], "B": 3, "N": 37}
    spec, module, gen = case(name, shape, seed=23)
    plan = sampled_plans(spec.at("bfloat16"), strategy, spec.widths_of(shape), 1, seed=5)[0]
    module.force_variant(runtime.build_variant(plan))
    cases = [fresh_inputs(spec, shape, gen, k) for k in range(3)]
    refs = [reference64(module, inputs) for inputs in cases]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        call_on_nan_memory(module, cases[0], refs[0].shape)
        assert module._fast_calls, "the autocast call was not recorded"
        for k in (1, 2):
            with torch.no_grad():
                assert replay(module, *cases[k]) is not None, "a matching autocast call was not replayed"
            replayed = call_on_nan_memory(module, cases[k], refs[k].shape)
            result = compare(replayed, refs[k], AUTOCAST_TOLERANCE)
            assert result.ok, f"replay {k}: {result}"
            module.forget_fast_calls()
            assert torch.equal(replayed, call_on_nan_memory(module, cases[k], refs[k].shape))
