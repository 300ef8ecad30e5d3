"""The README's training example as a benchmark (`pairgen-bench --train-loop`): a model holding a
triangle update, a contact head and a pair readout, trained with AdamW under autocast, timed a
whole step at a time (forward, loss, backward, optimizer step) with

- pairgen: the three drop-in modules;
- reference: the same model on the PyTorch reference modules (the same weights);
- cuequivariance: cuEquivariance's triangle update (its function, the weights held in its fused
  layout as a model built for it holds them, its operands cast to the autocast's dtype), the
  contact head and the readout PyTorch's references.

All three start from the same weights and inputs; their first losses are reported beside the times
(they agree to the autocast's rounding)."""
from __future__ import annotations

import statistics
import time

import torch

from ..ops import get_op
from ..ops.trimul.peers import af3_weights, cat

#: The README example's widths, at the length the bench runs it.
DEFAULT_SHAPE = {"B": 2, "N": 384, "P": 64, "H": 32, "D": 32}
MODELS = ("pairgen", "reference", "cuequivariance")


class PairModel(torch.nn.Module):
    """A triangle update of the pairs, then contacts from them and a readout of nodes against them."""

    def __init__(self, tri: torch.nn.Module, contact: torch.nn.Module, readout: torch.nn.Module):
        super().__init__()
        self.tri, self.contact, self.readout = tri, contact, readout

    def forward(self, pair, mask, nodes):
        pair = pair + self.tri(pair, mask)
        return self.contact(pair), self.readout(nodes, pair, mask)


class CuequivarianceTriangle(torch.nn.Module):
    """cuEquivariance's triangle update with a module's weights, held as parameters in its fused
    (AlphaFold 3) layout, so an optimizer steps them as a model built for it would."""

    def __init__(self, module: torch.nn.Module, function):
        super().__init__()
        self.function = function
        self.direction = "outgoing" if module.widths["outgoing"] else "incoming"
        self.weights = torch.nn.ParameterDict({name: torch.nn.Parameter(w.detach().clone())
                                               for name, w in af3_weights(module, cat).items() if w is not None})

    def forward(self, x, mask):
        weights = dict(self.weights.items())
        if torch.is_autocast_enabled(x.device.type):  # its operands in the autocast's dtype, as autocast's matmuls take them
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), {name: w.to(dtype) for name, w in weights.items()}
        return self.function(x, self.direction, mask=mask.to(x.dtype), eps=1e-5, **weights)


def pairgen_model(shape: dict, device) -> PairModel:
    import pairgen

    P, H, D = shape["P"], shape["H"], shape["D"]
    return PairModel(pairgen.TriangleMultiplication(P, H, direction="outgoing", gate_on="normalized", bias=False),
                     pairgen.ContactHead(pair_dim=P, hidden_dim=H),
                     pairgen.PairReadout(node_dim=D, pair_dim=P, hidden_dim=H)).to(device)


def reference_model(model: PairModel) -> PairModel:
    """The same model on the PyTorch reference modules, with the same weights."""
    return PairModel(get_op("trimul").make_reference(model.tri), get_op("contact").make_reference(model.contact),
                     get_op("readout").make_reference(model.readout))


def cuequivariance_model(model: PairModel) -> PairModel | str:
    """cuEquivariance's triangle update and the references of the other two; a string says why it
    cannot run here."""
    try:
        from cuequivariance_torch import triangle_multiplicative_update
    except Exception as exc:  # not installed, or its CUDA libraries do not load here
        return f"cuequivariance_torch is not importable ({type(exc).__name__}: {exc})"
    return PairModel(CuequivarianceTriangle(model.tri, triangle_multiplicative_update),
                     get_op("contact").make_reference(model.contact), get_op("readout").make_reference(model.readout))


def batch(shape: dict, device, seed: int = 0) -> tuple:
    """(pair, mask, nodes, target) as the README's example makes them, at this shape."""
    g = torch.Generator().manual_seed(seed)
    B, N, P, D = shape["B"], shape["N"], shape["P"], shape["D"]
    pair, nodes = torch.randn(B, N, N, P, generator=g), torch.randn(B, N, D, generator=g)
    mask, target = torch.rand(B, N, N, generator=g) > 0.1, (torch.rand(B, N, N, generator=g) > 0.5).float()
    return tuple(t.to(device) for t in (pair, mask, nodes, target))


def train_step(model: PairModel, optimizer, data: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The README example's step: forward under autocast, its loss, backward, AdamW's step."""
    pair, mask, nodes, target = data
    with torch.autocast(pair.device.type, dtype=dtype):
        contacts, nodes_out = model(pair, mask, nodes)
    loss = torch.nn.functional.binary_cross_entropy(contacts.float(), target) + nodes_out.float().square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def step_times_ms(model: PairModel, data: tuple, dtype: torch.dtype, steps: int, warmup: int) -> tuple:
    """(the first step's loss, the step times in ms after `warmup` steps): each step timed from its
    start to the end of its GPU work (the device synchronised around it)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cuda = data[0].is_cuda
    first = None
    times = []
    for step in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        loss = train_step(model, optimizer, data, dtype)
        if cuda:
            torch.cuda.synchronize()
        if first is None:
            first = float(loss)
        if step >= warmup:
            times.append((time.perf_counter() - started) * 1e3)
    return first, times


def measure(shape: dict | None = None, device="cuda", dtype: torch.dtype = torch.bfloat16, steps: int = 20,
            warmup: int = 5, models=MODELS) -> dict:
    """One row: each model's median step time (ms), peak memory on a GPU (MiB) and first loss, or
    why it did not run."""
    shape = {**DEFAULT_SHAPE, **(shape or {})}
    torch.manual_seed(0)
    built = pairgen_model(shape, device)
    made = {"pairgen": lambda m: m, "reference": reference_model, "cuequivariance": cuequivariance_model}
    # every model from the same starting weights: each is built before any step
    candidates = {name: made[name](built) for name in models}
    data = batch(shape, device)
    row = {"op": "train-loop", "shape": shape, "precision": f"{str(dtype).removeprefix('torch.')} autocast",
           "mode": "train-loop", "steps": steps}
    for name, model in candidates.items():
        if isinstance(model, str):
            row[f"{name}_skipped"] = model
            continue
        if data[0].is_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        first, times = step_times_ms(model, data, dtype, steps, warmup)
        row[f"{name}_ms"] = statistics.median(times)
        row[f"{name}_first_loss"] = first
        if data[0].is_cuda:
            row[f"{name}_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return row


def table(row: dict) -> str:
    """The row as a markdown table: a line per model, its step time and the reference's over it."""
    lines = ["| model | step ms | × vs reference | peak MiB | first loss |", "|---|---:|---:|---:|---:|"]
    reference = row.get("reference_ms")
    for name in MODELS:
        if f"{name}_ms" in row:
            ms = row[f"{name}_ms"]
            ratio = f"{reference / ms:.2f}×" if reference else ""
            peak = f"{row[name + '_peak_mib']:.0f}" if f"{name}_peak_mib" in row else ""
            lines.append(f"| {name} | {ms:.2f} | {ratio} | {peak} | {row[name + '_first_loss']:.5f} |")
        elif f"{name}_skipped" in row:
            lines.append(f"| {name} | {row[name + '_skipped']} | | | |")
    shape = ", ".join(f"{k}={v}" for k, v in row["shape"].items())
    return (f"Training loop (the README's example: triangle update, contact head, readout; AdamW; "
            f"{row['precision']}), {shape}, median of {row['steps']} steps:\n\n" + "\n".join(lines) + "\n")
