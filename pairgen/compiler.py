"""NVRTC compilation to cubin, an on-disk cache, and parallel compilation.

Imports no torch, so the tuner's compile workers start fast.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from multiprocessing import get_context
from pathlib import Path

from . import config, files

CACHE_FORMAT = "4"  # bumped when the cached metadata changes (2: resources per kernel, 3: cubin size and sha256,
                    # 4: wgmma_serialized)
ELF_MAGIC = b"\x7fELF"  # every cubin is an ELF file
NVRTC_OPTIONS = ("-std=c++17", "--ptxas-options=-v")  # -v: registers and spills in the log
#: From NVRTC 12.9 on, a compile may be answered from the driver's compute cache, and then ptxas
#: does not run and its -v report (registers, spills) is missing from the log. pairgen keeps its
#: own cache of cubins with those reports, so NVRTC's is turned off where it exists.
NVRTC_NO_CACHE_FROM = (12, 9)


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message carries the log and the offending lines."""

    def __init__(self, log: str, source: str, name: str):
        self.log, self.source, self.name = log, source, name
        super().__init__(f"NVRTC failed to compile {name}:\n{log.strip()}\n{_excerpts(log, source, name)}")

    def __reduce__(self):
        # Rebuilt from its three fields when a compile worker process sends it back: the default
        # (the message alone) broke the whole pool with BrokenProcessPool instead of reporting it.
        return (type(self), (self.log, self.source, self.name))


def _excerpts(log: str, source: str, name: str, context: int = 3) -> str:
    lines = source.splitlines()
    shown = []
    for match in re.finditer(rf"{re.escape(name)}\((\d+)\): error", log):
        line = int(match.group(1))
        lo, hi = max(1, line - context), min(len(lines), line + context)
        block = "\n".join(f"{'>>' if n == line else '  '} {n:5d} | {lines[n - 1]}" for n in range(lo, hi + 1))
        shown.append(f"--- source around line {line} ---\n{block}")
    return "\n".join(shown)


@dataclass
class Compiled:
    """A cubin and what NVRTC/ptxas said about it."""

    cubin: bytes
    kernel_name: str
    arch: str
    nvrtc_version: str
    compile_s: float
    registers: int | None    # the largest over the source's kernels
    spill_bytes: int | None  # likewise: any kernel spilling shows here
    stack_bytes: int | None
    #: per __global__ function: {"registers", "spill_bytes", "stack_bytes"}
    kernels: dict = field(default_factory=dict)
    #: ptxas serialized the source's wgmma products: a wait after each (remark C7514) or one it
    #: injected before an accumulator is used (C7517), where it could not prove that nothing touches
    #: an accumulator while its product runs; kept in the cache so that a check needs no second compile
    wgmma_serialized: bool = False
    from_cache: bool = False

    def summary(self) -> str:
        text = (f"{self.registers} regs, {self.spill_bytes} B spilled, {self.stack_bytes} B stack, "
                f"{self.compile_s:.2f} s compile{' (cached)' if self.from_cache else ''}")
        if self.wgmma_serialized:
            text += ", wgmma products serialized by ptxas"
        if len(self.kernels) > 1:
            text += "; " + ", ".join(f"{name}: {k['registers']} regs" for name, k in sorted(self.kernels.items()))
        return text


@lru_cache(maxsize=1)
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return f"{major}.{minor}"


def nvrtc_options() -> tuple[str, ...]:
    """The options every compile passes (after the architecture): NVRTC_OPTIONS, and NVRTC's own
    cache off where this NVRTC has one (NVRTC_NO_CACHE_FROM)."""
    major, minor = (int(part) for part in nvrtc_version().split("."))
    return NVRTC_OPTIONS + (("--no-cache",) if (major, minor) >= NVRTC_NO_CACHE_FROM else ())


