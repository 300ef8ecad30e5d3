"""The kernels read the module's parameters as they are at each call (packed for the call: nothing is
kept), on the CPU (packing needs no GPU): whatever a training or EMA loop does to the module between
calls. And pairgen changes nothing in torch: no parameter changes class, no torch attribute or
global hook is touched by importing or using it."""
from __future__ import annotations

import copy
import io
import subprocess
import sys
from operator import attrgetter

import pytest
import torch
from torch import nn

from helpers import generator
from pairgen.ops import get_op, op_names
from pairgen.ops.packing import pack_on_host

SEED_WIDTHS = {name: get_op(name).widths_of(get_op(name).presets["seed"][0]) for name in op_names()}


def _module(name: str, seed: int = 0):
    return get_op(name).make_module(SEED_WIDTHS[name], generator(seed))


def _expected(module) -> torch.Tensor:
    """The packed buffer built from scratch from what the module's parameters are now."""
    slots = module._slots
    values = [attrgetter(name)(module).detach() for name in slots.names]
    return pack_on_host(module.fp32_layout(slots.sources), values).view(torch.float32)


def _assert_current(module) -> None:
    torch.testing.assert_close(module.packed_weights(), _expected(module), rtol=0, atol=0)


def _first_linear(module) -> tuple[str, nn.Linear]:
    path = next(p for p, _, _ in (n.rpartition(".") for n in module._slots.names)
                if isinstance(module.get_submodule(p), nn.Linear))
    return path, module.get_submodule(path)


@pytest.mark.parametrize("name", op_names())
def test_an_ema_update_through_data_is_seen(name):
    """`e.data.mul_(0.9).add_(p.data, alpha=0.1)` moves no version counter: the classic EMA loop."""
    ema, live = _module(name, 1), _module(name, 2)
    first = ema.packed_weights()
    for e, p in zip(ema.parameters(), live.parameters()):
        e.data.mul_(0.9).add_(p.data, alpha=0.1)
    assert not torch.equal(ema.packed_weights(), first)
    _assert_current(ema)


@pytest.mark.parametrize("name", op_names())
def test_an_in_place_update_is_seen(name):
    module = _module(name)
    first = module.packed_weights()
    with torch.no_grad():
        next(module.parameters()).mul_(2.0)  # in place, as an optimizer step does
    assert not torch.equal(module.packed_weights(), first)
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
    assert module._slots.anchor().dtype is torch.float32


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


def test_parameters_keep_their_class_and_survive_copies_and_pickles():
    module = _module("contact")
    before = [(p, type(p)) for p in module.parameters()]
    optimizer = torch.optim.AdamW(module.parameters())
    module.packed_weights()
    module(torch.randn(1, 5, 5, 64)).sum().backward()
    optimizer.step()
    assert all(a is b and type(a) is kind for (b, kind), a in zip(before, module.parameters())), \
        "a parameter stays the same object, of its own class"
    assert all(type(p) is nn.Parameter for p in module.parameters())
    _assert_current(module)
    clone = copy.deepcopy(module)
    _assert_current(clone)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for p in loaded.parameters():
        p.data.mul_(0.5)
    _assert_current(loaded)


@pytest.mark.parametrize("name", op_names())
def test_a_module_built_elsewhere_changes_nothing(name):
    module = _module(name)
    first = module.packed_weights()
    nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))  # registrations elsewhere
    assert torch.equal(module.packed_weights(), first)
    _assert_current(module)


_TORCH_STATE = """
import torch, torch.nn.modules.module as m
def state():
    return (torch.nn.Parameter.__new__, torch.nn.Parameter.__dict__.get("data"), dict(m._global_module_registration_hooks),
            dict(m._global_parameter_registration_hooks), dict(m._global_forward_pre_hooks), dict(m._global_forward_hooks),
            dict(m._global_backward_hooks), dict(m._global_buffer_registration_hooks),
            {k: v for k, v in vars(torch).items() if not k.startswith("_")},
            {k: v for k, v in vars(torch.nn).items() if not k.startswith("_")})
before = state()
import pairgen
from pairgen.ops.contact import ContactHead
module = ContactHead(16, 8)
module(torch.randn(1, 3, 3, 16))
after = state()
changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
assert not changed, changed
assert all(type(p) is torch.nn.Parameter for p in module.parameters())
print("unchanged")
"""


def test_importing_and_using_pairgen_changes_nothing_in_torch():
    """In a fresh process: nn.Parameter.__new__, the global module/parameter hooks and torch's and
    torch.nn's public names are the same before and after importing pairgen and running a module."""
    done = subprocess.run([sys.executable, "-c", _TORCH_STATE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "unchanged" in done.stdout, done.stderr[-2000:]
