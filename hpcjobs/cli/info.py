"""``hpcjobs info``: who is who in this job, to check a launch before a long run."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def configure(p) -> None:
    p.add_argument("--all-ranks", action="store_true", help="print a line from every rank, not only rank 0's")


def run(args) -> int:
    from mpi4py import MPI

    from ..bench.report import environment, preamble
    from ..comm import install, print0
    from ..runtime import cores_per_rank

    comm = MPI.COMM_WORLD
    for line in preamble(environment(comm), "hpcjobs info"):
        print0(line)
    for line in _gpu_lines():
        print0(line)
    cores = cores_per_rank(comm)  # collective: every rank, --all-ranks or not
    lines = comm.gather(f"rank {comm.Get_rank()} of {comm.Get_size()} on {MPI.Get_processor_name()}, "
                        f"{cores} core{'s' if cores > 1 else ''} (the default --threads), hpcjobs {install()[0]}, "
                        f"tuning {_tuning()}", root=0)
    if comm.Get_rank() == 0:
        print("\n".join(lines if args.all_ranks else lines[:1]), flush=True)
    return 0


def _tuning() -> str:
    """auto's table on this rank, which must be the same on every rank (auto
    refuses otherwise): built in, or HPCJOBS_TUNING's path and a digest of
    what it holds here (one path may hold different files on different hosts)."""
    path = os.environ.get("HPCJOBS_TUNING")
    if not path:
        return "built in"
    try:
        return f"{path} (sha256 {hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]})"
    except OSError as e:
        return f"{path} (unreadable here: {e.strerror})"


def _gpu_lines() -> list[str]:
    """The GPUs torch sees, whether MPI reads device memory, and what the
    GPU transports will hold per communicator (docs/algorithms.md, "GPUs")."""
    import sys

    from ..bench.device import cuda_aware_mpi, no_gpu_reason
    from ..collectives import cuda_ipc, staged

    aware = {True: "yes", False: "no", None: "unknown (no MPIX_Query_cuda_support)"}[cuda_aware_mpi()]
    reason = no_gpu_reason() if "torch" in sys.modules or _torch_importable() else "torch is not installed"
    if reason:
        return [f"#   gpus: none ({reason})", f"#   cuda-aware MPI: {aware}"]
    import torch

    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return [f"#   gpus: {torch.cuda.device_count()} ({names})",
            f"#   cuda-aware MPI: {aware}",
            f"#   GPU transport memory per communicator and rank: staged {staged.SLOTS} x "
            f"{staged.CHUNK_BYTES >> 20} MiB pinned host; cuda_ipc 2 device buffers, the largest message "
            f"rounded up to a power of two, at most 2 x {cuda_ipc.CAPACITY >> 20} MiB; "
            f"cuda_ipc fence: {cuda_ipc.sync_mode()}"]


def _torch_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None
