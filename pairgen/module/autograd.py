"""The autograd Functions that give a drop-in module's training calls their gradients: the kernel
forward with a closed-form (or recomputed reference) backward, the closed form with its forward's
intermediates kept, and the refusal of a second derivative through gradients computed without a
graph."""
from __future__ import annotations

import torch

from . import captured


def distinct_storages(grads: list, held: tuple) -> list:
    """`grads` with no two sharing a storage and none sharing one of `held` (the call's tensors):
    what a custom operator may return (pairgen/library.py). A closed form may give views of one
    tensor (the four input projections' weight gradients from one product, a LayerNorm's two
    affine ones from one reduction), which autograd takes as they are; here the second and later
    views of a storage are copied."""
    seen = {t.untyped_storage().data_ptr() for t in held if isinstance(t, torch.Tensor)}
    out = []
    for g in grads:
        if g is not None:
            if g.untyped_storage().data_ptr() in seen:
                g = g.clone()
            seen.add(g.untyped_storage().data_ptr())
        out.append(g)
    return out


class ReferenceBackward(torch.autograd.Function):
    """Forward through the kernel; backward through the module's closed-form gradients where it
    has them for this call (`analytic_gradients`), else by recomputing the reference under
    autograd (the reference's own gradients, at the cost of one recomputation)."""

    @staticmethod
    def forward(ctx, module, n_inputs, variant, *tensors):
        ctx.module, ctx.n_inputs = module, n_inputs
        # The recomputation runs under the forward's autocast, so its dtypes are the forward's.
        ctx.autocast = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        ctx.save_for_backward(*tensors)
        return module._launch(*tensors[:n_inputs], variant=variant)

    @staticmethod
    def backward(ctx, grad_out):
        return (None, None, None, *recomputed_gradients(ctx.module, ctx.saved_tensors, ctx.n_inputs, grad_out,
                                                        ctx.autocast))


def recomputed_gradients(module, tensors: tuple, n_inputs: int, grad_out: torch.Tensor, autocast: tuple) -> list:
    """The gradients of `tensors` (the call's inputs, then its parameters; None for those that do
    not require one) from nothing the forward kept: the closed form from the inputs where the op
    has one for this call, else the reference recomputed under autograd. autocast: (enabled, dtype)
    as the forward ran."""
    enabled, dtype = autocast
    # Under create_graph (grad mode on here) the gradients must themselves be differentiable in
    # the saved tensors: the closed form computes without autograd, so the reference's
    # autograd answers, on the saved tensors as they are (not detached) and building a graph.
    create_graph = torch.is_grad_enabled()
    if create_graph:
        inputs = list(tensors[:n_inputs])
    else:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors[:n_inputs]]
    params = list(tensors[n_inputs:])
    wanted = [t for t in inputs + params if t.requires_grad]
    analytic = None if create_graph else module.analytic_gradients(
        inputs, params, grad_out, autocast=dtype if enabled else None, wanted=[p.requires_grad for p in params])
    if analytic is not None:
        return [g if t.requires_grad else None for t, g in zip(inputs + params, analytic)]
    with torch.enable_grad(), torch.autocast("cuda", dtype=dtype, enabled=enabled):
        out = module.reference_forward(*inputs)
    grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True, create_graph=create_graph))
    return [next(grads) if t.requires_grad else None for t in inputs + params]


def saved_tensor_hooks_active() -> bool:
    """Whether torch.autograd.graph.saved_tensors_hooks (or a user of them: non-reentrant
    torch.utils.checkpoint, save_on_cpu) is active. PyTorch has no public query; without the
    private one this answers False."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


SECOND_DERIVATIVE_REFUSED = (
    "pairgen: a second derivative (create_graph=True) through kept intermediates is not supported: their "
    "gradients are computed without an autograd graph. Set the module's recompute_for_backward = True to "
    "differentiate through the reference's autograd instead.")


class _RefuseSecondDerivative(torch.autograd.Function):
    """Identity on gradients computed without a graph, tied to the incoming gradient so that the
    graph a create_graph=True backward builds reaches the caller's tensors; differentiating it
    raises SECOND_DERIVATIVE_REFUSED (not PyTorch's 'appears to not have been used in the graph',
    nor a silent zero)."""

    @staticmethod
    def forward(ctx, grad_out, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(SECOND_DERIVATIVE_REFUSED)


def graphless_gradients(grad_out: torch.Tensor, grads: list) -> list:
    """`grads` as a backward returns them: unchanged in a plain backward; under create_graph=True
    (grad mode on during the backward), tied to `grad_out` through a node that refuses to be
    differentiated."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not (torch.is_grad_enabled() and present):
        return grads
    # An incoming gradient with no graph of its own (d(out.sum())/d(out)) still gets a refusing
    # node: the gradients depend on the inputs, and differentiating them must not pass for zero.
    tie = grad_out if grad_out.requires_grad else grad_out.detach().requires_grad_()
    tied = _RefuseSecondDerivative.apply(tie, *(grads[i] for i in present))
    out = list(grads)
    for i, g in zip(present, tied):
        out[i] = g
    return out


