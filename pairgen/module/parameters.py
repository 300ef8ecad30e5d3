"""A module's parameters as its kernels read them: found again on every call, so whatever the user
did between calls (an optimizer step, an EMA update through `.data`, load_state_dict, a replaced
parameter or submodule, a parametrization) the call reads the weights as they are now. Nothing is
cached but where they live: each call checks, with C-level identity comparisons, that every
submodule and parameter on the way is the object it was, and looks them up again where one is not.
No torch class or global hook is touched (docs/architecture.md, section 5)."""
from __future__ import annotations

import operator
import warnings
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..ops.packing import Sources


class CallWeights(NamedTuple):
    """The weights one call runs on: the tensors, and where each weight the op names lies among
    them (packing.Sources): a module's own parameters, or a functional caller's tensors."""
    tensors: tuple
    sources: Sources


class ParameterSlots:
    """The parameters `names` (dotted state_dict names) of `root`, as they are at each call."""

    def __init__(self, root: nn.Module, names):
        self._root = root
        self.names = tuple(names)
        self.sources = Sources.each_its_own(self.names)
        self._warned: set = set()
        self._owners, self._keys, self._objects = (), (), ()  # every edge on every path: dict, key, object
        self._params = None  # CallWeights of the last resolve; None: resolve (or computed weights)

    def _resolve(self) -> None:
        owners, keys, objects, params = [], [], [], []
        computed = False
        for dotted in self.names:
            *path, name = dotted.split(".")
            module = self._root
            for part in path:
                child = module._modules[part]
                owners.append(module._modules), keys.append(part), objects.append(child)
                module = child
            param = module._parameters.get(name)
            if param is None or parametrize.is_parametrized(module, name):
                computed = True  # a parametrization, or the old weight_norm's hook: computed per call
                self._warn_once(f"pairgen: {dotted} is computed (a parametrization or a weight-norm hook), so it "
                                "is computed on every call")
            else:
                owners.append(module._parameters), keys.append(name), objects.append(param)
            params.append(param)
        self._owners, self._keys, self._objects = tuple(owners), tuple(keys), tuple(objects)
        self._params = None if computed else CallWeights(tuple(params), self.sources)

    def weights(self) -> CallWeights:
        """The parameters now, with their Sources."""
        params = self._params
        if params is not None and all(map(operator.is_, map(dict.get, self._owners, self._keys), self._objects)):
            return params
        self._resolve()
        if self._params is not None:
            return self._params
        return CallWeights(tuple(self._computed_values()), self.sources)

    def _computed_values(self) -> list:
        values = []
        for dotted in self.names:
            *path, name = dotted.split(".")
            owner = self._root.get_submodule(".".join(path)) if path else self._root
            if name in owner._parameters and not parametrize.is_parametrized(owner, name):
                values.append(owner._parameters[name])
                continue
            for hook in list(owner._forward_pre_hooks.values()):  # the old weight_norm computes in a hook
                hook(owner, ())
            values.append(getattr(owner, name))
        return values

    def anchor(self) -> torch.Tensor:
        """One parameter as it is now: input validation compares dtype and device with it."""
        return self.weights().tensors[0]

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=6)

    def __getstate__(self):  # a copy or a pickle finds its parameters again on first use
        state = dict(self.__dict__)
        state.update(_owners=(), _keys=(), _objects=(), _params=None)
        return state
