"""``hpcjobs bench allreduce``: every implementation, same buffers, one run,
printed as the nccl-tests table (the engine: :mod:`hpcjobs.bench.sweep`)."""

from __future__ import annotations

import argparse
import os
import sys

from ..bench.names import BASELINES, BUFFERS
from ..collectives import ALGORITHMS, DEVICE_ALGORITHMS, DTYPES, OPS
from .args import (UsageError, add_sweep_arguments, apply_placement, check_outputs, comma_list, nonnegative_int,
                   parse_bytes, positive_int, sweep_sizes, usage)


def configure(p) -> None:
    add_sweep_arguments(p)
    p.add_argument("--impl", default="ring,ring_pipelined",
                   help=f"comma-separated algorithms of ours, or 'all' (from: {', '.join((*ALGORITHMS, 'auto'))}; "
                        f"with --device cuda also {', '.join(DEVICE_ALGORITHMS)}; "
                        "add +check, e.g. ring+check, for the same with the cross-rank agreement check, "
                        "which is otherwise off here; default %(default)s)")
    p.add_argument("--baselines", default="mpi",
                   help=f"comma-separated baselines, 'all' or 'none' (from: {', '.join(BASELINES)}; "
                        "default %(default)s); one that cannot run here is skipped with the reason, except "
                        "horovod when HPCJOBS_REQUIRE_HOROVOD=1")
    p.add_argument("--tuning", metavar="PATH", default=None,
                   help="tuning table for auto, from `hpcjobs tune` (default: $HPCJOBS_TUNING, else built in)")
    p.add_argument("--dtype", "-d", default="float32", choices=DTYPES)
    p.add_argument("--op", "-o", default="sum", choices=OPS)
    p.add_argument("--framework", default="numpy", choices=("numpy", "torch"), help="buffer type (default numpy)")
    p.add_argument("--buffers", default="private", choices=BUFFERS,
                   help="private: ordinary arrays (default); symmetric: every size's buffer in shared memory "
                        "(symmetric_empty, one node), where shm reduces straight out of the peers' buffers "
                        "instead of staging; every row runs on that same buffer")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where every row's buffer lives: cpu (default), or this rank's GPU (local rank modulo "
                        "the GPUs it sees), where ours run through cuda_ipc / staged / auto (give them in --impl) and "
                        "the baselines that can run are nccl, gloo on CUDA tensors and mpi (device memory if "
                        "CUDA-aware, else a host copy in the timed call; give them in --baselines); each timed "
                        "call waits for the device")
    p.add_argument("--warmup", "-w", type=nonnegative_int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--passes", type=positive_int, default=1,
                   help="run the whole sweep this many times, auto measuring afresh in each, then print each "
                        "row's median over the passes (default 1; Horovod's rows once, after the last pass). On a "
                        "shared machine load comes in spells of seconds, longer than a row takes: one pass can "
                        "catch a spell that the median rides over")
    p.add_argument("--segment-bytes", default=None, metavar="SIZE[,SIZE...]",
                   help="ring_pipelined and hierarchical segment size(s): one row each, e.g. hierarchical/1M; "
                        "0 is hierarchical not pipelined (default: ring_pipelined's own 1M; hierarchical 1/32 of the "
                        "buffer, at least 256K per ring step across the nodes (256K x ranks per node x nodes), "
                        "across hosts, not pipelined on nodes simulated with --ranks-per-node)")
    p.add_argument("--no-wire", dest="wire", action="store_false",
                   help="across hosts, skip the untimed pass per row that counts the bytes each host's network "
                        "interfaces sent per call (/proc/net/dev) and prints them beside the algorithm's uplink "
                        "formula: columns wire(B), model(B), wire/model")
    p.add_argument("--json", metavar="PATH", help="also write the records and the environment as JSON")
    p.add_argument("--csv", metavar="PATH", help="also write the records as CSV")
    p.add_argument("--out", metavar="DIR",
                   help="write a report there: report.md with the table and environment, busbw.png, "
                        "latency.png, records.json, records.csv (plots need matplotlib)")


def _names(args) -> tuple[list[str], list[str]]:
    """(our implementations, baselines) from --impl and --baselines."""
    ours = [*ALGORITHMS, *DEVICE_ALGORITHMS] if args.device == "cuda" else list(ALGORITHMS)
    names = [*ours, "auto"] if args.impl == "all" else comma_list(args.impl)
    base = {"all": list(BASELINES), "none": []}.get(args.baselines, comma_list(args.baselines))
    unknown = [n for n in base if n not in BASELINES]
    if unknown:
        raise UsageError(f"unknown baseline {unknown[0]!r}; choose from {', '.join(BASELINES)}, all, none")
    # A baseline named in --impl goes through the same availability check.
    base += [n for n in names if n in BASELINES and n not in base]
    return [n for n in names if n not in BASELINES], base


