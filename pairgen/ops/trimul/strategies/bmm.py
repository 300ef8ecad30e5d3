"""bmm: a projection kernel writes a, b in (B*H, N, N) layout, cuBLAS bmm forms the triangle sums
(the transposes the direction needs are cuBLAS flags, no copies), an output kernel reads the
product in place (templates/trimul/bmm.cu.j2). fp32, right for every N; the GEMMs dominate from
N = 256."""
from __future__ import annotations

from ....spec import Kernel, Strategy, flat_tile_grid
from ..common import FMA_RESTRICTIONS, OUTPUT_ARGS, PROJECT_ARGS, fma_context

#: torch and what needs it, bound by _import_torch_half() on the first call a strategy runs, so that
#: the spec half (space, restrictions, plans) loads without torch and a call pays no import.
torch = fp32_matmul = triangle_bmm = None


def _import_torch_half() -> None:
    global torch, fp32_matmul, triangle_bmm
    import torch
    from ....module.modes import fp32_matmul
    from ..triangle import triangle_bmm


def derive(params: dict, w: dict, name: str):
    context, project_smem, output_smem = fma_context(params, w)
    threads = params["threads"]
    context.update(output_threads=threads, output_smem=output_smem)
    return context, (Kernel(name, threads, project_smem, PROJECT_ARGS, flat_tile_grid(params["p_tile"])),
                     Kernel(f"{name}_output", threads, output_smem, OUTPUT_ARGS, flat_tile_grid(params["o_tile"])))


def run(module, variant, weights, x, mask, out) -> None:
    """Projection kernel -> cuBLAS bmm (fp32: no TF32 even where the caller allowed it) -> output kernel."""
    if torch is None:
        _import_torch_half()
    B, N = x.shape[0], x.shape[1]
    project, output = variant.launches(x.get_device(), B, N)
    # One allocation for a, b and their product, from torch's stream-aware caching allocator (so a
    # captured CUDA graph never points at memory a later, larger call freed).
    ar, br, z = torch.empty((3, B * module.widths["H"], N, N), device=x.device, dtype=torch.float32).unbind(0)
    packed = module._packed(module.fp32_layout(weights.sources), weights)  # alive until every launch is enqueued
    x_ptr, w_ptr = x.data_ptr(), packed.data_ptr()
    project.named(x=x_ptr, mask=mask.data_ptr(), w=w_ptr, ar=ar.data_ptr(), br=br.data_ptr(),
                  mask_is_float=int(mask.dtype is torch.float32))
    with fp32_matmul():
        triangle_bmm(ar, br, module._outgoing, out=z)
    output.named(x=x_ptr, z=z.data_ptr(), w=w_ptr, out=out.data_ptr())


BMM = Strategy(
    name="bmm",
    summary="projection kernel -> (B*H, N, N) a, b -> cuBLAS bmm -> output kernel reading the product in place",
    # One block size for both kernels: it halves the space, and the defaults need no more.
    # min_blocks: the launch bounds' minimum blocks per SM. Unbounded, ptxas gives the 8x8 tiles
    # ~210 registers (one 256-thread block per SM); 2 caps them at 128. unroll: the 32 k-steps
    # of a 128-wide product unrolled 4 deep (a single value, kept as data to widen later).
    # The output kernel's two products ran slower than the projection's. o_weights_smem stages
    # its Wout/Wgate column chunks in shared memory (as p_weights_smem does for the projection):
    # it has not won a tuning yet. o_tn 8 gives each product 4 x 8 micro-tiles, 10.7 multiply-adds
    # per load as in the projection's (8 with o_tn 4).
    space={"p_tile": (64, 128), "p_tm": (4, 8), "p_tn": (4, 8), "p_weights_smem": (False, True),
           "o_tile": (32, 64, 128), "o_tm": (1, 2, 4), "o_tn": (4, 8), "o_weights_smem": (False, True),
           "threads": (128, 256), "unroll": (4,), "min_blocks": (1, 2)},
    derive=derive,
    restrictions=FMA_RESTRICTIONS,
    # Exact fp32 keeps tf32x3's and tf32's promises too: where it is faster (small N), they run it.
    precisions=("float32", "tf32x3", "tf32"),
    run=run,
)
