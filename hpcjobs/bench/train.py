"""``hpcjobs bench train``: training throughput of our optimizer against
Horovod's ``DistributedOptimizer`` and torch DDP, same model, same batch,
same run -- the shape of Horovod's ``pytorch_synthetic_benchmark.py``.

1. Every implementation gets its own copy of the same model (same initial
   weights) and one fixed random batch of ``--batch-size`` samples per rank.
2. ``--num-warmup-batches`` steps of each are run untimed.
3. ``--num-iters`` rounds follow; in each round every implementation runs
   ``--num-batches-per-iter`` steps, in an order shuffled per round with a
   seed (so slow phases of a shared host fall on all alike), and its
   samples/s per rank is recorded. The time of a round is the max over ranks.
4. ``single`` is one rank training alone (the others wait without spinning):
   scaling efficiency = total samples/s / (P * single's samples/s).
5. Horovod is started (``hvd.init()``) before each of its own rounds and
   shut down after, because while it runs its background thread keeps
   negotiating over MPI and burns about half a core on rank 0, which would
   slow every other implementation measured beside it. Every implementation
   takes one untimed step at the start of each of its rounds, so Horovod's
   first step after a restart is not timed either.
6. After timing, each implementation's parameters are compared across ranks
   (data parallelism keeps them identical); ranks that disagree count as
   ``#wrong`` and make the command exit non-zero.

Launch::

    mpirun -n 2 hpcjobs bench train --model mlp --width 1024 --batch-size 64
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from mpi4py import MPI

__all__ = ["IMPLS", "Result", "main"]

# name -> (description); "ours:*" are parsed as ours:<algorithm>[+<compression>[:<param>]][/<overlap>].
IMPLS = ("single", "ours:auto", "ours:auto/thread", "ours:auto/none", "ours:ring", "ours:auto+fp16", "ddp", "horovod")
DEFAULT_IMPLS = IMPLS


@dataclass
class Result:
    impl: str
    per_rank_sps: list[float] = field(default_factory=list)  # one per round: samples/s per rank
    wrong: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.per_rank_sps) if self.per_rank_sps else float("nan")

    @property
    def ci95(self) -> float:
        return 1.96 * statistics.stdev(self.per_rank_sps) if len(self.per_rank_sps) > 1 else 0.0


class _Runner:
    """One implementation: a model, an optimizer, a step function."""

    def __init__(self, name, model, step, alone=False, close=lambda: None, enter=lambda: None,
                 leave=lambda: None):
        self.name, self.model, self.step, self.alone, self.close = name, model, step, alone, close
        self.enter, self.leave = enter, leave


def _make_model(args, seed_state):
    import torch

    from ..training.models import build_model

    torch.set_rng_state(seed_state)
    return build_model(args.model, (args.input_size,), args.num_classes, width=args.width,
                       batch_norm=args.batch_norm)


def _build(name: str, args, comm, seed_state, x, y):
    import torch
    import torch.nn.functional as F

    from ..training import DistributedOptimizer

    model = _make_model(args, seed_state)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def loss_step(opt):
        def step():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return step

    if name == "single":
        return _Runner(name, model, loss_step(sgd), alone=True)
    if name.startswith("ours:"):
        from ..compression import make_compressor

        algorithm, compression, overlap = _parse_ours(name)
        opt = DistributedOptimizer(sgd, model.named_parameters(), comm=comm, algorithm=algorithm,
                                   compression=make_compressor(compression), fusion_bytes=args.fusion_bytes,
                                   overlap=overlap)
        return _Runner(name, model, loss_step(opt), close=opt.close)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        from .baselines import _ensure_process_group

        _ensure_process_group(comm)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

        def step():
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        return _Runner(name, model, step)
    if name == "horovod":
        from .baselines import _horovod

        hvd = _horovod(comm)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        hvd.shutdown()

        def enter():
            hvd.init(comm=MPI.COMM_WORLD)
        return _Runner(name, model, loss_step(opt), enter=enter, leave=hvd.shutdown)
    raise ValueError(name)


def _parse_ours(name: str) -> tuple[str, str, str]:
    """"ours:<algorithm>[+<compression>[:<param>]][/<overlap>]" -> (algorithm, compression, overlap).

    Raises:
        UsageError: an unknown algorithm, compression or overlap.
    """
    from ..cli import UsageError
    from ..collectives import ALGORITHMS
    from ..compression import make_compressor
    from ..training.distributed import OVERLAPS

    spec, _, overlap = name[len("ours:"):].partition("/")
    algorithm, _, compression = spec.partition("+")
    for what, value, allowed in (("algorithm", algorithm, ("auto",) + ALGORITHMS),
                                 ("overlap", overlap or "auto", OVERLAPS)):
        if value not in allowed:
            raise UsageError(f"unknown {what} {value!r} in {name!r}; choose from {', '.join(allowed)}")
    try:
        make_compressor(compression or "none")
    except ValueError as e:
        raise UsageError(f"{e} (in {name!r})") from None
    return algorithm, compression or "none", overlap or "auto"


def _wait_quietly(comm):
    """The ranks that sit out ``single`` wait here without spinning on a core."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def _time_round(runner: _Runner, comm, batches: int, batch_size: int) -> float:
    """Samples/s per rank for ``batches`` steps (max time over ranks)."""
    if runner.alone:
        if comm.Get_rank() == 0:
            t0 = time.perf_counter()
            for _ in range(batches):
                runner.step()
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
    dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return batches * batch_size / dt


