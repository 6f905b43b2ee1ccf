"""``hpcjobs info``: who is who in this job, to check a launch before a long run."""

from __future__ import annotations


def configure(p) -> None:
    p.add_argument("--all-ranks", action="store_true", help="print a line from every rank, not only rank 0")


def run(args) -> int:
    from mpi4py import MPI

    from ..bench.report import environment, preamble
    from ..comm import print0

    comm = MPI.COMM_WORLD
    for line in preamble(environment(comm), "hpcjobs info"):
        print0(line)
    lines = comm.gather(f"rank {comm.Get_rank()} of {comm.Get_size()} on {MPI.Get_processor_name()}", root=0)
    if args.all_ranks and comm.Get_rank() == 0:
        print("\n".join(lines), flush=True)
    return 0
