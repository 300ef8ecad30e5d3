"""GPU timing (docs/performance.md): CUDA events, warm-up, L2 flushed between repetitions, median."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

# Measured on an NVIDIA H200, torch 2.11.0+cu130 (8192^3 fp32 matmul with TF32 off; a device-to-device
# copy, bytes read + written): the floors in reports use these.
#: Measured on the GPU (copy, and dense matmuls at 8192³ in each precision).
CEILINGS = {"nvidia-h200": {"copy_bytes_per_s": 4.27e12, "fp32_flops_per_s": 51.3e12, "tf32_flops_per_s": 411e12,
                            "bf16_flops_per_s": 793e12}}
#: Precision -> (the rate it computes at, its multiplies per product, its bytes per fp32 element).
_PRECISION_RATES = {"float32": ("fp32_flops_per_s", 1, 1.0), "tf32": ("tf32_flops_per_s", 1, 1.0),
                    "tf32x3": ("tf32_flops_per_s", 3, 1.0), "bfloat16": ("bf16_flops_per_s", 1, 0.5),
                    "float16": ("bf16_flops_per_s", 1, 0.5)}

_flush_buffers: dict[torch.device, torch.Tensor] = {}


def _flush_l2(device: torch.device) -> None:
    if device.index is None:  # the key and the allocation name the device a bare "cuda" means now
        device = torch.device(device.type, torch.cuda.current_device() if device.type == "cuda" else 0)
    if device not in _flush_buffers:  # 256 MB: several times any L2 of today (H200: 60 MB)
        # A normal tensor even when the first timing runs under inference_mode (the forward bench):
        # an inference tensor could not be zeroed by a later timing outside it (a training step's).
        with torch.inference_mode(False):
            _flush_buffers[device] = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=device)
    _flush_buffers[device].zero_()


@dataclass
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    reps: int

    def __str__(self) -> str:
        return f"{self.median_us:.1f} us (p20 {self.p20_us:.1f}, p80 {self.p80_us:.1f}, n={self.reps})"


def time_cuda(fn: Callable[[], object], device: torch.device | None = None, reps: int = 100,
              warmup: int = 5, flush_l2: bool = True, max_seconds: float = 2.0,
              warmup_seconds: float = 0.05) -> Timing:
    """Median time of fn() between CUDA events on the current stream.

    The warm-up keeps compilation and handle creation out and runs for at least warmup_seconds:
    after an idle spell (a torch.compile build) the clocks are low, and a short warm-up times
    a kernel far slower than it runs. The first timed call sets how many repetitions fit in max_seconds.
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    done = 0
    while done < warmup or time.perf_counter() - start < warmup_seconds:
        fn()
        done += 1
        if done % 16 == 0:
            torch.cuda.synchronize(device)
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    # The stream fetched once: Event.record() without one looks up the current stream each time,
    # several times the host time of a record with the stream given.
    # The end record's lookup fell inside the timed interval of every host-bound call, pairgen's
    # and the peers' alike, and both lookups lengthened each repetition's host time, which the L2
    # flush before the call must hide for the call to be timed as the GPU runs it.
    stream = torch.cuda.current_stream(device)
    times: list[float] = []
    for k in range(reps):
        if flush_l2:
            _flush_l2(device)
        starts[k].record(stream)
        fn()
        ends[k].record(stream)
        if k == 0:
            torch.cuda.synchronize(device)
            first_s = starts[0].elapsed_time(ends[0]) / 1e3
            reps = min(reps, max(5, int(max_seconds / max(first_s, 1e-6))))  # (never past the events made)
        if k + 1 >= reps:
            break
    torch.cuda.synchronize(device)
    times = sorted(starts[k].elapsed_time(ends[k]) * 1e3 for k in range(reps))
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
    return Timing(statistics.median(times), q[0], q[3], len(times))


def time_graph_replay(fn: Callable[[], object], device: torch.device | None = None, reps: int = 100) -> Timing:
    """Kernel time without launch overhead: fn captured in a CUDA graph, its replay timed."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, device, reps=reps)


#: Runs of back-to-back calls per host-time measurement: one run varies within a session (other
#: processes, clocks); the median of several runs is what the bench reports, and every run is
#: kept beside it.
HOST_RUNS = 5
#: Back-to-back calls a host-time run issues.
HOST_CALLS = 200


def host_us_runs(fn: Callable[[], object], calls: int = HOST_CALLS, runs: int = HOST_RUNS) -> list[float]:
    """CPU time to issue one call (Python and launch overhead), GPU work not awaited: one value per
    run of `calls` back-to-back calls, the GPU drained between runs so no run waits on another's work."""
    values = []
    for _ in range(runs):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        values.append(1e6 * (time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return values


def gpu_us_of_one_call(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """The GPU's busy time in one call of fn, L2 flushed first: the durations of every kernel,
    copy and fill it ran, summed (torch.profiler). Beside a call's timed µs it says whether the
    call waits on the GPU or on the host (a training step with many small launches)."""
    from torch.profiler import ProfilerActivity, profile

    device = device or torch.device("cuda", torch.cuda.current_device())
    _flush_l2(device)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def floor_us(cost, gpu_slug: str, precision: str = "float32") -> float | None:
    """The larger of bytes over copy bandwidth and FLOPs over the precision's matmul rate, in us
    (cost is counted in fp32: 16-bit precisions move half its bytes; tf32x3 does three products)."""
    ceil = CEILINGS.get(gpu_slug)
    if ceil is None:
        return None
    rate, products, byte_scale = _PRECISION_RATES[precision]
    return 1e6 * max(byte_scale * cost.bytes / ceil["copy_bytes_per_s"], products * cost.flops / ceil[rate])


def strict_fp32() -> None:
    """fp32 means fp32: no TF32 in any matmul or convolution, for pairgen and its peers."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
