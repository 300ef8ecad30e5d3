"""What an op declares, as data: strategies, search spaces, restrictions, plans and the kernels a
plan launches. Imports no torch (and nothing else of pairgen), so compile workers, dry runs and
`pairgen-tune --status` stay light, and every other module can build on it without a cycle.

The Python <-> CUDA contract lives here: a Plan lists every kernel its variant launches (name,
block, shared memory, grid as a function of the call's shape, argument kinds), and
codegen.check_contract compares that list with the rendered source's `extern "C"` signatures
before anything is compiled.
"""
from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from . import precision as _precision

#: Argument kinds of a kernel's parameters: a device pointer, a 32-bit int, a 64-bit int.
ARG_KINDS = ("ptr", "i32", "i64")
#: How a kernel is launched: plainly, cooperatively (all blocks resident: a grid barrier), as a
#: programmatic dependent of the kernel before it in the stream (sm_90+; it waits with pdl_wait()),
#: or cooperatively where the whole grid fits on the GPU at once and plainly where it does not
#: ("cooperative_or_plain": the bound launch's mode says which, and the runner tells the kernel).
LAUNCH_MODES = ("plain", "cooperative", "programmatic", "cooperative_or_plain")


@dataclass(frozen=True)
class DeviceLimits:
    """What a restriction may depend on. Defaults are the H100/H200 (sm_90) values, used where
    no GPU is present (dry runs, CI)."""

    max_smem_per_block: int = 227 * 1024
    smem_per_sm: int = 228 * 1024
    max_threads_per_sm: int = 2048
    sm_count: int = 132
    arch: str = "sm_90"  # the device's compute capability as a target name


#: (B, N, SM count, blocks of this kernel resident per SM) -> (blocks to launch, the trailing
#: shape arguments the kernel takes, e.g. (B, N, tiles)).
GridFn = Callable[[int, int, int, int], "tuple[int, tuple[int, ...]]"]


#: The (args, mode) pairs a Kernel has already found well formed.
_CHECKED_CONTRACTS: set = set()


@dataclass(frozen=True)
class Kernel:
    """One __global__ function a variant launches: its declared contract with the template."""

    name: str
    threads: int
    smem_bytes: int
    #: "kind name" per argument (kind in ARG_KINDS, name as the template's signature names it), in
    #: the order of the C signature: codegen.check_contract compares both, so two arguments of one
    #: kind declared in each other's place are caught when the plan is rendered.
    args: tuple[str, ...]
    grid: GridFn
    mode: str = "plain"

    def __post_init__(self):
        if (self.args, self.mode) in _CHECKED_CONTRACTS:  # (a space's enumeration builds many alike)
            return
        bad = [a for a in self.args if len(a.split()) != 2 or a.split()[0] not in ARG_KINDS]
        if bad or self.mode not in LAUNCH_MODES:
            raise ValueError(f"kernel {self.name}: arguments must be \"kind name\" with a kind in {ARG_KINDS}, and "
                             f"the mode in {LAUNCH_MODES}; got args {self.args}, mode {self.mode!r}")
        _CHECKED_CONTRACTS.add((self.args, self.mode))

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(a.split()[0] for a in self.args)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.split()[1] for a in self.args)


@dataclass(frozen=True)
class Restriction:
    """A predicate on a plan; a point that fails one is pruned before it is compiled. on_point: it
    reads only the plan's params and widths (and the limits), not what the strategy derives, so
    feasible_plans can prune a point by it before building the point's plan."""

    reason: str
    holds: Callable[["Plan", DeviceLimits], bool]
    on_point: bool = False


@dataclass(frozen=True)
class PointProbe:
    """What an on_point restriction reads of a plan, before the plan is built."""

    params: dict
    widths: dict


class _Unassigned(Exception):
    """An on_point restriction read a parameter that a partial point has not assigned yet."""


