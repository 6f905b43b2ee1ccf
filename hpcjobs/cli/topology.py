"""``hpcjobs topology``: one line per rank, printed in rank order by rank 0."""

from __future__ import annotations

from .args import positive_int


def configure(p) -> None:
    p.add_argument("--ranks-per-node", type=positive_int, default=None, metavar="N",
                   help="simulate nodes of N consecutive ranks (default: $HPCJOBS_RANKS_PER_NODE, then Slurm, "
                        "then shared memory)")


def run(args) -> int:
    import numpy as np

    from ..topology import detect

    topo = detect(ranks_per_node=args.ranks_per_node)
    comm = topo.comm
    row = np.array([comm.Get_rank(), topo.node_id, topo.local_rank, topo.local_size,
                    topo.cross_comm.Get_rank(), topo.cross_comm.Get_size()], dtype=np.int64)
    rows = np.empty(6 * comm.Get_size(), dtype=np.int64) if comm.Get_rank() == 0 else None
    comm.Gather(row, rows, root=0)
    if comm.Get_rank() == 0:
        print(f"# {comm.Get_size()} ranks on {topo.num_nodes} node(s) {list(topo.local_sizes)}, "
              f"source: {topo.source}", flush=True)
        print("#  rank  node  local_rank  local_size  cross_rank  cross_size")
        for r in rows.reshape(-1, 6):
            print("  ".join(f"{v:>{w}}" for v, w in zip(r, (6, 5, 10, 10, 10, 10))), flush=True)
    return 0
