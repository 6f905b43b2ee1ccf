"""What each compressor saves and costs, in one run, against the
uncompressed allreduce -- and what it does to accuracy (after GRACE, Xu et
al. 2021); ``hpcjobs bench compression`` runs it.

Part 1 (:func:`tensor_rows`), tensors the size of real layers (fp32 values
shaped as near-square matrices so PowerSGD has a matrix to factor). For
each size and compressor:

- wire bytes: what this rank sent in one ``compressed_allreduce``,
  counted as it was sent; ratio = the uncompressed ring's bytes / these;
- codec ms: compress + decompress on one rank, no communication (median);
- allreduce ms: the whole compressed allreduce (slowest rank's median),
  timed interleaved with the uncompressed ring and ``auto`` (our fastest:
  shared memory on one node) so load on a shared host hits all alike;
  ``vs ring`` / ``vs auto`` are their times over this one (> 1: faster);
- #differ: ranks whose result is not bitwise rank 0's, or (the fp32
  rows) not ``MPI_Allreduce``'s average to float32's precision (must be 0).

Part 2 (:func:`train_rows`), on the training engine: MNIST-1D, every
compressor without and with error feedback next to uncompressed, the same
seeds; final test accuracy (mean and sd over the seeds), the bytes each rank sent over
the whole run (all runs use the ring, so bytes are counted alike) and the
ratio to uncompressed.

Launch::

    mpirun -n 2 hpcjobs bench compression --train --out results/compression
"""

from __future__ import annotations

import math
import statistics
import time
import zlib
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from ..collectives import allreduce
from ..collectives.auto import settled as auto_settled
from ..collectives.counting import counted_allreduce
from ..compression import compressed_allreduce, make_compressor
from ..training.config import TrainConfig
from ..training.loop import train
from .device import pinned_host_copy
from .harness import max_of_medians, sum_over_ranks, time_interleaved

__all__ = ["tensor_rows", "tensor_table", "train_rows", "train_table"]


def _shape(n: int) -> tuple[int, int]:
    rows = max(1, int(math.sqrt(n)))
    while n % rows:
        rows -= 1
    return rows, n // rows


# --- part 1: tensors -----------------------------------------------------------

def _codec_ms(c, t, name: str, iters: int) -> float:
    times = []
    for step in range(iters + 1):
        t0 = time.perf_counter()
        payload, ctx = c.compress(t, name=name, step=step)
        c.decompress(payload, ctx)
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


def tensor_rows(comm: MPI.Intracomm, elements: list[int], compressors: list[str], iters: int, algorithm: str,
                progress: Callable[[str], None] | None = None, device: str = "cpu") -> list[dict]:
    """Part 1 (module docstring): one row per size and compressor, the
    uncompressed ring and ``auto`` included; collective. Summable payloads
    take ``algorithm``; ``iters`` timed rounds per size. ``device``: where
    the gradient lives ("cuda:0": compressors on the GPU, payloads through
    host memory, the fp32 ring staged, ``auto`` among the GPU transports;
    every timed call waits for the device)."""
    on_gpu = device != "cpu"
    wait = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
    rank = comm.Get_rank()
    rows = []
    for n in elements:
        shape = _shape(n)
        g = torch.Generator().manual_seed(1000 + rank)
        grad = torch.randn(*shape, generator=g).to(device)
        comps = {spec: make_compressor(spec, seed=0) for spec in compressors}
        last: dict[str, object] = {}
        sent: dict[str, int] = {}
        step = [0]

        def compressed(spec):
            def run():
                out, b = compressed_allreduce(grad, comps[spec], name="w", comm=comm, algorithm=algorithm,
                                              step=step[0])
                wait()
                last["out"], sent[spec] = out, b
            return run

        work = grad.clone()

        def ring():
            if on_gpu:  # the ring through host memory, as staged transports carry it; bytes counted there
                host = pinned_host_copy(work)  # (work.cpu() made pageable memory each call, in the timed call)
                sent["fp32 ring"] = counted_allreduce(host, "avg", "ring", comm)
                work.copy_(host.view_as(work))
                wait()
            else:
                sent["fp32 ring"] = counted_allreduce(work, "avg", "ring", comm)
            last["out"] = work

        def auto():
            allreduce(work, op="avg", algorithm="auto", comm=comm)
            wait()
            last["out"] = work

        def reset(_label):
            work.copy_(grad)
            step[0] += 1

        exact = grad.cpu().double().numpy()
        comm.Allreduce(MPI.IN_PLACE, exact)  # MPI_Allreduce's sum, in float64: what the fp32 rows must give
        exact /= comm.Get_size()

        def check(label) -> int:
            out = last["out"].cpu().numpy()
            h = zlib.crc32(out.tobytes())
            # (the fp32 rows had been checked for agreement only: a ring that summed and did not divide passed)
            off = label.startswith("fp32") and not np.allclose(out, exact.reshape(out.shape), rtol=1e-5, atol=1e-6)
            return int(h != comm.bcast(h, root=0) or off)

        runs = {"fp32 ring": ring, "fp32 auto": auto} | {spec: compressed(spec) for spec in compressors}
        while not auto_settled(work, "avg", comm):  # auto's measuring calls, untimed, as the allreduce sweep does
            reset(None)
            auto()
        times, wrong = time_interleaved(runs, reset, check, comm, iters, warmup=1, seed=n)  # each size its orders
        base_bytes = max(1, comm.allreduce(sent["fp32 ring"], op=MPI.MAX))
        t_ring, t_auto = max_of_medians(times["fp32 ring"], comm), max_of_medians(times["fp32 auto"], comm)
        for label in runs:
            t = max_of_medians(times[label], comm)
            b = comm.allreduce(sent.get(label, -1), op=MPI.MAX)
            codec = (None if label.startswith("fp32") else
                     comm.allreduce(_codec_ms(comps[label], grad, "w", 3), op=MPI.MAX))
            rows.append(dict(elements=n, shape=list(shape), compressor=label, wire_bytes=b if b >= 0 else None,
                             ratio=base_bytes / b if b > 0 else None, codec_ms=codec, allreduce_ms=1e3 * t,
                             vs_ring=t_ring / t, vs_auto=t_auto / t, differ=sum_over_ranks(wrong[label], comm),
                             uncounted="(GPU)" if on_gpu else "(shm)"))
        if progress is not None:
            progress(f"{n:,} elements done")
    return rows


