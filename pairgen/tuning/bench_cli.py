"""Side-by-side timing: pairgen's module call and its CUDA-graph replay against PyTorch eager and
torch.compile(mode="max-autotune-no-cudagraphs", or --compile-mode), in one process and one run (docs/performance.md says how and why).

  pairgen-bench                  every op, its default shapes (seed + real)
  pairgen-bench --op contact --shape B=1,N=256,P=128,H=128 --peers eager,compile
  pairgen-bench --backward       forward + backward (training), with the GPU's and the host's time a
                                 step, peak memory and gradient error
  pairgen-bench --train-loop     the README's training example, whole steps, against the references
                                 and cuEquivariance's triangle update
  pairgen-bench --dry-run        list what would be measured

Writes bench.md (table), <date>-<gpu>.json (all numbers, merged per GPU and date) and bench.png (speedups, with matplotlib: the
`bench` extra) to --out. (`python scripts/bench.py` is this command, from a checkout that is not installed.)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from ..ops import get_op, op_names
from .. import config
from ..spec import precision_of
from .cli import add_selection_args, environment_problem, selected_shapes, shape_label


#: pairgen's function beside the triangle update's module (pairgen/tuning/function_peers.py: its
#: NAMES; that module imports torch, which the command's parsing does not).
FUNCTION_PEERS = ("functional", "functional-fresh")
#: torch.compile's mode for the compile peer unless --compile-mode says otherwise: its best kernels,
#: without CUDA graphs (pairgen's own call is timed without them too; graph replay is its own column).
COMPILE_MODE = "max-autotune-no-cudagraphs"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_selection_args(parser)
    parser.add_argument("--peers", default="eager,compile,cuequivariance",
                        help="comma-separated peers: eager, compile, and an op's own (trimul: cuequivariance, "
                             "timed where it is importable; functional and functional-fresh, pairgen's function on "
                             "the module's weights passed as the same tensors, or concatenated anew, on every call, "
                             "in the models' form); default: eager,compile,cuequivariance")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="output folder: bench.md, bench.png and <date>-<gpu>.json (rows of one GPU and date, "
                             "merged across runs; the repo keeps them in benchmarks/results/)")
    parser.add_argument("--reps", type=int, default=200, help="timed repetitions per measurement")
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward (a training step's work: gradients for the input and every "
                             "parameter) instead of the forward, with each one's GPU time and host time a step "
                             "and its peak memory")
    parser.add_argument("--backward-mode", default="auto", choices=("auto", "closed_form", "reference"),
                        help="with --backward: the modules' backward_mode (default auto); rows of another mode are "
                             "kept apart from auto's in the results")
    parser.add_argument("--recompute-for-backward", action="store_true",
                        help="with --backward: the modules' recompute_for_backward (the kernel forward, then a "
                             "backward that recomputes the intermediates instead of keeping them); kept apart too")
    parser.add_argument("--captured-steps", default="default", choices=("default", "on", "off"),
                        help="with --backward: the modules' capture_training_steps (default: the op's own; the "
                             "heads replay repeated closed-form steps as CUDA graphs, the triangle update does not); "
                             "rows that replayed captured steps say so in their mode")
    parser.add_argument("--compile-mode", default=COMPILE_MODE,
                        choices=("default", "reduce-overhead", "max-autotune", COMPILE_MODE),
                        help=f"the torch.compile peer's mode (default {COMPILE_MODE}; \"default\" builds in a "
                             "fraction of the time, useful for --backward where max-autotune's build of the "
                             "backward takes many minutes); rows record it")
    parser.add_argument("--train-loop", nargs="?", const="", metavar="SHAPE",
                        help="time the README's training example instead (triangle update, contact head and readout "
                             "trained with AdamW under bf16 autocast; whole steps) on pairgen's modules, the PyTorch "
                             "references and cuEquivariance's triangle update; SHAPE overrides its widths, e.g. "
                             "N=512 (default B=2,N=384,P=64,H=32,D=32); writes train-loop.md")
    parser.add_argument("--autocast", action="store_true",
                        help="with --precision bfloat16 or float16: fp32 modules and inputs, every call under "
                             "torch.autocast to that dtype and its output made fp32 (fp32 in and out, as GPU MODE's "
                             "TriMul benchmark calls; pairgen's module with output_dtype=torch.float32, so its "
                             "kernels write the fp32 output; cuEquivariance's kernel on the input cast to that "
                             "dtype); checked against the float64 reference at the autocast standard")
    parser.add_argument("--dry-run", action="store_true", help="list what would be measured, and exit")
    args = parser.parse_args(argv)
    return parser, args


def _forward_label(module, inputs: tuple, n: int, device) -> tuple:
    """(the variant a forward call runs, or None; what the row says it runs)."""
    kernel_precision = module.kernel_precision(*inputs)
    if kernel_precision is None:
        path, detail = module.without_kernel_path(inputs, training=False)
        if path == "fp32 kernel":
            return None, f"fp32 kernel on inputs made fp32: {detail[0].plan.label}"
        return None, "closed form (no kernels in this dtype)" if path == "closed form" else "reference (no kernel)"
    variant = module.variant_for(n, device, kernel_precision)
    if variant is None:  # why: no kernel fits, or the kernel measured slower (tuner or first-use check)
        from ..precision import HALF_DTYPES

        why = module.explain(n, device, kernel_precision).source
        if kernel_precision in HALF_DTYPES and module.without_kernel_path(inputs, training=False)[0] == "closed form":
            return None, f"closed form ({why})"
        return None, f"reference ({why})"
    return variant, variant.plan.label


def _under_autocast(fn, dtype):
    """fn() under torch.autocast to `dtype`, its output made fp32: fp32 in and out."""
    import torch

    def call():
        with torch.autocast("cuda", dtype=dtype):
            return fn().float()
    return call


def _autocast_peer(spec, name: str, module, inputs: tuple, dtype):
    """An op's own peer in `dtype` for an fp32 call: on a copy of the module in that dtype and
    buffers of the inputs in it, each call casting the fp32 inputs into them and the output back
    to fp32 (a string says why it cannot run here)."""
    import copy

    import torch

    half = copy.deepcopy(module).to(dtype)
    staged = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    peer = spec.extra_peer(name, half, staged)
    if isinstance(peer, str):
        return peer

    def call():
        for buffer, given in zip(staged, inputs):
            if given.is_floating_point():
                buffer.copy_(given)
        out = peer()
        return out.float() if out.dtype is not torch.float32 else out
    return call


def measure(spec, shape, peers, reps, compile_mode: str = COMPILE_MODE, autocast: bool = False):
    """One row: pairgen's call, graph replay and host time, each peer's time, and every output's
    error against the float64 reference (pairgen's is also checked against the op's tolerance for
    the precision). Peers run in the module's dtype. autocast: fp32 modules and inputs, each call
    (pairgen's, eager's, torch.compile's) under torch.autocast to the precision's dtype with its
    output made fp32, the op's own peers on the inputs cast to that dtype; the autocast standard."""
    import torch

    from pairgen import runtime
    from pairgen.precision import HALF_DTYPES
    from pairgen.spec import AUTOCAST_TOLERANCE
    from pairgen.tuning import function_peers
    from pairgen.tuning.check import compare, reference64
    from pairgen.tuning.evaluate import inputs_in_precision, module_in_precision, reference_in_precision
    from pairgen.tuning.timing import floor_us, host_us_runs, time_cuda, time_graph_replay

    device = torch.device("cuda", torch.cuda.current_device())
    precision = precision_of(spec)
    autocast_dtype = HALF_DTYPES[precision] if autocast else None
    gen = torch.Generator().manual_seed(0)
    widths = spec.widths_of(shape)
    module = module_in_precision(spec, widths, gen, "float32" if autocast else precision, device)
    inputs = inputs_in_precision(spec.make_inputs(shape, gen), "float32" if autocast else precision, device)
    eager = reference_in_precision(spec, module)
    if autocast:  # fp32 out: pairgen's kernels write it where they can (the `.float()` after is then free)
        module.output_dtype = torch.float32
    tolerance = AUTOCAST_TOLERANCE if autocast else spec.tolerance[precision]
    row = {"op": spec.name, "shape": shape, "precision": f"{precision} autocast" if autocast else precision}
    wrap = (lambda fn: _under_autocast(fn, autocast_dtype)) if autocast else (lambda fn: fn)
    with torch.inference_mode():
        expected = reference64(module, inputs)
        call = wrap(lambda: module(*inputs))
        check = compare(call(), expected, tolerance)
        row["rel_l2"] = check.rel_l2
        with torch.autocast("cuda", dtype=autocast_dtype or torch.bfloat16, enabled=autocast):
            _, row["variant"] = _forward_label(module, inputs, shape["N"], device)
        row["check"] = str(check)
        row["call_us"] = time_cuda(call, device, reps=reps).median_us
        row["graph_us"] = time_graph_replay(call, device, reps=reps).median_us
        row["host_runs_us"] = [round(us, 2) for us in host_us_runs(call)]
        row["host_us"] = statistics.median(row["host_runs_us"])
        timed = {}
        if "eager" in peers:
            timed["eager"] = wrap(lambda: eager(*inputs))
        if "compile" in peers:
            compiled = torch.compile(eager, mode=compile_mode)
            row["compile_mode"] = compile_mode
            start = time.perf_counter()
            wrap(lambda: compiled(*inputs))()
            row["compile_build_s"] = time.perf_counter() - start
            timed["compile"] = wrap(lambda: compiled(*inputs))
        for name in peers:
            if name in spec.extra_peer_names and autocast:
                peer = _autocast_peer(spec, name, module, inputs, autocast_dtype)
            elif name in spec.extra_peer_names:
                peer = spec.extra_peer(name, module, inputs)
            elif spec.name == "trimul" and name in FUNCTION_PEERS and not autocast:
                peer = function_peers.functional_peer(name, module, inputs)
            else:
                continue
            if isinstance(peer, str):
                row.setdefault("unavailable", {})[name] = peer
            else:
                timed[name] = peer
        for name, fn in timed.items():
            try:
                row[f"{name}_rel_l2"] = compare(fn(), expected, tolerance).rel_l2
            except Exception as exc:  # a peer that does not take this shape or dtype
                row.setdefault("unavailable", {})[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            row[f"{name}_us"] = time_cuda(fn, device, reps=reps).median_us
        row["call_again_us"] = time_cuda(call, device, reps=reps).median_us  # the spread between two runs
    row["floor_us"] = floor_us(spec.cost(shape), runtime.device_info(device.index).slug, precision)
    return row


#: Training steps a host-time run issues back to back (timing.host_us_runs): a step of the triangle
#: update is about 60 launches, so ten stay within the GPU's launch queue (about a thousand).
STEPS_PER_HOST_RUN = 10


#: --captured-steps -> a module's capture_training_steps
CAPTURED_STEPS = {"default": None, "on": True, "off": False}


def measure_training(spec, shape, peers, reps, backward_mode: str = "auto", recompute: bool = False,
                     compile_mode: str = COMPILE_MODE, captured_steps: str = "default"):
    """One --backward row: forward + backward of the loss (out * g).sum() (g random, fixed) for
    pairgen's module and each peer, each with gradients for the input and its parameters: median
    µs (L2 flushed), the GPU's busy time in one step and the host's time to issue one (steps back
    to back, the GPU not awaited: the step takes about the larger), the peak memory one step adds,
    and the input gradient's relative L2 against float64 autograd of the reference. Peers run in
    the module's dtype."""
    import torch

    from pairgen.module import captured
    from pairgen.tuning.evaluate import inputs_in_precision, module_in_precision, reference_in_precision
    from pairgen.tuning.timing import gpu_us_of_one_call, host_us_runs, time_cuda

    device = torch.device("cuda", torch.cuda.current_device())
    precision = precision_of(spec)
    gen = torch.Generator().manual_seed(0)
    module = module_in_precision(spec, spec.widths_of(shape), gen, precision, device)
    module.backward_mode = backward_mode
    module.recompute_for_backward = recompute
    module.capture_training_steps = CAPTURED_STEPS[captured_steps]
    inputs = inputs_in_precision(spec.make_inputs(shape, gen), precision, device)
    x = inputs[0].detach().requires_grad_()
    train_inputs = (x, *inputs[1:])
    eager = reference_in_precision(spec, module)
    with torch.no_grad():
        g = torch.randn(module(*inputs).shape, generator=gen).to(device, x.dtype)
    exact = _input_gradient64(spec, module, inputs, g)
    kernel_precision = module.kernel_precision(*inputs)
    variant, label = _forward_label(module, inputs, shape["N"], device)
    kept = "closed form: its forward keeps the intermediates for its backward (no kernel forward)"
    if kernel_precision is None:
        label = kept if module.without_kernel_path(train_inputs, training=True)[0] == "closed form" \
            else "reference (no kernel)"
    elif variant and module.trains_through_reference(kernel_precision, train_inputs):
        label = f"reference (backward_mode {module.backward_mode!r} trains {kernel_precision} calls in PyTorch)"
    elif variant and module._saves_for_backward(train_inputs):
        label = kept
    mode = "train" if backward_mode == "auto" else f"train ({backward_mode})"
    if config.fused_backward():  # kept apart from the PyTorch passes' rows
        mode += " +fused"
    if recompute:
        mode += " recompute"
    row = {"op": spec.name, "shape": shape, "precision": precision, "mode": mode, "variant": label}
    calls = {"pairgen": lambda: module(*train_inputs)}
    if "eager" in peers:
        calls["eager"] = lambda: eager(*train_inputs)
    if "compile" in peers:
        compiled = torch.compile(eager, mode=compile_mode)
        row["compile_mode"] = compile_mode
        calls["compile"] = lambda: compiled(*train_inputs)
    for name in peers:
        if name in spec.extra_peer_names:
            peer = spec.extra_peer(name, module, train_inputs, train=True)
            if isinstance(peer, str):
                row.setdefault("unavailable", {})[name] = peer
            else:
                calls[name] = peer
    for name, fn in calls.items():
        def step(fn=fn):
            x.grad = None
            fn().backward(g)
        try:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            # The first two steps build what a first call builds (torch.compile, cuBLAS handles, kernels;
            # pairgen's captured step at the second); the peak is the third's, over the memory before the
            # first, so that what the steps keep allocated between them counts.
            step()
            step()
            torch.cuda.synchronize(device)
            row[f"{name}_grad_rel_l2"] = ((x.grad.double() - exact).norm() / exact.norm()).item()
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            # a captured step's graphs also hold their temporaries' memory, which memory_allocated does not count
            spare = captured.pool_spare_bytes(module) if name == "pairgen" else 0
            row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated(device) - before + spare) / 2**20
            row[f"{name}_us"] = time_cuda(step, device, reps=reps).median_us
        except Exception as exc:  # a peer that does not take this shape or dtype, or has no backward
            row.setdefault("unavailable", {})[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        # few steps a run: their launches stay within the GPU's queue, so the host never waits
        row[f"{name}_host_us"] = statistics.median(host_us_runs(step, calls=STEPS_PER_HOST_RUN))
        try:
            row[f"{name}_gpu_us"] = gpu_us_of_one_call(step, device)
        except RuntimeError as exc:  # a profiler that cannot trace here (CUPTI): the row keeps its times
            row.setdefault("unavailable", {})[f"{name} GPU time"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if captured.steps_of(module).held():
        row["mode"] += " captured"
    return row


def _input_gradient64(spec, module, inputs, g):
    """d((out * g).sum())/d(input) by float64 autograd of the reference on the module's weights."""
    reference = spec.make_reference(module).double()
    x64 = inputs[0].double().requires_grad_()
    rest = [t.double() if t.is_floating_point() else t for t in inputs[1:]]
    reference(x64, *rest).backward(g.double())
    return x64.grad


def _us(row: dict, key: str) -> str:
    return f"{row[key]:.0f}" if key in row else "–"


def training_table(rows, peers) -> str:
    names = ["pairgen", *peers]
    head = ["op", "shape", "precision", "mode", "pairgen variant (forward)"] + [f"{n} fwd+bwd µs" for n in names]
    head += [f"× vs {p}" for p in peers] + ["GPU / host µs a step: " + " / ".join(names)]
    head += ["peak MiB: " + " / ".join(names), "input grad rel L2: " + " / ".join(names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["op"], shape_label(r["shape"]), r.get("precision", "float32"), r["mode"], f"`{r['variant']}`"]
        cells += [f"{r[n + '_us']:.1f}" if n + "_us" in r else "–" for n in names]
        cells += [f"{r[p + '_us'] / r['pairgen_us']:.2f}×" if p + "_us" in r and "pairgen_us" in r else "–"
                  for p in peers]
        cells.append(" / ".join(f"{_us(r, n + '_gpu_us')}, {_us(r, n + '_host_us')}" if n + "_us" in r else "–"
                                for n in names))
        cells.append(" / ".join(f"{r[n + '_peak_mib']:.0f}" if n + "_peak_mib" in r else "–" for n in names))
        cells.append(" / ".join(f"{r[n + '_grad_rel_l2']:.1e}" if n + "_grad_rel_l2" in r else "–" for n in names))
        lines.append("| " + " | ".join(cells) + " |")
    notes = {f"{name}: {why}" for r in rows for name, why in r.get("unavailable", {}).items()}
    return "\n".join(lines + [""] + [f"- not measured: {note}" for note in sorted(notes)])


def table(rows, peers) -> str:
    head = ["op", "shape", "precision", "pairgen variant", "call µs (2 runs)", "graph µs", "overhead µs",
            "host µs/call"]
    head += [f"{p} µs" for p in peers] + [f"× vs {p}" for p in peers] + ["floor µs", "call / floor", "check"]
    head += ["rel L2 vs float64: pairgen / " + " / ".join(peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["op"], shape_label(r["shape"]), r.get("precision", "float32"), f"`{r['variant']}`",
                 f"{r['call_us']:.1f} / {r['call_again_us']:.1f}",
                 f"{r['graph_us']:.1f}", f"{r['call_us'] - r['graph_us']:.1f}", f"{r['host_us']:.1f}"]
        cells += [f"{r[p + '_us']:.1f}" if p + "_us" in r else "–" for p in peers]
        cells += [f"{r[p + '_us'] / r['call_us']:.1f}×" if p + "_us" in r else "–" for p in peers]
        floor = r.get("floor_us")
        cells += [f"{floor:.1f}" if floor else "–", f"{r['call_us'] / floor:.1f}" if floor else "–",
                  "ok" if r["check"].startswith("ok") else r["check"]]
        errors = [r.get("rel_l2")] + [r.get(f"{p}_rel_l2") for p in peers]
        cells.append(" / ".join(f"{e:.1e}" if e is not None else "–" for e in errors))
        lines.append("| " + " | ".join(cells) + " |")
    notes = {f"{name}: {why}" for r in rows for name, why in r.get("unavailable", {}).items()}
    means = geometric_means(rows, ["call", *peers]) if len(rows) > 1 else {}
    mean_line = ["- geometric means of these rows' µs (call, then each peer timed on all of them): "
                 + ", ".join(f"{name} {us:.1f}" for name, us in means.items())] if means else []
    return "\n".join(lines + [""] + [f"- not measured: {note}" for note in sorted(notes)] + mean_line)


def geometric_means(rows, names) -> dict:
    """{name: the geometric mean of the rows' <name>_us}, for the names every row has a time of
    (GPU MODE ranks its TriMul shapes so)."""
    import math

    return {name: math.exp(sum(math.log(r[f"{name}_us"]) for r in rows) / len(rows))
            for name in names if rows and all(f"{name}_us" in r for r in rows)}


def plot(rows, peers, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['op']}\n{shape_label(r['shape'])}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    width = 0.8 / max(1, len(peers))
    for k, peer in enumerate(peers):
        ax.bar([i + k * width for i in range(len(rows))], [r.get(peer + "_us", 0.0) / r["call_us"] for r in rows],
               width, label=f"vs {peer}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(peers) - 1) / 2 for i in range(len(rows))], labels, fontsize=8)
    ax.set_ylabel("speedup of pairgen's module call (×)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    if (problem := environment_problem()) is not None:
        print(f"pairgen-bench: {problem}", file=sys.stderr)
        return 2
    peers = [p for p in args.peers.split(",") if p]
    if args.autocast and (args.backward or args.train_loop is not None
                          or not args.precision or set(args.precision) - {"bfloat16", "float16"}):
        parser.error("--autocast times forwards in --precision bfloat16 or float16 (and only those)")
    work = selected_shapes(args, parser, without_kernels=("bfloat16", "float16"))
    known = {"eager", "compile", *FUNCTION_PEERS}.union(*(get_op(name).extra_peer_names for name in op_names()))
    bad = set(peers) - known
    if bad:
        parser.error(f"unknown peers {sorted(bad)}; known: {sorted(known)}")
    if args.dry_run:
        for spec, shape in work:
            mine = [p for p in peers if p in ("eager", "compile") or p in spec.extra_peer_names]
            print(f"would measure {spec.name} {shape_label(shape)} against {', '.join(mine) or 'no peers'}")
        return 0
    import torch

    from pairgen.tuning.timing import strict_fp32

    if not torch.cuda.is_available():
        print("pairgen-bench needs a CUDA GPU; none is visible to torch", file=sys.stderr)
        return 2
    strict_fp32()
    import cuda.core

    from pairgen.compiler import nvrtc_version
    from pairgen.tuning.timing import HOST_CALLS

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "nvrtc": nvrtc_version(), "cuda.core": cuda.core.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "tf32": "off",
           "timing": "median of CUDA-event-timed calls, L2 flushed before each; inference_mode; host µs/call: the "
                     f"time to issue one of {HOST_CALLS} calls made back to back (once the driver's launch queue is full "
                     "the host waits for the GPU, so for calls of milliseconds it tends to their GPU time)"}
    from pairgen import native

    # The compiled fast path is built on first use in the background; the bench measures calls as
    # they run once it is there (a process on a machine that has built it before loads it at once).
    native.fastcall(wait=True)
    env["fastcall"] = native.status()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.train_loop is not None:
        return run_train_loop(args, env)
    rows = []
    if args.backward:
        from pairgen.tuning.timing import HOST_RUNS

        env["timing"] = ("median of CUDA-event-timed forward + backward steps, L2 flushed before each; GPU: the "
                         "kernels' time in one step (torch.profiler); host: the time to issue one step, "
                         f"{STEPS_PER_HOST_RUN} back to back, median of {HOST_RUNS} runs")
    for spec, shape in work:
        if args.backward:
            rows.append(measure_training(spec, shape, peers, args.reps, args.backward_mode, args.recompute_for_backward,
                                         args.compile_mode, args.captured_steps))
            r = rows[-1]
            print(f"{spec.name} {shape_label(shape)} {r['precision']} {r['mode']} fwd+bwd: "
                  + ", ".join(f"{n} {r[n + '_us']:.1f} µs (GPU {_us(r, n + '_gpu_us')}, host {_us(r, n + '_host_us')}; "
                              f"{r[n + '_peak_mib']:.0f} MiB)"
                              for n in ["pairgen", *peers] if n + "_us" in r), flush=True)
        else:
            rows.append(measure(spec, shape, peers, args.reps, args.compile_mode, args.autocast))
            r = rows[-1]
            print(f"{spec.name} {shape_label(shape)} {r['precision']}: call {r['call_us']:.1f} µs, "
                  f"graph {r['graph_us']:.1f} µs, "
                  + ", ".join(f"{p} {r[p + '_us']:.1f} µs" for p in peers if p + "_us" in r), flush=True)
        text = write_results(args.out, env, rows, peers)  # after every shape: a cut-short run keeps its rows
    if peers and not args.backward:
        plot(rows, peers, args.out / "bench.png")
    print(text)
    return 0


def run_train_loop(args, env: dict) -> int:
    """--train-loop: the README's training example, timed on each model; train-loop.md and the row
    merged into the results JSON."""
    from .train_loop import measure, table

    shape = {k: int(v) for k, v in (part.split("=") for part in args.train_loop.split(",") if part)}
    row = measure(shape, "cuda", steps=max(5, min(args.reps, 30)))
    env = {**env, "timing": "median of whole training steps (forward under autocast, loss, backward, AdamW step), "
                            "the GPU synchronised around each"}
    text = f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}.\n\n{table(row)}"
    (args.out / "train-loop.md").write_text(text)
    merge_rows(args.out, env, [row])
    print(text)
    return 0


def results_name(env: dict) -> str:
    """The machine-readable results file of one GPU and date: what the README's tables cite
    (benchmarks/results/<date>-<gpu>.json in the repo)."""
    slug = "".join(c if c.isalnum() else "-" for c in env["gpu"].lower()).strip("-")
    return f"{env['date']}-{slug}.json"


def write_results(out: Path, env: dict, rows: list, peers: list) -> str:
    """bench.md (the table), and the rows as JSON under results_name(env), merged with the rows an
    earlier run of the same GPU and date wrote there (a later row of the same op and shape wins)."""
    training = any(r.get("mode", "").startswith("train") for r in rows)
    text = (f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, NVRTC {env['nvrtc']}, {env['date']}; "
            f"TF32 off in float32 rows; peers in each row's dtype; {env['timing']}.\n\n"
            + (training_table(rows, peers) if training else table(rows, peers)) + "\n")
    (out / "bench.md").write_text(text)
    merge_rows(out, env, rows)
    return text


def merge_rows(out: Path, env: dict, rows: list) -> None:
    """The rows as JSON under results_name(env), merged with the rows an earlier run of the same GPU
    and date wrote there (a later row of the same op, shape, precision and mode wins)."""
    path = out / results_name(env)
    earlier = json.loads(path.read_text())["rows"] if path.exists() else []
    def key(r):
        return r["op"], json.dumps(r["shape"], sort_keys=True), r.get("precision", "float32"), r.get("mode", "forward")

    mine = {key(r) for r in rows}
    kept = [r for r in earlier if key(r) not in mine]
    path.write_text(json.dumps({"env": env, "rows": kept + rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
