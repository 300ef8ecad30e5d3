"""`pairgen-tune` on a host whose GPUs are stood in for on the CPU: tests/test_tuner_cluster.py puts
a `pairgen-tune` on PATH that runs this file with the command's arguments.

Everything but the GPU is pairgen-tune's own: its arguments, the studies and their storage, the
worker processes of --devices (spawned: each runs this file again, as __mp_main__, so they stand in
too), the re-timing of the finalists and the tuned entry. The stand-in GPU compiles nothing (a plan
is its own variant) and times a point as test_tuner.FakeEvaluator does (a made-up cost; some
points fail to compile or fail the check).

Set by the test, in the environment:
  PAIRGEN_STANDIN_GPUS    how many GPUs this host has
  PAIRGEN_STANDIN_DIR     where each worker appends the points of the search it attempts (compiles,
                          then times unless the compile failed: attempted-<pid>.log), and where the
                          victim says it is stalled (stalled.json)
  PAIRGEN_STANDIN_VICTIM  (on one host) the GPU whose worker stalls in the first point it times,
                          holding it, until the test kills it; the other workers attempt nothing
                          more before it has been killed and its heartbeat has lapsed, so the
                          victim is sure to hold a point and the search to still run when it is free
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_tuner import FakeEvaluator  # noqa: E402

from pairgen.spec import DeviceLimits  # noqa: E402
from pairgen.tuning.tuner import _point_key  # noqa: E402

STALLED = "stalled.json"
#: Written by the test once it has killed the victim: the time it did (time.time()).
KILLED = "killed"


def fake_gpu(index: int = 0):
    from pairgen import runtime

    return runtime.DeviceInfo(index, "Fake GPU", "fake-gpu", "sm_90", DeviceLimits())


class StandInGpu(FakeEvaluator):
    """GpuEvaluator's interface, on the CPU."""

    def __init__(self, spec, shape, device_index: int = 0, seed: int = 0, peers=("eager", "compile"), pool=None):
        super().__init__()
        self.device, self.peers = device_index, tuple(peers)
        self.retiming = False  # set while the finalists are timed again (retime_points, below)
        self.log_dir = Path(os.environ["PAIRGEN_STANDIN_DIR"])
        self.victim = os.environ.get("PAIRGEN_STANDIN_VICTIM") == str(device_index)

    def baselines(self):
        return {peer: us for peer, us in super().baselines().items() if peer in self.peers}

    def compile(self, plans):
        if not self.retiming:  # points of the search, each compiled once and then timed (or failed)
            with open(self.log_dir / f"attempted-{os.getpid()}.log", "a") as log:
                log.writelines(_point_key(plan.strategy, plan.params) + "\n" for plan in plans)
            if not self.victim:
                self._wait_for_the_victim()
        return super().compile(plans)

    def evaluate(self, plan):
        if self.victim and not self.retiming:
            self._stall(_point_key(plan.strategy, plan.params))
        return super().evaluate(plan)

    def _stall(self, point: str) -> None:
        (self.log_dir / f"{STALLED}.tmp").write_text(json.dumps({"pid": os.getpid(), "point": point}))
        os.replace(self.log_dir / f"{STALLED}.tmp", self.log_dir / STALLED)
        time.sleep(600)  # killed long before; the heartbeat thread beats on meanwhile
        raise RuntimeError("the test was to kill this worker")

    def _wait_for_the_victim(self, timeout_s: float = 120.0) -> None:
        """Until the victim has been killed and its heartbeat has lapsed: the search is then sure to
        be running when its point becomes free (workers that finished their trials first would
        leave it unattempted)."""
        from pairgen.tuning import storage

        deadline = time.monotonic() + timeout_s
        while not (self.log_dir / KILLED).exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the victim never stalled, or was never killed")
            time.sleep(0.05)
        lapsed = float((self.log_dir / KILLED).read_text()) + storage.GRACE_PERIOD_S + storage.HEARTBEAT_INTERVAL_S
        time.sleep(max(0.0, lapsed - time.time()))


def _retime_points_untracked(real):
    """tuner.retime_points, with the evaluator told: the finalists' timings are not the search's."""

    def retime_points(evaluator, *args, **kwargs):
        evaluator.retiming = True
        try:
            return real(evaluator, *args, **kwargs)
        finally:
            evaluator.retiming = False

    return retime_points


def stand_in(setattr_=setattr) -> None:
    """Replace the GPU, with setattr_ (the test's monkeypatch.setattr in its own process)."""
    import torch

    from pairgen import compiler, runtime
    from pairgen.tuning import evaluate, storage, tune_cli, tuner

    gpus = int(os.environ.get("PAIRGEN_STANDIN_GPUS", "1"))
    setattr_(tune_cli, "gpu_missing", lambda what: False)
    setattr_(torch.cuda, "current_device", lambda: 0)
    setattr_(torch.cuda, "device_count", lambda: gpus)
    setattr_(torch.cuda, "get_device_name", lambda index=0: "Fake GPU")
    setattr_(torch.cuda, "set_device", lambda index: None)
    setattr_(torch.cuda, "device", lambda index: contextlib.nullcontext())
    setattr_(runtime, "device_info", fake_gpu)
    setattr_(evaluate, "GpuEvaluator", StandInGpu)
    setattr_(compiler, "compile_pool", lambda workers=None: contextlib.nullcontext())
    setattr_(tuner, "retime_points", _retime_points_untracked(tuner.retime_points))
    # Short heartbeats: a dead worker's point is taken over in seconds, not minutes.
    setattr_(storage, "HEARTBEAT_INTERVAL_S", 1)
    setattr_(storage, "GRACE_PERIOD_S", 3)


if __name__ in ("__main__", "__mp_main__"):  # this host's pairgen-tune, or one of its spawned workers
    stand_in()

if __name__ == "__main__":
    from pairgen.tuning import tune_cli

    sys.exit(tune_cli.main())
