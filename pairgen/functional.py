"""`pairgen.triangle_multiplicative_update`: the triangle update as a function, with the arguments
of cuEquivariance's function of that name, so a model that calls it can call pairgen by changing
the import.

Its form is the one AlphaFold 3, Boltz and Protenix use: LayerNorm, then fused input projections
`p_in` and `g_in` of width 2H (the first H channels are a, the last H are b), a = p·sigmoid(g)·mask,
the triangle sums, LayerNorm, `p_out`, and the output gated by `g_out` of the normalised input.
That is `TriangleMultiplication(P, H, direction, gate_on="normalized")` with proj_a = p_in[:H],
proj_b = p_in[H:], gate_a = g_in[:H], gate_b = g_in[H:], out_proj = p_out, out_gate = g_out.

The calls it takes are cuEquivariance's: x of shape (..., N, N, P) with any leading dimensions
(flattened into one batch, the result shaped like x); a mask of shape (..., N, N) whose leading
dimensions broadcast to x's (absent, or of size 1), or None (every pair kept); `precision` as
cuEquivariance's TriMulPrecision enum or its name in any case.

How a call runs:
- without gradients (inference), CUDA input: the tuned kernels of a module built once per
  structure (widths, direction, precision, dtypes, which weights are given), run on the caller's
  tensors as they are: each call packs them for the kernels in one launch (no copy is kept, so
  there is nothing to go stale and nothing to rebuild for weights made anew by a torch.cat), and
  a call like an earlier one is replayed from compiled code with the weights as its inputs. CPU
  input runs the reference.
- with gradients wanted (an input or a weight requires grad, grad mode on): the module's closed
  form, its gradients mapped onto the caller's tensors; the PyTorch definition where the closed
  form has no such call (float64, a mask that wants a gradient, under torch.compile, a CPU
  autocast).
- eps other than 1e-5 (the kernels' LayerNorm epsilon): the PyTorch computation.
"""
from __future__ import annotations

import enum
import functools
from collections import OrderedDict

import torch
import torch.nn.functional as F

from .first_use import Pending
from .module import training_replay
from .module.autograd import graphless_gradients
from .module.dispatch import saves_for_backward
from .module.modes import current_autocast
from .module.parameters import CallWeights
from .module.validation import as_mask, check_float_tensor
from .precision import ALIASES, CLOSED_FORM_DTYPES, CUEQUIVARIANCE_ALIASES
from .ops.trimul import packs

#: Weight sets whose modules are kept (least recently used first out).
MAX_MODULES = 16
KERNEL_EPS = 1e-5
#: What an fp32 call computes in (a module's precision= spelling, or "bfloat16"), by cuEquivariance's
#: name (its TriMulPrecision members, any case) or pairgen's (pairgen/precision.py): "default" and
#: "none" are exact fp32, pairgen's default; "bfloat16" computes on the bf16 kernels, as an fp32
#: call under autocast to bf16 does, and answers in fp32 (which the kernels write where they can). float16 is not one (cuEquivariance has no
#: such mode; fp16 inputs compute in their own dtype).
PRECISIONS = {alias: p.spelling for alias, p in {**CUEQUIVARIANCE_ALIASES, **ALIASES}.items()
              if p.module_option or p.name == "bfloat16"}
#: The weights in the AlphaFold 3 layout, in the function's argument order.
_WEIGHT_NAMES = packs.AF3_NAMES
_REQUIRED = ("p_in_weight", "g_in_weight", "p_out_weight", "g_out_weight")

_modules: OrderedDict = OrderedDict()
#: (direction, precision, which weights are None) -> the module whose recording of such a call on
#: given weights (_on_given_weights) _replay tries first.
_replayers: dict = {}
#: A module per structure (_structure_key): its kernels run on the weights each call gives.
_structures: OrderedDict = OrderedDict()


