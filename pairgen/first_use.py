"""Never slower than the reference on shapes nobody tuned.

A key (op, dtype, widths, N bucket) with no tuned entry runs the op's default parameters, which are
not fit for every width (at pair width 768 they ran 5x slower than eager PyTorch). So the first
time a module meets such a key on a GPU, it times the default variant against its PyTorch
reference on that call's own inputs (a few runs each, in turns, about half a second at most), keeps
the faster, and writes the verdict to the user's tuned folder, <gpu>/first-use/<op>.json (the
PAIRGEN_TUNED_DIR folder when that is set), where later processes read it instead of timing again.
A verdict is for one default variant's source: a template edit that changes it times again.
PAIRGEN_FIRST_USE_CHECK=0 turns the check off (the default variant then runs untimed); tuning the
shape (pairgen-tune) replaces the default, and its verdict, with a tuned entry.

No check runs while a CUDA graph is being captured (the call then runs the default, and a later
call outside the capture times it); a check that fails for any reason (the reference running out
of memory where the kernel fits, say) warns and keeps the default.
"""
from __future__ import annotations

import json
import logging
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

from . import config, files
from .tuned import make_key

log = logging.getLogger("pairgen")
#: What a first-use check times the kernel against unless the caller names another rival.
REFERENCE_RIVAL = "the PyTorch reference"

#: The longest a check times (after one warm-up run of each): runs stop after this many seconds.
CHECK_BUDGET_S = 0.5
CHECK_RUNS = 5


def verdict_path(op: str, gpu_slug: str) -> Path:
    """Outside <gpu>/<op>.json's pattern on purpose: the tuned database never reads a verdict."""
    root = config.tuned_dir_override() or config.user_tuned_dir()
    return root / gpu_slug / "first-use" / f"{op}.json"


def load_verdicts(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:  # unreadable or torn: time again, and say so
        log.warning("pairgen: ignoring the first-use verdicts in %s (%s)", path, exc)
        return []
    verdicts = data.get("verdicts") if isinstance(data, dict) else None
    return [v for v in verdicts if isinstance(v, dict)] if isinstance(verdicts, list) else []


def stored_verdict(op: str, gpu_slug: str, dtype: str, widths: dict, bucket: int, source_sha256: str) -> dict | None:
    """The verdict recorded for this key and this default variant's source, or None."""
    key = make_key(dtype, widths, bucket)
    for verdict in load_verdicts(verdict_path(op, gpu_slug)):
        if verdict.get("key") == key and verdict.get("source_sha256") == source_sha256:
            return verdict
    return None


def record_verdict(op: str, gpu_slug: str, dtype: str, widths: dict, bucket: int, source_sha256: str,
                   label: str, kernel_us: float, reference_us: float, rival: str = REFERENCE_RIVAL) -> Path:
    """Write (or replace) the key's verdict; the file is replaced whole (a reader never sees half),
    under a lock file beside it (processes checking other keys at once keep their verdicts too).
    reference_us is the time of `rival`, what runs without the kernel (winner "reference")."""
    path = verdict_path(op, gpu_slug)
    key = make_key(dtype, widths, bucket)
    verdict = {"key": key, "variant": label, "source_sha256": source_sha256,
               "kernel_us": round(kernel_us, 2), "reference_us": round(reference_us, 2), "rival": rival,
               "winner": "kernel" if kernel_us <= reference_us else "reference", "date": time.strftime("%Y-%m-%d")}
    with files.locked(path.with_name(f"{path.name}.lock")):
        verdicts = [v for v in load_verdicts(path) if v.get("key") != key] + [verdict]
        text = json.dumps({"verdicts": sorted(verdicts, key=lambda v: json.dumps(v["key"], sort_keys=True))},
                          indent=1, sort_keys=True)
        files.write_atomic(path, text.encode())
    return path


class Pending:
    """A default variant not yet timed against the reference: what runtime.select hands a module
    for such a key. The first module call that can time it settles it for every module."""

    __slots__ = ("variant", "op", "gpu_slug", "dtype", "widths", "bucket", "source_sha256", "settled", "winner")

    def __init__(self, variant, op: str, gpu_slug: str, dtype: str, widths: dict, bucket: int, source_sha256: str):
        self.variant, self.op, self.gpu_slug, self.dtype = variant, op, gpu_slug, dtype
        self.widths, self.bucket, self.source_sha256 = dict(widths), bucket, source_sha256
        self.settled, self.winner = False, variant

    def settle(self, kernel: Callable[[], object], reference: Callable[[], object], device,
               rival: str = REFERENCE_RIVAL) -> object:
        """Time kernel() against reference() (this call's inputs), record the verdict, and return
        what to run from now on: the variant, or None for what `rival` names (the reference, or
        what the module runs where no kernel does: the closed form). The verdict's reference_us
        is the rival's time."""
        if self.settled:
            return self.winner
        if _capturing():
            return self.variant  # nothing can be timed inside a capture: a later call times it
        self.settled = True
        try:
            kernel_us, reference_us = measure(kernel, reference, device)
        except Exception as exc:  # never lose the call to its check: keep the default, say why
            if "out of memory" in str(exc).lower():
                # The reference needs far more memory than the kernel (its intermediates): give back
                # what the failed attempt left cached, for the kernel and the caller.
                import torch

                torch.cuda.empty_cache()
            warnings.warn(f"pairgen: the first-use check of {self.op} {self.variant.plan.label} failed "
                          f"({type(exc).__name__}: {str(exc)[:300]}); running the default kernel")
            return self.variant
        self.winner = self.variant if kernel_us <= reference_us else None
        try:
            path = record_verdict(self.op, self.gpu_slug, self.dtype, self.widths, self.bucket, self.source_sha256,
                                  self.variant.plan.label, kernel_us, reference_us, rival)
        except OSError as exc:  # a read-only home: the verdict holds for this process only
            path = f"nowhere ({exc})"
        runs = "the kernel" if self.winner is not None else rival
        log.info("pairgen %s %s N bucket %d: default %s %.1f us, %s %.1f us at first use: running %s "
                 "(verdict in %s)", self.op, self.dtype, self.bucket, self.variant.plan.label, kernel_us,
                 rival, reference_us, runs, path)
        if self.winner is None:
            warnings.warn(f"pairgen: {self.op} widths {self.widths} ({self.dtype}, N bucket {self.bucket}) is not "
                          f"tuned on this GPU and the default kernel was slower than {rival} "
                          f"({kernel_us:.1f} vs {reference_us:.1f} us); running {rival}. `pairgen-tune` "
                          "for this shape finds a faster kernel.")
        return self.winner


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def measure(kernel: Callable[[], object], reference: Callable[[], object], device) -> tuple[float, float]:
    """Median µs of each, from CUDA events, in turns after a warm-up run of each (the first call
    builds what it caches: the kernel's launch, cuBLAS handles)."""
    import torch

    with torch.no_grad():
        kernel()
        reference()
        torch.cuda.synchronize(device)
        times: dict[Callable, list[float]] = {kernel: [], reference: []}
        start = time.perf_counter()
        for _ in range(CHECK_RUNS):
            for fn, runs in times.items():
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                runs.append(begin.elapsed_time(end) * 1e3)
            if time.perf_counter() - start > CHECK_BUDGET_S:
                break
    return statistics.median(times[kernel]), statistics.median(times[reference])
