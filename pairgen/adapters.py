"""`pairgen.adapt(module)`: a pairgen TriangleMultiplication that computes what another project's
triangle-update module computes, built from its weights.

Recognised by their parameter names (the projects' own classes, or anything laid out the same way):

| form | parameters | gate | biases | weights |
| --- | --- | --- | --- | --- |
| AlphaFold 2 / OpenFold | `linear_a_p`, `linear_a_g`, `linear_b_p`, `linear_b_g`, `linear_g`, `linear_z`, `layer_norm_in`, `layer_norm_out` | on the normalised input | as the source has them | shared: the pairgen module holds the source's own `Parameter` objects (training either trains both) |
| AlphaFold 3 / Boltz | `norm_in`, `p_in`, `g_in` (fused, 2H rows: a's H, then b's), `norm_out`, `p_out`, `g_out` | on the normalised input | as the source has them | copied: pairgen keeps a and b apart, so the fused rows are split into new tensors |
| OpenFold 3, fused (`FusedTriangleMultiplicationOutgoing/Incoming`) | `linear_ab_p`, `linear_ab_g` (fused as AlphaFold 3's `p_in`, `g_in`), `linear_z`, `linear_g`, `layer_norm_in`, `layer_norm_out` | on the normalised input | as the source has them | copied, as the AlphaFold 3 form |
| lucidrains' triangle-multiplicative-module (and its copies, e.g. IgFold's) | `norm`, `left_proj`, `right_proj`, `left_gate`, `right_gate`, `out_gate` (Linear(P, H): the gate in hidden width, on the normalised triangle sums before `to_out`), `to_out_norm`, `to_out`, `mix_einsum_eq` | on the normalised input, placed in hidden width (`gate_at="hidden"`) | all | copied (`patch`'s stand-in shares them); the incoming direction's "left" is pairgen's b |
| alphafold3-pytorch | its `PreLayerNorm` wrapper (`norm`) around `TriangleMultiplication` (`fn`: `left_right_proj` = Linear(P, 4H) + GLU, `out_gate`, `to_out_norm`, `to_out`); needs P = H, as that module itself does | on the normalised input | none | copied (the GLU's rows are split; `patch`'s stand-in takes views of them and trains them); the incoming direction's "left" is pairgen's b |

The direction comes from the source (`_outgoing`, else its class name containing "Outgoing" or
"Incoming"), or from `direction=`. The LayerNorms must use eps 1e-5 (the kernels').
"""
from __future__ import annotations

import torch
from torch import nn

from .functional import (KERNEL_EPS, af3_parameters, assign_parameters, closed_form_trains, empty_trimul, place_of,
                         train_on_callers_weights, triangle_multiplicative_update)

_OPENFOLD = ("linear_a_p", "linear_a_g", "linear_b_p", "linear_b_g", "linear_g", "linear_z", "layer_norm_in",
             "layer_norm_out")
_AF3 = ("norm_in", "p_in", "g_in", "norm_out", "p_out", "g_out")
#: The AlphaFold 3 form's parts (its names) -> the submodule holding each, per project.
_AF3_NAMES = {name: name for name in _AF3}
_OF3_FUSED_NAMES = {"norm_in": "layer_norm_in", "p_in": "linear_ab_p", "g_in": "linear_ab_g",
                    "norm_out": "layer_norm_out", "p_out": "linear_z", "g_out": "linear_g"}
_OF3_FUSED = tuple(_OF3_FUSED_NAMES.values())
_AF3_PYTORCH = ("left_right_proj", "out_gate", "to_out_norm", "to_out", "mix_einsum_eq")
_LUCIDRAINS = ("norm", "left_proj", "right_proj", "left_gate", "right_gate", "out_gate", "to_out_norm", "to_out",
               "mix_einsum_eq")


