"""``hpcjobs soak``: many random allreduces checked against MPI_Allreduce,
with each rank's memory watched (:mod:`hpcjobs.soak`).

Launch::

    mpirun -n 3 hpcjobs soak --ops 10000
"""

from __future__ import annotations

import json

from .._files import atomic_write
from .args import check_outputs, nonnegative_float, positive_int, seed_int, usage


def configure(p) -> None:
    p.add_argument("--ops", type=positive_int, default=10_000, help="allreduces to run (default 10000)")
    p.add_argument("--max-count", type=positive_int, default=1 << 16,
                   help="largest element count, drawn log-uniformly (default 65536)")
    p.add_argument("--seed", type=seed_int, default=0, help="the draw of sizes, ops and dtypes (default 0)")
    p.add_argument("--max-rss-growth", type=nonnegative_float, default=10.0,
                   help="fail when a rank's RSS grows more than this many percent (default 10)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON (rank 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no line after each tenth of the operations")


def run(args) -> int:
    from ..bench.memory import SOAK_BYTES_PER_ELEMENT, check_fits
    from ..collectives import OPS
    from ..comm import print0, private
    from ..soak import DTYPES, algorithms, soak

    comm = private()
    check_outputs(comm, [("--json", args.json, False)])
    with usage():
        check_fits(comm, SOAK_BYTES_PER_ELEMENT * args.max_count, f"--max-count {args.max_count:,}")
    print0(f"# hpcjobs soak: {args.ops} allreduces at {comm.Get_size()} ranks, counts 0..{args.max_count}, "
           f"algorithms {', '.join(algorithms(comm))}, dtypes {', '.join(DTYPES)}, ops {', '.join(OPS)}")

    def progress(done: int, seconds: float) -> None:
        print0(f"# {done}/{args.ops} ({seconds:.0f} s)")

    result = soak(comm, args.ops, args.max_count, args.seed, progress if args.progress else None)
    worst = result.worst_growth_percent
    if comm.Get_rank() == 0:
        print(f"# {result.ops} allreduces (after {result.warmup} at --max-count, one per algorithm), "
              f"{result.elements:,} elements per rank, {result.seconds:.1f} s; "
              f"per algorithm: " + ", ".join(f"{a} {n}" for a, n in result.per_algorithm.items()))
        print(f"# {'rank':>4s} {'RSS after 1% (MiB)':>19s} {'RSS at end (MiB)':>17s} {'growth':>7s}")
        for r, s, e in result.rss:
            print(f"  {r:4d} {s / 2**20:19.1f} {e / 2**20:17.1f} {100.0 * (e - s) / s if s else 0:6.1f}%")
        print(f"# wrong results: {result.wrong_ops} operations, {result.wrong_elements} elements (summed over "
              f"ranks); largest RSS growth {worst:.1f}% (limit {args.max_rss_growth:g}%)", flush=True)
        for d in result.wrong:  # what to run again: the operation's draw (--seed {args.seed} draws it again)
            print(f"# wrong: operation {d['op_index']}: {d['algorithm']} {d['op']} of {d['count']:,} {d['dtype']} "
                  f"({'torch' if d['torch'] else 'numpy'})", flush=True)
        if result.wrong_ops > len(result.wrong):
            print(f"# wrong: ... and {result.wrong_ops - len(result.wrong)} more (--seed {args.seed})", flush=True)
        if args.json:
            with atomic_write(args.json) as f:
                json.dump(result.to_dict(), f, indent=1)
    return 1 if result.wrong_ops or worst > args.max_rss_growth else 0
