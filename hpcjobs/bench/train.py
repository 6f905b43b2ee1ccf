"""Training throughput of our optimizer against Horovod's
``DistributedOptimizer`` and torch DDP, same model, same batch, same run --
the shape of Horovod's ``pytorch_synthetic_benchmark.py`` (``hpcjobs bench
train`` runs it).

1. Every implementation gets its own copy of the same model (same initial
   weights) and one fixed random batch of ``batch_size`` samples per rank.
2. ``warmup_batches`` steps of each are run untimed.
3. ``iters`` rounds follow; in each round every implementation runs
   ``batches_per_iter`` steps, in an order shuffled per round with a
   seed (so slow phases of a shared host fall on all alike), and its
   samples/s per rank is recorded. The time of a round is the max over ranks.
4. ``single`` is one rank training alone (the others wait without spinning):
   scaling efficiency = total samples/s / (P * single's samples/s).
5. Horovod is measured first, as one block (its warmup and all its
   rounds), then shut down before the others are built: while it runs
   its background thread keeps negotiating over MPI and burns about half a
   core on rank 0, which would slow every other implementation measured
   beside it, and Horovod 0.28.1 cannot be restarted reliably (started and
   shut down around each round, about one run in ten at 3 ranks had a rank
   leave a step while the others still waited in it). The others' threads
   (hvd-hpcjobs' controller polls every millisecond on rank 0) do not run
   beside it either. Every implementation takes one untimed step at the
   start of each round.
6. Each implementation's first step (untimed) is held against
   ``MPI_Allreduce``'s average (:func:`~.workload.update_error`); after
   timing, its parameters are compared across ranks. Ranks that disagree, or
   a first step over :data:`AVERAGED_WITHIN` off where the gradients travel
   whole or as fp16/bf16, count as ``#wrong``: the command exits non-zero.

Launch::

    mpirun -n 2 hpcjobs bench train --model mlp --width 1024 --batch-size 64
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from mpi4py import MPI

from ..collectives import ALGORITHMS
from ..comm import agree
from ..compression import make_compressor
from ..runtime import out_of_memory
from ..training import DistributedOptimizer
from ..training.config import OVERLAPS
from . import horovod
from .baselines import available, ensure_process_group, shutdown
from .workload import AVERAGED_WITHIN, Workload, data, flat_parameters, model, reference_update, stepper, update_error

__all__ = ["Workload", "Result", "check_impl", "unavailable", "parameters", "bench_train", "table"]


@dataclass
class Result:
    impl: str
    per_rank_sps: list[float] = field(default_factory=list)  # one per round: samples/s per rank
    comm_shares: list[float] = field(default_factory=list)  # ours: per round, the share of time in allreduce
    wrong: int = 0
    update_error: float | None = None  # the first step's distance from the average's (module docstring, 6.)

    @property
    def median(self) -> float:
        return statistics.median(self.per_rank_sps) if self.per_rank_sps else float("nan")

    @property
    def ci95(self) -> float:
        return 1.96 * statistics.stdev(self.per_rank_sps) if len(self.per_rank_sps) > 1 else 0.0


class _Runner:
    """One implementation: a model, an optimizer, a step function."""

    def __init__(self, name, model, step, alone=False, close=lambda: None, block=False, leave=lambda: None,
                 comm_s=None, settled=lambda: True):
        self.name, self.model, self.step, self.alone, self.close = name, model, step, alone, close
        self.block, self.leave = block, leave  # block: measured alone first, then leave()
        self.comm_s = comm_s  # ours: () -> seconds its optimizer has spent in allreduce so far
        self.settled = settled  # ours:auto: () -> whether auto is done measuring (the same on every rank)


@contextlib.contextmanager
def _oom_ends_the_job(w: Workload, comm, impl: str | None = None):
    """A CUDA out-of-memory error inside names the model, the batch, the
    device and the implementation, and ends the job on every rank (the
    others would wait in the next step's allreduce)."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        doing = (f"training {w.model} with {w.batch_size} samples per rank"
                 + (f" ({impl})" if impl else "") + (f", autocast to {w.amp}" if w.amp != "none" else ""))
        raise out_of_memory(e, comm, w.device, doing, "lower --batch-size or use --amp bf16") from e


def _make_model(w: Workload, seed_state):
    torch.set_rng_state(seed_state)
    return model(w).to(w.device)