def adapt(source: nn.Module, direction: str | None = None):
    """A pairgen `TriangleMultiplication` (gate on the normalised input) equal in function to
    `source`, on its device and in its dtype. Raises ValueError for a module it does not recognise."""
    if all(hasattr(source, name) for name in _OPENFOLD):
        return _from_openfold(source, direction or _direction_of(source))
    if all(hasattr(source, name) for name in _AF3):
        return _from_af3(source, direction or _direction_of(source))
    if all(hasattr(source, name) for name in _OF3_FUSED):
        return _from_af3(source, direction or _direction_of(source), _OF3_FUSED_NAMES)
    if _is_af3_pytorch(source):
        return _from_af3_pytorch(source)
    if all(hasattr(source, name) for name in _LUCIDRAINS):
        return _from_lucidrains(source)
    raise ValueError(f"pairgen.adapt does not recognise {type(source).__name__}: expected the parameters of the "
                     f"OpenFold form {_OPENFOLD}, of the AlphaFold 3 / Boltz form {_AF3}, of OpenFold 3's fused "
                     f"form {_OF3_FUSED}, of lucidrains' form {_LUCIDRAINS}, or alphafold3-pytorch's "
                     f"PreLayerNorm(norm, fn) around a module with {_AF3_PYTORCH}")


def _direction_of(source: nn.Module) -> str:
    if isinstance(getattr(source, "_outgoing", None), bool):
        return "outgoing" if source._outgoing else "incoming"
    name = type(source).__name__.lower()
    for direction in ("outgoing", "incoming"):
        if direction in name:
            return direction
    raise ValueError(f"cannot tell the direction of {type(source).__name__} (no `_outgoing`, no 'Outgoing' or "
                     "'Incoming' in its class name): pass direction='outgoing' or 'incoming'")


def _check_eps(*norms: nn.LayerNorm) -> None:
    for norm in norms:
        if abs(norm.eps - KERNEL_EPS) > 1e-12:
            raise ValueError(f"pairgen's kernels use LayerNorm eps {KERNEL_EPS}; the source's is {norm.eps}")


def _from_openfold(source: nn.Module, direction: str):
    s = source
    _check_eps(s.layer_norm_in, s.layer_norm_out)
    P, H = s.linear_a_p.weight.shape[1], s.linear_a_p.weight.shape[0]
    pairs = {"proj_a": s.linear_a_p, "gate_a": s.linear_a_g, "proj_b": s.linear_b_p, "gate_b": s.linear_b_g,
             "out_proj": s.linear_z, "out_gate": s.linear_g}
    biases = [linear.bias is not None for linear in pairs.values()]
    if any(biases) and not all(biases):
        raise ValueError("pairgen's module has biases on all six projections or on none; the source has them on "
                         + ", ".join(name for name, b in zip(pairs, biases) if b))
    values = {"layer_norm_in.weight": s.layer_norm_in.weight, "layer_norm_in.bias": s.layer_norm_in.bias,
              "layer_norm_out.weight": s.layer_norm_out.weight, "layer_norm_out.bias": s.layer_norm_out.bias}
    for ours, linear in pairs.items():
        values[f"{ours}.weight"] = linear.weight
        if all(biases):
            values[f"{ours}.bias"] = linear.bias
    return assign_parameters(empty_trimul(P, H, direction, all(biases)), values)


def _af3_weights(source: nn.Module, names: dict) -> dict:
    """The AlphaFold 3 form's weights of `source` as triangle_multiplicative_update takes them
    ("norm_in_weight", ..., "g_out_bias"; a missing bias is None), read through `names`."""
    w = {}
    for part, attr in names.items():
        sub = getattr(source, attr)
        w[f"{part}_weight"], w[f"{part}_bias"] = sub.weight, sub.bias
    return w


