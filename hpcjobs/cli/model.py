"""``hpcjobs model``: the alpha-beta-gamma model fitted here, every algorithm
predicted against measured, and the bytes each one really sends
(:mod:`hpcjobs.perfmodel`)."""

from __future__ import annotations

import statistics

from .args import UsageError, add_sweep_arguments, apply_placement, check_outputs, sweep_sizes, usage

MEASURE_BYTES = 64 << 20  # perfmodel.measure's largest message, whatever --max-bytes


def configure(p) -> None:
    add_sweep_arguments(p, factor=4)
    p.add_argument("--out", metavar="DIR", help="write model.json and model.png (predicted vs measured)")


def run(args) -> int:
    from ..bench.memory import check_fits, check_sweep_fits
    from ..bench.sweep import implementations, unchecked_benchmarks
    from ..bench.sweep import run as sweep
    from ..collectives.costs import COSTS
    from ..comm import print0, private
    from ..perfmodel import MODELED, compare, count_bytes, formula_bytes, measure, write
    from ..topology import detect_private

    sizes = sweep_sizes(args)
    apply_placement(args)
    unchecked_benchmarks()
    comm = private()
    P = comm.Get_size()
    if P < 2:
        raise UsageError("the cost model needs at least 2 ranks (mpirun -n 2 or more)")
    check_outputs(comm, [("--out", args.out, True)])
    with usage():
        check_sweep_fits(comm, sizes, args.max_bytes)
        # (measuring alpha and beta sends up to MEASURE_BYTES whatever --max-bytes: a send and a receive buffer)
        check_fits(comm, 2 * MEASURE_BYTES, f"measuring alpha and beta (messages of up to {MEASURE_BYTES >> 20} MB)")
    topo = detect_private(comm)
    if topo.num_nodes > 1:
        return _across(args, comm, topo, sizes)
    print0(f"# hpcjobs model: {P} ranks on {topo.num_nodes} node(s); measuring alpha, beta, gamma")
    m = measure(comm)
    print0(f"#   alpha = {m.alpha * 1e6:.2f} us    beta = {_gbs(m.beta, 2)} (exchange), "
           f"{_gbs(m.beta_pingpong, 2)} (ping-pong)    gamma = {_gbs(m.gamma, 2)} reduced")
    names = [a for a in MODELED if a != "hierarchical" or topo.num_nodes > 1]
    records = sweep(comm, sizes, implementations(names), iters=args.iters)
    rows = compare(records, P, m, topo.local_size if topo.uniform else None)
    print0("# predicted: the formulas costed with measured per-size message and reduction costs;")
    print0("# linear: the same formulas with the fitted alpha + n*beta (an exchange; a one-way hop: n*beta "
           "ping-pong) and n*gamma")
    _print_rows(rows, names)
    print0("# bytes rank 0 sends, counted (parameter server: rank 0 is the server), against the formula:")
    print0("#    size(B)  algorithm            sent(B)  received(B)  formula")
    counted = []
    for nbytes in (1 << 20, 16 << 20):
        for name in ("ring", "recursive_doubling", "parameter_server"):
            sent, received = count_bytes(name, nbytes, comm)
            counted.append({"size_bytes": nbytes, "algorithm": name, "sent": sent, "received": received})
            want = formula_bytes(name, nbytes, P)
            # the formulas count a power of two: elsewhere rank 0 of a fold sends once and sits out
            verdict = ("matches" if sent == want else f"counted {sent}"
                       + ("; the formula is for powers of two" if P & (P - 1) and name == "recursive_doubling"
                          else ""))
            print0(f"{nbytes:>12}  {name:<20} {sent:>9} {received:>12}  {COSTS[name].sent} = {want} ({verdict})")
    if args.out and comm.Get_rank() == 0:
        print0(f"# written to {write(args.out, m, rows, counted, P)}")
    return 0