def _params_agree(runner: _Runner, comm) -> bool:
    import torch

    from ..comm import agree

    flat = torch.cat([p.detach().reshape(-1).double() for p in runner.model.parameters()]).numpy()
    return bool(agree(flat, comm).all())


def _measure(runners, comm, args, rng, results):
    for r in runners:
        r.enter()
        for _ in range(args.num_warmup_batches):
            if r.alone:
                _time_round(r, comm, 1, args.batch_size)
            else:
                r.step()
        r.leave()
    for it in range(args.num_iters):
        order = list(runners)
        rng.shuffle(order)
        for r in order:
            r.enter()
            _time_round(r, comm, 1, args.batch_size)  # untimed: first step after a (re)start
            sps = _time_round(r, comm, args.num_batches_per_iter, args.batch_size)
            r.leave()
            results.setdefault(r.name, Result(r.name)).per_rank_sps.append(sps)
        if comm.Get_rank() == 0 and args.progress:
            print(f"# round {it + 1}/{args.num_iters}", flush=True)


def _configure(p) -> None:
    from ..cli import parse_bytes, positive_float, positive_int
    from ..training.models import MODELS

    p.add_argument("--impl", default=",".join(DEFAULT_IMPLS),
                   help="comma-separated: single, ours:<algorithm>[+<compression>][/thread|/none], ddp, horovod "
                        f"(default: {','.join(DEFAULT_IMPLS)})")
    p.add_argument("--model", choices=MODELS, default="mlp", help="default: %(default)s")
    p.add_argument("--width", type=positive_int, default=1024, help="hidden units / channels (default 1024)")
    p.add_argument("--batch-norm", action="store_true")
    p.add_argument("--input-size", type=positive_int, default=40, help="features per sample (MNIST-1D: 40)")
    p.add_argument("--num-classes", type=positive_int, default=10)
    p.add_argument("--batch-size", type=positive_int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--num-warmup-batches", type=positive_int, default=5, help="default: %(default)s")
    p.add_argument("--num-batches-per-iter", type=positive_int, default=5, help="default: %(default)s")
    p.add_argument("--num-iters", type=positive_int, default=10, help="timed rounds (default 10)")
    p.add_argument("--fusion-bytes", type=parse_bytes, default=1 << 20, help="our bucket size (default 1M)")
    p.add_argument("--lr", type=positive_float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, help="torch threads per rank (default: this rank's cores)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rank 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def main(args) -> int:
    import torch

    from ..cli import UsageError
    from ..comm import print0, private
    from ..training.cli import set_threads
    from .baselines import available, shutdown

    comm = private()
    size = comm.Get_size()
    names = [n.strip() for n in args.impl.split(",") if n.strip()]
    for n in names:
        if n.startswith("ours:"):
            _parse_ours(n)
        elif n not in ("single", "ddp", "horovod"):
            raise UsageError(f"unknown implementation {n!r}; see --help")
    threads = set_threads(args, comm)
    skipped = {}
    for n, base in (("ddp", "gloo"), ("horovod", "horovod")):
        if n in names:
            reason = available(base, comm)
            if reason:
                skipped[n] = reason
                names.remove(n)
    torch.manual_seed(args.seed)
    seed_state = torch.get_rng_state()
    g = torch.Generator().manual_seed(args.seed + comm.Get_rank())
    x = torch.randn(args.batch_size, args.input_size, generator=g)
    y = torch.randint(0, args.num_classes, (args.batch_size,), generator=g)
    nparams = sum(p.numel() for p in _make_model(args, seed_state).parameters())
    print0(f"# bench train: {args.model} width {args.width} ({nparams} parameters, {4 * nparams / 2**20:.1f} MiB "
           f"of fp32 gradients), batch {args.batch_size}/rank, {size} ranks, {threads} torch thread(s)/rank, "
           f"{args.num_iters} rounds x {args.num_batches_per_iter} steps")
    for n, why in skipped.items():
        print0(f"# {n}: skipped ({why})")
    rng = random.Random(args.seed)
    results: dict[str, Result] = {}
    runners = [_build(n, args, comm, seed_state, x, y) for n in names]
    _measure(runners, comm, args, rng, results)
    wrong = {r.name: int(not _params_agree(r, comm)) for r in runners if not r.alone}
    for r in runners:
        r.close()
    # DDP's reducer must go before its Gloo process group: destroyed the
    # other way round, at interpreter exit, a rank hung in native code about
    # one run in six here (seen under CPU load).
    del runners
    gc.collect()
    comm.Barrier()
    shutdown()
    for name, res in results.items():
        res.wrong = wrong.get(name, 0)
    args.order = [n for n in names if n in results]
    _report(results, size, comm, args)
    return 1 if any(wrong.values()) else 0


def _report(results, size, comm, args) -> None:
    if comm.Get_rank() != 0:
        return
    single, ddp, hvd = results.get("single"), results.get("ddp"), results.get("horovod")
    print("#")
    print(f"# {'impl':20s} {'samples/s/rank':>15s} {'+-95%':>8s} {'total samples/s':>16s} {'efficiency':>10s} "
          f"{'vs ddp':>7s} {'vs horovod':>10s} {'#wrong':>6s}")
    rows = []
    for name in args.order:
        res = results[name]
        total = res.median * (1 if name == "single" else size)
        eff = total / (size * single.median) if single and name != "single" else float("nan")
        vs_ddp = res.median / ddp.median if ddp else float("nan")
        vs_hvd = res.median / hvd.median if hvd else float("nan")
        print(f"  {name:20s} {res.median:15.0f} {res.ci95:8.0f} {total:16.0f} {eff:10.2f} {vs_ddp:7.2f} "
              f"{vs_hvd:10.2f} {res.wrong:6d}")
        rows.append(dict(impl=name, samples_per_s_per_rank=res.median, ci95=res.ci95, total_samples_per_s=total,
                         efficiency=eff, vs_ddp=vs_ddp, vs_horovod=vs_hvd, wrong=res.wrong, rounds=res.per_rank_sps))
    print("# samples/s/rank: median over rounds; efficiency = total / (ranks x single); "
          "ratios are of medians from this run", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": size, "config": {k: v for k, v in vars(args).items() if not k.startswith("_")
                                                 and isinstance(v, (int, float, str, bool, type(None)))},
                       "results": rows}, f, indent=1)
        print(f"# wrote {args.json}", flush=True)


def _register():
    from ..cli import arguments, command

    command("bench train", "training throughput: our DistributedOptimizer vs Horovod and torch DDP, one run")(
        arguments(_configure)(main))


_register()