def _from_af3(source: nn.Module, direction: str, names: dict = _AF3_NAMES):
    part = {name: getattr(source, attr) for name, attr in names.items()}
    _check_eps(part["norm_in"], part["norm_out"])
    two_h, P = part["p_in"].weight.shape
    bias = any(part[name].bias is not None for name in ("p_in", "g_in", "p_out", "g_out"))
    values = af3_parameters(_af3_weights(source, names), bias, lambda t: nn.Parameter(t.detach().clone()))
    return assign_parameters(empty_trimul(P, two_h // 2, direction, bias), values)


def _is_af3_pytorch(source: nn.Module) -> bool:
    fn = getattr(source, "fn", None)
    return isinstance(getattr(source, "norm", None), nn.LayerNorm) and fn is not None and \
        all(hasattr(fn, name) for name in _AF3_PYTORCH)


def _einsum_direction(fn: nn.Module) -> str:
    """From its einsum (alphafold3-pytorch's and lucidrains' forms): '... i k d, ... j k d'
    (outgoing) or '... k j d, ... k i d' (incoming)."""
    inputs = fn.mix_einsum_eq.replace(" ", "").split("->")[0].split(",")
    return "outgoing" if inputs[0].endswith("ikd") else "incoming"


def _check_af3_pytorch(source: nn.Module) -> None:
    fn = source.fn
    _check_eps(source.norm, fn.to_out_norm)
    four_h, P = fn.left_right_proj[0].weight.shape
    if fn.out_gate.weight.shape != (P, P):
        raise ValueError(f"alphafold3-pytorch's TriangleMultiplication gates its output in width dim_hidden="
                         f"{four_h // 4}; it runs only with dim_hidden == dim (got dim={P}), and so does pairgen's "
                         "adaptation")


#: alphafold3-pytorch's GLU projection (4H, P) by blocks of H rows: the values of left and right,
#: then their gates. Outgoing sums left[i,k]·right[j,k]: a = left; incoming sums
#: left[k,j]·right[k,i]: a = right.
_GLU_BLOCKS = {"outgoing": {"proj_a": 0, "proj_b": 1, "gate_a": 2, "gate_b": 3},
               "incoming": {"proj_a": 1, "proj_b": 0, "gate_a": 3, "gate_b": 2}}


def _af3_pytorch_weights(source: nn.Module) -> dict:
    """alphafold3-pytorch's parameters as pairgen's module names them: the GLU projection as it is
    (its row blocks are taken apart by _af3_pytorch_values and put together by
    _af3_pytorch_gradients)."""
    fn = source.fn
    return {"layer_norm_in.weight": source.norm.weight, "layer_norm_in.bias": source.norm.bias,
            "glu": fn.left_right_proj[0].weight, "layer_norm_out.weight": fn.to_out_norm.weight,
            "layer_norm_out.bias": fn.to_out_norm.bias, "out_proj.weight": fn.to_out[0].weight,
            "out_gate.weight": fn.out_gate.weight}


def _af3_pytorch_values(weights: dict, direction: str, take) -> dict:
    """pairgen's parameters from _af3_pytorch_weights, each through take(tensor)."""
    glu = weights["glu"]
    H = glu.shape[0] // 4
    values = {name: take(t) for name, t in weights.items() if name != "glu"}
    for name, block in _GLU_BLOCKS[direction].items():
        values[f"{name}.weight"] = take(glu[block * H:(block + 1) * H])
    return values


def _af3_pytorch_gradients(grads: dict, direction: str) -> list:
    """The gradients of _af3_pytorch_weights's tensors, in order, from pairgen's parameters'."""
    by_block = sorted(_GLU_BLOCKS[direction], key=_GLU_BLOCKS[direction].get)
    glu = torch.cat([grads[f"{name}.weight"] for name in by_block])
    return [glu if name == "glu" else grads[name] for name in
            ("layer_norm_in.weight", "layer_norm_in.bias", "glu", "layer_norm_out.weight", "layer_norm_out.bias",
             "out_proj.weight", "out_gate.weight")]


def _from_af3_pytorch(source: nn.Module, shared: bool = False):
    """Copies of the source's parameters (adapt), or views of them (patch's stand-in: no copy, never
    stale, gradients mapped back by _af3_pytorch_gradients)."""
    _check_af3_pytorch(source)
    direction = _einsum_direction(source.fn)
    weights = _af3_pytorch_weights(source)
    take = (lambda t: nn.Parameter(t.detach(), requires_grad=False)) if shared else \
        (lambda t: nn.Parameter(t.detach().clone()))
    four_h, P = weights["glu"].shape
    return assign_parameters(empty_trimul(P, four_h // 4, direction, bias=False),
                             _af3_pytorch_values(weights, direction, take))


# ---- patching a model in place ------------------------------------------------------------------

class _Patched(nn.Module):
    """Stands in for a source module inside a model: it holds the source's own children and
    parameters (the same dictionaries), so the model's state_dict keys, checkpoints, `.to()` and
    optimizers see exactly what they saw before; the forward runs pairgen. The source itself is
    kept (unregistered) for `unpatch` and for the call options pairgen does not implement."""

    form = ""

    def __init__(self, source: nn.Module, direction: str):
        super().__init__()
        self._parameters, self._buffers, self._modules = source._parameters, source._buffers, source._modules
        self.__dict__["source"] = source
        self.direction = direction
        self.training = source.training
        #: Calls run on pairgen, and calls handed to the source's own forward (options pairgen does
        #: not implement, or a dtype it has no computation for while gradients are wanted).
        self.pairgen_calls = self.source_calls = 0

    def train(self, mode: bool = True):
        """The source's own flag follows (its forward runs for the options pairgen does not take,
        and unpatch puts it back)."""
        super().train(mode)
        self.source.training = mode
        return self

    def _source_forward(self, *args, **kwargs):
        self.source_calls += 1
        return self.source(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"pairgen stand-in for {type(self.source).__name__} ({self.form} form, {self.direction})"

    def _kept(self, key: tuple, build):
        """The pairgen module built from the source, built again when `key` (what it depends on) moves."""
        cached = self.__dict__.get("_pairgen")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_pairgen"] = (key, build(self.source))
        return cached[1]


def _run_flat(module, x, pair_mask):
    """The pairgen module on x (..., N, N, P) with its leading dimensions flattened into one batch."""
    lead, (n1, n2, c) = x.shape[:-3], x.shape[-3:]
    return module(x.reshape(-1, n1, n2, c), pair_mask.reshape(-1, n1, n2)).reshape(*lead, n1, n2, c)


def _openfold_call(z, mask, inplace_safe: bool, add_with_inplace: bool, update) -> torch.Tensor:
    """OpenFold's calling convention around update(z, mask): no mask is every pair kept; with
    `inplace_safe` and `_add_with_inplace` both set it returns z + update, written into z."""
    result = update(z, mask if mask is not None else z.new_ones(z.shape[:-1]))
    return z.add_(result) if inplace_safe and add_with_inplace else result


class PatchedOpenFold(_Patched):
    """An OpenFold-form module's forward on pairgen's kernels, through `adapt` (parameters
    shared; rebuilt when the model's parameters are replaced by other objects). Leading dimensions
    beyond one batch (templates) are flattened into it. OpenFold 3's kernel choices
    (`use_cueq_triangle_kernels`, `use_triton_triangle_kernels`, `_inplace_chunk_size`) are
    accepted and ignored: pairgen is the kernel. With `inplace_safe` and `_add_with_inplace` both
    set, OpenFold returns z + update written into z, and so does this; options it does not know
    call the source's own forward."""

    form = "OpenFold"
    #: The kernel choices of OpenFold 3 (use_*_triangle_kernels, _inplace_chunk_size) and Protenix
    #: (triangle_multiplicative="torch" or "cuequivariance"): pairgen is the kernel.
    _IGNORED = ("use_cueq_triangle_kernels", "use_triton_triangle_kernels", "_inplace_chunk_size",
                "triangle_multiplicative")

    def forward(self, z, mask=None, inplace_safe=False, _add_with_inplace=False, **options):
        if any(name not in self._IGNORED for name in options):
            return self._source_forward(z, mask, inplace_safe=inplace_safe, _add_with_inplace=_add_with_inplace,
                                        **options)
        self.pairgen_calls += 1
        # shared parameters: only their replacement by other objects needs a new module
        module = self._kept(tuple(id(p) for p in self.source.parameters()),
                            lambda source: _from_openfold(source, self.direction))
        return _openfold_call(z, mask, inplace_safe, _add_with_inplace, lambda x, m: _run_flat(module, x, m))


class PatchedAF3(_Patched):
    """An AlphaFold 3 / Boltz-form module's forward as `pairgen.triangle_multiplicative_update` on
    the model's live parameters (views, no copies: never stale). Extra positional and keyword
    options (Boltz's `use_kernels`) are accepted and ignored: pairgen is the kernel."""

    form = "AlphaFold 3 / Boltz"
    names = _AF3_NAMES

    def forward(self, x, mask=None, *unused, **unused_options):
        return self._update(x, mask)

    def _update(self, x, mask):
        """The update on the model's live weights (the function takes any leading dimensions)."""
        self.pairgen_calls += 1
        eps = getattr(self.source, self.names["norm_in"]).eps
        return triangle_multiplicative_update(x, self.direction, mask, **_af3_weights(self.source, self.names), eps=eps)


class PatchedOpenFold3Fused(PatchedAF3):
    """OpenFold 3's FusedTriangleMultiplication* (the AlphaFold 3 form under OpenFold's names and
    calling convention) on `pairgen.triangle_multiplicative_update` over the live weights. Its
    kernel choices are accepted and ignored; with `inplace_safe` and `_add_with_inplace` it returns
    z + update written into z, as OpenFold does; options it does not know call the source."""

    form = "OpenFold 3 fused"
    names = _OF3_FUSED_NAMES

    def forward(self, z, mask=None, inplace_safe=False, _add_with_inplace=False, **options):
        if any(name not in PatchedOpenFold._IGNORED for name in options):
            return self._source_forward(z, mask, inplace_safe=inplace_safe, _add_with_inplace=_add_with_inplace,
                                        **options)
        return _openfold_call(z, mask, inplace_safe, _add_with_inplace, self._update)


class PatchedAF3Pytorch(_Patched):
    """alphafold3-pytorch's PreLayerNorm(TriangleMultiplication) on pairgen: a module whose
    parameters are views of the live ones (no copy; rebuilt only when a parameter moves to other
    memory), trained through its closed form with the gradients put back into the GLU projection's
    row blocks. Its per-token mask becomes the pair mask it implies; its output dropout (a
    multiplicative mask, so it commutes with the output gate) is applied to pairgen's result.
    A dtype the closed form does not train in (float64) with gradients wanted, and options pairgen
    does not know, run the source's own forward."""

    form = "alphafold3-pytorch"

    def forward(self, x, mask=None, **options):
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        if options or (wants_grad and not closed_form_trains(x, None)):
            return self._source_forward(x, mask=mask, **options) if mask is not None else \
                self._source_forward(x, **options)
        self.pairgen_calls += 1
        weights = _af3_pytorch_weights(self.source)
        module = self._kept(tuple(place_of(w) for w in weights.values()),
                            lambda source: _from_af3_pytorch(source, shared=True))
        pair = (mask[..., :, None] & mask[..., None, :]) if mask is not None else \
            x.new_ones(x.shape[:-1], dtype=torch.bool)
        flat, flat_pair = x.reshape(-1, *x.shape[-3:]), pair.reshape(-1, *x.shape[-3:-1])
        if wants_grad:
            direction = self.direction
            out = train_on_callers_weights(module, lambda grads: _af3_pytorch_gradients(grads, direction), flat,
                                           flat_pair, tuple(weights.values()))
        else:
            out = module(flat, flat_pair)
        dropout = self.source.fn.to_out[1] if len(self.source.fn.to_out) > 1 else None
        if dropout is not None and self.training:
            out = dropout(out)
        return out.reshape(x.shape)


class PatchedLucidrains(_Patched):
    """lucidrains' TriangleMultiplicativeModule (the out gate in hidden width) on pairgen's kernels,
    through `adapt`'s mapping with the parameters shared (rebuilt when the model's parameters are
    replaced by other objects). Its mask is a pair mask, multiplied as the source multiplies it;
    leading dimensions beyond one batch are flattened into it."""

    form = "lucidrains"

    def forward(self, x, mask=None):
        self.pairgen_calls += 1
        module = self._kept(tuple(id(p) for p in self.source.parameters()),
                            lambda source: _from_lucidrains(source, shared=True))
        return _run_flat(module, x, mask if mask is not None else x.new_ones(x.shape[:-1]))


def _stand_in_for(module: nn.Module):
    """(the stand-in class, direction) for a module pairgen can stand in for; a string says why not."""
    if isinstance(module, _Patched):
        return "already patched"
    if all(hasattr(module, name) for name in _LUCIDRAINS):
        try:
            _from_lucidrains(module, shared=True)  # what it checks: the LayerNorms' eps, a bias on every Linear
        except ValueError as exc:
            return str(exc)
        return PatchedLucidrains, _einsum_direction(module)
    if _is_af3_pytorch(module):
        try:
            _check_af3_pytorch(module)
        except ValueError as exc:
            return str(exc)
        return PatchedAF3Pytorch, _einsum_direction(module.fn)
    form = PatchedOpenFold if all(hasattr(module, n) for n in _OPENFOLD) else \
        PatchedAF3 if all(hasattr(module, n) for n in _AF3) else \
        PatchedOpenFold3Fused if all(hasattr(module, n) for n in _OF3_FUSED) else None
    if form is None:
        return None
    try:
        direction = _direction_of(module)
        norms = ("layer_norm_in", "layer_norm_out") if form is PatchedOpenFold else \
            (form.names["norm_in"], form.names["norm_out"])
        _check_eps(*(getattr(module, name) for name in norms))
    except ValueError as exc:
        return str(exc)
    return form, direction


def patch(model: nn.Module) -> list[str]:
    """Replace, in place, every triangle-update module of `model` that pairgen recognises (the forms
    `adapt` takes) by a stand-in that runs pairgen and keeps the model's parameters, state_dict keys
    and call signature. Returns one line per module found: what was swapped, or why not."""
    if not isinstance(_stand_in_for(model) or "", str):
        raise ValueError("patch(model) swaps the modules inside a model; for one module use pairgen.adapt")
    report = []
    for name, module in list(model.named_modules())[1:]:  # [0] is the model itself
        found = _stand_in_for(module)
        if found is None or found == "already patched":
            continue
        if isinstance(found, str):
            report.append(f"{name} ({type(module).__name__}): not swapped: {found}")
            continue
        stand_in, direction = found
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, stand_in(module, direction))
        report.append(f"{name} ({type(module).__name__}): swapped for pairgen ({stand_in.form} form, {direction})")
    return report


def unpatch(model: nn.Module) -> int:
    """Put back every module `patch` replaced; returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, _Patched):
            parent_name, _, child = name.rpartition(".")
            module.source.training = module.training  # model.train()/eval() while patched reached the stand-in
            setattr(model.get_submodule(parent_name), child, module.source)
            count += 1
    return count


def _from_lucidrains(source: nn.Module, shared: bool = False):
    """lucidrains' TriangleMultiplicativeModule: LayerNorm, gated left/right projections (mask on
    the projections), the einsum, to_out_norm, the out gate in hidden width, to_out; every Linear
    with a bias. Copies of its parameters (adapt), or the parameters themselves (patch's stand-in)."""
    s = source
    _check_eps(s.norm, s.to_out_norm)
    H, P = s.left_proj.weight.shape
    linears = (s.left_proj, s.right_proj, s.left_gate, s.right_gate, s.out_gate, s.to_out)
    if any(linear.bias is None for linear in linears):
        raise ValueError("lucidrains' form has a bias on every Linear; this module lacks one")
    direction = _einsum_direction(s)
    left, right = {"proj": s.left_proj, "gate": s.left_gate}, {"proj": s.right_proj, "gate": s.right_gate}
    # outgoing sums left[i,k]·right[j,k]: a = left; incoming sums left[k,j]·right[k,i]: a = right.
    a, b = (left, right) if direction == "outgoing" else (right, left)
    pairs = {"layer_norm_in": s.norm, "layer_norm_out": s.to_out_norm, "out_proj": s.to_out, "out_gate": s.out_gate,
             "proj_a": a["proj"], "gate_a": a["gate"], "proj_b": b["proj"], "gate_b": b["gate"]}
    values = {f"{ours}.{name}": getattr(sub, name) if shared else getattr(sub, name).detach().clone()
              for ours, sub in pairs.items() for name in ("weight", "bias")}
    return assign_parameters(empty_trimul(P, H, direction, bias=True, gate_at="hidden"), values)