def _build(name: str, w: Workload, comm, seed_state, x, y) -> _Runner:
    model = _make_model(w, seed_state)
    sgd = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=0.9)
    loss_step = stepper(w, model, x, y)

    if name == "single":
        return _Runner(name, model, loss_step(sgd), alone=True)
    if name.startswith("ours:"):
        algorithm, compression, overlap = check_impl(name)
        opt = DistributedOptimizer(sgd, model.named_parameters(), comm=comm, algorithm=algorithm,
                                   compression=make_compressor(compression), fusion_bytes=w.fusion_bytes,
                                   overlap=overlap)
        return _Runner(name, model, loss_step(opt, ("ours", sgd)), close=opt.close,
                       comm_s=lambda: opt.stats["comm_s"], settled=_auto_settled(opt, algorithm, compression))
    if name in ("ddp", "ddp-hpcjobs"):
        from torch.nn.parallel import DistributedDataParallel

        cap = {"bucket_cap_mb": w.fusion_bytes / 2**20} if w.same_buckets else {}
        if w.device.startswith("cuda"):
            cap["device_ids"] = [torch.device(w.device)]
        if name == "ddp":
            ensure_process_group(comm)  # Gloo, torch's default group
            ddp = DistributedDataParallel(model, **cap)
        else:  # the same DDP on a group of the hpcjobs backend
            from ..torch_backend import new_process_group

            group = new_process_group(comm)
            ddp = DistributedDataParallel(model, process_group=group, **cap)
        opt = torch.optim.SGD(ddp.parameters(), lr=w.lr, momentum=0.9)
        return _Runner(name, model, stepper(w, ddp, x, y)(opt),
                       close=group.shutdown if name == "ddp-hpcjobs" else lambda: None)
    if name == "hvd-hpcjobs":
        from ..horovod import torch as hvd_api

        hvd_api.init(comm)
        opt = hvd_api.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        return _Runner(name, model, loss_step(opt, "horovod"), close=hvd_api.shutdown)
    if name == "horovod":
        hvd = horovod.start(comm)  # runs until its block is measured (module docstring, 5.)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        return _Runner(name, model, loss_step(opt, "horovod"), block=True, leave=horovod.stop)
    raise ValueError(name)


def check_impl(name: str) -> tuple[str, str, str] | None:
    """Check an implementation's name; for "ours:<algorithm>[+<compression>
    [:<param>]][/<overlap>]" return (algorithm, compression, overlap).

    Raises:
        ValueError: an unknown implementation, algorithm, compression or overlap.
    """
    if name in ("single", "ddp", "horovod", "ddp-hpcjobs", "hvd-hpcjobs"):
        return None
    if not name.startswith("ours:"):
        raise ValueError(f"unknown implementation {name!r}; choose from single, ddp, horovod, ddp-hpcjobs, "
                         "hvd-hpcjobs, "
                         "ours:<algorithm>[+<compression>][/thread|/none]")
    spec, _, overlap = name[len("ours:"):].partition("/")
    algorithm, _, compression = spec.partition("+")
    for what, value, allowed in (("algorithm", algorithm, ("auto",) + ALGORITHMS),
                                 ("overlap", overlap or "auto", OVERLAPS)):
        if value not in allowed:
            raise ValueError(f"unknown {what} {value!r} in {name!r}; choose from {', '.join(allowed)}")
    try:
        make_compressor(compression or "none")
    except ValueError as e:
        raise ValueError(f"{e} (in {name!r})") from None
    return algorithm, compression or "none", overlap or "auto"


def _wait_quietly(comm):
    """The ranks that sit out ``single`` wait here without spinning on a core."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def _sync() -> None:
    """Wait for this rank's GPU work (nothing on the CPU): a timed round
    ends when its kernels have run, not when they were queued."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time_round(runner: _Runner, comm, batches: int, batch_size: int) -> float:
    """Samples/s per rank for ``batches`` steps (max time over ranks)."""
    _sync()
    if runner.alone:
        if comm.Get_rank() == 0:
            t0 = time.perf_counter()
            for _ in range(batches):
                runner.step()
            _sync()
            dt = time.perf_counter() - t0
            comm.Ibarrier().Wait()
        else:
            _wait_quietly(comm)
            dt = 0.0
        dt = comm.allreduce(dt, op=MPI.MAX)
        return batches * batch_size / dt
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(batches):
        runner.step()
    _sync()
    dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return batches * batch_size / dt