def _most_read_first(space: dict, checks: tuple, widths: dict, limits, added: dict) -> list:
    """The space's parameters in the order the enumeration assigns them: those that more on_point
    restrictions read first (on the space's first point and a few others), so that the
    restrictions answer, and prune, near the top of the enumeration; ties by name."""
    names = sorted(space)
    reads = {name: 0 for name in names}
    for k in range(4):  # the first point, then points with each parameter at another of its values
        point = {**added, **{name: space[name][(k * (i + 1)) % len(space[name])] for i, name in enumerate(names)}}
        for holds in checks:
            watched = _WatchedParams(point)
            holds(PointProbe(watched, widths), limits)
            for name in watched.read & reads.keys():
                reads[name] += 1
    return sorted(names, key=lambda name: (-reads[name], name))


class _WatchedParams(dict):
    """A point's params that note each parameter a restriction reads (`read`), and raise
    _Unassigned on reading one of `pending` (not yet assigned while feasible_plans enumerates the
    point): a restriction that answers without one holds or fails for every completion of it."""

    def __init__(self, params: dict, pending: frozenset = frozenset()):
        super().__init__(params)
        self.pending, self.read = pending, set()

    def _reading(self, name) -> None:
        if name in self.pending:
            raise _Unassigned(name)
        self.read.add(name)

    def __getitem__(self, name):
        self._reading(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        self._reading(name)
        return super().get(name, default)

    def __contains__(self, name):
        self._reading(name)
        return super().__contains__(name)


@dataclass
class Plan:
    """A point of the search space made concrete for channel widths: what the template needs
    (context) and every kernel the variant launches (the first is its main kernel)."""

    op: str
    strategy: str
    params: dict
    widths: dict
    context: dict
    kernels: tuple[Kernel, ...]
    precision: str = "float32"
    #: The main kernel's C name (kernel_name; empty: the strategy's own, kernel_base_name).
    kernel_name: str = ""

    @property
    def main(self) -> Kernel:
        return self.kernels[0]

    @functools.cached_property
    def build_key(self) -> tuple:
        """What makes two plans one build (runtime's cache of variants): the point and widths, and the
        context too, since a strategy's switch (a module-level constant its derive reads) makes
        another kernel of the same point. Made once a plan: a training step's lookup repeats it."""
        return (self.op, self.strategy, self.precision, tuple(sorted(self.params.items())),
                tuple(sorted(self.widths.items())), repr(sorted(self.context.items())))

    @property
    def threads(self) -> int:
        return self.kernels[0].threads

    @property
    def smem_bytes(self) -> int:
        return self.kernels[0].smem_bytes

    @property
    def label(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        where = "" if self.precision == "float32" else f"[{self.precision}]"
        return f"{self.strategy}{where}({inner})"


#: (params, widths, base kernel name) -> (template context, the kernels launched, main first).
#: widths holds the op's width_names as ints and "precision" (a str).
DeriveFn = Callable[[dict, dict, str], "tuple[dict, tuple[Kernel, ...]]"]


@dataclass(frozen=True)
class Strategy:
    """One template and its search space (a dict of choices per parameter), declared in one file
    (pairgen/ops/<op>/strategies/<name>.py) with what runs it. `derive` turns a point into the
    template's context and the kernels it declares; `run` runs a call on a variant of it."""

    name: str
    space: dict[str, tuple]
    derive: DeriveFn
    restrictions: tuple[Restriction, ...] = ()
    summary: str = ""
    #: The precisions it computes in (tuned keys' dtype): "float32" is exact fp32, no TF32.
    precisions: tuple[str, ...] = ("float32",)
    #: What runs a call: run(module, variant, weights, *inputs, out) packs the weights, makes the
    #: scratch, launches the variant's kernels by argument name and runs any host step between
    #: them (a cuBLAS product). None: declared for rendering only (tests' stand-in ops).
    run: Callable | None = None
    #: The precisions whose calls can be recorded and replayed in compiled code (pairgen/fastcall.py):
    #: those where `run` launches only pairgen kernels and noted 16-bit products on the inputs, the
    #: weights, the output, buffers the module holds and per-call buffers it notes.
    records: tuple[str, ...] = ()
    #: The 16-bit precisions whose `run` writes an fp32 `out` itself (a call that wants an fp32
    #: output: KernelModule.output_dtype); elsewhere such a call's output is cast.
    fp32_output: tuple[str, ...] = ()
    #: Groups of parameters that shape one kernel each (its warps, pass widths, stages). Around the
    #: best point timed so far, the tuner times every feasible change of one group's values
    #: together (tuner.group_neighbours): a kernel's shape often wins only when several of its
    #: parameters change at once, a move a sampler seldom proposes.
    groups: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Tolerance:
    max_abs: float
    rel_l2: float


#: The 16-bit accuracy standard (bf16/fp16 modules): relative L2 against float64 of the same
#: rounded inputs and weights; no elementwise bound (a 16-bit value's own rounding can exceed any).
SIXTEEN_BIT_TOLERANCE = Tolerance(max_abs=float("inf"), rel_l2=1e-2)
#: An fp32 module's call under a 16-bit autocast, against the float64 reference of its fp32 weights
#: and inputs: cuEquivariance's bf16 triangle update measured 2.6e-2 there (H200, N = 128-512), so an
#: fp32 call under autocast must do no worse.
AUTOCAST_TOLERANCE = Tolerance(max_abs=float("inf"), rel_l2=2.65e-2)


@dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A package's module-level __getattr__ that imports `exports[name]` (a submodule of `package`)
    when `name` is first read: an op package names its torch half without importing torch."""
    import importlib

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def kernel_base_name(op: str, strategy: str) -> str:
    """The strategy's name for its kernels, as kernels were named before names carried the variant
    (tuned entries recorded under it still match: codegen.hashes_as_tuned)."""
    return f"pairgen_{op}_{strategy}"


def kernel_name(op: str, strategy: str, precision: str, params: dict) -> str:
    """A variant's main kernel name: op, strategy, precision and every parameter of its point
    (booleans as 0/1), so that a profile or a log says which variant ran, e.g.
    pairgen_trimul_wgmma_bf16_o_groups3_o_stages1_o_wn64_p_groups4_p_stages1_p_wn64_swizzle1. A
    variant's other kernels add a suffix (`_output`, `_nodes`, ...)."""
    point = "_".join(f"{name}{int(value)}" for name, value in sorted(params.items()))
    return f"{kernel_base_name(op, strategy)}_{_precision.BY_NAME[precision].short}_{point}"


class OpSpec:
    """Data every op declares, and the behaviour that follows from it. Subclasses (in
    pairgen/ops/<op>/spec.py) set the class attributes and cost(); the op's package binds its torch
    half (the reference module, the drop-in module, the input generator), loaded on first use, so
    the spec alone serves `pairgen-tune --status` and dry runs where torch is not installed."""

    name: str
    width_names: tuple[str, ...]
    strategies: dict[str, Strategy]
    default_points: tuple[tuple[str, dict], ...]  # tried in order; the first feasible one is used
    presets: dict[str, tuple[dict, ...]]          # tuning shapes: "seed", "real"
    tolerance: dict[str, Tolerance]               # per dtype
    width_defaults: dict[str, int] = {}           # compile-time options a --shape may leave out
    #: Options added after tuned keys existed without them: a module's widths and a key carry one
    #: only where it differs from this value, so the keys tuned before it stay what they were.
    optional_widths: dict[str, int] = {}
    #: Per strategy, parameters added after tuned entries existed, each with the value that
    #: reproduces the kernel those entries ran: an entry (or a study's trial) without them plans.
    added_params: dict[str, dict] = {}
    #: peers beyond eager and torch.compile that scripts/bench.py can time for this op
    extra_peer_names: tuple[str, ...] = ()
    #: The precision plans are made in where a caller names none (the view's, in a PrecisionView).
    precision: str | None = None

    #: () -> (reference class, drop-in module class, make_inputs, extra_peer or None): see bind()
    _load: Callable | None = None
    _loaded: tuple | None = None

    def bind(self, load: Callable[[], tuple]) -> "OpSpec":
        """Register the function that imports the op's torch half; it runs on first use."""
        self._load, self._loaded = load, None
        return self

    def _torch_half(self) -> tuple:
        if self._loaded is None:
            self._loaded = self._load()
        return self._loaded

    @property
    def reference_class(self):
        return self._torch_half()[0]

    @property
    def module_class(self):
        return self._torch_half()[1]

    # ---- what a subclass provides ------------------------------------------------------------

    def constructor_args(self, widths: dict) -> dict:
        """The modules' constructor keywords for these widths."""
        raise NotImplementedError

    def cost(self, shape: dict) -> Cost:
        raise NotImplementedError

    # ---- plans -----------------------------------------------------------------------------

    def strategies_for(self, precision: str) -> list[str]:
        """The strategies that compute in `precision`, in declaration order."""
        return [name for name, s in self.strategies.items() if precision in s.precisions]

    @property
    def precisions(self) -> tuple[str, ...]:
        """Every precision some strategy of the op computes in, "float32" first."""
        seen = dict.fromkeys(p for s in self.strategies.values() for p in s.precisions)
        return tuple(sorted(seen, key=lambda p: p != "float32"))

    def at(self, precision: str, require_kernels: bool = True) -> "PrecisionView":
        """The op seen in one precision: what tuning, dry runs and benches of that precision use.
        require_kernels=False: also a precision no strategy computes in (no strategies, no
        default points), for a bench of modules in that dtype."""
        if require_kernels and precision not in self.precisions:
            raise ValueError(f"{self.name} has no kernels in {precision!r}; it has {self.precisions}")
        return PrecisionView(self, precision)

    def _precision_of(self, strategy: str, precision: str | None) -> str:
        """A named precision, else the spec's own (a view's), else the strategy's first."""
        if precision is None:
            precision = self.precision or self.strategies[strategy].precisions[0]
        return precision

    def plan(self, strategy: str, params: dict, widths: dict, precision: str | None = None) -> Plan:
        params = self.with_added_params(strategy, params)
        self.check_point(strategy, params)
        precision = self._precision_of(strategy, precision)
        if precision not in self.strategies[strategy].precisions:
            raise ValueError(f"{self.name}/{strategy} does not compute in {precision!r}; "
                             f"it does {self.strategies[strategy].precisions}")
        w = self.widths_of(widths)
        # An exact (fp32) strategy offered to tf32x3 and tf32 runs its fp32 code, and is named so.
        code_precision = "float32" if "float32" in self.strategies[strategy].precisions else precision
        name = kernel_name(self.name, strategy, code_precision, params)
        context, kernels = self.strategies[strategy].derive(dict(params), {**self.optional_widths, **w, "precision": precision},
                                                            name)
        return Plan(self.name, strategy, dict(params), w, context, tuple(kernels), precision, name)

    def infeasible(self, plan: Plan, limits: DeviceLimits) -> list[str]:
        """Reasons the plan cannot run (empty when it can)."""
        strategy = self.strategies[plan.strategy]
        return [r.reason for r in strategy.restrictions if not r.holds(plan, limits)]

    def default_plan(self, widths: dict, limits: DeviceLimits, precision: str | None = None) -> Plan | None:
        precision = precision or precision_of(self)
        for strategy, params in self.default_points:
            if precision not in self.strategies[strategy].precisions:
                continue
            plan = self.plan(strategy, params, widths, precision)
            if not self.infeasible(plan, limits):
                return plan
        return None

    def points(self, strategy: str):
        """Every point of a strategy's space, feasible or not."""
        space = self.strategies[strategy].space
        names = sorted(space)
        for values in itertools.product(*(space[n] for n in names)):
            yield dict(zip(names, values))

    def feasible_plans(self, strategy: str, widths: dict, limits: DeviceLimits,
                       precision: str | None = None) -> list[Plan]:
        """Every feasible point's plan, in points()'s order. A space can hold millions of points
        and building a plan costs a strategy's derive, so the on_point restrictions prune first
        (points_passing_on_point)."""
        return list(self.iter_feasible_plans(strategy, widths, limits, precision))

    def iter_feasible_plans(self, strategy: str, widths: dict, limits: DeviceLimits, precision: str | None = None):
        """feasible_plans one at a time (a caller that needs only the first few stops early)."""
        plans = (self.plan(strategy, params, widths, precision)
                 for params in self.points_passing_on_point(strategy, widths, limits))
        return (plan for plan in plans if not self.infeasible(plan, limits))

    def points_passing_on_point(self, strategy: str, widths: dict, limits: DeviceLimits):
        """The points that pass every on_point restriction, in points()'s order, without visiting
        each point (_walk_on_point). (The 16-bit triangle update's space holds 28 M points, of which
        under one percent pass.)"""
        space = self.strategies[strategy].space
        canonical = sorted(space)
        index = {name: {value: k for k, value in enumerate(space[name])} for name in canonical}
        passing = list(self._walk_on_point(strategy, widths, limits, lambda name: space[name]))
        passing.sort(key=lambda point: tuple(index[name][point[name]] for name in canonical))
        yield from ({name: point[name] for name in canonical} for point in passing)

    def _walk_on_point(self, strategy: str, widths: dict, limits: DeviceLimits,
                       values_of: Callable[[str], list]) -> Iterator[dict]:
        """The points passing every on_point restriction, depth first: the parameters assigned in
        _most_read_first's order, each one's values in values_of(name)'s order. A restriction is
        tried on the partial point until it answers without reading an unassigned parameter; one
        that fails prunes every completion at once, one that holds is not tried again below."""
        space = self.strategies[strategy].space
        w = self.widths_of(widths)
        added = self.added_params.get(strategy, {})
        checks = tuple(r.holds for r in self.strategies[strategy].restrictions if r.on_point)
        names = _most_read_first(space, checks, w, limits, added)
        pending_after = [frozenset(names[depth + 1:]) for depth in range(len(names))]
        assigned = {name: value for name, value in added.items() if name not in space}

        def undecided_after(depth: int, open_checks: tuple):
            """The checks a partial point through names[depth] leaves open, or None if one fails."""
            probe = PointProbe(_WatchedParams(assigned, pending_after[depth]), w)
            still_open = []
            for holds in open_checks:
                try:
                    if not holds(probe, limits):
                        return None
                except _Unassigned:
                    still_open.append(holds)
            return tuple(still_open)

        def walk(depth: int, open_checks: tuple):
            name = names[depth]
            for value in values_of(name):
                assigned[name] = value
                left = undecided_after(depth, open_checks) if open_checks else ()
                if left is None:
                    continue
                if depth + 1 == len(names):
                    yield {n: assigned[n] for n in names}
                else:
                    yield from walk(depth + 1, left)
            del assigned[name]

        return walk(0, checks)

    #: Complete points nearest_feasible builds and rejects before it gives up.
    REPAIR_LEAVES = 64

    def nearest_feasible(self, strategy: str, params: dict, widths: dict, limits: DeviceLimits,
                         precision: str | None = None, accept: Callable[[dict], bool] = lambda params: True) -> dict | None:
        """A feasible point near `params` that `accept` takes, found in milliseconds: the
        parameters, in the order the restrictions read them most, keep the proposal's value wherever
        a completion passes the on_point restrictions, else the value nearest it in the space's
        order (a depth-first walk trying those first). None where the first REPAIR_LEAVES complete
        points all fail the plan's restrictions (or `accept`): the parameters kept first were the
        wrong ones."""
        space = self.strategies[strategy].space

        def nearest_first(name: str) -> list:
            values = list(space[name])
            at = values.index(params[name]) if params.get(name) in values else 0
            return [values[k] for k in sorted(range(len(values)), key=lambda k: abs(k - at))]

        for tried, point in enumerate(self._walk_on_point(strategy, widths, limits, nearest_first)):
            if tried == self.REPAIR_LEAVES:
                return None
            point = {name: point[name] for name in sorted(space)}
            if accept(point) and not self.infeasible(self.plan(strategy, point, widths, precision), limits):
                return point
        return None

    def _point_filter(self, strategy: str, widths: dict, limits: DeviceLimits) -> Callable[[dict], bool]:
        """A test of a point's params against the strategy's on_point restrictions (False: the
        point is infeasible; True: its plan decides), for points drawn at random (sample_plans).
        The restriction that rejected the last point is tried first: neighbouring points tend to
        fail the same one."""
        checks = [r.holds for r in self.strategies[strategy].restrictions if r.on_point]
        w = self.widths_of(widths)

        def may_hold(params: dict) -> bool:
            nonlocal checks
            probe = PointProbe(self.with_added_params(strategy, params), w)
            for k, holds in enumerate(checks):
                if not holds(probe, limits):
                    if k:  # the one that rejected goes first (a new list: a caller in another thread keeps its own)
                        checks = [holds, *checks[:k], *checks[k + 1:]]
                    return False
            return True

        return may_hold

    #: Random draws per wanted point before sample_plans enumerates the feasible points instead. A
    #: draw costs microseconds; an enumeration from a fraction of a second, where the restrictions
    #: prune early, to a few seconds where many points pass (the trimul wgmma space holds ~3.5 M
    #: points, one in ~5500 feasible at P = 48, H = 24: 10 000 draws find one with odds of about 0.84).
    SAMPLE_DRAWS_PER_POINT = 10_000

    def sample_plans(self, strategy: str, widths: dict, k: int, rng: random.Random,
                     limits: DeviceLimits = DeviceLimits(), precision: str | None = None) -> list[Plan]:
        """The strategy's feasible default points, then k distinct feasible points drawn by rng,
        uniformly: points drawn from the whole space and the infeasible ones rejected (a space can
        hold millions of points, and building every plan costs seconds), or, where too few of
        the draws are feasible, a sample of every feasible point."""
        defaults = [self.plan(s, p, widths, precision) for s, p in self.default_points if s == strategy]
        space = self.strategies[strategy].space
        names = sorted(space)
        may_hold = self._point_filter(strategy, widths, limits)
        drawn, seen = [], set()
        for _ in range(self.SAMPLE_DRAWS_PER_POINT * k):
            if len(drawn) == k:
                break
            values = tuple(rng.choice(space[n]) for n in names)
            if values in seen:
                continue
            seen.add(values)
            params = dict(zip(names, values))
            if not may_hold(params):
                continue
            plan = self.plan(strategy, params, widths, precision)
            if not self.infeasible(plan, limits):
                drawn.append(plan)
        if len(drawn) < k:
            feasible = self.feasible_plans(strategy, widths, limits, precision)
            drawn = rng.sample(feasible, min(k, len(feasible)))
        return [p for p in defaults if not self.infeasible(p, limits)] + drawn

    def widths_of(self, shape: dict) -> dict:
        """The widths as a tuned key names them: every width name, then the optional ones that
        differ from their default."""
        widths = {name: int(shape[name]) for name in self.width_names}
        widths.update({name: int(shape[name]) for name, default in self.optional_widths.items()
                       if int(shape.get(name, default)) != default})
        return widths

    @property
    def all_width_names(self) -> tuple[str, ...]:
        """The names a module's widths may hold: width_names, then the optional ones."""
        return self.width_names + tuple(self.optional_widths)

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
            if value not in space[key] or type(value) is not type(space[key][space[key].index(value)]):
                raise ValueError(f"{self.name}/{strategy}: {key}={value!r} not in {space[key]}")

    # ---- modules and data (torch, imported when used) ----------------------------------------

    def make_module(self, widths: dict, generator):
        from .testdata import randomize_parameters

        module = self.module_class(**self.constructor_args(widths))
        randomize_parameters(module, generator)
        return module

    def make_reference(self, module):
        """A plain reference module holding the same weights (the peers run this)."""
        ref = self.reference_class(**self.constructor_args(module.widths))
        ref.load_state_dict(module.state_dict())
        return ref.to(next(module.parameters()).device)

    def make_inputs(self, shape: dict, generator, distribution: str = "normal") -> tuple:
        return self._torch_half()[2](shape, generator, distribution)

    def extra_peer(self, name: str, module, inputs: tuple, train: bool = False):
        """A callable timing peer `name` on these inputs, or a string saying why there is none
        here (a library that is not installed, a shape it does not support). train: the peer's
        weights want gradients (a backward through it computes them, as the module's does)."""
        peer = self._torch_half()[3]
        if name not in self.extra_peer_names or peer is None:
            return f"{self.name} has no peer {name!r}"
        return peer(name, module, inputs, train=train)


def precision_of(spec) -> str:
    """The precision an op spec or a PrecisionView tunes, benches and keys entries in: the view's,
    else exact fp32 (an OpSpec's `precision` is None: its plans take each strategy's first)."""
    return spec.precision or "float32"


class PrecisionView:
    """An op's spec in one precision (a tuned key's dtype): its strategies and default points are
    those that compute in it, and its plans are made in it; everything else is the op's. The tuner,
    the dry runs and the bench work on views, so none of them names a precision twice."""

    def __init__(self, spec: OpSpec, precision: str):
        self._spec, self.precision = spec, precision
        self.op_spec = spec  # the whole op, every precision's strategies
        self.strategies = {n: s for n, s in spec.strategies.items() if precision in s.precisions}
        self.default_points = tuple((s, p) for s, p in spec.default_points if s in self.strategies)

    def __getattr__(self, name: str):
        return getattr(self._spec, name)

    @property
    def base(self) -> OpSpec:
        return self._spec

    def plan(self, strategy: str, params: dict, widths: dict, precision: str | None = None) -> Plan:
        return self._spec.plan(strategy, params, widths, precision or self.precision)

    def default_plan(self, widths: dict, limits: DeviceLimits, precision: str | None = None) -> Plan | None:
        return self._spec.default_plan(widths, limits, precision or self.precision)

    def feasible_plans(self, strategy: str, widths: dict, limits: DeviceLimits, precision: str | None = None):
        return self._spec.feasible_plans(strategy, widths, limits, precision or self.precision)

    def iter_feasible_plans(self, strategy: str, widths: dict, limits: DeviceLimits, precision: str | None = None):
        return self._spec.iter_feasible_plans(strategy, widths, limits, precision or self.precision)

    def nearest_feasible(self, strategy: str, params: dict, widths: dict, limits: DeviceLimits,
                         precision: str | None = None, accept: Callable[[dict], bool] = lambda params: True) -> dict | None:
        return self._spec.nearest_feasible(strategy, params, widths, limits, precision or self.precision, accept)

    def sample_plans(self, strategy: str, widths: dict, k: int, rng: random.Random,
                     limits: DeviceLimits = DeviceLimits(), precision: str | None = None) -> list[Plan]:
        return self._spec.sample_plans(strategy, widths, k, rng, limits, precision or self.precision)


# ---- small arithmetic the specs share ----------------------------------------------------------

def section_offsets(sizes: list[tuple[str, int]], units_per_16_bytes: int = 4) -> dict[str, int]:
    """Offsets of named sections packed one after another, in the sizes' units (floats by default),
    each starting on a 16-byte boundary so kernels can read it with 16-byte loads; "total" is the
    packed length."""
    offsets, at = {}, 0
    for name, size in sizes:
        offsets[name] = at
        at = align(at + size, units_per_16_bytes)
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


def cuda_bool(value) -> str:
    """A Python truth value as a C++ literal for a template."""
    return "true" if value else "false"


def padded_stride(width: int) -> int:
    """A shared-memory row stride >= width with stride % 32 == 4: tile_gemm.cuh's float4 reads of
    consecutive rows then land in distinct banks."""
    return align(width, 32) + 4


def flat_tile_grid(tile: int) -> GridFn:
    """One block per tile of `tile` consecutive pairs of the flattened B*N*N; the kernel takes
    (B, N, tiles) after its pointers."""

    def grid(B, N, sms, resident, _tile=tile):
        tiles = ceil_div(B * N * N, _tile)
        return max(1, tiles), (B, N, tiles)

    return grid


def smem_fits(plan: Plan, limits: DeviceLimits) -> bool:
    """Every kernel of the plan within the per-block shared-memory limit."""
    return all(k.smem_bytes <= limits.max_smem_per_block for k in plan.kernels)


#: What every tensor-core tile strategy (a plan context with "mma_shape": mt 16-row and nt 8-column
#: fragments per warp) must satisfy: its accumulators in registers, its block in shared memory, its
#: persistent grid's blocks resident together.
MMA_TILE_RESTRICTIONS = (
    Restriction("at most 128 accumulators per thread",
                lambda p, _: 4 * p.context["mma_shape"]["mt"] * p.context["mma_shape"]["nt"] <= 128),
    Restriction("shared memory exceeds the per-block limit", smem_fits),
    Restriction("persistent blocks must be co-resident on an SM",
                lambda p, limits: p.params["blocks_per_sm"] * p.smem_bytes <= limits.smem_per_sm),
)


#: Hopper's warpgroup products (wgmma) compile for sm_90a, whose features run on sm_90 only.
WGMMA_ON_SM90 = Restriction("wgmma needs sm_90 (its sm_90a features do not run on later architectures)",
                            lambda p, limits: limits.arch == "sm_90", on_point=True)


def persistent_blocks(num_tiles: int, blocks_per_sm: int, sms: int, resident_per_sm: int) -> int:
    """Blocks of a persistent grid (blocks_per_sm per SM, each looping over tiles), or one block per
    tile (blocks_per_sm 0). Clamped to the blocks that can be resident at once (registers decide
    that only after compilation): a block that waits for a slot would run its tiles last."""
    if not blocks_per_sm:
        return max(1, num_tiles)
    return max(1, min(num_tiles, min(blocks_per_sm, max(1, resident_per_sm)) * sms))


def persistent_tile_grid(tile: int) -> GridFn:
    """As flat_tile_grid, but at most as many blocks as are resident at once: each block loops over
    tiles, so what it stages once (weights kept in shared memory) serves all of them."""

    def grid(B, N, sms, resident, _tile=tile):
        tiles = ceil_div(B * N * N, _tile)
        return max(1, min(tiles, max(1, resident) * sms)), (B, N, tiles)

    return grid


# ---- tensor cores (mma.sync): what the ops' templates/common/mma.cuh.j2 kernels share -----------

#: Precision (a tuned key's dtype) -> the template's MMA_KIND (templates/common/mma.cuh.j2), and
#: the precisions whose operands are 16-bit (else fp32, rounded to TF32 in the kernels): both
#: from pairgen/precision.py.
MMA_KINDS = _precision.MMA_KINDS
HALF_PRECISIONS = _precision.HALF_PRECISIONS


def byte_sections(sizes: list[tuple[str, int]]) -> dict[str, int]:
    """section_offsets in bytes: the tensor-core packs mix 16-bit and fp32 sections."""
    return section_offsets(sizes, units_per_16_bytes=16)


def element_bytes(precision: str) -> int:
    return 2 if precision in HALF_PRECISIONS else 4


def mma_row_bytes(width: int, elem_bytes: int) -> int:
    """Shared row stride of a `width`-element operand row (mma.cuh.j2's MmaRow): k padded to the
    32-byte k-step, then to == 16 (mod 128) bytes."""
    return align(align(width * elem_bytes, 32), 128) + 16
