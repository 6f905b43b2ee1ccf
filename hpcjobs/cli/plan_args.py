"""``hpcjobs plan``'s flags: the device and parameter counts it parses,
and the flags that only go together, checked before anything is measured."""

from __future__ import annotations

import sys

from . import plan_runs
from ..training.config import DEFAULT_WIDTH
from .args import UsageError


class Counts(list):
    """Device counts as given; ``ranged`` those that came from a range."""

    ranged: frozenset = frozenset()


def device_counts(text: str) -> Counts:
    """'1,8,64', '1-16' or '8-64:8' (low-high[:step]) -> sorted distinct
    counts (argparse type). Above one node a range keeps whole nodes only
    (:func:`whole_nodes`); a count listed alone is kept as given."""
    import argparse

    listed, ranged = set(), set()
    try:
        for part in text.split(","):
            span, _, step = part.strip().partition(":")
            lo, dash, hi = span.partition("-")
            if (dash and not hi) or (step and not dash):  # "12-" and "8:2": a range without its end
                raise ValueError
            lo_i, hi_i, step_i = int(lo), int(hi or lo), int(step or 1)
            if lo_i < 1 or hi_i < lo_i or step_i < 1 or (hi_i - lo_i) // step_i > 100_000:
                raise ValueError
            (ranged if dash else listed).update(range(lo_i, hi_i + 1, step_i))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,8,64 or 1-16 or 8-64:8 (positive, low-high), "
                                         f"got {text!r}") from None
    out = Counts(sorted(listed | ranged))
    out.ranged = frozenset(ranged - listed)
    return out


def whole_nodes(counts: Counts, per_node: int) -> list[int]:
    """``counts`` less the ranged ones that would leave a node part-filled."""
    return [p for p in counts if p not in counts.ranged or p <= per_node or p % per_node == 0]


def params_count(text: str) -> int:
    """'25.6M', '138e6', '1000' -> parameters (argparse type)."""
    import argparse

    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        value = -1
    if not 1 <= value < 1e13:
        raise argparse.ArgumentTypeError(f"expected a parameter count like 25.6M or 1000000, got {text!r}")
    return int(round(value))


def default_counts(per_node: int) -> Counts:
    """1, 2, 4, ... below a node, the node, then 2, 4, 8, ... nodes: to 256
    devices, or 2 nodes where a node has more than 128."""
    counts = [p for p in (1 << i for i in range(9)) if p < per_node] + [per_node]
    while counts[-1] * 2 <= max(256, 2 * per_node):
        counts.append(counts[-1] * 2)
    return Counts(counts)


