"""What is tuned and what runs: `pairgen-tune --status` (every tuned folder's entries and their
state, the first-use verdicts, which entries apply on a GPU) and `pairgen-tune --explain` (what a
module runs for a shape, and why), on this GPU or on one described by hand (--gpu, --arch)."""
from __future__ import annotations

from pathlib import Path

from ..spec import precision_of
from .cli import shape_label


def described_gpu(args):
    """A runtime.DeviceInfo for --gpu/--arch (default device limits), else None."""
    if args.gpu is None:
        return None
    from pairgen import runtime
    from pairgen.spec import DeviceLimits

    digits = args.arch[len("sm_"):].rstrip("af")
    capability = (int(digits[:-1]), int(digits[-1]))
    return runtime.DeviceInfo(0, args.gpu, runtime.slugify(args.gpu), args.arch, DeviceLimits(), capability)


def this_gpu():
    """The current GPU's runtime.DeviceInfo; None where torch is not installed or sees no GPU
    (--status and --dry-run run there too)."""
    try:
        import torch
    except ImportError:
        return None

    if not torch.cuda.is_available():
        return None
    from pairgen import runtime

    return runtime.device_info(torch.cuda.current_device())


def status(info=None) -> int:
    """Every tuned folder lookups read, in order, and each entry's state; then which entries apply
    on this GPU (or on `info`, a GPU described by hand)."""
    from pairgen import config, runtime
    from pairgen.ops import backward_tuning, get_op
    from pairgen.tuned import all_databases

    backward_dbs = {backward_tuning.db_name(op): op for op in backward_tuning.OPS}
    totals = {"stale": 0, "invalid": 0, "malformed": 0}
    seen: dict[tuple, Path] = {}  # (gpu, op, key) -> the folder whose entry lookups use
    for root in config.tuned_read_dirs():
        dbs = all_databases(root)
        print(f"\n## {root} ({folder_role(root)})\n")
        if not dbs:
            print("no tuned entries")
            continue
        print("| gpu | op | shape | precision | strategy | µs | × eager | × compile | state |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for db in dbs:
            entries = db.entries()
            if db.problem:
                print(f"| {db.gpu_slug} | {db.op} | – | – | – | – | – | – | IGNORED: {db.problem} |")
            backward_op = backward_dbs.get(db.op)  # the training path's entries (pairgen-tune --backward)
            spec = None if backward_op else get_op(db.op)
            for e in entries:
                # "ok", "stale", or "invalid: why"
                state = backward_tuning.entry_state(backward_op, e) if backward_op else runtime.entry_state(spec, e)
                kind = state.split(":")[0]
                if kind in totals:
                    totals[kind] += 1
                cell = _state_cell(state)
                where = (db.gpu_slug, db.op, repr(e["key"]))
                if where in seen:
                    cell += f"; hidden by the entry in {seen[where]}"
                elif kind == "ok":
                    seen[where] = root
                base = e.get("baselines_us", {})
                runs = "the kernel" if backward_op else what_runs(e.get("us"), base)
                if runs not in ("the kernel", "–"):  # timed slower than what a module runs without it
                    cell += f"; a module runs {runs}"
                ratio = lambda peer: f"{base[peer] / e['us']:.1f}×" if peer in base and e.get("us") else "–"  # noqa: E731
                print(f"| {db.gpu_slug} | {db.op} | {shape_label(e.get('shape', e['key']))} | {e['key']['dtype']} "
                      f"| {e['strategy']} "
                      f"| {e.get('us', '–')} | {ratio('eager')} | {ratio('compile')} | {cell} |")
            for index, why in db.skipped():
                totals["malformed"] += 1
                print(f"| {db.gpu_slug} | {db.op} | entry {index} | – | – | – | – | – | MALFORMED: {why} ({db.path}) |")
    stale, invalid = totals["stale"], totals["invalid"]
    print(f"\n{stale} stale entr{'y' if stale == 1 else 'ies'}" + (f", {invalid} invalid" if invalid else "")
          + ("; re-tune them with: pairgen-tune --stale (the training path's, *_backward: pairgen-tune "
             "--backward)" if stale or invalid else ""))
    if totals["malformed"]:
        # Lookups skip them and pairgen-tune writes them back as they are: only a person can fix them.
        print(f"{totals['malformed']} malformed entr{'y' if totals['malformed'] == 1 else 'ies'}, skipped by every "
              "lookup: fix or remove each in its file (entry N: the file's entries list, counted from 0)")
    print(first_use_verdicts())
    info = info or this_gpu()
    if info is not None:
        print(applies_on(info))
    return 0


def first_use_verdicts() -> str:
    """The first-use checks' verdicts (pairgen/first_use.py): which untuned keys run the reference
    because their default kernel was slower. Deleting a file forgets its verdicts."""
    from pairgen import config, first_use

    root = config.tuned_dir_override() or config.user_tuned_dir()
    files = sorted(root.glob("*/first-use/*.json"))
    if not files:
        return f"\nno first-use verdicts under {root}"
    lines = [f"\n## first-use verdicts under {root} (delete a file to time its keys again)\n",
             "| gpu | op | widths | precision | N bucket | default µs | reference µs | runs |", "|---|---|---|---|---|---|---|---|"]
    for path in files:
        for v in first_use.load_verdicts(path):
            key = v.get("key", {})
            widths = " ".join(f"{k}={val}" for k, val in sorted(key.get("widths", {}).items()))
            lines.append(f"| {path.parent.parent.name} | {path.stem} | {widths} | {key.get('dtype')} | {key.get('n_bucket')} "
                         f"| {v.get('kernel_us')} | {v.get('reference_us')} | {v.get('winner')} |")
    return "\n".join(lines)


def folder_role(root: Path) -> str:
    from pairgen import config

    if config.tuned_dir_override() is not None:
        return "PAIRGEN_TUNED_DIR: read and written"
    roles = []
    if root == config.tuned_write_dir():
        roles.append("the checkout's, written by tuning" if root == config.shipped_tuned_dir()
                     else "the user's, written by tuning")
    elif root == config.shipped_tuned_dir():
        roles.append("shipped with pairgen" if not config.in_checkout() else "the checkout's, read only")
    return ", ".join(roles) or "read"


def applies_on(info) -> str:
    """Which folders' entries lookups use on a GPU, per op: its own; for widths it has none for, a
    same-architecture GPU's; else the op's default parameters (runtime.choose, per call)."""
    from pairgen import config, runtime
    from pairgen.ops import op_names
    from pairgen.tuned import TunedDB

    lines = [f"\non {info.name} ({info.slug}, {info.arch}):"]
    for op in op_names():
        own = [str(db.path) for db in (TunedDB(op, info.slug, root) for root in config.tuned_read_dirs())
               if db.path.is_file()]
        same = runtime._same_arch_databases(op, info)
        parts = [f"this GPU's entries ({', '.join(own)})"] if own else []
        if same:
            parts.append(("for widths it has none for, " if own else "no entries of its own; ")
                         + f"entries tuned on {', '.join(dict.fromkeys(db.gpu_slug for db in same))} "
                         f"(same architecture, {info.arch}) apply ({', '.join(str(db.path) for db in same)})")
        if not own and not same:
            parts.append("no entries for this GPU or its architecture")
        lines.append(f"  {op}: {'; '.join(parts)}; else the op's default parameters")
    return "\n".join(lines)


def _state_cell(state: str) -> str:
    if state == "stale":
        return "STALE (today's code renders another source)"
    return "INVALID" + state[len("invalid"):] if state.startswith("invalid") else state


def what_runs(us: "float | None", baselines: dict) -> str:
    """What a module runs at a tuned shape (runtime.faster_without_the_kernel): the best kernel, or
    what the tuner timed faster than it (the closed form, else the PyTorch reference), with its µs."""
    from pairgen.runtime import faster_without_the_kernel

    if us is None:
        return "–"
    instead = faster_without_the_kernel({"us": us, "baselines_us": baselines})
    return "the kernel" if instead is None else f"{instead[0]} ({instead[1]:.1f} µs)"


def explain(work, info) -> int:
    """What a module runs for each selected shape on `info`'s GPU, and where it comes from: the
    forward variant, and the fused backward kernels of a training call. On this machine's GPU also
    the routes an inference and a training call take (stand-in inputs, nothing computed)."""
    from pairgen import config, runtime

    print(f"on {info.name} ({info.slug}, {info.arch}); tuned folders, first first: "
          + ", ".join(str(d) for d in config.tuned_read_dirs()))
    here = this_gpu()
    for spec, shape in work:
        if here is not None and here.slug == info.slug:
            explained = _explain_on_this_gpu(spec, shape, info)
        else:
            explained = runtime.explain(spec, precision_of(spec), spec.widths_of(shape), shape["N"], info=info)
            backward = _backward_line(spec, shape, info)
            if backward:
                explained.routes = (("training call's backward (routes need this GPU)", backward),)
        print(f"{shape_label(shape)}: {explained}")
    return 0


def _explain_on_this_gpu(spec, shape: dict, info):
    """module.explain on a module of the shape's widths in its precision: the variant and the
    routes of an inference and a training call."""
    import torch

    from .evaluate import module_in_precision

    module = module_in_precision(spec, spec.widths_of(shape), torch.Generator().manual_seed(0), precision_of(spec),
                                 torch.device("cuda", info.index))
    return module.explain(shape["N"], info.index, precision_of(spec), batch=shape["B"])


def _backward_line(spec, shape: dict, info) -> "str | None":
    """The fused backward kernels a closed-form training call of the shape runs (their launch
    shapes and where those came from); None for an op without any."""
    from pairgen.ops import backward_tuning
    from pairgen.precision import lookup

    if spec.name not in backward_tuning.OPS:
        return None
    kind = lookup(precision_of(spec)).storage
    return backward_tuning.describe(spec.name, kind, spec.widths_of(shape), shape["N"], info)
