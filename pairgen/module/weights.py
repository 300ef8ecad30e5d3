"""Packed weights that always follow the module's parameters: PackedParameters, the
WatchedParameter subclass whose `.data` is watched, and the registration hooks and epochs that
tell a pack it may be stale (docs/architecture.md, section 5)."""
from __future__ import annotations

import operator
import warnings
from typing import Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook, register_module_parameter_registration_hook
from torch.nn.utils import parametrize

from .. import fastcall

# ---- packed weights that always follow the module's parameters -------------------------------
#
# The kernels read a packed copy of the parameters. A copy must never go stale, whatever the user
# does to the module between calls:
#   * in-place updates through autograd-visible ops (optimizer steps, `with no_grad: p.mul_()`,
#     load_state_dict): the parameter's version counter moves;
#   * in-place updates through `p.data` (the classic EMA `e.data.mul_(0.9).add_(p.data, ...)`): no
#     version counter moves, so the parameters a module packs are watched: reading or assigning
#     their `.data` bumps a process-wide epoch;
#   * a replaced parameter or submodule (`m.mlp[0] = nn.Linear(...)`) or a parametrization
#     (`weight_norm`): module and parameter registrations bump a structure epoch, and the
#     parameters are found again from the module by their paths (repacked if they are others).
# A parametrized (or hook-computed, the old torch.nn.utils.weight_norm) weight is computed and
# repacked on every call, as its forward would compute it.

_VERSION = operator.attrgetter("_version")
STRUCTURE_EPOCH = [0]  # module and parameter registrations: a pack made before re-resolves its parameters
DATA_EPOCH = [0]       # .data of a watched parameter read or assigned: a pack made before is rebuilt


def _bump_structure(*_args) -> None:
    STRUCTURE_EPOCH[0] += 1


class WatchedParameter(nn.Parameter):
    """An nn.Parameter whose `.data`, read or assigned, bumps the data epoch: an in-place update
    through `.data` moves no version counter, so it would otherwise be invisible. Packed parameters
    are switched to this class in place (same object: optimizers and user references still hold
    it); a pickle brings back a plain Parameter, which is watched again on first use."""

    @property
    def data(self):
        DATA_EPOCH[0] += 1
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        DATA_EPOCH[0] += 1
        torch.Tensor.data.__set__(self, value)


fastcall.PLAIN_TYPES = (nn.Parameter, WatchedParameter)  # a replay takes both as plain tensors


def _watch(param) -> None:
    if type(param) is nn.Parameter:  # other subclasses (DTensor parameters, ...) keep their class
        param.__class__ = WatchedParameter


_parameter_new = nn.Parameter.__new__


def _new_parameter(cls, data=None, requires_grad=True):
    """nn.Parameter(p) of a watched p makes a plain alias of it, as it does of any Parameter:
    torch's own check accepts only Tensor and Parameter data as they are, and would reject the
    subclass (register_parametrization, weight tying and other code wrap existing parameters)."""
    if type(data) is WatchedParameter:
        return torch.Tensor._make_subclass(cls, data, requires_grad)
    return _parameter_new(cls, data, requires_grad)


if not getattr(nn.Parameter.__new__, "_pairgen", False):
    _new_parameter._pairgen = True
    nn.Parameter.__new__ = staticmethod(_new_parameter)


_module_hooks = register_module_module_registration_hook(_bump_structure)
_parameter_hooks = register_module_parameter_registration_hook(_bump_structure)