def _auto_settled(opt, algorithm: str, compression: str | None):
    """Whether ``auto`` under ``opt`` is done measuring its candidates on
    every bucket, so the rounds time what it settled on (as the allreduce
    sweep does): from its buckets' sizes; a compressed payload's sizes are
    the compressor's, so there after as many steps as the most candidates
    take (3 × 21 calls a size)."""
    # one rank has nothing to measure: the step count below would step for nothing there
    if algorithm != "auto" or opt._user_comm.Get_size() == 1:
        return lambda: True
    if compression not in (None, "none"):
        steps = iter(range(64))
        return lambda: next(steps, None) is None
    from ..collectives.auto import settled

    return lambda: all(settled(b.buffer, "avg", opt._user_comm) for b in opt._buckets)


def _params_agree(runner: _Runner, comm) -> bool:
    return bool(agree(flat_parameters(runner.model).numpy(), comm).all())


def _held(name: str) -> bool:
    """Whether ``name``'s update_error can make it wrong: its gradients travel whole or as fp16/bf16."""
    return (check_impl(name) or ("", "none", ""))[1] in ("none", "fp16", "bf16")


def _measure(runners, comm, w: Workload, warmup_batches: int, batches_per_iter: int, iters: int, rng,
             results, progress) -> None:
    def warm_up(r):
        for _ in range(warmup_batches):
            if r.alone:
                _time_round(r, comm, 1, w.batch_size)
            else:
                r.step()
        for _ in range(200):  # auto's measuring steps, untimed (bounded: a table row needs about 21 a size)
            if r.settled():
                break
            r.step()

    def round_of(r):
        _time_round(r, comm, 1, w.batch_size)  # untimed
        before = r.comm_s() if r.comm_s else 0.0
        sps = _time_round(r, comm, batches_per_iter, w.batch_size)
        res = results.setdefault(r.name, Result(r.name))
        res.per_rank_sps.append(sps)
        if r.comm_s:  # the mean over ranks of each one's allreduce time, over the round's time
            seconds = batches_per_iter * w.batch_size / sps
            res.comm_shares.append(comm.allreduce(r.comm_s() - before) / comm.Get_size() / seconds)

    for r in (r for r in runners if r.block):
        with _oom_ends_the_job(w, comm, r.name):
            warm_up(r)
            for _ in range(iters):
                round_of(r)
        comm.Barrier()
        r.leave()
    rest = [r for r in runners if not r.block]
    for r in rest:
        with _oom_ends_the_job(w, comm, r.name):
            warm_up(r)
    for it in range(iters):
        order = list(rest)
        rng.shuffle(order)
        for r in order:
            with _oom_ends_the_job(w, comm, r.name):
                round_of(r)
        if progress is not None:
            progress(it + 1)


def unavailable(names: list[str], comm, device: str = "cpu") -> dict[str, str]:
    """The baselines among ``names`` that cannot run here, with the reason
    (collective). On a GPU, DDP runs on NCCL (one GPU per rank)."""
    skipped, cuda = {}, device.startswith("cuda")
    for n, base in (("ddp", "nccl" if cuda else "gloo"), ("horovod", "horovod")):
        if n in names:
            reason = available(base, comm)
            if not reason and n == "horovod" and cuda:  # (each rank's Horovod; agreed: a split would hang)
                import horovod.torch as hvd

                built = comm.allgather(hvd.cuda_built())
                reason = None if all(built) else f"the Horovod of rank {built.index(False)} was built without CUDA"
            if reason:
                skipped[n] = reason
    return skipped


def parameters(w: Workload) -> int:
    """The model's parameter count."""
    return sum(p.numel() for p in model(w).parameters())