def _check(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")


def _parse_kernels(log: str) -> dict[str, dict]:
    """ptxas -v's report per entry function: registers, spill stores and stack frame bytes."""
    kernels = {}
    for block in re.split(r"Compiling entry function '", log)[1:]:
        name = block.split("'", 1)[0]
        regs = re.search(r"Used (\d+) registers", block)
        spill = re.search(r"(\d+) bytes spill stores", block)
        stack = re.search(r"(\d+) bytes stack frame", block)
        kernels[name] = {"registers": int(regs.group(1)) if regs else None,
                         "spill_bytes": int(spill.group(1)) if spill else None,
                         "stack_bytes": int(stack.group(1)) if stack else None}
    return kernels


def _wgmma_serialized(log: str) -> bool:
    """Whether ptxas's report says it serialized wgmma products (remarks C7514, "... serialized ...",
    and C7517, "wgmma.wait_group is injected ..."; only ptxas's own lines, not the source that
    NVRTC's warnings quote)."""
    return any(line.startswith("ptxas") and ("serialized" in line or "injected" in line)
               for line in log.splitlines())


def _worst(kernels: dict[str, dict], what: str) -> int | None:
    values = [k[what] for k in kernels.values() if k[what] is not None]
    return max(values) if values else None


def cache_key(source: str, arch: str) -> str:
    text = "\0".join([source, arch, nvrtc_version(), CACHE_FORMAT, *nvrtc_options()])
    return hashlib.sha256(text.encode()).hexdigest()


def _cache_paths(key: str) -> tuple[Path, Path]:
    folder = config.cache_dir() / "cubin" / key[:2]
    return folder / f"{key}.cubin", folder / f"{key}.json"


def _cubin_problem(cubin: bytes, meta: dict) -> str | None:
    """Why a cached cubin cannot be trusted, or None if it matches what was written.

    A cubin loaded on the GPU is not checked any further, so a truncated or overwritten file
    would only fail there, far from its cause (or, worse, run)."""
    if not cubin:
        return "the cubin is empty"
    if not cubin.startswith(ELF_MAGIC):
        return "the cubin is not an ELF file"
    if len(cubin) != meta.get("cubin_size"):
        return f"the cubin has {len(cubin)} bytes, its metadata says {meta.get('cubin_size')}"
    if hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
        return "the cubin's sha256 differs from its metadata's"
    return None


def _read_entry(cubin_path: Path, meta_text: bytes) -> Compiled:
    """The cache entry as a Compiled; raises ValueError saying why if it does not verify."""
    try:
        meta = json.loads(meta_text)
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable: {exc}") from exc
    if not isinstance(meta, dict):
        raise ValueError("the metadata is not a JSON object")
    problem = _cubin_problem(cubin, meta)
    if problem:
        raise ValueError(problem)
    fields = {k: v for k, v in meta.items() if k not in ("cubin_size", "cubin_sha256")}
    try:
        return Compiled(**fields, cubin=cubin, from_cache=True)
    except TypeError as exc:  # fields missing or unknown
        raise ValueError(f"the metadata does not describe a Compiled: {exc}") from exc


def _read_cache(key: str, warn: bool = True) -> Compiled | None:
    """The verified cache entry for `key`, or None: not cached, or damaged (warned where `warn`,
    then recompiled)."""
    cubin_path, meta_path = _cache_paths(key)
    try:
        meta_text = meta_path.read_bytes()  # written last: no metadata, no entry
    except OSError:
        return None  # not cached, or a cache that cannot be read: either way compile
    try:
        return _read_entry(cubin_path, meta_text)
    except ValueError as exc:
        if not warn:
            return None
        warnings.warn(f"pairgen: ignoring the damaged compile cache entry {cubin_path} ({exc}); recompiling it",
                      RuntimeWarning, stacklevel=3)
        return None


_warned_unwritable_cache = False  # per process: each compile worker warns at most once too


def _warn_unwritable_cache_once(error: OSError) -> None:
    global _warned_unwritable_cache
    if _warned_unwritable_cache:
        return  # a tuning run compiles thousands of variants: one warning says it all
    _warned_unwritable_cache = True
    warnings.warn(f"pairgen: cannot write the compile cache in {config.cache_dir()} ({error}); compiling in "
                  "memory, so cubins are not kept between processes. Point PAIRGEN_CACHE_DIR at a writable "
                  "directory to keep them.", RuntimeWarning, stacklevel=4)


def _write_cache(key: str, compiled: Compiled) -> None:
    """Store `compiled` under `key`, with the cubin's size and sha256 for _read_cache to verify.
    A cache that cannot be written (read-only, not a directory, full) costs the reuse, never the
    compile that just succeeded."""
    cubin_path, meta_path = _cache_paths(key)
    meta = {k: v for k, v in asdict(compiled).items() if k not in ("cubin", "from_cache")}
    meta.update(cubin_size=len(compiled.cubin), cubin_sha256=hashlib.sha256(compiled.cubin).hexdigest())
    try:
        files.write_atomic(cubin_path, compiled.cubin)  # the cubin first: metadata present means a cubin written
        files.write_atomic(meta_path, json.dumps(meta).encode())
    except OSError as exc:
        _warn_unwritable_cache_once(exc)


def _nvrtc_compile(source: str, name: str, arch: str) -> tuple[bytes, str]:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in nvrtc_options())]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        # NVRTC writes into the buffers it is given: they must be fresh, writable bytearrays. A
        # bytes object such as b" " * size is immutable and, for sizes 0 and 1, one of CPython's
        # shared singletons: writing the log's terminating NUL into b" " corrupted unrelated
        # code (torch.save then wrote wrong zip records in the same process).
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log_buf = bytearray(size)
        if size:
            nvrtc.nvrtcGetProgramLog(prog, log_buf)
        log = bytes(log_buf).rstrip(b"\0 ").decode(errors="replace")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(log, source, name)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin_buf = bytearray(size)
        if size:
            (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin_buf)
            _check(err, "nvrtcGetCUBIN")
        cubin = bytes(cubin_buf)
        _check_cubin(cubin, arch)
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _check_cubin(cubin: bytes, arch: str) -> None:
    """NVRTC "succeeds" with an empty cubin for a virtual target such as compute_90 (it makes
    PTX only): refuse it here rather than fail at load time on the GPU."""
    if not cubin.startswith(ELF_MAGIC):
        what = "an empty cubin" if not cubin else "a cubin that is not an ELF file"
        raise RuntimeError(f"NVRTC produced {what} for --gpu-architecture={arch}: "
                           "expected a real GPU target sm_XY such as sm_90 (not compute_XY)")


