"""Other libraries' output kept off pairgen-tune's terminal, in a log file.

The terminal of a tuning run is pairgen's: a line per shape, the progress bar, the closing table.
The peers it times are other people's code, and torch.compile in max-autotune mode is loud: on an
H200, 13 shapes printed 54 torch._inductor "Runtime error during autotuning ... Ignoring this
choice" lines and an autotune table per matmul, burying the results. So, while a run lasts:

- Python warnings that pairgen did not raise go to the log (pairgen's own still show);
- the torch loggers' stream handlers write to the log (torch gives its loggers their own stderr
  handlers, which do not propagate, so configuring the root logger would not reach them);

and while a peer is built and timed (when torch.compile runs), everything the process writes goes
to the log, file descriptors 1 and 2 included: inductor prints its autotune tables with
sys.stderr.write, and its benchmark subprocesses and the compilers it runs write to the inherited
descriptors. Nothing of pairgen's is printed during that call.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path

#: The package's folder: a warning raised from a file in it is pairgen's own.
PAIRGEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ThirdPartyLog:
    """A context for a tuning run: other libraries' warnings and torch's logs go to `path`
    (appended to); quiet_peers(evaluator) sends everything of its peers' calls there too."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = None
        self._showwarning = None
        self._handlers: list[tuple[logging.StreamHandler, object]] = []

    def __enter__(self) -> "ThirdPartyLog":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", buffering=1, encoding="utf-8", errors="replace")
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._show_warning
        for handler in _torch_stream_handlers():
            self._handlers.append((handler, _swap_stream(handler, self.file)))
        return self

    def __exit__(self, *exc) -> None:
        for handler, old in reversed(self._handlers):
            _swap_stream(handler, old)
        self._handlers.clear()
        warnings.showwarning = self._showwarning
        self.file.close()

    def _show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if _is_pairgens(category, filename):
            self._showwarning(message, category, filename, lineno, file, line)
        else:
            self.file.write(warnings.formatwarning(message, category, filename, lineno, line))

    @contextlib.contextmanager
    def everything(self):
        """Every write of this process (sys.stdout, sys.stderr, and file descriptors 1 and 2, which
        child processes and C libraries write to) goes to the log while the block runs."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or odd stream: nothing buffered to keep apart
                stream.flush()
        saved: dict[int, int] = {}
        try:
            for fd in (1, 2):
                try:
                    saved[fd] = os.dup(fd)
                except OSError:  # no such descriptor (a detached process): nothing to redirect
                    continue
                os.dup2(self.file.fileno(), fd)
            with contextlib.redirect_stdout(self.file), contextlib.redirect_stderr(self.file):
                yield
        finally:
            self.file.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)

    def quiet_peers(self, evaluator) -> "QuietPeers":
        return QuietPeers(evaluator, self)

    def summary(self) -> str:
        """One line for the end of the report: where the other libraries' output went. An empty
        log is removed (unless another run appends to it)."""
        try:
            lines = len(self.path.read_text(encoding="utf-8", errors="replace").splitlines())
        except OSError:
            return f"other libraries' output (torch.compile, torch's warnings and logs): {self.path} (unreadable)"
        if lines == 0:
            with contextlib.suppress(OSError):
                self.path.unlink()
            return "other libraries' output (torch.compile, torch's warnings and logs): none"
        return f"other libraries' output (torch.compile, torch's warnings and logs): {lines} lines in {self.path}"


class QuietPeers:
    """An evaluator whose peers (eager PyTorch, torch.compile) are built and timed with all output
    in the log; everything else is the wrapped evaluator's."""

    def __init__(self, evaluator, log: ThirdPartyLog):
        object.__setattr__(self, "_evaluator", evaluator)
        object.__setattr__(self, "_log", log)

    def baselines(self) -> dict[str, float]:
        with self._log.everything():
            return self._evaluator.baselines()

    def __getattr__(self, name):
        return getattr(self._evaluator, name)

    def __setattr__(self, name, value):  # settings made on the evaluator reach the one that runs
        setattr(self._evaluator, name, value)


def _is_pairgens(category, filename: str) -> bool:
    """A warning pairgen raised: its class is pairgen's, or the line that raised it is in pairgen."""
    if getattr(category, "__module__", "").split(".")[0] == "pairgen":
        return True
    return os.path.abspath(filename or "").startswith(PAIRGEN_DIR + os.sep)


def _swap_stream(handler: logging.StreamHandler, stream):
    """Point the handler at `stream`; returns the stream it had. Unlike StreamHandler.setStream,
    the old stream is not flushed: a stream closed under the handler (a test harness's capture,
    say) must not end the run."""
    with contextlib.suppress(Exception):
        handler.flush()
    handler.acquire()
    try:
        old, handler.stream = handler.stream, stream
    finally:
        handler.release()
    return old


def _torch_stream_handlers() -> list[logging.StreamHandler]:
    """The handlers torch set on its loggers to write to stderr: plain StreamHandlers. Handlers of
    other classes on those loggers (a file's, a test harness's capture) are someone's choice and
    are left alone."""
    handlers = []
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or not (name == "torch" or name.startswith("torch.")):
            continue
        handlers += [h for h in logger.handlers if type(h) is logging.StreamHandler and h not in handlers]
    return handlers