def tensor_table(rows: list[dict]) -> str:
    """Part 1's rows as a Markdown table."""
    lines = ["| elements | compressor | wire bytes/rank | fewer bytes (x) | codec ms | allreduce ms | "
             "vs fp32 ring | vs fp32 auto | #differ |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['elements']:,} | {r['compressor']} | "
                     + (f"{r['wire_bytes']:,}" if r["wire_bytes"] is not None else r.get("uncounted", "(shm)"))
                     + " | "
                     + (f"{r['ratio']:.1f}" if r["ratio"] else "-") + " | "
                     + (f"{r['codec_ms']:.1f}" if r["codec_ms"] is not None else "-")
                     + f" | {r['allreduce_ms']:.1f} | {r['vs_ring']:.2f} | {r['vs_auto']:.2f} | {r['differ']} |")
    return "\n".join(lines)


# --- part 2: training ------------------------------------------------------------

def train_rows(comm: MPI.Intracomm, compressors: list[str], model: str, num_samples: int, epochs: int,
               batch_per_rank: int, lr: float, seeds: int, progress: Callable[[str], None] | None = None
               ) -> list[dict]:
    """Part 2 (module docstring): MNIST-1D with every compressor, without
    and with error feedback, beside uncompressed, ``seeds`` runs each, SGD
    with momentum 0.9 at ``lr``; collective."""
    cells = [("none", False)] + [(spec, ef) for spec in compressors for ef in (False, True)]

    def config(spec: str, ef: bool, seed: int, epochs: int = epochs) -> TrainConfig:
        return TrainConfig(model=model, dataset="mnist1d", num_samples=num_samples, batch_per_rank=batch_per_rank,
                           optimizer="sgd", lr=lr, momentum=0.9, warmup="none", algorithm="ring", compression=spec,
                           error_feedback=ef, epochs=epochs, seed=seed, quiet=True, progress=False)

    # An untimed epoch of each cell first: the data's first load and torch's first calls had landed on "none"'s
    # first run, each run timed whole (0.72 s against 0.04 s the same run again, in one process), and a
    # compressor's first run took 2-4x its later ones; then the seeds' rounds, each cell once per round, the order
    # turned by one each round, so no cell always runs first; the time is the median over the seeds.
    for spec, ef in cells:
        train(config(spec, ef, 0, epochs=1), comm)
    runs = {cell: [] for cell in cells}  # cell -> [(test acc, final loss, bytes sent, seconds)] by seed
    t_all, done = time.perf_counter(), 0
    for seed in range(seeds):
        for spec, ef in cells[seed % len(cells):] + cells[:seed % len(cells)]:
            t0 = time.perf_counter()
            history = train(config(spec, ef, seed), comm)
            last = history[-1]  # a diverged run ends at chance and counts as such
            runs[spec, ef].append((last["test_acc"], last["loss"],
                                   sum(h["sent_bytes"] for h in history) / len(history) * epochs,
                                   time.perf_counter() - t0))
            done += 1
            if progress is not None:
                progress(f"train {done}/{seeds * len(cells)}: "
                         f"{spec}{' +EF' if ef else ''}, seed {seed}: test acc {100 * last['test_acc']:.2f}%"
                         f"{'' if math.isfinite(last['loss']) else ' (diverged)'} ({time.perf_counter() - t_all:.0f}s)")
    rows = []
    for (spec, ef), got in runs.items():
        accs = [acc for acc, _, _, _ in got]
        rows.append(dict(compressor=spec, error_feedback=ef, test_acc=statistics.fmean(accs),
                         test_acc_sd=statistics.stdev(accs) if len(accs) > 1 else 0.0, accs=accs,
                         diverged=sum(not math.isfinite(loss) for _, loss, _, _ in got),
                         sent_bytes=statistics.fmean(b for _, _, b, _ in got),
                         seconds=statistics.median(t for _, _, _, t in got)))
    base = rows[0]
    for r in rows:
        r["delta_points"] = 100 * (r["test_acc"] - base["test_acc"])
        r["fewer_bytes"] = base["sent_bytes"] / r["sent_bytes"] if r["sent_bytes"] else None
        r["time_ratio"] = r["seconds"] / base["seconds"]
    return rows


def train_table(rows: list[dict]) -> str:
    """Part 2's rows as a Markdown table."""
    lines = ["| compressor | error feedback | test accuracy % | vs none (points) | bytes sent/rank | "
             "fewer bytes (x) | time vs none |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['compressor']} | {'yes' if r['error_feedback'] else 'no'} | "
                     f"{100 * r['test_acc']:.2f} ± {100 * r['test_acc_sd']:.2f}"
                     + (f" ({r['diverged']}/{len(r['accs'])} diverged)" if r["diverged"] else "")
                     + f" | {r['delta_points']:+.2f} | "
                     f"{r['sent_bytes']:,.0f} | "
                     + (f"{r['fewer_bytes']:.1f}" if r["fewer_bytes"] is not None else "-")  # 1 rank: none sent
                     + f" | {r['time_ratio']:.2f} |")
    return "\n".join(lines)
