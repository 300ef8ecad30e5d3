"""What every op provides: its spec (data) and the plumbing its drop-in module shares."""
from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import math
import random
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class DeviceLimits:
    """What a restriction may depend on. Defaults are the H100/H200 (sm_90) values, used where
    no GPU is present (dry runs, CI)."""

    max_smem_per_block: int = 227 * 1024
    smem_per_sm: int = 228 * 1024
    max_threads_per_sm: int = 2048
    sm_count: int = 132


@dataclass(frozen=True)
class Restriction:
    """A predicate on a plan; a point that fails one is pruned before it is compiled."""

    reason: str
    holds: Callable[["Plan", DeviceLimits], bool]


@dataclass(frozen=True)
class Strategy:
    """One template and its search space (a dict of choices per parameter)."""

    name: str
    space: dict[str, tuple]
    restrictions: tuple[Restriction, ...] = ()
    summary: str = ""


@dataclass
class Plan:
    """A point of the search space made concrete for channel widths: what the template needs
    (context), and how to launch it (threads, shared memory, a grid for each (B, N))."""

    op: str
    strategy: str
    params: dict
    widths: dict
    context: dict
    threads: int
    smem_bytes: int
    # (B, N, SM count, blocks resident per SM) -> (blocks to launch, work items the kernel loops over)
    grid: Callable[[int, int, int, int], tuple[int, int]] = field(repr=False)

    @property
    def label(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.strategy}({inner})"


@dataclass(frozen=True)
class Tolerance:
    max_abs: float
    rel_l2: float


@dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float


