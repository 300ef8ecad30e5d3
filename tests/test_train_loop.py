"""The README's training example as a benchmark (pairgen/tuning/train_loop.py, `pairgen-bench
--train-loop`), on the CPU: the three models start from the same weights, take whole training steps,
and the cuEquivariance stand-in holds the weights in the fused layout its function takes."""
from __future__ import annotations

import torch

import pairgen
from pairgen.tuning import train_loop

SMALL = {"B": 1, "N": 9, "P": 16, "H": 8, "D": 8}


def test_each_model_trains_from_the_same_weights_and_is_timed():
    row = train_loop.measure(SMALL, "cpu", steps=2, warmup=1)
    assert row["pairgen_ms"] > 0 and row["reference_ms"] > 0
    # on the CPU pairgen's modules run their references: the same first step, to the rounding
    assert abs(row["pairgen_first_loss"] - row["reference_first_loss"]) <= 1e-3 * abs(row["reference_first_loss"])
    text = train_loop.table(row)
    assert "| pairgen |" in text and "| reference |" in text and "N=9" in text
    if "cuequivariance_skipped" in row:  # not installed here: the table says why
        assert "not importable" in text


def test_the_cuequivariance_stand_in_computes_the_module_from_its_fused_weights_and_trains_them():
    """With pairgen's function (cuEquivariance's arguments) in cuEquivariance's place: the same
    output as the module it was made from, and an optimizer step moves its own parameters."""
    torch.manual_seed(3)
    module = pairgen.TriangleMultiplication(16, 8, direction="outgoing", gate_on="normalized", bias=False)
    stand_in = train_loop.CuequivarianceTriangle(module, pairgen.triangle_multiplicative_update)
    x, mask = torch.randn(1, 7, 7, 16), torch.rand(1, 7, 7) > 0.2
    torch.testing.assert_close(stand_in(x, mask), module(x, mask), rtol=1e-5, atol=1e-5)
    assert set(stand_in.weights) >= {"p_in_weight", "g_in_weight", "p_out_weight", "g_out_weight"}
    assert stand_in.weights["p_in_weight"].shape == (16, 16)  # a's 8 rows, then b's
    before = stand_in.weights["p_in_weight"].detach().clone()
    optimizer = torch.optim.AdamW(stand_in.parameters(), lr=1e-2)
    stand_in(x, mask).square().mean().backward()
    optimizer.step()
    assert not torch.equal(before, stand_in.weights["p_in_weight"])
