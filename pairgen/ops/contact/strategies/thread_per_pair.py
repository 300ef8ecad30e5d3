"""thread_per_pair: one thread per pair, each layer computed `chunk` outputs at a time in
registers (templates/contact/thread_per_pair.cu.j2); with `symmetric`, one thread per unordered pair."""
from __future__ import annotations

from ....spec import Kernel, Restriction, Strategy, ceil_div, cuda_bool
from ..common import FP32_RESTRICTIONS, base_context, run_single_kernel

#: x, packed weights, out, then B, N and the pairs as 64-bit ints.
THREAD_PER_PAIR_ARGS = ("ptr x", "ptr wpack", "ptr out", "i64 B", "i64 N", "i64 total")


def derive(params: dict, widths: dict, name: str):
    context, weights = base_context(params, widths)
    P, H, threads = widths["P"], widths["H"], params["threads"]
    context.update(threads=threads, chunk=params["chunk"], symmetric=cuda_bool(params["symmetric"]))

    def grid(B, N, sms, resident, _sym=params["symmetric"], _t=threads):
        work = B * (N * (N + 1) // 2 if _sym else N * N)
        return max(1, ceil_div(work, _t)), (B, N, work)

    return context, (Kernel(name, threads, weights + 4 * (P + H) * threads, THREAD_PER_PAIR_ARGS, grid),)


THREAD_PER_PAIR = Strategy(
    name="thread_per_pair",
    summary="one thread per pair, layers computed `chunk` outputs at a time in registers",
    space={"threads": (64, 128, 256), "chunk": (4, 8, 16), "weights_smem": (True, False),
           "symmetric": (True, False)},
    derive=derive,
    restrictions=FP32_RESTRICTIONS + (
        Restriction("chunk must divide H", lambda p, _: p.widths["H"] % p.params["chunk"] == 0),
    ),
    run=run_single_kernel,
    records=("float32",),
)
