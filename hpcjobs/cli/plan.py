"""``hpcjobs plan``: iteration time, samples/s, scaling efficiency and time
to a target loss at each device count, from measurements, with the fastest
count and the cheapest within 10% of it (:mod:`hpcjobs.planner`). Runs alone
(no mpirun)::

    hpcjobs plan --params 25.6M --throughput 400 --batch-per-device 64 --devices-per-node 8 \\
        --intra-bw 150 --inter-bw 100 --devices 1,8,64,256
    hpcjobs plan --model mlp --width 2048 --measure --cost-model model.json --devices-per-node 4 \\
        --devices 1-4 --metrics run.jsonl --target-loss 0.3 --json plan.json --plot plan.png
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time

from .._files import atomic_write, finite
from .._plots import MISSING, pyplot
from ..convergence import LOSS_MODELS
from ..training.config import AMP
from . import plan_runs
from .args import (UsageError, check_amp, check_outputs, nonnegative_float, parse_bytes, positive_float, positive_int,
                   usage)
from .plan_args import check_flags, device_counts, params_count, whole_nodes
from .train import compression_spec

MODEL_NAMES = ("mlp", "cnn1d", "resnet18", "resnet50", "gpt-mini", "gpt2-small")  # training.config's, no torch


def configure(p) -> None:
    from ..collectives.costs import COSTS

    g = p.add_argument_group("the model")
    m = g.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", choices=MODEL_NAMES, help="one of ours: its real tensors (and --measure)")
    m.add_argument("--params", type=params_count, metavar="N", help="parameters (25.6M, 138e6, ...)")
    g.add_argument("--width", type=positive_int, help="mlp/cnn1d width (default train's: 256 and 32)")
    g.add_argument("--image-size", type=positive_int, help="ResNet input side --measure times (default 224)")
    g.add_argument("--bytes-per-param", type=positive_int, help="gradient bytes per parameter (4; 2: fp16)")
    g = p.add_argument_group("one device")
    t = g.add_mutually_exclusive_group(required=True)
    t.add_argument("--throughput", type=positive_float, metavar="X",
                   help="samples/s of one device at --batch-per-device (its whole step)")
    t.add_argument("--measure", action="store_true",
                   help="time --model's step here (forward, backward, update, when each gradient is ready)")
    g.add_argument("--batch-per-device", type=positive_int, default=64, metavar="B", help="default %(default)s")
    g.add_argument("--backward-share", type=positive_float,
                   help="with --throughput: backward's share of the step, over which gradients arrive (2/3)")
    g.add_argument("--measure-steps", type=positive_int, help="timed steps for --measure (10)")
    g.add_argument("--threads", type=positive_int,
                   help="torch threads for --measure (default: the cores this process may run on)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where --measure times the step (cuda: the current GPU, each gradient's ready time from "
                        "a CUDA event) (default cpu)")
    g.add_argument("--amp", choices=AMP, default="none",
                   help="mixed precision of the step --measure times: bf16, fp16 (GPUs) (default none)")
    g = p.add_argument_group("the machines (or --cost-model)")
    g.add_argument("--devices-per-node", type=positive_int, metavar="G",
                   help="default 1, or the ranks per node a --cost-model was measured with")
    g.add_argument("--intra-bw", type=positive_float, metavar="GB/s", help="between devices of a node, one way")
    g.add_argument("--intra-latency", type=nonnegative_float, metavar="us", help="default 5")
    g.add_argument("--inter-bw", type=positive_float, metavar="Gbit/s", help="each node's network link")
    g.add_argument("--inter-latency", type=nonnegative_float, metavar="us", help="default 20")
    g.add_argument("--reduce-bw", type=positive_float, metavar="GB/s",
                   help="bytes reduced per second (default: free, as on GPUs)")
    g.add_argument("--cost-model", metavar="PATH",
                   help="model.json from `hpcjobs model` (measured across nodes: both links) instead")
    g = p.add_argument_group("the job")
    g.add_argument("--devices", type=device_counts,
                   help="device counts: 1,8,64,256 or 1-16 or 8-64:8; above one node a range keeps whole nodes "
                        "(default: 1,2,4,... up to a node, then 2,4,8,... nodes, to 256 devices or 2 nodes; "
                        "one node's without a network)")
    g.add_argument("--algorithm", choices=("auto",) + tuple(n for n in COSTS if n != "ring_pipelined"),
                   default="auto", help="auto: the cheapest with a formula for the layout (default)")
    g.add_argument("--no-overlap", action="store_true", help="reduce after backward, not during it")
    g.add_argument("--compression", type=compression_spec, metavar="NAME[:PARAM]",
                   help="e.g. fp16, topk:0.01: its payload's bytes; with --measure also its codec time and "
                        "its dtype's reduction cost, timed here")
    g.add_argument("--fusion-bytes", type=parse_bytes, default=1 << 20, help="bucket size (default 1M, train's)")
    g.add_argument("--metrics", metavar="RUN.jsonl", help="a train --metrics file: the loss curve to fit")
    g.add_argument("--target-loss", type=positive_float, metavar="L", help="with --metrics: time to this loss")
    g.add_argument("--loss-model", choices=LOSS_MODELS, default="optimus",
                   help="the curve fitted to --metrics: optimus, 1/(b0*k + b1) + b2, or power, a*(k + b)^-alpha "
                        "(from the 2nd epoch; for losses falling faster than 1/k) (default: %(default)s)")
    g.add_argument("--noise-scale", type=positive_float, metavar="SAMPLES",
                   help="gradient noise scale (default: the metrics' noise_scale, from train --noise-scale)")
    g.add_argument("--runs", metavar="A.jsonl,B.jsonl",
                   help="train --metrics files at different device counts: the black-box fit, side by side")
    g.add_argument("--against", metavar="C.jsonl,D.jsonl",
                   help="train --metrics files to hold the predictions against, at device counts --devices plans: "
                        "measured and predicted step, and the time waited for reductions against the exposed "
                        "communication")
    p.add_argument("--json", metavar="PATH", help="write the rows and the recommendation as JSON")
    p.add_argument("--plot", metavar="PATH", help="throughput and time to target against devices (png)")


def _network(args):
    from ..planner import Linear, Network

    gamma = 1e-9 / args.reduce_bw if args.reduce_bw else 0.0
    if args.cost_model:
        from ..machine import costing

        net, node = plan_runs.cost_model(args.cost_model)  # (check_flags read it already: it reads)
        if node is None:  # measured inside one node: the network from the flags, if any
            inter = Linear(args.inter_latency * 1e-6, 8e-9 / args.inter_bw, gamma) if args.inter_bw else None
            return Network(args.devices_per_node, costing(net), inter)
        return Network(args.devices_per_node, costing(node), costing(net, link=True))
    if args.devices_per_node > 1 and not args.intra_bw:
        raise UsageError("give --intra-bw GB/s for devices that share a node (or --cost-model)")
    node = Linear(args.intra_latency * 1e-6, 1e-9 / args.intra_bw if args.intra_bw else 0.0, gamma)
    inter = Linear(args.inter_latency * 1e-6, 8e-9 / args.inter_bw, gamma) if args.inter_bw else None
    return Network(args.devices_per_node, node, inter)


def _workload(args):
    from ..planner import Workload, flat_shapes

    if not args.model:
        return Workload.from_throughput(flat_shapes(args.params), args.throughput, args.batch_per_device,
                                        args.bytes_per_param, args.backward_share), f"{args.params} parameters"
    import torch

    from ..bench.workload import Workload as Bench, model

    device = "cpu"
    if args.measure and args.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False)")
        device = f"cuda:{torch.cuda.current_device()}"
    if args.measure:
        check_amp(args.amp, torch.device(device))
    w = Bench(model=args.model, width=args.width, batch_norm=False, input_size=40, image_size=args.image_size,
              num_classes=10 if args.model in ("mlp", "cnn1d") else 1000, batch_size=args.batch_per_device,
              fusion_bytes=args.fusion_bytes, lr=0.01, seed=0, device=device, amp=args.amp)
    if args.measure:
        from ..bench.profile import profile_step
        from ..runtime import set_threads

        set_threads(args.threads, None)  # default: this process's cores; and denormals flushed, as train does
        on = device + ("" if args.amp == "none" else f", {args.amp}")
        print(f"# plan: measuring {args.model} at batch {args.batch_per_device} on {on} ({args.measure_steps} "
              "steps)", file=sys.stderr, flush=True)
        step = profile_step(w, args.measure_steps)
        return step, f"{args.model}, {sum(math.prod(t[2]) for t in step.tensors)} parameters, measured on {on}"
    shapes = [tuple(q.shape) for q in reversed(list(model(w).parameters())) if q.requires_grad]
    return (Workload.from_throughput(shapes, args.throughput, args.batch_per_device, args.bytes_per_param,
                                     args.backward_share), f"{args.model}, {sum(map(math.prod, shapes))} parameters")


def _payload(spec: str | None, measure: bool, model: str | None):
    """The compressor's payload bytes (from compressing a tensor of each
    bucket's shape); with ``measure``, also its codec time and its cost per
    byte reduced, timed here. Without ``model`` (``--params``: the gradient
    as vectors), a compressor that leaves vectors whole is refused."""
    if not spec:
        return None
    import timeit

    import torch

    from ..collectives._buffers import as_flat, reducer
    from ..compression import make_compressor
    from ..planner import Payload

    comp, sizes, times = make_compressor(spec, seed=0), {}, {}

    def compressed(shape: tuple):
        return comp.compress(torch.randn(*shape), name="plan", step=0)

    def nbytes(n: int, shape: tuple) -> tuple:  # each part's: a summable payload's are reduced one by one
        if (n, shape) not in sizes:
            payload, _ = compressed(shape)
            parts = payload if isinstance(payload, tuple) else (payload,)
            sizes[(n, shape)] = tuple(x.numel() * x.element_size() for x in parts)
        return sizes[(n, shape)]

    def codec_s(n: int, shape: tuple, P: int) -> float:  # compress, decompress, add: medians of 3
        if (n, shape) not in times:
            x, spent = torch.randn(*shape), []
            for _ in range(3):
                t0 = time.perf_counter()
                payload, ctx = comp.compress(x, name="plan", step=0)
                t1 = time.perf_counter()
                out = comp.decompress(payload, ctx)
                t2 = time.perf_counter()
                out.add_(x)
                spent.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
            times[(n, shape)] = [statistics.median(s) for s in zip(*spent)]
        c, d, a = times[(n, shape)]
        # an allgather's payloads are each decompressed and summed on every device (compressed_allreduce)
        return c + d if comp.summable else c + P * d + (P - 1) * a

    if not model and sum(nbytes(1 << 16, (1 << 16,))) >= 4 << 16:
        raise UsageError(f"--compression {spec} sends vectors as they are (it compresses matrices), and --params "
                         "plans the gradient as vectors: give --model")
    per_byte = None
    if measure and comp.summable:  # the payload's dtype reduced here, in place, as our allreduce does
        payload, _ = compressed((1 << 18,))
        flat = as_flat(payload[0] if isinstance(payload, tuple) else payload)  # bfloat16: its bits, as ours reduce it
        a, b, add = flat.data.copy(), flat.data.copy(), reducer("sum", flat.dtype)
        per_byte = statistics.median(timeit.repeat(lambda: add(a, b), number=1, repeat=5)) / a.nbytes
    payload, _ = compressed((1 << 10,))
    parts = len(payload) if isinstance(payload, tuple) else 1
    return Payload(nbytes, comp.summable, comp.fusable, codec_s if measure else None, per_byte, parts)


def _reduced(spec: str | None) -> bool:
    """Whether the gradient (``spec``'s payload) goes through an allreduce,
    which ``--algorithm`` names, or through an allgather."""
    if not spec:
        return True
    from ..compression import make_compressor

    return make_compressor(spec, seed=0).summable


def predict(args) -> tuple:
    """Every row ``args`` (plan's flags) asks for: checks the flags, costs
    each layout, measures or takes the one device's step, and returns
    ``(rows, workload, net, what, target, points, checks)``
    (``checks``: the ``--against`` runs beside their rows)."""
    from ..planner import allreduce_s, plan

    if args.compression == "none":  # train's spelling of no compression: plan the same run
        args.compression = None
    if args.measure and not args.model:
        raise UsageError("--measure times one of our models: give --model")
    if (args.device != "cpu" or args.amp != "none") and not args.measure:
        raise UsageError("--device and --amp say how --measure times the step: give --model and --measure")
    if args.compression and args.device == "cuda":
        raise UsageError("--compression times its codec on the CPU: with --device cuda give --throughput instead")
    if bool(args.metrics) != bool(args.target_loss):
        raise UsageError("--metrics and --target-loss go together")
    if args.loss_model != "optimus" and not args.metrics:
        raise UsageError("--loss-model picks the curve fitted to --metrics: give --metrics and --target-loss")
    check_outputs(None, [("--json", args.json, False), ("--plot", args.plot, False)])
    _check_plot_format(args.plot)
    with usage(ValueError):
        check_flags(args)
        net = _network(args)
        devices = whole_nodes(args.devices, args.devices_per_node)
        if not devices:
            raise UsageError(f"--devices: no count fills whole nodes of {args.devices_per_node} "
                             "(--devices-per-node)")
        if len(devices) < len(args.devices):  # a range's: said, and the JSON's inputs list what was planned
            print(f"# plan: --devices: left out {', '.join(str(p) for p in args.devices if p not in devices)} "
                  f"(not whole nodes of {args.devices_per_node})", file=sys.stderr)
            args.devices = devices
        if args.algorithm != "auto" and not _reduced(args.compression):  # (train takes it and uses it not)
            print(f"# plan: --compression {args.compression} sends through an allgather: --algorithm "
                  f"{args.algorithm} is not used, in this plan or in train", file=sys.stderr)
        if _reduced(args.compression):  # a gathered payload never runs the algorithm: no layout of its to check
            for P in devices:  # every layout costed before anything is measured
                allreduce_s(1, P, net, args.algorithm)
        runs = plan_runs.read_against(args.against, devices, args.batch_per_device)
        target = args.metrics and plan_runs.target(args.metrics, args.target_loss, args.loss_model, args.noise_scale)
        workload, what = _workload(args)
        fitted, points = plan_runs.fit(args.runs, args.batch_per_device)
        rows = plan(workload, devices, net, args.algorithm, not args.no_overlap, args.fusion_bytes,
                    _payload(args.compression, args.measure, args.model), target or None, fitted)
        checks = plan_runs.against(runs, rows)
    return rows, workload, net, what, target, points, checks


def run(args) -> int:
    from ..planner import recommend

    rows, workload, net, what, target, points, checks = predict(args)
    best = recommend(rows)
    print(f"# plan: {what}, batch {workload.batch}/device, one device {workload.batch / workload.step_s:.4g} samples/s "
          f"(forward {workload.forward_s * 1e3:.3g} ms, backward {workload.backward_s * 1e3:.3g} ms, update "
          f"{workload.update_s * 1e3:.3g} ms), {workload.grad_bytes / 2**20:.1f} MiB of gradients, "
          f"{net.devices_per_node} device(s)/node, overlap {'off' if args.no_overlap else 'on'}"
          + (f", compression {args.compression}" if args.compression else ""))
    if points:
        print("# black-box fit from runs at (devices, s/iteration): "
              + ", ".join(f"({p}, {t:.4g})" for p, t in points))
    if target:
        print(f"# target loss {target.loss}: {target.epochs:.3g} epochs [{target.low:.3g}, {target.high:.3g}] at "
              f"batch {target.base_batch} ({plan_runs.FITS[args.loss_model]} fit of {args.metrics}); noise scale "
              + (f"{target.noise_scale:.4g} samples" if target.noise_scale else "unknown: epochs taken as batch-free"))
    if target and target.noise_scale:
        print(f"# the noise scale is the critical batch (McCandlish et al.): {target.noise_scale:.4g} samples = "
              f"{target.noise_scale / workload.batch:.3g} devices at {workload.batch}/device; beyond it each doubling "
              "cuts the steps by a quarter or less and adds half or more to the samples")
    print(table(rows))
    print(f"# fastest: {_devices(best['fastest'])}; cheapest within 10% of it: {_devices(best['cheapest'])} "
          f"(by {best['by']})")
    if checks:
        print("# against measured runs, per step (median over epochs 2 on): error = predicted / measured - 1; "
              "waited for reductions (the rank that waited longest) against the exposed communication, the rest "
              "of the step against one device's compute")
        print(plan_runs.table(checks))
    if args.json:
        with atomic_write(args.json) as f:
            json.dump(finite({"inputs": {k: v for k, v in vars(args).items() if not k.startswith("_")
                                  and isinstance(v, (int, float, str, bool, list, type(None)))},
                       "one_device": {"batch": workload.batch, "forward_s": workload.forward_s,
                                      "backward_s": workload.backward_s, "update_s": workload.update_s,
                                      "grad_bytes": workload.grad_bytes},
                       "rows": [{**r, **{k: r.get(k) for k in OPTIONAL_KEYS}} for r in rows],  # every plan's keys
                       "recommendation": best, "runs": points, "against": checks,
                       "target": None if not target else {**dataclasses.asdict(target), "fit": args.loss_model,
                                                          "metrics": args.metrics}}), f, indent=1, allow_nan=False)
    if args.plot:
        _plot(rows, args.plot, what)
    return 0


# a row's keys that only some plans fill (a target, measured runs): null in the JSON where not, so that a tool
# reading row["device_hours"] finds the key in every plan
OPTIONAL_KEYS = ("fit_iteration_s", "epochs", "epochs_low", "epochs_high", "time_to_target_s", "device_hours")


def _devices(n: int) -> str:
    return f"{n} device{'s' * (n != 1)}"


def table(rows: list[dict]) -> str:
    cols = [("devices", "devices", "{}"), ("algorithm", "algorithm", "{}"), ("iteration_s", "iter ms", "{:.4g}"),
            ("fit_iteration_s", "fit ms", "{:.4g}"), ("exposed_s", "exposed ms", "{:.3g}"),
            ("samples_per_s", "samples/s", "{:.4g}"), ("efficiency", "efficiency", "{:.3f}"),
            ("epochs", "epochs", "{:.3g}"), ("time_to_target_s", "to target s", "{:.4g}"),
            ("device_hours", "device-h", "{:.3g}")]
    cols = [c for c in cols if c[0] in rows[0]]
    ms = {"iteration_s", "fit_iteration_s", "exposed_s"}
    def cell(r, key, fmt):
        if key == "algorithm" and len(r.get("algorithms", ())) > 1:  # auto took more than one: most bytes first
            return "+".join(sorted(r["algorithms"], key=r["algorithms"].get, reverse=True))
        return fmt.format(r[key] * (1e3 if key in ms else 1))

    cells = [[c[1] for c in cols]] + [[cell(r, c[0], c[2]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("| " + " | ".join(v.rjust(w) for v, w in zip(row, widths)) + " |" for row in cells)


def _check_plot_format(path: str | None) -> None:
    """A --plot path matplotlib can write, before anything is measured: an
    unknown extension had failed with a traceback after the plan was printed,
    and none at all wrote PATH.png, not PATH."""
    plt = path and pyplot()
    if not plt:
        return  # no --plot; or no matplotlib, which _plot says
    kinds = plt.gcf().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix not in kinds:
        raise UsageError(f"--plot {path}: name a file matplotlib writes, ending in one of "
                         f".{', .'.join(sorted(kinds))}" + (f" (not .{suffix})" if suffix else ""))


def _plot(rows: list[dict], path: str, what: str) -> None:
    plt = pyplot()
    if plt is None:
        print(f"# plot: {MISSING}", file=sys.stderr)
        return
    P = [r["devices"] for r in rows]
    fig, axes = plt.subplots(1, 2 if "time_to_target_s" in rows[0] else 1, figsize=(10, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(P, [r["samples_per_s"] for r in rows], "o-", label="predicted")
    ax.plot(P, [r["samples_per_s"] / r["efficiency"] for r in rows], "--", label="linear (efficiency 1)")
    ax.set(xscale="log", yscale="log", xlabel="devices", ylabel="samples/s", title=what)
    ax.legend()
    if "time_to_target_s" in rows[0]:
        ax = axes[0][1]
        ax.plot(P, [r["time_to_target_s"] / 3600 for r in rows], "o-")
        ax.set(xscale="log", yscale="log", xlabel="devices", ylabel="hours to target loss")
    for a in axes[0]:  # after every set(xscale=...), which puts back the log scale's own ticks
        a.set_xticks(P, [str(p) for p in P], minor=False)
        a.minorticks_off()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
