"""Input checks every drop-in module runs before dispatching (conditions first, a message built
only on failure: they run on every call), and the layout the kernels need of their inputs."""
from __future__ import annotations

import torch


def check_float_tensor(name: str, t, rank: int, param: torch.Tensor) -> None:
    """Type, dtype, rank, and the device of `param` (one of the module's parameters)."""
    if isinstance(t, torch.Tensor) and t.dtype is param.dtype and t.dim() == rank and t.device == param.device:
        return  # the common case, in ~1 us: the checks below only build the message
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")
    if t.device != param.device:
        raise ValueError(f"{name} is on {t.device} but the module's parameters are on {param.device}")
    if t.dtype != param.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but the module's parameters are {param.dtype}")


def check_mask(name: str, mask, shape: tuple, device: torch.device) -> None:
    """Every op takes the same masks: bool, integer or floating point, of the given shape, on the
    inputs' device. An integer mask is read as mask != 0 (see as_mask)."""
    if isinstance(mask, torch.Tensor) and mask.shape == shape and mask.device == device and not mask.dtype.is_complex:
        return  # the common case; the checks below build the message
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"{name} must have shape (B, N, N) = {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.dtype.is_complex:
        raise ValueError(f"{name} must be bool, integer or floating point, got dtype {mask.dtype}")
    raise ValueError(f"{name} is on {mask.device} but the inputs are on {device}")


def as_mask(mask: torch.Tensor) -> torch.Tensor:
    """An integer mask as bool (mask != 0), so 0/1 or 0/255 masks of any integer type mean keep or
    drop in every op, on the kernel path and the reference path alike; bool and floating-point
    masks as they are (each op says how it reads a floating-point one)."""
    if mask.dtype is torch.bool or mask.dtype.is_floating_point:
        return mask
    return mask != 0


def contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with its data on a 16-byte boundary, copied only when it is not: the kernels
    read rows with float4 loads and cp.async, which fault on a view that starts mid-vector (a
    contiguous slice such as x[1:] of a flat tensor, or a narrowed last dimension made contiguous)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