def run(args) -> int:
    from mpi4py import MPI

    from ..bench import sweep, verdicts
    from ..bench.baselines import available, shutdown
    from ..bench.memory import check_sweep_fits
    from ..bench.report import environment, header, preamble, row, write_csv, write_json, write_report
    from .._plots import MISSING
    from ..collectives import auto
    from ..collectives._shared import is_single_node
    from ..comm import print0, private
    from ..topology import detect_private

    sizes = sweep_sizes(args)
    names, base = _names(args)
    apply_placement(args)
    sweep.unchecked_benchmarks()
    try:
        segs = [0 if s == "0" else parse_bytes(s) for s in comma_list(args.segment_bytes)] if args.segment_bytes else []
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"--segment-bytes: {e}") from None
    if segs and not any(n.removesuffix("+check") in ("ring_pipelined", "hierarchical") for n in names):
        raise UsageError("--segment-bytes sizes the segments of ring_pipelined and hierarchical, and --impl has "
                         "neither: it would be ignored")
    device = "cpu"
    if args.device == "cuda" and args.framework != "numpy":
        raise UsageError("--framework picks the host buffers' type; with --device cuda every row reduces a CUDA "
                         "tensor: leave --framework out")
    if args.device == "cuda":
        from ..bench.device import no_gpu_reason

        reason = no_gpu_reason()
        if reason:
            raise UsageError(f"--device cuda: {reason}")
        if args.buffers == "symmetric":
            raise UsageError("--buffers symmetric is host shared memory; with --device cuda every row reduces a "
                             "CUDA tensor (cuda_ipc opens the peers' buffers itself)")
    with usage():
        impls = sweep.implementations(names, segs, device=args.device)
    comm = private()
    if args.device == "cuda":
        from ..bench.device import gpu_for_rank

        device = gpu_for_rank(comm)
    if args.buffers == "symmetric" and not is_single_node(comm):
        raise UsageError("--buffers symmetric needs every rank on one node (symmetric buffers are shared memory)")
    check_outputs(comm, [("--json", args.json, False), ("--csv", args.csv, False), ("--out", args.out, True)])
    with usage():
        check_sweep_fits(comm, sizes, args.max_bytes)
    skipped = {}
    for name in base:
        reason = available(name, comm)
        if reason is None and device != "cpu":
            from ..bench.device import device_unavailable

            reason = device_unavailable(name)
        if reason is None:
            impls.update(sweep.implementations([name], device=args.device))
        elif name == "horovod" and os.environ.get("HPCJOBS_REQUIRE_HOROVOD") == "1":
            raise RuntimeError(f"HPCJOBS_REQUIRE_HOROVOD=1 but horovod cannot run: {reason}")
        else:
            skipped[name] = reason
    env = environment(comm)
    topo = detect_private(comm)  # what the hierarchical and auto rows see
    env["nodes"] = f"{topo.num_nodes} ({topo.source}; ranks per node {','.join(map(str, topo.local_sizes))})"
    from ..bench.wire import CALLS, WireMeter, host_tx_bytes, spans_hosts

    meter = None
    if args.wire and spans_hosts(comm):
        readable = comm.allreduce(host_tx_bytes() is not None, op=MPI.LAND)
        if readable:
            meter = WireMeter(comm, topo)
            env["wire"] = (f"bytes each host's interfaces sent per call (/proc/net/dev: {meter.counted}; {CALLS} "
                           f"untimed calls per row after its timed ones); wire(B) the busiest host's, model(B) the "
                           f"uplink formula (collectives/costs.py)")
            if not meter.ranks_per_node:
                env["wire"] += ", none here: nodes unequal or not consecutive"
        else:
            env["wire"] = "not counted: a host's /proc/net/dev cannot be read"
    where = f"{args.framework} buffers ({args.buffers})" if device == "cpu" else f"CUDA tensors ({device})"
    if device != "cpu":
        env.update(_device_env(comm, device))
    for line in preamble(env, f"hpcjobs bench allreduce: {', '.join(impls)}; dtype {args.dtype}, op {args.op}, "
                              f"{where}; time = max over ranks of each rank's median"):
        print0(line)
    if any(impl.settled is not None for impl in impls.values()):
        print0(f"# auto's tuning table: {auto.table_used(comm)}")
    for name, reason in skipped.items():
        print0(f"# {name}: skipped: {reason}")
    left_out = [f"{label}: has no {args.dtype} allreduce; its rows are left out"
                for label, impl in impls.items() if not impl.supports(args.dtype)]
    for line in left_out:
        print0(f"# {line}")
    # (the saved records had no trace of a baseline asked for and not run, but the echoed command line)
    if skipped:
        env["skipped"] = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
    if left_out:
        env["left out"] = "; ".join(left_out)
    print0(header(meter is not None))
    settings = dict(dtype=args.dtype, op=args.op, iters=args.iters, warmup=args.warmup, framework=args.framework,
                    buffers=args.buffers, device=device, wire=meter)
    first = {label: impl for label, impl in impls.items() if not impl.late}
    late = {label: impl for label, impl in impls.items() if impl.late}
    passes = []
    try:
        for n in range(args.passes):
            if args.passes > 1:
                auto.remeasure()  # each pass measures as a fresh job would
                print0(f"# pass {n + 1} of {args.passes}")
            records = sweep.run(comm, sizes, first, on_record=lambda r: print0(row(r)), pass_index=n, **settings)
            # Horovod once, after the last pass: its controller, once started, keeps a thread busy beside every
            # later row, and horovod-gloo cannot start after its MPI controller has (a second pass died there)
            if late and n == args.passes - 1:
                print0(f"# {', '.join(late)}: measured after the others, each in its own pass beside "
                       "MPI_Allreduce as an anchor (Horovod's background thread keeps ~half a core busy on rank 0 "
                       "once initialised)")
                records += sweep.late_passes(comm, sizes, late, records, on_record=lambda r: print0(row(r)),
                                             log=lambda line: print0(f"# {line}"), **settings)
            for label, impl in impls.items():
                if impl.settled is not None:  # auto, with or without +check
                    summary = verdicts.kept_summary(records, label, args.dtype, args.op, comm, device != "cpu")
                    print0(f"# {label} kept: {summary}")
            env["verdicts"] = _verdicts(records, impls)
            passes.append(records)
    finally:
        shutdown()  # stop Gloo's and Horovod's threads before the interpreter does
    records = sweep.median_records(passes)  # of one pass: its own records
    if args.passes > 1:
        env["passes"] = args.passes
        print0(f"# median over {args.passes} passes")
        print0(header(meter is not None))
        for r in records:
            print0(row(r))
        env["verdicts"] = _verdicts(records, impls, f", medians over {args.passes} passes")
    wrong = sum(r.wrong for r in records)
    print0(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if comm.Get_rank() == 0:
        if args.json:
            write_json(args.json, records, env)
            print0(f"# records written to {args.json}")
        if args.csv:
            write_csv(args.csv, records)
            print0(f"# records written to {args.csv}")
        if args.out:
            command = " ".join(["hpcjobs", *sys.argv[1:]])
            title = f"hpcjobs bench allreduce, {comm.Get_size()} ranks"
            paths = write_report(args.out, records, env, title, command)
            print0(f"# report written to {paths[0]}" + ("" if any(p.endswith(".png") for p in paths)
                                                        else f"; no plots: {MISSING}"))
    return 1 if wrong else 0


def _device_env(comm, device: str) -> dict:
    """What the device rows ran on: the GPU, how many ranks share it, the
    transports' settings."""
    import torch

    from ..bench.device import cuda_aware_mpi
    from ..collectives import cuda_ipc, staged
    from ..topology import detect_private

    local = detect_private(comm).local_size
    gpus = torch.cuda.device_count()
    return {"gpu": f"{torch.cuda.get_device_name(device)}; {gpus} visible, {local} ranks per node"
                   + (f" ({local // gpus if gpus else local} per GPU)" if local > gpus else ""),
            "cuda-aware MPI": {True: "yes", False: "no", None: "unknown"}[cuda_aware_mpi()],
            "transports": f"cuda_ipc fence {cuda_ipc.sync_mode()}, staged chunks {staged.CHUNK_BYTES >> 10} KiB x "
                          f"{staged.SLOTS} pinned"}


def _verdicts(records, impls: dict, over: str = "") -> list[str]:
    """How auto did against the best of ours, and auto (our best where it
    was not run) against each baseline: printed, and returned for the
    saved records."""
    from ..bench import verdicts
    from ..comm import print0

    lines = []
    line = verdicts.auto_against_best(records) if "auto" in impls else None
    if line:
        lines.append(f"auto vs the best of ours{over}: {line}")
    for label in impls:
        if label in BASELINES or label.startswith("mpi/"):  # mpi/tuned:N: a forced Open MPI algorithm
            said = verdicts.ours_against(records, label)
            if said:
                lines.append(f"{said[0]} vs {label}{over} (its time / ours; above 1 we are faster): {said[1]}")
            corrected = verdicts.drift_corrected(records, label)  # a late row: its pass ran in other conditions
            if said and corrected is not None:
                lines.append(f"{said[0]} vs {label}{over}, its times divided by its anchor's drift: "
                             f"{verdicts.ours_against(corrected, label)[1]}")
    for line in lines:
        print0(f"# {line}")
    return lines
