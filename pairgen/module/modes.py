"""The torch modes a call runs under: CUDA autocast (read, switched off), cuBLAS's fp32 matmul mode
(exact fp32 or TF32 tensor cores), and a cast that costs nothing when there is nothing to do."""
from __future__ import annotations

import contextlib

import torch


def current_autocast() -> "torch.dtype | None":
    """The dtype of the CUDA autocast in effect, or None."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def autocast_off():
    """A context with the CUDA autocast off (a null context where none is on)."""
    return torch.autocast("cuda", enabled=False) if torch.is_autocast_enabled("cuda") else contextlib.nullcontext()


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype; t itself when it is already (Tensor.to costs a dispatch even with nothing to do)."""
    return t if t.dtype is dtype else t.to(dtype)


@contextlib.contextmanager
def cublas_fp32_mode(tf32: bool):
    """cuBLAS fp32 matmuls inside run in exact fp32 (tf32=False), even where the caller allowed TF32,
    or on TF32 tensor cores (tf32=True: the tf32 and tf32x3 precisions' GEMMs, whose operands the
    kernels have rounded to TF32 already); the caller's setting is restored after. Through the
    fp32_precision API where torch has it (2.9+): there, reading the legacy allow_tf32 raises once a
    caller has used the new API, so the legacy flag would break such callers; the new API read and
    written this way leaves a legacy caller's flag as it was."""
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    saved = matmul.fp32_precision if new_api else matmul.allow_tf32
    wanted = ("tf32" if tf32 else "ieee") if new_api else tf32
    if saved != wanted:
        setattr(matmul, "fp32_precision" if new_api else "allow_tf32", wanted)
    try:
        yield
    finally:
        if saved != wanted:
            setattr(matmul, "fp32_precision" if new_api else "allow_tf32", saved)


def fp32_matmul():
    """cuBLAS fp32 matmuls inside run in exact fp32 (see cublas_fp32_mode)."""
    return cublas_fp32_mode(False)
