"""``hpcjobs bench compression``: bytes, codec time and allreduce time per
compressor against the uncompressed allreduce, and (``--train``) MNIST-1D
accuracy with and without error feedback (:mod:`hpcjobs.bench.compression`).

    mpirun -n 2 hpcjobs bench compression --train --out results/compression
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from .._files import write_text
from ..bench.names import COMPRESSORS
from ..collectives import MESSAGE_ALGORITHMS
from ..compression.names import make_compressor
from ..training.config import MODELS
from .args import UsageError, check_outputs, comma_list, positive_float, positive_int, usage


def _counts(text: str) -> list[int]:
    """'100K,1M,2.5M' -> element counts (powers of 1000)."""
    out = []
    for item in comma_list(text):
        scale = {"K": 10 ** 3, "M": 10 ** 6}.get(item[-1:].upper(), 1)
        try:
            value = float(item[:-1] if scale > 1 else item) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a count: {item!r} (use e.g. 100K, 1M, 2.5M)") from None
        if not value >= 1 or math.isinf(value):  # (inf: int() raised OverflowError, which argparse passed on)
            raise argparse.ArgumentTypeError(f"counts must be finite and >= 1, got {item!r}")
        out.append(int(value))
    if not out:
        raise argparse.ArgumentTypeError("give at least one count, e.g. 100K,1M")
    return out


def _compressors(text: str) -> list[str]:
    specs = comma_list(text)
    for s in specs:
        try:
            if make_compressor(s) is None:
                raise ValueError("'none' is the baseline, always included")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return specs


def configure(p) -> None:
    p.add_argument("--compressors", type=_compressors, default=list(COMPRESSORS),
                   help="comma-separated NAME[:PARAM] (default: " + ",".join(COMPRESSORS) + ")")
    p.add_argument("--elements", type=_counts, default=[10 ** 5, 10 ** 6, 10 ** 7, 25 * 10 ** 6],
                   help="tensor sizes in fp32 elements (default: 100K,1M,10M,25M)")
    p.add_argument("--iters", type=positive_int, default=5, help="timed rounds per size (default 5)")
    p.add_argument("--algorithm", choices=("auto",) + MESSAGE_ALGORITHMS, default="ring",
                   help="allreduce of summable payloads (default: ring)")
    g = p.add_argument_group("accuracy study (--train)")
    g.add_argument("--train", action="store_true", help="also train MNIST-1D with every compressor, +- EF")
    g.add_argument("--model", choices=MODELS, default="mlp", help="default: %(default)s")
    g.add_argument("--num-samples", type=positive_int, default=10000, help="MNIST-1D samples (default 10000)")
    g.add_argument("--epochs", type=positive_int, default=20, help="default: %(default)s")
    g.add_argument("--batch-per-rank", type=positive_int, default=32, help="default: %(default)s")
    # 0.01 is the largest rate at which every error-feedback variant stayed
    # stable here: random-k 1% with error feedback diverged at 0.02 and 0.05
    # (docs/results/compression.md, "Accuracy"); uncompressed is best near 0.05.
    g.add_argument("--lr", type=positive_float, default=0.01, help="SGD rate, momentum 0.9 (default 0.01)")
    g.add_argument("--seeds", type=positive_int, default=3, help="seeds per cell (default 3)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the gradients live: cpu (default), or this rank's GPU (compressors run there with "
                        "torch ops, payloads cross through host memory; tensors part only)")
    p.add_argument("--threads", type=positive_int, help="torch threads per rank (default: this rank's cores)")
    p.add_argument("--out", "-O", metavar="DIR", help="write results.json and compression.md here (rank 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def run(args) -> int:
    from ..bench.compression import tensor_rows, tensor_table, train_rows, train_table
    from ..bench.memory import COMPRESSION_BYTES_PER_ELEMENT, check_fits
    from ..bench.sweep import unchecked_benchmarks
    from ..comm import print0, private
    from ..runtime import set_threads

    device = "cpu"
    if args.device == "cuda":
        from ..bench.device import gpu_for_rank, no_gpu_reason

        reason = no_gpu_reason()
        if reason:
            raise UsageError(f"--device cuda: {reason}")
        if args.train:
            raise UsageError("--train trains on the CPU; run the accuracy study without --device cuda")
    comm = private()
    if args.device == "cuda":
        device = gpu_for_rank(comm)
    size = comm.Get_size()
    check_outputs(comm, [("--out", args.out, True)])
    if device == "cpu":  # (on a GPU the gradient and its copies are in device memory)
        with usage():
            check_fits(comm, COMPRESSION_BYTES_PER_ELEMENT * max(args.elements), f"--elements {max(args.elements):,}")
    unchecked_benchmarks()
    threads = set_threads(args.threads, comm)
    progress = (lambda line: print0(f"# {line}")) if args.progress else None
    print0(f"# bench compression: {size} ranks, {threads} torch thread(s)/rank, compressors "
           f"{','.join(args.compressors)}, summable payloads by {args.algorithm}"
           + ("" if device == "cpu" else f"; gradients on {device}"))
    rows = tensor_rows(comm, args.elements, args.compressors, args.iters, args.algorithm, progress, device)
    tensor_md = tensor_table(rows)
    print0("\n" + tensor_md + "\n")
    trained, train_md = None, None
    if args.train:
        print0(f"# accuracy: {args.model} on MNIST-1D ({args.num_samples} samples), {args.epochs} epochs, "
               f"batch {args.batch_per_rank}/rank, SGD lr {args.lr} momentum 0.9, {args.seeds} seed(s)")
        trained = train_rows(comm, args.compressors, args.model, args.num_samples, args.epochs,
                             args.batch_per_rank, args.lr, args.seeds, progress)
        train_md = train_table(trained)
        print0("\n" + train_md + "\n")
    differ = sum(r["differ"] for r in rows)
    if comm.Get_rank() == 0 and args.out:
        out = Path(args.out)
        write_text(out / "results.json", json.dumps({"ranks": size, "tensors": rows, "training": trained}, indent=1))
        text = f"# Compression study ({size} ranks)\n\n## Tensors\n\n{tensor_md}\n"
        if train_md:
            text += f"\n## Training (MNIST-1D, {args.model})\n\n{train_md}\n"
        write_text(out / "compression.md", text)
        print(f"# wrote {out}/results.json and {out}/compression.md", flush=True)
    if differ:
        print0(f"# ERROR: {differ} rank results differ from rank 0's")
    return 1 if differ else 0