def bench_train(comm: MPI.Intracomm, names: list[str], w: Workload, warmup_batches: int, batches_per_iter: int,
                iters: int, progress: Callable[[int], None] | None = None) -> dict[str, Result]:
    """Measure ``names`` (module docstring); collective. ``progress(round)``
    is called after each timed round. Returns the results by name, each
    with ``wrong`` counting the ranks' parameters come out different and a
    first step off the average (module docstring, 6.), and ``update_error``.

    Raises:
        MemoryError: a CUDA out-of-memory error, naming the model, the batch,
            the device and the implementation; with several ranks the job
            ends on every rank instead, with that message on stderr.
    """
    torch.manual_seed(w.seed)
    seed_state = torch.get_rng_state()
    with _oom_ends_the_job(w, comm):
        x, y = data(w, torch.Generator().manual_seed(w.seed + comm.Get_rank()))
    if w.same_buckets:  # read by Horovod and by our Horovod API when they start
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(w.fusion_bytes)
    rng = random.Random(w.seed)
    results: dict[str, Result] = {}
    built = {}
    # Horovod's block first, then the others are built: their threads (hvd-hpcjobs' controller polls every
    # millisecond on rank 0) must not run beside it, as Horovod's does not run beside them (docstring, 5.)
    names = list(dict.fromkeys(names))  # a name given twice is one runner, measured once a round
    first, rest = [n for n in names if n == "horovod"], [n for n in names if n != "horovod"]
    reference, errors = None, {}
    if comm.Get_size() > 1 and any(n != "single" for n in names):
        with _oom_ends_the_job(w, comm, "the reference step, MPI_Allreduce's average"):
            reference = reference_update(w, _make_model(w, seed_state), x, y, comm)
    for group, told in ((first, None), (rest, progress)):  # (progress: the rounds of the shuffled ones)
        for n in group:
            with _oom_ends_the_job(w, comm, n):
                built[n] = _build(n, w, comm, seed_state, x, y)
                if reference is not None and not built[n].alone:  # its first step, held against the average
                    built[n].step()
                    errors[n] = update_error(built[n].model, reference, comm)
        _measure([built[n] for n in group], comm, w, warmup_batches, batches_per_iter, iters, rng, results, told)
    runners = [built.pop(n) for n in names]
    wrong = {r.name: int(not _params_agree(r, comm)) for r in runners if not r.alone}
    [r.close() for r in runners]  # (a comprehension: no loop variable left holding the last runner)
    # DDP's reducer must go before its Gloo process group: destroyed the
    # other way round, at interpreter exit, a rank hung in native code about
    # one run in six here (seen under CPU load). Nothing else may hold a runner.
    del runners
    gc.collect()
    comm.Barrier()
    shutdown()
    for name, res in results.items():
        res.update_error = errors.get(name)
        off = res.update_error is not None and not res.update_error <= AVERAGED_WITHIN  # (inf: not finite)
        res.wrong = wrong.get(name, 0) + int(_held(name) and off)
    return results


def table(results: dict[str, Result], size: int, order: list[str]) -> tuple[list[str], list[dict]]:
    """The results table (lines to print) and its rows (for JSON): samples/s
    per rank, scaling efficiency against ``single``, and ratios against
    ``ddp`` and ``horovod``, all from this run's medians."""
    single, ddp, hvd = results.get("single"), results.get("ddp"), results.get("horovod")
    lines = ["#", f"# {'impl':20s} {'samples/s/rank':>15s} {'+-95%':>8s} {'total samples/s':>16s} "
                  f"{'efficiency':>10s} {'vs ddp':>7s} {'vs horovod':>10s} {'#wrong':>6s} {'comm':>5s}"]
    rows = []
    for name in order:
        res = results[name]
        total = res.median * (1 if name == "single" else size)
        eff = total / (size * single.median) if single and name != "single" else float("nan")
        vs_ddp = res.median / ddp.median if ddp else float("nan")
        vs_hvd = res.median / hvd.median if hvd else float("nan")
        share = statistics.median(res.comm_shares) if res.comm_shares else None
        lines.append(f"  {name:20s} {res.median:15.0f} {res.ci95:8.0f} {total:16.0f} {eff:10.2f} {vs_ddp:7.2f} "
                     f"{vs_hvd:10.2f} {res.wrong:6d} {f'{100 * share:4.0f}%' if share is not None else '    -':>5s}")
        def num(v):  # NaN (no single, ddp or horovod row) as JSON's null: a bare NaN is not JSON
            return None if math.isnan(v) else v

        rows.append(dict(impl=name, samples_per_s_per_rank=res.median, ci95=res.ci95, total_samples_per_s=total,
                         efficiency=num(eff), vs_ddp=num(vs_ddp), vs_horovod=num(vs_hvd), wrong=res.wrong,
                         update_error=None if res.update_error in (None, math.inf) else res.update_error,
                         rounds=res.per_rank_sps, comm_share=share))
    lines.append("# samples/s/rank: median over rounds; +-95%: 1.96 x the rounds' standard deviation (one round's "
                 "spread, as Horovod's synthetic benchmark prints it, not the median's interval); "
                 "efficiency = total / (ranks x single); ratios are of medians from this run")
    errors = {n: results[n].update_error for n in order if results[n].update_error is not None and _held(n)}
    if errors:
        lines.append(f"# #wrong: 1 where the ranks' parameters differ after timing, +1 where the first step lands over "
                     f"{AVERAGED_WITHIN:g} of its size from MPI_Allreduce's average (update_error; lossy compressions "
                     f"not held; the largest held here: {max(errors.values()):.1g})")
    if any(results[n].comm_shares for n in order):
        lines.append("# comm: our optimizer's time in allreduce over the step time, median over rounds "
                     "(overlapped with backward where it runs /thread)")
    return lines, rows
