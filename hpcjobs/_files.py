"""atomic_write: a file that a reader, or a crash, sees whole or not at all.

Every file the suite writes whole goes through it: checkpoints, the tuning
table, the benchmark reports, ``--json`` and ``model.json``, the amended
``--metrics`` line. A temporary file next to the target (same directory, so
the rename stays on one file system) is written, closed and renamed over the
target; an exception on the way removes it and leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_write"]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", *, durable: bool = False,
                 newline: str | None = None) -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)``: ``path`` holds the old
    content until the block ends without an exception, then the new one.

    ``mode`` is ``"w"`` or ``"wb"``; ``newline`` as :func:`open`'s (``""`` for
    :mod:`csv`). A symbolic link is written through, not replaced. The file
    keeps the permissions of the one it replaces; a new file gets the umask's,
    as :func:`open` gives. What is not a regular file (``/dev/stdout``, a
    pipe) is written in place, as :func:`open` would. ``durable=True`` also flushes the file and then its
    directory to the disk, so that a power cut after the block leaves the new
    file (checkpoints).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', not {mode!r}")
    try:
        kind = os.stat(path).st_mode  # through links: /dev/stdout is one to /proc/self/fd/1, then a pipe
    except FileNotFoundError:
        kind = stat.S_IFREG
    if not stat.S_ISREG(kind):  # never a file renamed over a device or a pipe
        with open(path, mode, newline=newline) as f:
            yield f
        return
    path = Path(path).resolve()
    # one name per process and thread: two writers of the same path never share a temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, mode, newline=newline) as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
