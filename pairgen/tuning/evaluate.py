"""The tuner's GPU evaluator: compile candidates in parallel, check each against the float64
reference (docs/ops.md: fresh inputs, an odd shape, heavy tails, NaN-prefilled output), time it."""
from __future__ import annotations

import time

import torch

from .. import codegen, compiler, runtime
from ..module import dispatch
from ..precision import HALF_DTYPES as HALF_PRECISION_DTYPES
from .check import CheckFailed, compare, reference64
from ..spec import OpSpec, Plan, precision_of
from .timing import time_cuda


def module_in_precision(spec: OpSpec, widths: dict, generator, precision: str, device) -> torch.nn.Module:
    """A module with random weights that computes in `precision`: a bfloat16/float16 module, or a
    float32 module with precision= (tf32x3, tf32; float32 is the default "ieee")."""
    module = spec.make_module(widths, generator).to(device)
    if precision in HALF_PRECISION_DTYPES:
        return module.to(HALF_PRECISION_DTYPES[precision])
    if precision != "float32":
        module.precision = precision
    return module


def inputs_in_precision(tensors: tuple, precision: str, device) -> tuple:
    """Inputs on the device, floating-point ones in the module's dtype (float masks too, as a
    caller in that dtype would pass them)."""
    dtype = HALF_PRECISION_DTYPES.get(precision)
    return tuple(t.to(device, dtype=dtype) if dtype is not None and t.dtype.is_floating_point else t.to(device)
                 for t in tensors)


def reference_in_precision(spec: OpSpec, module) -> torch.nn.Module:
    """The plain reference on the module's weights, in the module's dtype (the eager peer)."""
    return spec.make_reference(module).to(next(module.parameters()).dtype)


class GpuEvaluator:
    def __init__(self, spec: OpSpec, shape: dict, device_index: int = 0, seed: int = 0,
                 peers: tuple[str, ...] = ("eager", "compile"), pool=None):
        self.spec, self.shape, self.peers, self.pool = spec, dict(shape), peers, pool
        self.precision = precision_of(spec)
        self.device = torch.device("cuda", device_index)
        info = runtime.device_info(device_index)
        self.limits, self.arch = info.limits, info.arch
        gen = torch.Generator().manual_seed(seed)
        widths = spec.widths_of(shape)
        self.module = module_in_precision(spec, widths, gen, self.precision, self.device)
        self.inputs = inputs_in_precision(spec.make_inputs(shape, gen, "normal"), self.precision, self.device)
        odd = {**shape, "B": 3 if shape["B"] * shape["N"] ** 2 < 1 << 20 else 1, "N": 37}
        odd_inputs = inputs_in_precision(spec.make_inputs(odd, gen, "cauchy"), self.precision, self.device)
        self.cases = [(self.inputs, reference64(self.module, self.inputs)),
                      (odd_inputs, reference64(self.module, odd_inputs))]
        self.tolerance = spec.tolerance[self.precision]

    def baselines(self) -> dict[str, float]:
        """The peers' times, and the closed form's where a module runs it without a kernel
        (closed_form: the entry's kernel must beat it, runtime.faster_without_the_kernel)."""
        reference = reference_in_precision(self.spec, self.module)
        out = {}
        with torch.inference_mode():
            if "eager" in self.peers:
                out["eager"] = time_cuda(lambda: reference(*self.inputs), self.device).median_us
            closed_form = dispatch.closed_form_instead(self.module, self.inputs, self.precision)
            if closed_form is not None:
                out["closed_form"] = time_cuda(closed_form, self.device).median_us
            if "compile" in self.peers:
                compiled = torch.compile(reference, mode="max-autotune-no-cudagraphs")
                compiled(*self.inputs)
                out["compile"] = time_cuda(lambda: compiled(*self.inputs), self.device).median_us
        return out

    def compile(self, plans: list[Plan]) -> list[object]:
        rendered = [codegen.render_plan(p) for p in plans]
        results = compiler.compile_many([(r.source, r.kernel_name, self.arch) for r in rendered], self.pool)
        return [res if isinstance(res, Exception) else runtime.Variant(p, r, res)
                for p, r, res in zip(plans, rendered, results)]

    def start_compiles(self, plans: list[Plan]) -> list:
        """The plans' compiles started on the pool (rendered here: rendering is quick), each as a
        call that waits for its variant or compile error; without a pool, compiled now."""
        if self.pool is None:
            return [lambda variant=variant: variant for variant in self.compile(plans)]
        rendered = [codegen.render_plan(p) for p in plans]
        futures = [compiler.start_compile((r.source, r.kernel_name, self.arch), self.pool) for r in rendered]

        def waiter(plan, render, future):
            def wait():
                result = future.result()
                return result if isinstance(result, Exception) else runtime.Variant(plan, render, result)
            return wait
        return [waiter(p, r, f) for p, r, f in zip(plans, rendered, futures)]

    def check(self, variant) -> None:
        for inputs, ref in self.cases:
            out = torch.full(ref.shape, float("nan"), device=self.device, dtype=inputs[0].dtype)
            with torch.inference_mode():
                self.module._launch(*inputs, out=out, variant=variant)
            torch.cuda.synchronize(self.device)
            result = compare(out, ref, self.tolerance)
            if not result.ok:
                shape = "x".join(str(s) for s in inputs[0].shape)
                raise CheckFailed(f"input {shape}: {result}")

    def evaluate(self, variant) -> float:
        self.check(variant)
        self.module.force_variant(variant)
        try:
            with torch.inference_mode():
                return time_cuda(lambda: self.module(*self.inputs), self.device, reps=100,
                                 max_seconds=0.5).median_us
        finally:
            self.module.force_variant(None)


def tuned_entry(result, spec: OpSpec, dtype: str | None = None) -> dict:
    """The tuned/ record of a finished tuning run."""
    import cuda.core

    from .. import __version__, codegen
    from ..compiler import nvrtc_version
    from ..spec import n_bucket
    from ..tuned import make_key

    best = result.best
    dtype = dtype or precision_of(spec)
    widths = spec.widths_of(result.shape)
    return {
        "key": make_key(dtype, widths, n_bucket(result.shape["N"])),
        "shape": result.shape,
        "strategy": best["strategy"],
        "params": best["params"],
        "template_sha256": codegen.template_hash(spec.name, best["strategy"]),
        # What makes the entry stale: today's code rendering another source at these parameters.
        "source_sha256": codegen.render_plan(spec.plan(best["strategy"], best["params"], widths, dtype)).source_sha256,
        "us": round(best["us"], 2),
        "baselines_us": {k: round(v, 2) for k, v in result.baselines.items()},
        "trials": result.counts,
        "compile_s_mean": round(result.compile_s_mean, 2) if result.compile_s_mean else None,
        "tune_seconds": round(result.elapsed_s, 1),
        **({"timed": result.timed} if result.timed else {}),
        "date": time.strftime("%Y-%m-%d"),
        "versions": {"pairgen": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "nvrtc": nvrtc_version(), "cuda.core": cuda.core.__version__},
    }