def triangle_multiplicative_update(x: torch.Tensor, direction: str = "outgoing", mask: torch.Tensor | None = None,
                                   norm_in_weight=None, norm_in_bias=None, p_in_weight=None, p_in_bias=None,
                                   g_in_weight=None, g_in_bias=None, norm_out_weight=None, norm_out_bias=None,
                                   p_out_weight=None, p_out_bias=None, g_out_weight=None, g_out_bias=None,
                                   eps: float = 1e-5, precision=None) -> torch.Tensor:
    """x: (..., N, N, P); mask: (..., N, N) (leading dimensions broadcast to x's), bool, integer or
    float, or None (every pair kept); p_in_weight, g_in_weight: (2H, P); p_out_weight: (P, H);
    g_out_weight: (P, P); LayerNorm weights default to ones and biases to zeros; the Linear biases
    are optional. precision: None, a TriMulPrecision member or a name (PRECISIONS, any case); it
    applies to fp32 input: bf16/fp16 inputs compute in their own dtype. Returns the update, shaped
    like x."""
    given = (norm_in_weight, norm_in_bias, p_in_weight, p_in_bias, g_in_weight, g_in_bias, norm_out_weight,
             norm_out_bias, p_out_weight, p_out_bias, g_out_weight, g_out_bias)
    precision = precision_name(precision)
    if _replayers and eps == KERNEL_EPS and mask is not None:
        out = _replay(x, direction, mask, given, precision)
        if out is not None:
            return out
    weights = dict(zip(_WEIGHT_NAMES, given))
    _check(x, direction, mask, weights)
    flat = x if x.dim() == 4 else x.reshape(-1, *x.shape[-3:])
    flat_mask = None if mask is None else _flat_mask(mask, x)
    if precision == "bfloat16" and x.dtype is torch.float32 and x.is_cuda:
        with torch.autocast("cuda", dtype=torch.bfloat16):  # the kernels write the fp32 output where they can
            out = _update(flat, direction, flat_mask, weights, eps, "ieee", out_dtype=torch.float32)
        out = out.to(x.dtype)
    else:
        out = _update(flat, direction, flat_mask, weights, eps, "ieee" if precision == "bfloat16" else precision)
    return out if out.dim() == x.dim() else out.reshape(x.shape)


def _replay(x, direction: str, mask, given: tuple, precision: str):
    """A call like a recorded one (the same direction, precision, weights given and, checked by the
    replay itself, the same shapes, dtypes, device and contiguity of x, the mask and every weight,
    the autocast, and no autograd): replayed from compiled code before any Python check, as a
    module's own repeated calls are. None: take the ordinary path."""
    module = _replayers.get(_replayer_key(direction, precision, given))
    if module is None:
        return None
    return module._fast_forward(x, mask, *(w for w in given if w is not None))


def _replayer_key(direction: str, precision: str, given) -> tuple:
    """The _replayers key of a call: its direction, precision and which weights it gives (in the
    function's argument order): the one spelling both the recording and the lookup use."""
    return (direction, precision, *(w is not None for w in given))


def precision_name(precision) -> str:
    """pairgen's precision for cuEquivariance's `precision` argument: None, an enum member (its
    name) or a string, in any case."""
    if precision is None:
        return "ieee"
    name = precision.name if isinstance(precision, enum.Enum) else precision
    if isinstance(name, str) and name.lower() in PRECISIONS:
        return PRECISIONS[name.lower()]
    raise ValueError(f"precision must be None, a TriMulPrecision member or one of {sorted(PRECISIONS)} (any case), "
                     f"got {precision!r} (bf16/fp16 inputs compute in their own dtype)")