#: A template whose kernels use an architecture's own features (Hopper's wgmma) says so with this
#: line; they then compile for that architecture's feature target (sm_90 -> sm_90a), whose code
#: runs on that architecture only (the strategy's restrictions keep it there).
ARCH_SPECIFIC_MARKER = "// pairgen: arch-specific (sm_90a)"


def target_for(source: str, arch: str) -> str:
    """The target `source` compiles for on `arch`: its feature target where it asks for one."""
    if ARCH_SPECIFIC_MARKER in source and not arch.endswith("a"):
        return arch + "a"
    return arch


def compile_source(source: str, kernel_name: str, arch: str, use_cache: bool = True) -> Compiled:
    """Compile `source` for `arch` (e.g. "sm_90"; its feature target where the source asks for one,
    see target_for), or take it from the disk cache."""
    arch = target_for(source, arch)
    key = cache_key(source, arch)
    cached = _read_cache(key) if use_cache else None
    if cached is not None:
        return cached
    lock = _lock_compile(key) if use_cache else None
    try:
        # Compiled by another process while this one waited (a damaged entry was warned of above).
        cached = _read_cache(key, warn=False) if lock is not None else None
        return cached if cached is not None else _compile_uncached(source, kernel_name, arch, key, use_cache)
    finally:
        if lock is not None:
            _unlock_compile(lock, key)


