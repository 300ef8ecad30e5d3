"""The kernels' packed weights always follow the module's current parameters, on the CPU (packing
needs no GPU): whatever a training or EMA loop does to the module between calls."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from helpers import generator
from pairgen.module.weights import WatchedParameter
from pairgen.ops import get_op, op_names

SEED_WIDTHS = {name: get_op(name).widths_of(get_op(name).presets["seed"][0]) for name in op_names()}


def _module(name: str, seed: int = 0):
    return get_op(name).make_module(SEED_WIDTHS[name], generator(seed))


def _expected(module) -> torch.Tensor:
    """The packed buffer built from scratch from what the module's parameters are now."""
    values = []
    for path, name in module._weights._paths:
        sub = module.get_submodule(path)
        values.append(getattr(sub, name).detach())
    return module._pack(values)


def _assert_current(module) -> None:
    torch.testing.assert_close(module.packed_weights(), _expected(module), rtol=0, atol=0)


def _first_linear(module) -> tuple[str, nn.Linear]:
    path = next(p for p, _ in module._weights._paths if isinstance(module.get_submodule(p), nn.Linear))
    return path, module.get_submodule(path)


@pytest.mark.parametrize("name", op_names())
def test_an_ema_update_through_data_is_seen(name):
    """`e.data.mul_(0.9).add_(p.data, alpha=0.1)` moves no version counter: the classic EMA loop."""
    ema, live = _module(name, 1), _module(name, 2)
    first = ema.packed_weights()
    for e, p in zip(ema.parameters(), live.parameters()):
        e.data.mul_(0.9).add_(p.data, alpha=0.1)
    assert ema.packed_weights() is not first
    _assert_current(ema)


@pytest.mark.parametrize("name", op_names())
def test_unchanged_parameters_are_not_repacked(name):
    module = _module(name)
    first = module.packed_weights()
    assert module.packed_weights() is first
    with torch.no_grad():
        next(module.parameters()).mul_(2.0)  # in place, as an optimizer step does
    assert module.packed_weights() is not first
    _assert_current(module)


@pytest.mark.parametrize("name", op_names())
def test_a_replaced_submodule_is_seen(name):
    module = _module(name)
    module.packed_weights()
    path, linear = _first_linear(module)
    parent_path, _, child = path.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    fresh = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    setattr(parent, child, fresh) if not child.isdigit() else parent.__setitem__(int(child), fresh)
    _assert_current(module)
    assert module._weights.anchor().dtype is torch.float32


@pytest.mark.parametrize("name", op_names())
def test_a_parametrization_is_followed_on_every_call(name):
    module = _module(name)
    module.packed_weights()
    path, linear = _first_linear(module)
    with pytest.warns(UserWarning, match="computed"):
        torch.nn.utils.parametrizations.weight_norm(linear)
        _assert_current(module)
    with torch.no_grad():
        linear.parametrizations.weight.original0.mul_(3.0)  # the norm g: the weight scales
    _assert_current(module)


@pytest.mark.parametrize("name", op_names())
def test_an_old_style_weight_norm_hook_is_followed(name):
    module = _module(name)
    module.packed_weights()
    _, linear = _first_linear(module)
    with pytest.warns((UserWarning, FutureWarning)):
        torch.nn.utils.weight_norm(linear)
        _assert_current(module)
    with torch.no_grad():
        linear.weight_g.mul_(0.5)
    _assert_current(module)


@pytest.mark.parametrize("name", op_names())
def test_a_parameter_assigned_through_data_is_seen(name):
    module = _module(name)
    module.packed_weights()
    param = next(module.parameters())
    param.data = torch.randn_like(param)
    _assert_current(module)


def test_watched_parameters_stay_the_same_objects_and_survive_copies_and_pickles():
    module = _module("contact")
    before = list(module.parameters())
    optimizer = torch.optim.AdamW(module.parameters())
    module.packed_weights()
    assert all(a is b for a, b in zip(before, module.parameters())), "optimizers keep their parameters"
    assert all(type(p) is WatchedParameter and isinstance(p, nn.Parameter) for p in module.parameters())
    module(torch.randn(1, 5, 5, 64)).sum().backward()
    optimizer.step()
    _assert_current(module)
    clone = copy.deepcopy(module)
    _assert_current(clone)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for p in loaded.parameters():
        p.data.mul_(0.5)  # a plain Parameter after the round trip: watched again on first use
    _assert_current(loaded)
    loaded.packed_weights()
    next(loaded.parameters()).data.mul_(2.0)
    _assert_current(loaded)


@pytest.mark.parametrize("name", op_names())
def test_modules_made_elsewhere_do_not_repack(name):
    """Registrations anywhere make a module look its parameters up again, but only other
    parameters than the last pack's cost a repack: a model that builds modules as it runs must
    not repack every call."""
    module = _module(name)
    first = module.packed_weights()
    nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))  # registrations elsewhere
    assert module.packed_weights() is first
    _ = next(module.parameters()).data  # a .data read may be followed by a write: repacked
    assert module.packed_weights() is not first
    _assert_current(module)