def _flat_mask(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The mask as (B, N, N) for x flattened to (B, N, N, P): its leading dimensions broadcast to
    x's first (a mask without them, or of size 1 in them, is the same for every batch entry)."""
    if x.dim() == 4 and mask.dim() == 3 and mask.shape[0] == x.shape[0]:
        return mask  # the models' call: nothing to broadcast or flatten
    lead, n = x.shape[:-3], x.shape[-3:-1]
    if mask.dim() - 2 == len(lead) and mask.shape[:-2] == lead:
        return mask.reshape(-1, *n)
    return mask.expand(*lead, *n).reshape(-1, *n)


def _update(x, direction: str, mask, weights: dict, eps: float, precision: str,
            out_dtype: "torch.dtype | None" = None) -> torch.Tensor:
    """The update of x (B, N, N, P) with mask (B, N, N) or None; weights as the caller gave them
    (None where left out). out_dtype: what an inference call's kernels write (the module's
    output_dtype; None: the reference's dtype); other paths return the reference's."""
    tensors = [x, *(w for w in weights.values() if w is not None)] + ([mask] if mask is not None else [])
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if eps != KERNEL_EPS or (wants_grad and not closed_form_trains(x, mask)):
        return reference(x, direction, mask, weights, eps)
    if not wants_grad:
        if not x.is_cuda:
            with torch.no_grad():
                return reference(x, direction, mask, weights, eps)
        if mask is None:
            mask = torch.ones(x.shape[:3], dtype=torch.bool, device=x.device)
        return _on_given_weights(x, direction, as_mask(mask), weights, precision, out_dtype)
    if mask is None:
        mask = torch.ones(x.shape[:3], dtype=torch.bool, device=x.device)
    weights = _complete(weights, x)  # the module's LayerNorms hold affines; the kernels' packs fill them
    module = _module_for(weights, direction, precision, x, _key(weights, direction, precision, x))
    # the closed form, its gradients mapped onto the caller's tensors
    names = [n for n, w in weights.items() if w is not None]
    return train_on_callers_weights(module, lambda grads: af3_gradients(grads, names), x, mask,
                                    tuple(weights[n] for n in names))


def train_on_callers_weights(module, gather, x: torch.Tensor, mask: torch.Tensor, given: tuple) -> torch.Tensor:
    """A training call of `module`, whose parameters are views of the caller's weights `given`,
    through ClosedFormForCaller (gather: see there): replayed in compiled code where a recorded
    call like it matches (module/training_replay.py), else on the Python path, recorded where it
    keeps its intermediates."""
    if module._training_replays:
        out = training_replay.replayed_call(module, (x, mask, *given))
        if out is not None:
            return out
    recorder = training_replay.caller_recorder(module, (x, mask), given) if saves_for_backward(module, [x, mask]) else None
    return ClosedFormForCaller.apply(module, gather, current_autocast(), recorder, x, mask, *given)


def closed_form_trains(x: torch.Tensor, mask) -> bool:
    """Whether the closed form computes this call's gradients. Not for a mask that wants its own
    gradient, for dtypes it has no arithmetic for (float64), under a CPU autocast (it computes
    in the dtypes it chooses, where the reference's products follow the autocast), nor under
    torch.compile (it traces the definition; the autograd.Function would have it trace a Python
    backward)."""
    return (x.dtype in CLOSED_FORM_DTYPES and not (mask is not None and mask.requires_grad)
            and not (not x.is_cuda and torch.is_autocast_enabled("cpu")) and not torch.compiler.is_compiling())


class ClosedFormForCaller(torch.autograd.Function):
    """A call with gradients wanted, through a module whose parameters are views of the caller's
    weights: as the module trains (KernelModule's SavedClosedForm), the forward computed the closed
    form's way with its intermediates kept for the backward; or, with the module's
    recompute_for_backward, its kernel forward without autograd and a backward that recomputes
    them (pairgen/ops/trimul/backward.py). `gather(gradients by parameter path, and "input")`
    returns the caller's weights' gradients, in the order of `weights` (e.g. af3_gradients for
    fused 2H-row weights)."""

    @staticmethod
    def forward(ctx, module, gather, autocast, recorder, x, mask, *weights):
        ctx.module, ctx.gather, ctx.autocast, ctx.saved, ctx.recorder = module, gather, autocast, None, recorder
        if saves_for_backward(module, [x, mask]):
            params = {path: p.detach() for path, p in module.named_parameters()}
            def run():
                return module.closed_form_forward((x, mask), params)
            out, ctx.saved = run() if recorder is None else recorder.forward(run)
            return out
        ctx.save_for_backward(x, mask)
        return module(x, mask)

    @staticmethod
    def backward(ctx, grad_out):
        skipped = 4  # module, gather, autocast, recorder
        needs = ctx.needs_input_grad[skipped:]  # x, mask, then the weights
        g = grad_out.detach()
        def run() -> list:  # the gradients of x, the mask (none) and the caller's weights
            by_name = _gradients_by_name(ctx, g)
            caller = ctx.gather(by_name) if any(needs[2:]) else [None] * len(needs[2:])
            return [by_name["input"], None, *caller]
        with torch.no_grad():
            recorder, ctx.recorder = ctx.recorder, None
            grads = run() if recorder is None else recorder.backward(run, g, list(needs))
        grads = [grad if need else None for grad, need in zip(grads, needs)]
        return (None,) * skipped + tuple(graphless_gradients(grad_out, grads))


def _gradients_by_name(ctx, grad_out: torch.Tensor) -> dict:
    """ClosedFormForCaller's gradients by the module's parameter paths, and "input": from the kept
    intermediates, or recomputed from the saved inputs."""
    module = ctx.module
    if ctx.saved is not None:
        return module.saved_gradients(module, ctx.saved, grad_out)
    x, mask = ctx.saved_tensors
    named = list(module.named_parameters())
    grads = module.analytic_gradients([x, mask], [p.detach() for _, p in named], grad_out, autocast=ctx.autocast)
    return {"input": grads[0], **{path: g for (path, _), g in zip(named, grads[2:])}}


def af3_gradients(grads: dict, names: list[str]) -> list:
    """The gradients of the caller's AlphaFold 3-layout weights `names`, in order, from those of the
    TriangleMultiplication's parameters (dotted paths) that af3_parameters made from them: a fused
    2H-row weight's gradient is its a rows' then its b rows'."""
    fused = {"p_in": ("proj_a", "proj_b"), "g_in": ("gate_a", "gate_b")}
    single = {"norm_in": "layer_norm_in", "norm_out": "layer_norm_out", "p_out": "out_proj", "g_out": "out_gate"}
    out = {}
    for name in names:
        part, kind = name.rsplit("_", 1)
        if part in fused:
            out[name] = torch.cat([grads[f"{half}.{kind}"] for half in fused[part]])
        else:
            out[name] = grads[f"{single[part]}.{kind}"]
    return [out[name] for name in names]


def reference(x, direction: str, mask, weights: dict, eps: float = 1e-5) -> torch.Tensor:
    """The definition, in PyTorch (differentiable in every tensor): the path for gradients."""
    P = x.shape[-1]
    H = weights["p_in_weight"].shape[0] // 2
    xn = F.layer_norm(x, (P,), weights["norm_in_weight"], weights["norm_in_bias"], eps)
    ab = F.linear(xn, weights["p_in_weight"], weights["p_in_bias"]) * torch.sigmoid(
        F.linear(xn, weights["g_in_weight"], weights["g_in_bias"]))
    if mask is not None:
        ab = ab * mask.unsqueeze(-1).to(ab.dtype)
    a, b = ab[..., :H], ab[..., H:]
    z = torch.einsum("bikh,bjkh->bijh", a, b) if direction == "outgoing" else torch.einsum("bkih,bkjh->bijh", a, b)
    z = F.layer_norm(z, (H,), weights["norm_out_weight"], weights["norm_out_bias"], eps)
    return F.linear(z, weights["p_out_weight"], weights["p_out_bias"]) * torch.sigmoid(
        F.linear(xn, weights["g_out_weight"], weights["g_out_bias"]))


def _check(x, direction, mask, weights: dict) -> None:
    """Every argument's type, shape, dtype class and device, each error naming the argument at
    fault. Conditions first, messages only on failure: this runs on every call."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or not x.is_floating_point() or x.shape[-3] != x.shape[-2]:
        raise ValueError("x must be a floating-point tensor of shape (..., N, N, P), got "
                         + (f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__))
    if direction != "outgoing" and direction != "incoming":
        raise ValueError(f"direction must be 'outgoing' or 'incoming', got {direction!r}")
    missing = [n for n in _REQUIRED if weights[n] is None]
    if missing:
        raise ValueError(f"pairgen's triangle_multiplicative_update needs the projection weights; missing: {missing}")
    device = x.get_device()
    for name, w in weights.items():
        if w is not None and not (isinstance(w, torch.Tensor) and w.dtype.is_floating_point and w.get_device() == device):
            _explain_weight(name, w, x)
    P, H = x.shape[-1], _hidden_width(weights)
    for name, shape in _shapes(P, H):
        w = weights[name]
        if w is not None and w.shape != shape:
            hint = " (a's H rows, then b's)" if name in ("p_in_weight", "g_in_weight") else ""
            raise ValueError(f"{name} must have shape {shape}{hint} for x with P={P} and H={H}, "
                             f"got {tuple(w.shape)}")
    if mask is not None:
        _check_mask(mask, x)


def _explain_weight(name: str, w, x) -> None:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {w.dtype}")
    raise ValueError(f"{name} is on {w.device} but x is on {x.device}")


@functools.lru_cache(maxsize=64)
def _shapes(P: int, H: int) -> tuple:
    """(weight name, the shape it must have) for widths P and H."""
    return (("p_out_weight", (P, H)), ("p_in_weight", (2 * H, P)), ("g_in_weight", (2 * H, P)),
            ("g_out_weight", (P, P)), ("norm_in_weight", (P,)), ("norm_in_bias", (P,)), ("p_in_bias", (2 * H,)),
            ("g_in_bias", (2 * H,)), ("norm_out_weight", (H,)), ("norm_out_bias", (H,)), ("p_out_bias", (P,)),
            ("g_out_bias", (P,)))


def _hidden_width(weights: dict) -> int:
    """H as most of p_in_weight (2H rows), g_in_weight (2H rows) and p_out_weight (H columns) have it
    (p_out_weight's where none agree), so the error names the weight that disagrees."""
    p_in, g_in, p_out = weights["p_in_weight"], weights["g_in_weight"], weights["p_out_weight"]
    if p_out.dim() == 2 and p_in.shape[0] == g_in.shape[0] == 2 * p_out.shape[1]:
        return p_out.shape[1]  # they agree
    said = [w.shape[0] // 2 for w in (p_in, g_in) if w.dim() == 2 and w.shape[0] % 2 == 0]
    said.append(p_out.shape[-1] if p_out.dim() == 2 else -1)
    return max(set(said), key=lambda h: (said.count(h), h == said[-1]))


def _check_mask(mask, x: torch.Tensor) -> None:
    if (isinstance(mask, torch.Tensor) and mask.shape == x.shape[:-1] and not mask.dtype.is_complex
            and mask.get_device() == x.get_device()):
        return  # the common case; the checks below build the message
    lead, n = tuple(x.shape[:-3]), tuple(x.shape[-3:-1])
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    shape = tuple(mask.shape)
    broadcasts = mask.dim() >= 2 and mask.dim() - 2 <= len(lead) and shape[-2:] == n and all(
        m in (1, l) for m, l in zip(shape[:-2][::-1], lead[::-1]))
    if not broadcasts:
        raise ValueError(f"mask must have shape (..., N, N) = {lead + n} (leading dimensions absent or of size 1 "
                         f"broadcast), got {shape}")
    if mask.dtype.is_complex:
        raise ValueError(f"mask must be bool, integer or floating point, got dtype {mask.dtype}")
    if mask.device != x.device:
        raise ValueError(f"mask is on {mask.device} but x is on {x.device}")


def _complete(weights: dict, x) -> dict:
    """LayerNorm weights and biases that were not given, as the identity affine (ones, zeros)."""
    P, H = x.shape[-1], weights["p_in_weight"].shape[0] // 2
    like = weights["p_in_weight"]
    full = dict(weights)
    for name, size, fill in (("norm_in_weight", P, 1.0), ("norm_in_bias", P, 0.0), ("norm_out_weight", H, 1.0),
                             ("norm_out_bias", H, 0.0)):
        if full[name] is None:
            full[name] = torch.full((size,), fill, dtype=like.dtype, device=like.device)
    return full


def _key(weights: dict, direction: str, precision: str, x) -> tuple:
    """Where every weight lies (its address, shape and strides), for a call that trains: the kept
    module's parameters are views of that memory, so they hold it (no other tensor can be given it
    while the module is kept) and see every update to it. A slice of a parameter taken anew on
    every call (alphafold3-pytorch's fused projections) finds its module again."""
    parts = tuple(place_of(w) if w is not None else None for w in weights.values())
    return direction, precision, x.dtype, x.device, parts


def place_of(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def _module_for(weights: dict, direction: str, precision: str, x, key: tuple):
    """A module whose parameters are views of the caller's weights, for a call that trains (the
    closed form's gradients are mapped onto the caller's tensors)."""
    module = _modules.get(key)
    if module is not None:
        _modules.move_to_end(key)
        return module
    module = _build(weights, direction, precision, x)
    _keep(_modules, key, module)
    return module


def _keep(kept: OrderedDict, key: tuple, module) -> None:
    kept[key] = module
    while len(kept) > MAX_MODULES:
        kept.popitem(last=False)


def _structure_key(weights: dict, direction: str, precision: str, x, out_dtype=None) -> tuple:
    """What a module's kernels depend on besides the weights' values."""
    given = tuple(w is not None for w in weights.values())
    return (direction, precision, x.dtype, x.device, weights["p_in_weight"].dtype, tuple(weights["p_out_weight"].shape),
            out_dtype, given)


def _structure_module(key: tuple, weights: dict, direction: str, precision: str, x, out_dtype=None):
    """The module of this structure (its parameters never read: each call gives the weights)."""
    module = _structures.get(key)
    if module is None:
        P, H = x.shape[-1], weights["p_in_weight"].shape[0] // 2
        bias = any(weights[n] is not None for n in ("p_in_bias", "g_in_bias", "p_out_bias", "g_out_bias"))
        module = empty_trimul(P, H, direction, bias, precision)
        module.output_dtype = out_dtype
        _keep(_structures, key, module)
    else:
        _structures.move_to_end(key)
    return module


def _on_given_weights(x, direction: str, mask, weights: dict, precision: str, out_dtype=None):
    """A CUDA inference call: the tuned kernels of this structure's module on the caller's tensors
    (packed for the call in one launch), recorded for replay with the weights as its inputs; the
    reference where no kernel computes the call. out_dtype: the module's output_dtype (what its
    kernels write where they can)."""
    key = _structure_key(weights, direction, precision, x, out_dtype)
    module = _structure_module(key, weights, direction, precision, x, out_dtype)
    present = tuple(w for w in weights.values() if w is not None)
    if module._fast_calls:  # a recording of such a call: it checks the inputs itself
        out = module._fast_forward(x, mask, *present)
        if out is not None:
            return out
    if not torch.is_autocast_enabled("cuda"):
        check_float_tensor("x", x, 4, weights["p_in_weight"])  # the weights' dtype and device
    kernel_precision = module.kernel_precision(x, mask)

    def reference_call():  # a LayerNorm affine left out (None) is the identity there too
        return reference(x, direction, mask, weights)

    if kernel_precision is None:
        return reference_call()
    given = CallWeights(present, packs.af3_sources(key[-1], x.shape[-1], weights["p_in_weight"].shape[0] // 2))
    variant = module._choice_for(x.shape[1], x.get_device(), kernel_precision)
    if type(variant) is Pending:
        variant = module._first_use(variant, (x, mask), kernel_precision, weights=given, reference=reference_call)
    if variant is None:
        return reference_call()
    out = module._launch_recorded((x, mask), variant, given)
    if module._fast_calls:  # recorded: the next such call is replayed before any Python check
        _replayers[_replayer_key(direction, precision, weights.values())] = module
    return out


def _build(weights: dict, direction: str, precision: str, x):
    """A TriangleMultiplication whose parameters are views of the caller's weights (no copy)."""
    P, H = x.shape[-1], weights["p_in_weight"].shape[0] // 2
    bias = any(weights[n] is not None for n in ("p_in_bias", "g_in_bias", "p_out_bias", "g_out_bias"))
    values = af3_parameters(weights, bias, lambda t: torch.nn.Parameter(t.detach(), requires_grad=False))
    return assign_parameters(empty_trimul(P, H, direction, bias, precision), values)


def empty_trimul(P: int, H: int, direction: str, bias: bool, precision: str = "ieee", gate_at: str = "output"):
    """A TriangleMultiplication (gate on the normalised input) with no storage: every parameter is
    assigned next (assign_parameters), so nothing is initialised at random."""
    from .ops.trimul import TriangleMultiplication

    with torch.device("meta"):
        return TriangleMultiplication(P, H, direction=direction, gate_on="normalized", bias=bias, precision=precision,
                                      gate_at=gate_at)


def assign_parameters(module: torch.nn.Module, values: dict) -> torch.nn.Module:
    """Parameters by dotted path; a Parameter is taken as it is (shared), a tensor is wrapped."""
    for path, value in values.items():
        sub, name = path.rsplit(".", 1)
        param = value if isinstance(value, torch.nn.Parameter) else torch.nn.Parameter(value, requires_grad=True)
        setattr(module.get_submodule(sub), name, param)
    return module


def af3_parameters(w: dict, bias: bool, take) -> dict:
    """A TriangleMultiplication's parameters (dotted paths) from the AlphaFold 3 / cuEquivariance
    layout `w` (norm_in_weight, norm_in_bias, p_in_weight with 2H rows: a's, then b's, p_in_bias,
    g_in_*, norm_out_*, p_out_*, g_out_*), each through take(tensor) -> Parameter (a copy, or a
    view that shares memory). With bias, a bias left out while others are given is zeros."""
    H = w["p_in_weight"].shape[0] // 2
    like = w["p_in_weight"]

    def bias_of(name: str, rows=slice(None)):
        t = w[name]
        if t is None:
            t = torch.zeros(w[name.replace("_bias", "_weight")].shape[0], dtype=like.dtype, device=like.device)
        return t[rows]

    values = {"layer_norm_in.weight": w["norm_in_weight"], "layer_norm_in.bias": w["norm_in_bias"],
              "layer_norm_out.weight": w["norm_out_weight"], "layer_norm_out.bias": w["norm_out_bias"],
              "out_proj.weight": w["p_out_weight"], "out_gate.weight": w["g_out_weight"]}
    for half, rows in (("a", slice(0, H)), ("b", slice(H, 2 * H))):
        values[f"proj_{half}.weight"] = w["p_in_weight"][rows]
        values[f"gate_{half}.weight"] = w["g_in_weight"][rows]
        if bias:
            values[f"proj_{half}.bias"] = bias_of("p_in_bias", rows)
            values[f"gate_{half}.bias"] = bias_of("g_in_bias", rows)
    if bias:
        values["out_proj.bias"], values["out_gate.bias"] = bias_of("p_out_bias"), bias_of("g_out_bias")
    return {path: take(t) for path, t in values.items()}
