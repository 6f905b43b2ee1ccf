"""``text``: a byte-level language-modelling dataset that needs no download.

The corpus is the text of the files under ``data_dir`` (every regular file,
in sorted path order), or, without ``data_dir``, hpcjobs' own Python source
(about 1.2 MB, shipped with the package, so every rank of every machine
reads the same bytes offline). Tokens are bytes: a vocabulary of 256. A
corpus of one file is mapped, not read: the ranks of a node share its pages
in the page cache, and a batch reads only its windows. Several files are
joined in each rank's memory (one copy per rank: join a large corpus into
one file first). A mapped file must not be rewritten in place while a run
reads it (a rank reading a page cut off dies of SIGBUS): replace it by a
rename.

The corpus is cut in two without overlap: the first 90% for training, the
last 10% for test. Each is cut into consecutive windows of ``seq_len + 1``
bytes at a stride of ``seq_len``; a sample is the window's first
``seq_len`` bytes (``x``) and the same window shifted by one (``y``, the
next byte at every position). ``num_samples`` keeps the corpus's first
``num_samples * seq_len`` bytes (so about that many windows, 90% for
training).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["VOCAB", "corpus", "windows"]

VOCAB = 256
_SEPARATOR = b"\n\n"


def corpus(data_dir: str | os.PathLike | None = None) -> np.ndarray:
    """The corpus's bytes as uint8.

    Raises:
        FileNotFoundError: ``data_dir`` does not exist or holds no bytes.
    """
    if data_dir is None:
        root = Path(__file__).resolve().parent.parent  # the hpcjobs package
        files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    else:
        root = Path(data_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: no such directory (the text dataset reads every file in it)")
        files = sorted(p for p in root.rglob("*") if p.is_file())
        if len(files) == 1 and files[0].stat().st_size:  # mapped (module docstring); read-only
            try:
                return np.memmap(files[0], dtype=np.uint8, mode="r")
            except (OSError, ValueError):  # a file system that maps no files: read, as several files are
                pass
    data = _SEPARATOR.join(p.read_bytes() for p in files)
    if not data:
        raise FileNotFoundError(f"{root}: no text to read (the text dataset reads every file in it)")
    return np.frombuffer(data, dtype=np.uint8)


def windows(data: np.ndarray, seq_len: int) -> np.ndarray:
    """Consecutive ``(seq_len + 1)``-byte windows at stride ``seq_len``,
    ``(N, seq_len + 1)`` (a view: no copy)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n = max(0, (len(data) - 1) // seq_len)  # (a corpus of a byte: none, said by the caller)
    return np.lib.stride_tricks.as_strided(data, shape=(n, seq_len + 1), strides=(seq_len, 1), writeable=False)
