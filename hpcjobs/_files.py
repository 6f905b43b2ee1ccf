"""atomic_write: a file that a reader, or a crash, sees whole or not at all.

Every file the suite writes whole goes through it: checkpoints, the tuning
table, the benchmark reports, ``--json`` and ``model.json``, the
experiments' tables, a submitted job script, the amended ``--metrics``
line (not the plots, which matplotlib writes, nor the logs appended to line
by line). A temporary file next to the target (same directory, so the rename
stays on one file system) is written, closed and renamed over the target; an
exception on the way removes it and leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import secrets
import stat
import sys
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_write", "is_stream", "is_stdout", "write_text", "remove_leftovers", "fsync_dir", "finite"]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", *, durable: bool = False,
                 newline: str | None = None) -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)``: ``path`` holds the old
    content until the block ends without an exception, then the new one.

    ``mode`` is ``"w"`` or ``"wb"``; ``newline`` as :func:`open`'s (``""`` for
    :mod:`csv`). A symbolic link is written through, not replaced. The file
    keeps the permissions of the one it replaces; a new file gets the umask's,
    as :func:`open` gives. Written in place, as :func:`open` would: what is not
    a regular file (a pipe, a device) or is a descriptor's name (``/dev/fd/N``,
    ``/proc/<pid>/fd/N``). What this process has open as its standard output or
    error is written through that descriptor, after what it printed there
    (``--json /dev/stdout > out.json``: a file renamed over ``out.json`` lost
    what the command printed, and a plain open wrote over it).
    ``durable=True`` also flushes the file and then its directory to the disk,
    so that a power cut after the block leaves the new file (checkpoints).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', not {mode!r}")
    where = _where(path)
    if isinstance(where, int):  # through this process's own descriptor: after what it printed, not over it
        for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}.values():
            with contextlib.suppress(Exception):
                stream.flush()
        with open(where, mode, newline=newline, closefd=False) as f:
            yield f
        return
    if where == "in place":
        with open(path, mode, newline=newline) as f:
            yield f
        return
    path = Path(path).resolve()
    # a name of its own, made here and nowhere else: created exclusively, never through a link
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # (remove_leftovers reads it)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        try:
            f = open(fd, mode, newline=newline)
        except BaseException:
            os.close(fd)
            raise
        with f:
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
        fsync_dir(path.parent)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush ``folder``'s entries (a rename into it) to the disk."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_leftovers(path: str | os.PathLike) -> None:
    """Remove the temp files :func:`atomic_write` left beside ``path`` when
    a kill cut its write short (``.NAME.PID.HEX.tmp`` of a process no longer
    here; another ``NAME.x``'s and a live process's stay): a requeued job
    killed as it wrote its checkpoint left one the size of a checkpoint each
    time, for good."""
    path = Path(path)
    ours = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        m = ours.fullmatch(tmp.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # alive (another user's): left


def write_text(path: str | os.PathLike, text: str) -> None:
    """``Path(path).write_text(text)``, whole or not at all (:func:`atomic_write`)."""
    with atomic_write(path) as f:
        f.write(text)


def is_stream(path: str | os.PathLike) -> bool:
    """Whether :func:`atomic_write` writes ``path`` where it is, as a stream
    (this process's standard output or error, a pipe, a device): what is
    written there cannot be read back and rewritten."""
    return _where(path) != "renamed over"


def is_stdout(path: str | os.PathLike) -> bool:
    """Whether ``path`` is what this process has open as its standard output
    (``/dev/stdout``, or the file stdout was sent to)."""
    return _where(path) == 1


def _where(path: str | os.PathLike) -> int | str:
    """How :func:`atomic_write` writes ``path``: 1 or 2 where it is what this
    process has open as its standard output or error (``/dev/stdout``, with
    stdout a file, a pipe or a tty); "in place" where it is not a regular file
    (a pipe, a device) or is a descriptor's name (``/dev/fd/N``,
    ``/dev/stdin``, ``/proc/<pid>/fd/N``: a file already open elsewhere); else
    "renamed over" (a regular file, or none yet)."""
    try:
        st = os.stat(path)  # through links: /dev/stdout is one to /proc/self/fd/1
    except OSError:
        return "renamed over"
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(fd), st):
                return fd
    if not stat.S_ISREG(st.st_mode) or os.path.abspath(path).startswith(("/dev/fd/", "/dev/std", "/proc/")):
        return "in place"
    return "renamed over"


def finite(v, number=None):
    """``v`` (numbers in dicts, lists and tuples) as JSON holds it: every NaN
    and infinity as None (JSON has neither, and json.dump wrote bare NaN and
    Infinity, which jq and strict parsers refuse), every other float through
    ``number`` where given (a rounding)."""
    if isinstance(v, float):
        return (number(v) if number else v) if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x, number) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x, number) for x in v]
    return v
