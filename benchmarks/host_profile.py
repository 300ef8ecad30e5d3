#!/usr/bin/env python3
"""Where the host time of a 16-bit training step of the triangle update goes, by pairgen function.

Every top-level function and method of pairgen's modules (and a few PyTorch calls: bmm, matmul,
empty, Tensor.to, Tensor.sum, cat) is wrapped with a timer; then bf16 steps of the models' form
(B1, P = H = 128, outgoing: the forward, then backward of an incoming gradient) run with the GPU
idle before each, as `pairgen-bench --backward` times them. Prints each function's inclusive host
µs a step and its calls a step, largest first. The timers cost about 1 µs a call, so the total is
a little above an untimed step's.

    python benchmarks/host_profile.py [N] [--top K]

Needs a GPU that runs the projection kernels (sm_90). docs/performance.md (session 37) has a
table it made.
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import pkgutil
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's pairgen first

import torch  # noqa: E402

import pairgen  # noqa: E402

#: PyTorch calls timed beside pairgen's functions: (owner, attribute).
TORCH_CALLS = ((torch, "bmm"), (torch, "matmul"), (torch, "empty"), (torch, "cat"), (torch.Tensor, "to"),
               (torch.Tensor, "sum"))
#: Methods left unwrapped: object plumbing, and those a wrapper would change the meaning of.
SKIPPED_METHODS = {"__init__", "__getattr__", "__setattr__", "__getattribute__", "__repr__", "__torch_function__"}


class Timers:
    """Inclusive seconds and calls per label, counted while `on`."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()
        self.on = False

    def wrap(self, function, label: str):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if not self.on:
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
        return timed


def wrap_pairgen(timers: Timers) -> None:
    """Every function defined in a pairgen module, wherever a pairgen module holds it (by its own
    name or imported), and every method of pairgen's classes but autograd Functions'."""
    modules = [importlib.import_module(info.name) for info in pkgutil.walk_packages(pairgen.__path__, "pairgen.")
               if "native" not in info.name]
    wrapped = {}
    for module in modules:
        short = module.__name__.removeprefix("pairgen.")
        for name, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
                wrapped[value] = timers.wrap(value, f"{short}.{name}")
            elif (isinstance(value, type) and value.__module__ == module.__name__
                  and not issubclass(value, torch.autograd.Function)):
                for attribute, method in list(vars(value).items()):
                    if isinstance(method, types.FunctionType) and attribute not in SKIPPED_METHODS:
                        setattr(value, attribute, timers.wrap(method, f"{short}.{value.__name__}.{attribute}"))
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value in wrapped:
                setattr(module, name, wrapped[value])
    for owner, attribute in TORCH_CALLS:
        label = f"{'Tensor' if owner is torch.Tensor else 'torch'}.{attribute}"
        setattr(owner, attribute, timers.wrap(getattr(owner, attribute), label))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int, nargs="?", default=512, help="the pair representation's length N")
    parser.add_argument("--steps", type=int, default=40, help="timed steps")
    parser.add_argument("--top", type=int, default=60, help="rows printed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("host_profile: needs a GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    module = pairgen.TriangleMultiplication(128, 128, direction="outgoing", gate_on="normalized",
                                            bias=False).cuda().bfloat16()
    shape = (1, args.n, args.n, 128)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(shape[:3], device="cuda", dtype=torch.bool)
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x, mask).backward(grad_out)

    for _ in range(10):  # compiles, first-use checks, the allocator's blocks
        step()
    timers = Timers()
    wrap_pairgen(timers)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    timers.on = True
    start = time.perf_counter()
    for _ in range(args.steps):
        torch.cuda.synchronize()
        step()
    torch.cuda.synchronize()
    timers.on = False
    per_step = (time.perf_counter() - start) / args.steps * 1e6
    print(f"N{args.n}: {per_step:.0f} µs a step with the timers on ({torch.cuda.get_device_name()}); "
          "inclusive µs a step (calls a step):")
    for label in sorted(timers.seconds, key=lambda k: -timers.seconds[k])[:args.top]:
        print(f"{timers.seconds[label] / args.steps * 1e6:8.1f} ({timers.calls[label] / args.steps:5.1f})  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