def _across(args, comm, topo, sizes) -> int:
    """Across nodes: α, β per link class, each algorithm's two-level path
    (collectives/costs.py, ACROSS) against what it measures here."""
    from ..bench.sweep import implementations
    from ..bench.sweep import run as sweep
    from ..collectives.costs import ACROSS, hierarchical_segments
    from ..comm import print0
    from ..perfmodel import compare_across, measure_links, write

    P, L = comm.Get_size(), topo.local_size
    nodes = comm.allgather(topo.node_id)
    if not topo.uniform:
        raise UsageError(f"the two-level model needs nodes of as many ranks each; these have "
                         f"{list(topo.local_sizes)}" + (f": give a --ranks-per-node that divides the {P} ranks"
                                                        if topo.source == "override" else ""))
    if nodes != sorted(nodes):
        raise UsageError(f"the two-level model needs each node's ranks consecutive; by rank the nodes are {nodes} "
                         "(mpirun's default placement and srun --distribution=block give consecutive ranks)")
    M = topo.num_nodes
    print0(f"# hpcjobs model: {P} ranks on {M} nodes of {L} ({topo.source}); measuring alpha, beta inside a "
           "node and between nodes, gamma")
    node, net = measure_links(comm, topo)
    for label, m in (("inside a node", node if L > 1 else None), ("between nodes", net)):
        if m is None:
            print0(f"#   {label}: one rank per node, nothing sent inside one")
            continue
        print0(f"#   {label}: alpha = {m.alpha * 1e6:.2f} us   beta = {_gbs(m.beta, 3)} (exchange), "
               f"{_gbs(m.beta_pingpong, 3)} (ping-pong)")
        if m is net:
            print0(f"#     the model's A = {m.oneway_s[0] * 1e6:.2f} us (one way, {m.sizes[0]} B), B = "
                   f"{m.sizes[-1] / m.oneway_s[-1] / 1e9:.3f} GB/s (one way, sustained over {m.sizes[-1] >> 20} MB)")
    print0(f"#   gamma = {1 / node.gamma / 1e9:.2f} GB/s reduced")
    for name, a in ACROSS.items():
        if name != "ring_pipelined":
            print0(f"#   {name}: {a.formula}")
    names = ["ring", "recursive_doubling", "rabenseifner", "hierarchical"]
    records = sweep(comm, sizes, implementations(names), iters=args.iters)

    def segments(nbytes):  # as hierarchical cuts the sweep's float32 buffer here (its default; none simulated)
        return 1 if topo.source == "override" else hierarchical_segments(nbytes, L, P // L)

    rows = compare_across(records, P, L, node, net, segments)
    print0("# predicted: the two-level paths; inside a node the measured per-size message and reduction costs, "
           "between nodes the smallest message's one-way time + n x the largest's per byte (the sustained rate), "
           "an exchange as one direction, flows sharing an uplink as one message of their total bytes "
           "(machine.predict_across); linear: the fitted alpha + n*beta, n*beta ping-pong one way and between nodes "
           "(a shaped link's burst skews it)")
    _print_rows(rows, names)
    if args.out and comm.Get_rank() == 0:
        print0(f"# written to {write(args.out, net, rows, [], P, node=node, ranks_per_node=L, source=topo.source)}")
    return 0


def _gbs(per_byte: float, digits: int) -> str:
    """A fitted cost per byte as a rate; a slope fitted to 0 (time not
    growing with the bytes over the sizes measured) has none to print."""
    return f"{1 / per_byte / 1e9:.{digits}f} GB/s" if per_byte > 0 else "unbounded GB/s (a flat fit)"


def _print_rows(rows: list[dict], names: list[str]) -> None:
    """Predicted against measured, row by row, then the mean and largest
    error per algorithm from 1 MB up (rank 0)."""
    from ..comm import print0

    print0("#    size(B)  algorithm              measured(us)  predicted(us)   error   linear(us)   error")
    for r in rows:
        print0(f"{r['size_bytes']:>12}  {r['algorithm']:<20} {r['measured_us']:>13.1f} {r['predicted_us']:>14.1f} "
               f"{r['rel_error']:>+7.0%} {r['linear_us']:>12.1f} {r['linear_rel_error']:>+7.0%}")
    if not any(x["size_bytes"] >= 1 << 20 for x in rows):
        print0("# (no row of 1 MB or more to sum up: --max-bytes 1M or more)")
        return
    print0("# |error| over the rows >= 1 MB, mean (max): per-size model | linear model")
    for name in names:
        big = [x for x in rows if x["algorithm"] == name and x["size_bytes"] >= 1 << 20]
        if big:
            e = [abs(x["rel_error"]) for x in big]
            le = [abs(x["linear_rel_error"]) for x in big]
            print0(f"#   {name:<20} {statistics.mean(e):>4.0%} ({max(e):.0%})  |  "
                   f"{statistics.mean(le):>4.0%} ({max(le):.0%})")