def _compile_uncached(source: str, kernel_name: str, arch: str, key: str, use_cache: bool) -> Compiled:
    start = time.perf_counter()
    cubin, log = _nvrtc_compile(source, f"{kernel_name}.cu", arch)
    kernels = _parse_kernels(log)
    compiled = Compiled(cubin, kernel_name, arch, nvrtc_version(), time.perf_counter() - start,
                        _worst(kernels, "registers"), _worst(kernels, "spill_bytes"), _worst(kernels, "stack_bytes"),
                        kernels, _wgmma_serialized(log))
    if use_cache:
        _write_cache(key, compiled)
    return compiled


def _lock_path(key: str) -> Path:
    return _cache_paths(key)[0].with_suffix(".lock")


def _lock_compile(key: str):
    """The open lock file of `key`, locked: processes compiling the same source at once (a tuner's
    compile workers, test workers, ranks on one host at first use) then compile it once, the others
    waiting for its cubin instead of compiling it again. None where files cannot be locked here (no
    fcntl, as on Windows) or the cache folder cannot be written: then each process compiles."""
    try:
        import fcntl
    except ImportError:
        return None
    path = _lock_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "ab")
    except OSError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError:  # a file system without locks
        handle.close()
        return None
    return handle


def _unlock_compile(handle, key: str) -> None:
    """Remove the lock file, then release it. A process still waiting on the removed file finds the
    cubin when it gets the lock; one that comes later finds the cubin before it looks for a lock."""
    try:
        _lock_path(key).unlink()
    except OSError:
        pass
    handle.close()  # closing releases the lock


def _compile_job(job: tuple[str, str, str]) -> Compiled | CompileError:
    source, kernel_name, arch = job
    try:
        return compile_source(source, kernel_name, arch)
    except CompileError as exc:
        return exc


def compile_pool(workers: int | None = None) -> ProcessPoolExecutor:
    """A process pool for compile_many. Workers are spawned, not forked: the parent may hold a
    CUDA context, and a forked child must not touch it. They ignore Ctrl-C, which the terminal
    sends to every process of the command: the parent decides what stops (pairgen-tune keeps the
    shapes done and shuts the pool down), and an idle worker it interrupted would die printing a
    traceback and break the pool. They run at a lower CPU priority (WORKER_NICENESS): the tuner
    times calls while they compile the next candidates, and a call that is bound by its host time
    (the small shapes) must not wait for a core behind them."""
    return ProcessPoolExecutor(max_workers=workers or config.compile_workers(), mp_context=get_context("spawn"),
                               initializer=_start_worker)


#: How much lower than the parent's the compile workers' CPU priority is (os.nice's increment).
WORKER_NICENESS = 10


def _start_worker() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(WORKER_NICENESS)
    except (AttributeError, OSError):  # no nice() here (Windows), or not allowed: the normal priority
        pass


def start_compile(job: tuple[str, str, str], pool: ProcessPoolExecutor) -> Future:
    """One (source, kernel_name, arch) job started on the pool; its future gives the Compiled or
    the CompileError (a broken pool raises from it)."""
    return pool.submit(_compile_job, job)


def compile_many(jobs: list[tuple[str, str, str]], pool: ProcessPoolExecutor | None = None) -> list[Compiled | CompileError]:
    """Compile (source, kernel_name, arch) jobs across CPU cores; errors are returned, not raised."""
    if len(jobs) <= 1 or (pool is None and config.compile_workers() == 1):
        return [_compile_job(job) for job in jobs]
    if pool is not None:
        return list(pool.map(_compile_job, jobs))
    with compile_pool(min(config.compile_workers(), len(jobs))) as own_pool:
        return list(own_pool.map(_compile_job, jobs))
