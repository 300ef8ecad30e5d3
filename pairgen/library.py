"""pairgen's modules as torch.library operators, so torch.compile sees them.

Each op is registered twice: `pairgen::<op>(inputs, weights, handle) -> Tensor`, its forward, and
`pairgen::<op>_backward(inputs, weights, grad, handle) -> Tensor[]`, the gradients. `inputs` are the
module's call arguments (masks included), `weights` its parameters in `named_parameters()` order,
`handle` the int that names the module (`register`): the kernels, their tuned choice and the
packed weights live on the module, which the operator finds again by its handle.

- Eager calls do not go through the operators (their dispatch costs host time a small call cannot
  spare): a module's forward calls its kernels directly. Under torch.compile (dynamo tracing) the
  forward calls `torch.ops.pairgen.<op>` instead: one node in the graph, a fake implementation
  for shapes (dynamic lengths included), and autograd through the registered backward.
- The forward runs the module's kernels when the weights it is given are the module's own
  parameters (what a compiled module passes); other weights (a functional caller, opcheck's
  copies) run the reference on them. CPU tensors run the reference.
- The backward recomputes the reference under autograd (as the eager path does), on the weights
  and inputs it is given; frozen parameters get no gradient.
"""
import contextlib
import weakref

import torch

_MODULES: dict[int, weakref.ref] = {}


def register(module) -> int:
    """The module's handle (its id), remembered until the module is collected."""
    handle = id(module)
    ref = _MODULES.get(handle)
    if ref is None or ref() is not module:
        _MODULES[handle] = weakref.ref(module, lambda _, h=handle: _MODULES.pop(h, None))
    return handle


def module_of(handle: int):
    ref = _MODULES.get(handle)
    module = ref() if ref is not None else None
    if module is None:
        raise RuntimeError(f"pairgen: handle {handle} names no live module (operators are called "
                           "through a module's forward, which registers it)")
    return module


@contextlib.contextmanager
def _module_flag(module, name: str):
    """Set a flag on the module for the duration of a call (restored after: calls may nest)."""
    saved = module.__dict__.get(name, False)
    module.forget_fast_calls()  # a recorded call would skip what the flag changes
    setattr(module, name, True)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _reference_only(module):
    return _module_flag(module, "_reference_only")


@contextlib.contextmanager
def state_per_call(module):
    """The module's packed weights and scratch made for this call and dropped after it. Inside a
    compiled graph, state the module kept between calls would come from a CUDA graph's memory pool
    and outlive the graph's call (mode="reduce-overhead" refuses that), and a graph replay would
    read the state of the recording: packed weights from before an optimizer step."""
    try:
        with _module_flag(module, "_state_per_call"):
            yield
    finally:
        module.__dict__.pop("_call_buffers", None)


def _is_own(module, weights: list) -> bool:
    own = list(module.parameters())
    return len(own) == len(weights) and all(a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                                                        and a.dtype == b.dtype) for a, b in zip(own, weights))


def _functional_reference(module, inputs: list, weights: list):
    """The module's reference computation on these weights (torch.func.functional_call)."""
    names = [name for name, _ in module.named_parameters()]
    with _reference_only(module):
        return torch.func.functional_call(module, dict(zip(names, weights)), tuple(inputs))


def _forward(inputs: list[torch.Tensor], weights: list[torch.Tensor], handle: int) -> torch.Tensor:
    module = module_of(handle)
    with torch.no_grad():
        if inputs[0].is_cuda and _is_own(module, weights):
            with state_per_call(module):
                return module(*inputs).contiguous()
        return _functional_reference(module, inputs, weights).contiguous()


def _backward(inputs: list[torch.Tensor], weights: list[torch.Tensor], grad: torch.Tensor,
              handle: int) -> list[torch.Tensor]:
    """Gradients for every floating-point input and every weight, in order (an empty tensor for
    an input that has none: a bool mask): the module's closed form where it has one on the GPU
    (KernelModule.analytic_gradients), else the reference's through torch.func.vjp."""
    module = module_of(handle)
    if inputs[0].is_cuda:  # the operator runs in its inputs' dtype: autocast does not reach it
        closed_form = module.analytic_gradients(list(inputs), list(weights), grad)
        if closed_form is not None and all(g is not None for t, g in zip(inputs, closed_form) if t.is_floating_point()):
            n = len(inputs)
            return [g.contiguous() if t.is_floating_point() else t.new_empty(0) for t, g in zip(inputs, closed_form)] \
                + [g.contiguous() for g in closed_form[n:]]
    floats = [k for k, t in enumerate(inputs) if t.is_floating_point()]

    def reference(float_inputs, ws):
        full = list(inputs)
        for k, t in zip(floats, float_inputs):
            full[k] = t
        return _functional_reference(module, full, ws)

    # torch.func.vjp, not torch.autograd.grad: an operator's implementation runs below the autograd
    # dispatch key, where enable_grad() records nothing; vjp brings its own autograd layer.
    _, vjp = torch.func.vjp(reference, [inputs[k] for k in floats], list(weights))
    grad_floats, grad_weights = vjp(grad)
    # Contiguous, as the fake implementation promises (a gradient can come back strided).
    result = [t.new_empty(0) for t in inputs]
    for k, g in zip(floats, grad_floats):
        result[k] = g.contiguous()
    return result + [g.contiguous() for g in grad_weights]


def _register(op: str, output_of) -> None:
    """The op's two operators; output_of(inputs, weights) -> the output's (shape, dtype), for the fake."""
    forward = torch.library.custom_op(f"pairgen::{op}", _forward, mutates_args=())
    backward = torch.library.custom_op(f"pairgen::{op}_backward", _backward, mutates_args=())

    @forward.register_fake
    def _(inputs, weights, handle):
        shape, dtype = output_of(inputs, weights)
        return inputs[0].new_empty(shape, dtype=dtype)

    @backward.register_fake
    def _(inputs, weights, grad, handle):
        return [t.new_empty(t.shape if t.is_floating_point() else (0,)) for t in inputs] + \
               [w.new_empty(w.shape) for w in weights]

    def setup_context(ctx, inputs, output):  # noqa: ARG001 (the output is not needed)
        ins, weights, handle = inputs
        ctx.n_inputs, ctx.handle = len(ins), handle
        ctx.save_for_backward(*ins, *weights)

    def backward_formula(ctx, grad):
        saved = ctx.saved_tensors
        ins, weights = list(saved[:ctx.n_inputs]), list(saved[ctx.n_inputs:])
        grads = getattr(torch.ops.pairgen, f"{op}_backward")(ins, weights, grad, ctx.handle)
        g_in = [g if t.is_floating_point() else None for g, t in zip(grads[:ctx.n_inputs], ins)]
        return g_in, list(grads[ctx.n_inputs:]), None

    forward.register_autograd(backward_formula, setup_context=setup_context)


def _same_as_first(inputs, weights):
    """The first input's shape and dtype: trimul's (B, N, N, P), the readout's nodes (B, N, D)."""
    return inputs[0].shape, inputs[0].dtype


def _contact_output(inputs, weights):
    x = inputs[0]
    return x.shape[:3], x.dtype


_register("trimul", _same_as_first)
_register("contact", _contact_output)
_register("readout", _same_as_first)


def compiled_call(module, op: str, inputs: tuple) -> torch.Tensor:
    """What a module's forward returns while torch.compile traces it: one operator call. The
    module was registered when it was built (or copied): tracing reads its handle."""
    return getattr(torch.ops.pairgen, op)(list(inputs), list(module.parameters()), module._handle)