class SavedClosedForm(torch.autograd.Function):
    """Forward computed the closed form's way (the op's saving_forward), its intermediates kept
    for the backward, which consumes them (saved_gradients): no kernel forward and no
    recomputation, at the memory of the saved intermediates."""

    @classmethod
    def run(cls, module, inputs: tuple, capture: bool = False, recorder_for=None) -> torch.Tensor:
        """The module's training call on `inputs` through this function, or, with `capture`
        (dispatch.captures_training_step), through its captured CUDA graphs where a slot is free
        for it (captured.py) (its parameters walked once: a walk costs a call tens of µs of host
        time). recorder_for(module, inputs, names, params): a Recorder that records an uncaptured
        call for a compiled replay (training_replay.py), or None."""
        named = list(module.named_parameters())
        names, params = tuple(name for name, _ in named), tuple(p for _, p in named)
        if capture:
            slot = captured.steps_of(module).slot_for(module, inputs, names, params)
            if slot is not None:
                return CapturedClosedForm.apply(module, slot, len(inputs), names, *inputs, *params)
        # Not captured: recorded for a compiled replay (training_replay.py) where the call allows.
        recorder = None if capture or recorder_for is None else recorder_for(module, inputs, names, params)
        return cls.apply(module, len(inputs), names, recorder, *inputs, *params)

    @staticmethod
    def forward(ctx, module, n_inputs, names, recorder, *tensors):
        ctx.module, ctx.n_inputs, ctx.names, ctx.recorder = module, n_inputs, names, recorder
        def run():
            return module.closed_form_forward(tensors[:n_inputs], dict(zip(names, tensors[n_inputs:])))
        out, ctx.saved = run() if recorder is None else recorder.forward(run)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        skipped = 4  # module, n_inputs, names, recorder
        wanted = ctx.needs_input_grad[skipped + ctx.n_inputs:]
        needs = ctx.needs_input_grad[skipped: skipped + ctx.n_inputs]
        g = grad_out.detach()
        def run():
            return ctx.module.saved_gradients(ctx.module, ctx.saved, g,
                                              captured.unwanted_gradients(ctx.module, needs, ctx.names, wanted))
        with torch.no_grad():
            recorder, ctx.recorder = ctx.recorder, None
            if recorder is None:
                grads = run()
            else:  # the gradients it wants in the recorder's order of the weights
                by_name = dict(zip(ctx.names, wanted))
                grads = recorder.backward(run, g, [*needs, *(by_name[n] for n in recorder.names)])
        inputs = [grads[key] if key and need else None for key, need in zip(ctx.module.input_gradients, needs)]
        params = [grads.get(name) if want else None for name, want in zip(ctx.names, wanted)]
        return (None,) * skipped + tuple(graphless_gradients(grad_out, [*inputs, *params]))


class CapturedClosedForm(torch.autograd.Function):
    """SavedClosedForm's call replayed from a captured slot (captured.Slot): the forward's graph,
    and the backward's from the intermediates the slot holds until then."""

    @staticmethod
    def forward(ctx, module, slot, n_inputs, names, *tensors):
        ctx.module, ctx.n_inputs, ctx.names = module, n_inputs, names
        ctx.lease = captured.Lease(slot)
        return slot.forward(tensors[:n_inputs])

    @staticmethod
    def backward(ctx, grad_out):
        skipped = 4  # module, slot, n_inputs, names
        slot = ctx.lease.slot
        if slot is None:
            raise RuntimeError(captured.CONSUMED)
        needs = ctx.needs_input_grad[skipped:]
        keys = [key if need else None for key, need in zip(ctx.module.input_gradients, needs[:ctx.n_inputs])]
        keys += [name if need else None for name, need in zip(ctx.names, needs[ctx.n_inputs:])]
        grads = slot.backward(grad_out.detach(), keys)
        ctx.lease.release()
        return (None,) * skipped + tuple(graphless_gradients(grad_out, grads))
