"""The correctness standard (docs/ops.md): a float64 reference on the same inputs and weights."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import Tolerance


@dataclass
class CheckResult:
    ok: bool
    max_abs: float
    rel_l2: float
    reason: str = ""

    def __str__(self) -> str:
        return (f"{'ok' if self.ok else 'FAILED'}: max|out-ref| {self.max_abs:.2e}, "
                f"||out-ref||/||ref|| {self.rel_l2:.2e}{' (' + self.reason + ')' if self.reason else ''}")


class CheckFailed(RuntimeError):
    pass


def reference64(module, inputs: tuple) -> torch.Tensor:
    """The reference module, with the module's weights, evaluated in float64 (no TF32 can apply)."""
    ref = module.op.make_reference(module).double()
    with torch.no_grad():
        return ref(*(t.double() if t.dtype.is_floating_point else t for t in inputs))


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> CheckResult:
    if out.shape != ref.shape:
        return CheckResult(False, float("inf"), float("inf"), f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    ref_finite = torch.isfinite(ref)
    mismatch = torch.isfinite(out.double()) != ref_finite
    if bool(mismatch.any()):
        count = int(mismatch.sum())
        return CheckResult(False, float("inf"), float("inf"), f"{count} elements non-finite where the reference is not "
                           "(unwritten output or overflow)")
    diff = (out.double() - ref)[ref_finite]
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    denom = float(ref[ref_finite].norm())
    rel = float(diff.norm()) / denom if denom > 0 else float(diff.norm())
    ok = max_abs <= tol.max_abs and rel <= tol.rel_l2
    return CheckResult(ok, max_abs, rel, "" if ok else f"limits {tol.max_abs:g} / {tol.rel_l2:g}")
