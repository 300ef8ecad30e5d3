"""Files that several processes, and several users, share: the compile cache, the tuned database,
the first-use verdicts, the tuner's journals and claims.

A file is replaced whole (a temp file beside it, renamed over it): a reader sees the old file or the
new one, never half. New files get the mode an ordinary open() gives, 0o666 less the umask: a
shared folder (a group's cache, a study directory on a shared disk) stays usable by the others
where the umask says so. (tempfile.mkstemp makes 0600 whatever the umask.)

Imports nothing of pairgen's, and no torch: compile workers use it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path


@contextlib.contextmanager
def locked(lock_path: Path):
    """Hold an exclusive lock on lock_path (created if missing) across processes, for a
    read-modify-write of the file beside it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    # Read-only is enough for flock, and lets a user lock a lock file another user created.
    fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def create_temp_beside(path: Path) -> tuple[int, str]:
    """A new, empty temp file in path's folder, opened for writing, with the umask's mode:
    (its descriptor, its path)."""
    while True:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(tmp)  # the kernel applies the umask
        except FileExistsError:
            continue


def write_atomic(path: Path, data: bytes, durable: bool = False) -> None:
    """Replace path with data (its folder created if missing). durable: the data reaches the disk
    before the rename makes it the file, so a crash leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk must not also fill up with temp files
            os.unlink(tmp)
        raise