def check_flags(args) -> None:
    """Refuses flags that would be ignored, then fills in the defaults:
    ``--devices-per-node``, a ``--cost-model``'s ranks per node (a
    one-node model's: its ranks; else 1), and ``--devices``, up to 256 devices, or a node where no
    network is given."""
    _shaping_flags(args)
    two_level, per_node = False, None
    if args.cost_model:
        two_level = plan_runs.cost_model(args.cost_model)[1] is not None
        per_node = plan_runs.cost_model_ranks_per_node(args.cost_model, two_level)
        if two_level and plan_runs.cost_model_source(args.cost_model) == "override":
            print(f"# plan: warning: --cost-model {args.cost_model} was measured with --ranks-per-node on one "
                  "machine: its link between nodes is shared memory, not a network", file=sys.stderr, flush=True)
    if args.devices_per_node is None:  # a one-node model: its ranks shared the node it measured
        args.devices_per_node = per_node or 1
    elif per_node == 1 and args.devices_per_node > 1:
        raise UsageError(f"--cost-model {args.cost_model} was measured with one rank per node: it has no link "
                         f"inside a node for --devices-per-node {args.devices_per_node}; run `hpcjobs model` with "
                         f"{args.devices_per_node} ranks per node (mpirun --map-by ppr:{args.devices_per_node}:node)")
    given = [f for f, v in (("--intra-bw", args.intra_bw), ("--intra-latency", args.intra_latency),
                            ("--inter-bw", args.inter_bw), ("--inter-latency", args.inter_latency),
                            ("--reduce-bw", args.reduce_bw)) if v is not None]
    if two_level and given:
        raise UsageError(f"--cost-model {args.cost_model} was measured across nodes: it gives both links, so "
                         f"{', '.join(given)} would be ignored; leave {_them(given)} out")
    inside = [f for f in given if f.startswith("--intra")] + (["--reduce-bw"] if args.reduce_bw else [])
    if args.cost_model and inside:
        raise UsageError(f"--cost-model {args.cost_model} gives the link inside a node and the cost of reducing: "
                         f"{', '.join(inside)} would be ignored; leave {_them(inside)} out")
    inside = [f for f in inside if f != "--reduce-bw"]
    if inside and args.devices_per_node == 1:
        raise UsageError(f"{', '.join(inside)}: the link between devices of a node, and --devices-per-node is 1: "
                         "give --devices-per-node")
    if args.inter_latency is not None and args.inter_bw is None:
        raise UsageError("--inter-latency is the network's, and no network is given: give --inter-bw too")
    if args.noise_scale is not None and not args.metrics:
        raise UsageError("--noise-scale scales the epochs to a target: give --metrics and --target-loss")
    measured = [f for f, v in (("--bytes-per-param", args.bytes_per_param),
                               ("--backward-share", args.backward_share)) if v is not None]
    if args.measure and measured:
        raise UsageError(f"--measure times the step and reads the gradients: {', '.join(measured)} would be "
                         f"ignored; leave {_them(measured)} out")
    for name, default in (("intra_latency", 5.0), ("inter_latency", 20.0), ("bytes_per_param", 4),
                          ("backward_share", 2 / 3)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.devices is None:
        args.devices = default_counts(args.devices_per_node)
        if not two_level and args.inter_bw is None:  # no network: one node's counts
            args.devices = Counts(p for p in args.devices if p <= args.devices_per_node)
            print(f"# plan: no network given (--inter-bw, or a --cost-model measured across nodes): one node, up "
                  f"to its {args.devices_per_node} device{'s' if args.devices_per_node > 1 else ''}", file=sys.stderr,
                  flush=True)  # (a bare plan had one row, silently)


def _shaping_flags(args) -> None:
    """Refuses the model's and the measurement's flags where nothing reads
    them (they had been taken and ignored), then fills in their defaults."""
    if args.params is not None:
        shaped = [f for f, v in (("--width", args.width), ("--image-size", args.image_size)) if v is not None]
        if shaped:
            raise UsageError(f"{', '.join(shaped)} shape{'s' if len(shaped) == 1 else ''} one of our models, and "
                             f"--params plans the gradient as vectors: give --model, or leave {_them(shaped)} out")
    elif args.width is not None and args.model not in ("mlp", "cnn1d"):
        raise UsageError(f"--width shapes mlp and cnn1d, not {args.model}")
    elif args.image_size is not None and not args.model.startswith("resnet"):
        raise UsageError(f"--image-size shapes the ResNets, not {args.model}")
    elif args.image_size is not None and not args.measure:  # a ResNet's parameters do not depend on it
        raise UsageError("--image-size sets the images --measure times the step on, and a ResNet's gradient is the "
                         "same at any size: give --measure, or leave it out")
    timing = [f for f, v in (("--threads", args.threads), ("--measure-steps", args.measure_steps)) if v is not None]
    if timing and not args.measure:
        raise UsageError(f"{', '.join(timing)} say{'s' if len(timing) == 1 else ''} how --measure times the step: "
                         f"give --model and --measure, or leave {_them(timing)} out")
    # the width `hpcjobs train --model` trains, so that a plan of its run plans its model
    args.width, args.image_size = args.width or DEFAULT_WIDTH.get(args.model), args.image_size or 224
    args.measure_steps = args.measure_steps or 10


def _them(flags: list) -> str:
    return "it" if len(flags) == 1 else "them"