class OpSpec:
    """Data every op declares; subclasses add plan() (derived template values) and the
    reference/inputs glue. Adding an op = pairgen/ops/<op>.py + templates/<op>/."""

    name: str
    width_names: tuple[str, ...]
    strategies: dict[str, Strategy]
    default_points: tuple[tuple[str, dict], ...]  # tried in order; the first feasible one is used
    presets: dict[str, tuple[dict, ...]]          # tuning shapes: "seed", "real"
    tolerance: dict[str, Tolerance]               # per dtype
    width_defaults: dict[str, int] = {}           # compile-time options a --shape may leave out

    def plan(self, strategy: str, params: dict, widths: dict) -> Plan:
        raise NotImplementedError

    def cost(self, shape: dict) -> Cost:
        raise NotImplementedError

    def make_module(self, widths: dict, generator: torch.Generator) -> nn.Module:
        raise NotImplementedError

    def make_inputs(self, shape: dict, generator: torch.Generator, distribution: str = "normal") -> tuple:
        raise NotImplementedError

    def make_reference(self, module: nn.Module) -> nn.Module:
        raise NotImplementedError

    #: peers beyond eager and torch.compile that scripts/bench.py can time for this op
    extra_peer_names: tuple[str, ...] = ()

    def extra_peer(self, name: str, module: nn.Module, inputs: tuple):
        """A callable timing peer `name` on these inputs, or a string saying why there is none
        here (a library that is not installed, a shape it does not support)."""
        return f"{self.name} has no peer {name!r}"

    # -- shared behaviour --------------------------------------------------------------------

    def infeasible(self, plan: Plan, limits: DeviceLimits) -> list[str]:
        """Reasons the plan cannot run (empty when it can)."""
        strategy = self.strategies[plan.strategy]
        return [r.reason for r in strategy.restrictions if not r.holds(plan, limits)]

    def default_plan(self, widths: dict, limits: DeviceLimits) -> Plan | None:
        for strategy, params in self.default_points:
            plan = self.plan(strategy, params, widths)
            if not self.infeasible(plan, limits):
                return plan
        return None

    def points(self, strategy: str):
        """Every point of a strategy's space, feasible or not."""
        space = self.strategies[strategy].space
        names = sorted(space)
        for values in itertools.product(*(space[n] for n in names)):
            yield dict(zip(names, values))

    def feasible_plans(self, strategy: str, widths: dict, limits: DeviceLimits) -> list[Plan]:
        plans = (self.plan(strategy, params, widths) for params in self.points(strategy))
        return [plan for plan in plans if not self.infeasible(plan, limits)]

    def sample_plans(self, strategy: str, widths: dict, k: int, rng: random.Random,
                     limits: DeviceLimits = DeviceLimits()) -> list[Plan]:
        """The strategy's feasible default points, then k feasible points drawn by rng."""
        defaults = [self.plan(s, p, widths) for s, p in self.default_points if s == strategy]
        feasible = self.feasible_plans(strategy, widths, limits)
        return [p for p in defaults if not self.infeasible(p, limits)] + rng.sample(feasible, min(k, len(feasible)))

    def widths_of(self, shape: dict) -> dict:
        return {name: int(shape[name]) for name in self.width_names}

    #: Per strategy, parameters added after tuned entries existed, each with the value that
    #: reproduces the kernel those entries ran: an entry (or a study's trial) without them plans.
    added_params: dict[str, dict] = {}

    def with_added_params(self, strategy: str, params: dict) -> dict:
        return {**self.added_params.get(strategy, {}), **params}

    def complete_point(self, strategy: str, params: dict) -> dict | None:
        """An older point in today's space: parameters added since take the value that reproduces
        the old kernel (added_params), else the strategy's default point's, else the first in the
        space; parameters gone are dropped. None when the strategy is gone or a kept value is no
        longer in the space."""
        space = self.strategies[strategy].space if strategy in self.strategies else None
        if space is None or any(k in space and v not in space[k] for k, v in params.items()):
            return None
        default = {**next((p for s, p in self.default_points if s == strategy), {}), **self.added_params.get(strategy, {})}
        return {k: params[k] if k in params else default.get(k, values[0]) for k, values in space.items()}

    def restarts(self, strategy: str, params: dict) -> list[dict]:
        """Where a re-tune starts from an older winner: the point completed to today's space, then
        the same point with each other value of every parameter it did not have (one at a time), so
        the new parameter is measured against the old winner whatever the sampler does next."""
        completed = self.complete_point(strategy, params)
        if completed is None:
            return []
        space = self.strategies[strategy].space
        return [completed] + [{**completed, k: v} for k in space if k not in params for v in space[k] if v != completed[k]]

    def check_point(self, strategy: str, params: dict) -> None:
        if strategy not in self.strategies:
            raise ValueError(f"{self.name}: unknown strategy {strategy!r}; known: {sorted(self.strategies)}")
        space = self.strategies[strategy].space
        if set(params) != set(space):
            raise ValueError(f"{self.name}/{strategy}: params {sorted(params)} != space {sorted(space)}")
        for key, value in params.items():
            if value not in space[key]:
                raise ValueError(f"{self.name}/{strategy}: {key}={value!r} not in {space[key]}")


def section_offsets(sizes: list[tuple[str, int]]) -> dict[str, int]:
    """Offsets (in floats) of named sections packed one after another, each starting on a
    16-byte boundary so kernels can read it with float4 loads; "total" is the packed length."""
    offsets, at = {}, 0
    for name, size in sizes:
        offsets[name] = at
        at = align(at + size)
    offsets["total"] = at
    return offsets


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align(n: int, to: int = 4) -> int:
    return ceil_div(n, to) * to


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def n_bucket(n: int) -> int:
    """Tuned entries are keyed by the power of two nearest to N (in log scale)."""
    return 1 << max(0, round(math.log2(max(1, n))))


