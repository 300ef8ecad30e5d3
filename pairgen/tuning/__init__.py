"""Tuning and measuring: the Optuna driver (tuner), the GPU evaluator, CUDA-event timing, the
float64 check, and the command-line helpers shared by scripts/tune.py and scripts/bench.py."""
