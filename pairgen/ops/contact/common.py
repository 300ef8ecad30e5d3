"""What the contact head's strategies share (no torch): the fp32 kernels' weight offsets, their
context and restrictions, and their runner (one kernel over x, the pack, out)."""
from __future__ import annotations

from ...spec import DeviceLimits, Plan, Restriction, cuda_bool, section_offsets, smem_fits


def weight_offsets(P: int, H: int) -> dict[str, int]:
    """Packed-weight layout shared with the templates (16-byte sections)."""
    return section_offsets([("w1t", P * H), ("b1", H), ("w2t", H * H), ("b2", H), ("w3", H), ("b3", 1),
                            ("gamma", P), ("beta", P)])


def _widths_vectorise(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.widths["H"] % 4 == 0 and plan.widths["P"] % 4 == 0


#: The restrictions every fp32 strategy has.
FP32_RESTRICTIONS = (
    Restriction("P and H must be multiples of 4 (float4 weight reads)", _widths_vectorise),
    Restriction("shared memory exceeds the per-block limit", smem_fits),
)


def base_context(params: dict, widths: dict) -> tuple[dict, int]:
    """The context every fp32 strategy shares, and the bytes of weights staged in shared memory."""
    P, H = widths["P"], widths["H"]
    off = weight_offsets(P, H)
    context = {"P": P, "H": H, "off": off, "weights_smem": cuda_bool(params["weights_smem"])}
    return context, (4 * off["total"] if params["weights_smem"] else 0)


def run_single_kernel(module, variant, weights, x, out) -> None:
    """The fp32 strategies' call: the weights packed for it, then one kernel over (x, weights, out)."""
    B, N = x.shape[0], x.shape[1]
    packed = module._packed(module.fp32_layout(weights.sources), weights)
    (main,) = variant.launches(x.get_device(), B, N)
    main.named(x=x.data_ptr(), wpack=packed.data_ptr(), out=out.data_ptr())
