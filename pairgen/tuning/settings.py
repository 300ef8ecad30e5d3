"""What a tuning run is asked to do (its settings and the samplers it may use), apart from the tuner
itself: the command line reads these to build its options, and `pairgen-tune --status`, `--explain`
and `--dry-run` run where Optuna (which the tuner imports) is not installed."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TuneSettings:
    trials: int = 64                 # distinct points checked and timed (pruned points not counted)
    time_budget_s: float | None = None
    batch: int | None = None         # points compiling at once (default: compile workers)
    seed: int = 0
    progress: bool = True
    finalists: int = 3               # best points timed again at the end, in turns (0: none)
    retime_rounds: int = 5
    sampler: str = "random"          # how the study proposes points (SAMPLERS; docs/performance.md compares them)


#: The samplers a study can propose points with (TuneSettings.sampler, pairgen-tune --sampler).
#: Random is the default: on the largest spaces it landed closest to a long search at the default
#: budget, and it costs no host time per proposal (docs/performance.md, "Which sampler").
SAMPLERS = ("random", "tpe", "gp")