class PackedParameters:
    """A module's parameters repacked into a kernel's layout, rebuilt only when one of them may
    have changed (see the comment above). `paths` names each parameter as (submodule path, name),
    e.g. ("mlp.0", "weight"); `pack(list of tensors)` builds the kernels' buffer."""

    def __init__(self, root: nn.Module, paths, pack: Callable[[list], torch.Tensor]):
        self._root = root
        self._paths = tuple(paths)
        self._pack = pack
        self._reset()
        self._warned = set()

    def _reset(self) -> None:
        self._epoch = None   # the structure epoch the slots were resolved at
        self._data_epoch = None  # the data epoch of the last pack
        self._slots = ()     # (owner dict, name) per parameter; owner None: computed every call
        self._params = []    # the parameter objects resolved
        self._owners, self._names = (), ()  # the slots' owner dicts and names, for get()'s check
        self._key = None     # their versions when last packed
        self._packed = None

    def _resolve(self) -> None:
        slots, params = [], []
        for path, name in self._paths:
            sub = self._root.get_submodule(path) if path else self._root
            param = sub._parameters.get(name)
            if param is None or parametrize.is_parametrized(sub, name):
                slots.append((sub, name, None))  # computed: a parametrization or a weight_norm hook
                params.append(None)
                self._warn_once("computed", f"pairgen: {path}.{name} is computed (a parametrization or a "
                                "weight-norm hook), so this module's weights are repacked on every call")
            else:
                _watch(param)
                slots.append((sub._parameters, name, param))
                params.append(param)
        if len(params) != len(self._params) or not all(map(operator.is_, params, self._params)):
            self._key = None  # other parameters than the last pack's: repack (a registration elsewhere is not)
        self._slots, self._params = tuple(slots), params
        # The per-call check runs over parallel tuples with C-level map() (a little faster than a
        # Python loop over the slots). Its cost is mostly the version reads.
        self._owners = tuple(owner for owner, _, _ in slots)
        self._names = tuple(name for _, name, _ in slots)
        self._computed = any(p is None for p in params)
        self._epoch = STRUCTURE_EPOCH[0]

    def anchor(self) -> torch.Tensor:
        """One parameter of the module as it is now: input validation compares dtype and device with it."""
        if self._epoch != STRUCTURE_EPOCH[0]:
            self._resolve()
        first = self._params[0]
        return first if first is not None else self._value(self._slots[0])

    def parameters(self) -> list:
        """The tensors packed now (a computed weight as its module computes it)."""
        if self._epoch != STRUCTURE_EPOCH[0]:
            self._resolve()
        return [self._value(slot) for slot in self._slots]

    @staticmethod
    def _value(slot) -> torch.Tensor:
        owner, name, param = slot
        if param is not None:
            return param
        for hook in list(owner._forward_pre_hooks.values()):  # the old weight_norm computes in a hook
            hook(owner, ())
        return getattr(owner, name)

    def get(self) -> torch.Tensor:
        if self._root.__dict__.get("_state_per_call"):
            # Held by the module until the operator's call ends (library.state_per_call): callers
            # keep only its data pointer, and a pack freed before its kernel is enqueued could be
            # handed to a later allocation of the same call.
            pack = self.fresh()
            self._root.__dict__.setdefault("_call_buffers", []).append(pack)
            return pack
        if self._epoch != STRUCTURE_EPOCH[0]:
            self._resolve()
        if self._data_epoch != DATA_EPOCH[0]:
            self._key, self._data_epoch = None, DATA_EPOCH[0]  # some .data was touched: repack
        if self._computed:
            key = None
        elif not all(map(operator.is_, map(operator.getitem, self._owners, self._names), self._params)):
            self._resolve()  # replaced without a registration (e.g. .to() overwriting parameters)
            return self.get()
        else:
            try:
                key = list(map(_VERSION, self._params))
            except RuntimeError:  # an inference tensor (made under torch.inference_mode) has no version
                key = self._unversioned()
        if key is None or key != self._key:
            with torch.no_grad():
                self._packed = self._pack([p.detach() for p in self.parameters()])
            self._key = key
        return self._packed

    def fresh(self) -> torch.Tensor:
        """A pack for this call alone, kept nowhere. Inside a compiled graph (the operators of
        pairgen/library.py), a pack the module kept would be allocated from a CUDA graph's memory
        pool and outlive the graph's call (which torch.compile's CUDA graphs refuse), and a replay
        would read the pack of the recording, not the parameters as an optimizer step left them."""
        if self._epoch != STRUCTURE_EPOCH[0]:
            self._resolve()
        with torch.no_grad():
            return self._pack([p.detach() for p in self.parameters()])

    def _unversioned(self) -> None:
        """Parameters created under torch.inference_mode (a module built or moved there) carry no
        version counter, so an in-place update cannot be seen: they are repacked on every call,
        which is correct but costs a few small kernels per call. Said once per module."""
        self._warn_once("unversioned", "pairgen: this module's parameters were created under torch.inference_mode, "
                        "so in-place updates to them cannot be detected and its weights are repacked on every "
                        "call; build or move the module outside inference_mode to avoid that cost")
        return None

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, stacklevel=5)

    def __getstate__(self):  # a copy or a pickle resolves and repacks on first use
        state = dict(self.__dict__)
        state.update(_epoch=None, _data_epoch=None, _slots=(), _params=[], _owners=(), _names=(), _key=None,
                     _packed=None)
        return state
