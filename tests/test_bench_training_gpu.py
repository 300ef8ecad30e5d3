"""GPU: the bench's training rows say where a step waits: the GPU's busy time in one step (the
profiler's kernels summed) and the host's time to issue one, beside the timed step."""
from __future__ import annotations

import time

import pytest
import torch

from pairgen.ops.trimul import TRIMUL
from pairgen.tuning.timing import gpu_us_of_one_call, time_cuda

pytestmark = pytest.mark.gpu


def test_the_gpu_time_of_one_call_is_its_kernels_time():
    """One large product: the profiler's kernel time agrees with CUDA events around it, and a
    sleep on the host between two small launches is not counted."""
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    # The events' lower fifth: other processes sharing the GPU (the suite runs in parallel) only
    # lengthen a call's events, by the time their kernels hold the GPU, never its own kernel.
    events = time_cuda(lambda: a @ a, device, reps=20).p20_us
    gpu = gpu_us_of_one_call(lambda: a @ a, device)
    assert 0.7 * events < gpu < 1.3 * events, (gpu, events)

    small = torch.ones(16, device=device)

    def two_launches_with_a_pause():
        small.add_(1)
        torch.cuda.synchronize()
        time.sleep(0.01)  # the host's 10 ms: the GPU idles
        small.add_(1)

    assert gpu_us_of_one_call(two_launches_with_a_pause, device) < 1000


def test_a_training_row_has_the_steps_gpu_and_host_time():
    from pairgen.tuning.bench_cli import measure_training

    spec = TRIMUL.at("bfloat16", require_kernels=False)
    shape = {"B": 1, "N": 96, "P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    row = measure_training(spec, shape, [], reps=10)
    assert row["pairgen_us"] > 0 and row["pairgen_gpu_us"] > 0 and row["pairgen_host_us"] > 0, row
    # the GPU's busy time is part of the step's
    assert row["pairgen_gpu_us"] < 1.2 * row["pairgen_us"], row
