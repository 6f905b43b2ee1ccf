"""``hpcjobs bench staging``: what the staged transport's pipeline buys on a
GPU, and the chunk size it should use.

At one message size, in interleaved rounds on the same CUDA tensor (time =
max over ranks of each rank's median, each call waited for): the three parts
of staging measured alone -- the device→host copy into pinned memory, the
host allreduce of the same bytes, the host→device copy -- and the staged
transport (:mod:`hpcjobs.collectives.staged`) at each chunk size, whose time
is then given as a ratio to the sum of the parts. A pipeline that pays comes
in below 1 (the copies hide behind the host's reduction); an unchunked
staging (one chunk) is about 1. Every rank's input is the bench's crafted
one (:mod:`hpcjobs.bench.inputs`), and ``#wrong`` counts, over the ranks,
the elements each part and each chunk size left other than exact: any
makes the command exit 1.
"""

from __future__ import annotations

import argparse

from ..collectives import ALGORITHMS, MESSAGE_ALGORITHMS
from .args import UsageError, comma_list, nonnegative_int, parse_bytes, positive_int


def configure(p) -> None:
    p.add_argument("--bytes", type=parse_bytes, default="64M", help="message size (default 64M)")
    p.add_argument("--chunks", default="256K,1M,4M,16M,64M",
                   help="chunk sizes to time the pipeline with (default %(default)s; the message size "
                        "itself is unchunked staging)")
    p.add_argument("--algorithm", default="ring", choices=ALGORITHMS,
                   help="the host allreduce, alone and per chunk (default ring)")
    p.add_argument("--iters", type=positive_int, default=10, help="timed rounds (default 10)")
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed rounds first (default 2)")


def run(args) -> int:
    from ..bench.device import gpu_for_rank, no_gpu_reason

    try:
        chunks = [parse_bytes(c) for c in comma_list(args.chunks)]
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"--chunks: {e}") from None
    if not chunks:  # (it failed after the measuring, in min())
        raise UsageError("--chunks: give one chunk size or more, e.g. 1M,4M")
    reason = no_gpu_reason()
    if reason:
        raise UsageError(f"bench staging measures a GPU: {reason}")
    import torch

    from ..bench.harness import max_of_medians, sum_over_ranks, time_interleaved
    from ..bench.inputs import expected_output, make_input
    from ..bench.sweep import format_bytes
    from ..collectives import staged
    from ..collectives._buffers import as_flat
    from ..collectives.agreement import set_checks
    from ..collectives.device import DeviceFlat
    from ..collectives.select import lookup
    from ..comm import print0, private

    set_checks(False)
    comm = private()
    device = gpu_for_rank(comm)
    count = args.bytes // 4
    # the bench's crafted inputs, which tell every rank and position apart (a dropped rank, a chunk staged
    # to the wrong place), and their exact sum
    mine = torch.from_numpy(make_input(count, "float32", "sum", comm.Get_rank()))
    want = torch.from_numpy(expected_output(count, "float32", "sum", comm.Get_size()))
    t = mine.to(device)
    pinned = torch.empty(count, pin_memory=True)
    host = mine.clone()
    step = lookup(args.algorithm).bound
    sync = torch.cuda.synchronize

    def waited(fn):
        return lambda: (fn(), sync())

    runs = {
        "copy device->host": waited(lambda: pinned.copy_(t, non_blocking=True)),
        f"host {args.algorithm}": lambda: step(as_flat(host), "sum", comm),
        "copy host->device": waited(lambda: t.copy_(pinned, non_blocking=True)),
    }
    for c in chunks:
        runs[f"staged/{format_bytes(c)}"] = waited(
            lambda c=c: staged.allreduce(DeviceFlat(t, "float32"), "sum", comm, step, chunk_bytes=c))

    def reset(label):  # every input in place, and a copy's destination holding what no input holds
        t.copy_(mine)
        host.copy_(mine)
        pinned.copy_(mine)
        {"copy device->host": pinned, "copy host->device": t}.get(label, torch.empty(0)).fill_(-1)
        sync()

    def check(label):  # this rank's elements that differ from what the call should leave
        got, expected = {"copy device->host": (pinned, mine), "copy host->device": (t, mine),
                         f"host {args.algorithm}": (host, want)}.get(label, (t, want))
        return int((got.cpu() != expected).sum())

    times, wrong = time_interleaved(runs, reset, check, comm, args.iters, args.warmup)
    us = {label: max_of_medians(v, comm) * 1e6 for label, v in times.items()}
    wrong = {label: sum_over_ranks(n, comm) for label, n in wrong.items()}
    parts = sum(us[k] for k in list(runs)[:3])
    print0(f"# hpcjobs bench staging: {format_bytes(args.bytes)} float32 sum, {comm.Get_size()} ranks, "
           f"{torch.cuda.get_device_name(device)}; host step {args.algorithm} "
           f"({'messages' if args.algorithm in MESSAGE_ALGORITHMS else 'shared memory'}); "
           "time = max over ranks of each rank's median")
    print0(f"{'':>22} {'time (us)':>12} {'/ parts':>8} {'#wrong':>7}")
    for label, v in us.items():
        ratio = f"{v / parts:8.2f}" if label.startswith("staged/") else f"{'':8}"
        print0(f"{label:>22} {v:12.1f} {ratio} {wrong[label]:7d}")
    print0(f"{'sum of the parts':>22} {parts:12.1f}")
    best = min((k for k in us if k.startswith("staged/")), key=us.get)
    print0(f"# fastest chunk: {best.split('/')[1]} ({us[best] / parts:.2f}x the parts)")
    bad = sum(wrong.values())
    print0(f"# Out of bounds values : {bad} {'OK' if bad == 0 else 'FAILED'}")
    return 1 if bad else 0
