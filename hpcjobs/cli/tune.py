"""``hpcjobs tune``: measure the allreduce algorithms that apply here and
write the tuning table ``algorithm="auto"`` reads (:mod:`hpcjobs.bench.tune`)."""

from __future__ import annotations

import os

from .args import add_sweep_arguments, apply_placement, check_outputs, positive_int, sweep_sizes, usage

# Sweeps per `hpcjobs tune`. Two runs here 15 s apart disagreed at 16 MB (shm
# 1.59x ahead of the ring in one, behind in the next); three passes give a
# median and three looks at which algorithms win near each size.
PASSES = 3


def configure(p) -> None:
    p.add_argument("--out", "-O", default="tuning.json", metavar="PATH",
                   help="tuning file to write or update (default tuning.json)")
    p.add_argument("--passes", type=positive_int, default=PASSES,
                   help=f"sweeps to run, one after the other; a size's time is the median over them "
                        f"(default {PASSES}: here the fastest algorithm at a size can change within seconds)")
    add_sweep_arguments(p)


def run(args) -> int:
    from ..bench import tune
    from ..bench.memory import check_sweep_fits
    from ..bench.report import environment
    from ..bench.sweep import format_bytes, unchecked_benchmarks
    from ..collectives._shared import is_single_node
    from ..comm import print0, private
    from ..topology import detect_private

    sizes = [n for n in sweep_sizes(args) if n >= 4]  # the sweep times float32: a size under one element holds none
    apply_placement(args)
    unchecked_benchmarks()
    comm = private()
    # the table is added to an existing file once every pass is done: one that cannot take it is refused now
    check_outputs(comm, [("--out", args.out, False, tune.merge_problem)])
    with usage():
        check_sweep_fits(comm, sizes, args.max_bytes)
    topo = detect_private(comm)
    names, left_out = tune.applicable(is_single_node(comm), topo.num_nodes)
    print0(f"# hpcjobs tune: {comm.Get_size()} ranks on {topo.num_nodes} node(s); "
           f"{len(names)} algorithms x {len(sizes)} sizes x {args.passes} passes")
    for line in left_out:
        print0(f"# left out: {line}")
    done = [0]

    def progress(rec):
        done[0] += 1
        if done[0] % len(names) == 0:
            n = done[0] // len(names)
            print0(f"#   pass {(n - 1) // len(sizes) + 1}: {format_bytes(rec.size_bytes):>6} done "
                   f"({n}/{len(sizes) * args.passes})")

    link = None
    if topo.num_nodes > 1 and topo.source != "override":  # real hosts: record the link the table is for
        from ..perfmodel import link_gbps

        link = link_gbps(comm, topo)
        print0(f"# link between nodes: {link:.2f} Gbit/s one way (16 MB, rank 0 to the next node)")
    try:
        table = tune.tune(comm, sizes, names, args.passes, args.iters, topo.num_nodes, on_record=progress,
                          topology=topo, link_gbps=link)
    except tune.WrongResults as e:  # every rank counted the same
        print0(f"# {e}")
        return 1
    if comm.Get_rank() == 0:
        tune.write(args.out, table, environment(comm))
        print("# up to (B)   algorithm                 time(us)  runner-up (its time / this) "
              "  also timed by auto", flush=True)
        for row in table["rows"]:
            bound = "inf" if row["max_bytes"] is None else str(row["max_bytes"])
            if not row["measured"]:  # above the sweep's largest size
                print(f"{bound:>12}   {row['algorithm']:<20} {'-':>13}  {'(built-in table: not measured)':<30}  "
                      f"{', '.join(row.get('candidates', [])[1:]) or '-'}", flush=True)
                continue
            last = row["measured"][-1]
            ratio = last["runner_up_ratio"]
            # under 1: the row's algorithm was kept, within STICKY of the size's fastest, to keep the rows few
            runner_up = f"{last['runner_up']} ({ratio:.2f}x{'' if ratio >= 1 else ', faster; kept'})"
            print(f"{bound:>12}   {row['algorithm']:<20} {last['time_us']:>13.1f}  {runner_up:<30}  "
                  f"{', '.join(row['candidates'][1:]) or '-'}", flush=True)
        print(f"# written to {args.out}; use it with HPCJOBS_TUNING={os.path.abspath(args.out)}", flush=True)
    return 0