class ReferenceBackward(torch.autograd.Function):
    """Forward through the kernel; backward by recomputing the reference under autograd.
    Gradients are therefore exactly the reference's, at the cost of one recomputation."""

    @staticmethod
    def forward(ctx, module, n_inputs, *tensors):
        ctx.module, ctx.n_inputs = module, n_inputs
        ctx.save_for_backward(*tensors)
        return module._launch(*tensors[:n_inputs])

    @staticmethod
    def backward(ctx, grad_out):
        tensors = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors[: ctx.n_inputs]]
        params = list(tensors[ctx.n_inputs:])
        wanted = [t for t in inputs + params if t.requires_grad]
        with torch.enable_grad():
            out = ctx.module.reference_forward(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        return (None, None, *[next(grads) if t.requires_grad else None for t in inputs + params])


_data_ptr = torch.Tensor.data_ptr


class PackedParameters:
    """A module's parameters repacked into a kernel's layout, rebuilt only when one of them
    changed: replaced or moved (data pointer) or updated in place (version counter).

    Holds the submodules' `_parameters` dicts, so a parameter replaced by assignment is seen,
    without nn.Module.__getattr__ on the hot path (2.4 us per submodule lookup, measured)."""

    def __init__(self, slots, pack: Callable[[list], torch.Tensor]):
        self._slots = tuple((module._parameters, name) for module, name in slots)
        self._pack = pack
        self._key = None
        self._packed = None
        self._warned_unversioned = False

    def parameters(self) -> list:
        return [owner[name] for owner, name in self._slots]

    def get(self) -> torch.Tensor:
        params = self.parameters()
        try:
            key = [p._version for p in params]
        except RuntimeError:  # an inference tensor (made under torch.inference_mode) has no version
            key = self._unversioned()
        else:
            key += map(_data_ptr, params)
        if key is None or key != self._key:
            with torch.no_grad():
                self._packed = self._pack([p.detach() for p in params])
            self._key = key
        return self._packed

    def _unversioned(self) -> None:
        """Parameters created under torch.inference_mode (a module built or moved there) carry no
        version counter, so an in-place update cannot be seen: they are repacked on every call,
        which is correct but costs a few small kernels per call. Said once per module."""
        if not self._warned_unversioned:
            self._warned_unversioned = True
            warnings.warn("pairgen: this module's parameters were created under torch.inference_mode, so "
                          "in-place updates to them cannot be detected and its weights are repacked on every "
                          "call; build or move the module outside inference_mode to avoid that cost",
                          stacklevel=4)
        return None

    def __getstate__(self):  # a copy or a pickle repacks on first use
        return {**self.__dict__, "_key": None, "_packed": None}


@functools.cache
def _runtime_module():
    """pairgen.runtime, which imports this module: imported on first use, then one cached call
    (an import statement in variant_for cost ~0.4 us per module call on the H200 host)."""
    return importlib.import_module("pairgen.runtime")


class KernelModule:
    """Mixin for drop-in modules: decides kernel or reference, and keeps the variant choice.

    A subclass provides: `op` (its OpSpec), `widths`, `reference_forward(*inputs)`,
    `_launch(*inputs, out=None)`, and validates its inputs before calling `_dispatch`.
    """

    op: OpSpec
    _forced_plan = None  # set by the tuner and the tests to run one specific variant
    _variant_cache: dict | None = None  # (device index, N) -> variant, valid for one runtime generation

    # Loaded kernels and packed weights belong to this process and device: a copy or a pickle
    # (an EMA copy of the model, torch.save) starts without them and rebuilds them on first use.
    _RUNTIME_STATE = ("_variant_cache", "_forced_plan")

    def __getstate__(self):
        state = dict(self.__dict__)
        for name in self._RUNTIME_STATE:
            if name in state:
                state[name] = None
        return state

    def force_variant(self, variant) -> None:
        """Run `variant` (a runtime.Variant) instead of the tuned choice; None restores it."""
        self._forced_plan = variant

    def uses_kernel(self, *tensors: torch.Tensor) -> bool:
        """CUDA float32 runs a kernel. Callers have validated the inputs first (one device,
        the parameters' dtype), so the first tensor speaks for all of them."""
        first = tensors[0]
        return first.is_cuda and first.dtype is torch.float32

    def variant_for(self, n: int, device: torch.device):
        """The variant for length n on this device (None: run the reference). Cached on the
        module: the host time of a call is what small shapes are made of (a runtime.select per
        call cost ~4 us there)."""
        if self._forced_plan is not None:
            return self._forced_plan
        runtime = _runtime_module()
        cache = self._variant_cache
        if cache is None or cache.get("generation") != runtime.generation():
            cache = self._variant_cache = {"generation": runtime.generation()}
        key = (device.index or 0, n)
        variant = cache.get(key, cache)
        if variant is cache:
            variant = cache[key] = runtime.select(self.op, "float32", self.widths, n, key[0])
        return variant

    def _dispatch(self, *inputs: torch.Tensor):
        if not self.uses_kernel(*inputs):
            return self.reference_forward(*inputs)
        first = inputs[0]
        variant = self.variant_for(first.shape[1], first.device)
        if variant is None:
            return self.reference_forward(*inputs)  # disabled, or no kernel fits these widths
        if torch.is_grad_enabled() and self._needs_grad(inputs):
            return ReferenceBackward.apply(self, len(inputs), *inputs, *self.parameters())
        return self._launch(*inputs, variant=variant)

    def _needs_grad(self, inputs) -> bool:
        return any(t.requires_grad for t in inputs) or any(p.requires_grad for p in self.parameters())


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_float_tensor(name: str, t, rank: int, param: torch.Tensor) -> None:
    """Type, dtype, rank, and the device of `param` (one of the module's parameters)."""
    if isinstance(t, torch.Tensor) and t.dtype is param.dtype and t.dim() == rank and t.device == param.device:
        return  # the common case, in ~1 us: the checks below only build the message
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")
    if t.device != param.device:
        raise ValueError(f"{name} is on {t.device} but the module's parameters are on {param.device}")
    if t.dtype != param.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but the module's parameters are {param.dtype}")


@contextlib.contextmanager
def fp32_matmul():
    """cuBLAS matmuls inside run in fp32 even where the caller allowed TF32; the caller's setting
    is restored after. Through the fp32_precision API where torch has it (2.9+): there, reading the
    legacy allow_tf32 raises once a caller has used the new API, so the legacy flag would break
    such callers; the new API read and written this way leaves a legacy caller's flag as it was."""
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    saved = matmul.fp32_precision if new_api else matmul.allow_tf32
    off = "ieee" if new_api else False
    if saved != off:
        setattr(matmul, "fp32_precision" if new_api else "allow_tf32", off)
    try:
        yield
    finally:
        if saved != off:
            setattr(matmul, "fp32_precision" if new_api else "allow_tf32", saved)


def cuda_bool(value) -> str:
    """A Python truth value as a C++ literal for a template."""
    return "true" if value else "false"


def padded_stride(width: int) -> int:
    """A shared-memory row stride >= width with stride % 32 == 4: tile_gemm.cuh's float4 reads of
    consecutive rows then land in distinct banks."""
    return align(width, 32) + 4


def contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with its data on a 16-byte boundary, copied only when it is not: the kernels
    read rows with float4 loads and cp.async, which fault on a view that starts mid-vector (a
    contiguous slice such as x[1:] of a flat tensor, or a narrowed last dimension made contiguous)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def random_tensor(shape, generator: torch.Generator, distribution: str = "normal") -> torch.Tensor:
    """Test data per OPS.md: normal, or heavy-tailed (a Cauchy clipped to +-50). Never zeros."""
    if distribution == "normal":
        return torch.randn(shape, generator=generator)
    if distribution == "cauchy":
        u = torch.rand(shape, generator=generator)
        return torch.tan(torch.pi * (u - 0.5)).clamp(-50.0, 50.0)
    raise ValueError(f"unknown distribution {distribution!r}")


def randomize_parameters(module: nn.Module, generator: torch.Generator) -> None:
    """Random weights of the default init's scale, and LayerNorm affine away from (1, 0)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            scale = (1.0 / fan_in) ** 0.5 if p.dim() > 1 else 0.5
            p.copy_(torch.randn(p.shape, generator=generator) * scale + (1.0 if name.endswith("layer_norm.weight") else 0.0))
