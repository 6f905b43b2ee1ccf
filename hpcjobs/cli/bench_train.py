"""``hpcjobs bench train``: training throughput of our optimizer against
Horovod's ``DistributedOptimizer`` and torch DDP, same model, same run
(:mod:`hpcjobs.bench.train`).

    mpirun -n 2 hpcjobs bench train --model mlp --width 1024 --batch-size 64
"""

from __future__ import annotations

import json

from .._files import atomic_write
from ..bench.names import TRAIN_IMPLS
from ..runtime import DEVICES
from ..training.config import AMP, GPT_MODELS, IMAGE_MODELS, MIN_IMAGE_SIZE, MODELS
from .args import (check_amp, check_outputs, comma_list, dataclass_values, parse_bytes, positive_float, positive_int,
                   seed_int, usage)


def configure(p) -> None:
    p.add_argument("--impl", default=",".join(TRAIN_IMPLS),
                   help="comma-separated: single, ours:<algorithm>[+<compression>][/thread|/none], ddp, horovod, "
                        "ddp-hpcjobs (DDP on the hpcjobs torch.distributed backend), hvd-hpcjobs (our "
                        "Horovod-compatible API) "
                        f"(default: {','.join(TRAIN_IMPLS)})")
    p.add_argument("--model", choices=MODELS + IMAGE_MODELS + GPT_MODELS, default="mlp",
                   help="default: %(default)s; resnet18/resnet50 train on random images (--image-size), "
                        "gpt-mini (10.8M parameters) and gpt2-small (124M) on random tokens")
    p.add_argument("--image-size", type=positive_int,
                   help=f"pixels per side for the ResNets (default 224; at least {MIN_IMAGE_SIZE})")
    g = p.add_argument_group("GPT shape (default: the preset's)")
    g.add_argument("--seq-len", type=positive_int, help="tokens per sequence (gpt-mini 256, gpt2-small 1024)")
    g.add_argument("--layers", type=positive_int, help="transformer blocks (6, 12)")
    g.add_argument("--heads", type=positive_int, help="attention heads (6, 12)")
    g.add_argument("--embed", type=positive_int, help="model width (384, 768); a multiple of --heads")
    g.add_argument("--vocab", type=positive_int, help="vocabulary (256, 50257)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: this rank's GPU (by local rank) when every rank sees one, else the CPU; cuda: fail "
                        "without one. On GPUs ddp runs on NCCL (one GPU per rank) (default: %(default)s)")
    p.add_argument("--amp", choices=AMP, default="none",
                   help="mixed precision: bf16 (autocast); fp16 (autocast and a GradScaler) is for GPUs and refused "
                        "on CPUs (default none)")
    p.add_argument("--width", type=positive_int, help="mlp/cnn1d: hidden units / channels (default 1024)")
    p.add_argument("--batch-norm", action="store_true", help="mlp/cnn1d: BatchNorm after each hidden layer")
    p.add_argument("--input-size", type=positive_int, help="mlp/cnn1d: features per sample (MNIST-1D: 40, the "
                   "default)")
    p.add_argument("--num-classes", type=positive_int,
                   help="classes of the MLP and ResNets (default 10; the GPTs: --vocab)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--num-warmup-batches", type=positive_int, default=5, help="default: %(default)s")
    p.add_argument("--num-batches-per-iter", type=positive_int, default=5, help="default: %(default)s")
    p.add_argument("--num-iters", type=positive_int, default=10, help="timed rounds (default 10)")
    p.add_argument("--fusion-bytes", type=parse_bytes, default=1 << 20, help="our bucket size (default 1M)")
    p.add_argument("--same-buckets", action="store_true",
                   help="DDP and Horovod fuse --fusion-bytes too (default: theirs, 25 MiB and 64 MiB)")
    p.add_argument("--lr", type=positive_float, default=0.01)
    p.add_argument("--seed", type=seed_int, default=0, help="the model's initial weights and the data (default 0)")
    p.add_argument("--threads", type=positive_int, help="torch threads per rank (default: this rank's cores)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rank 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def run(args) -> int:
    from ..bench.train import Workload, bench_train, check_impl, parameters, table, unavailable
    from ..comm import print0, private
    from ..runtime import pick_device, set_threads

    comm = private()
    size = comm.Get_size()
    names = comma_list(args.impl)
    with usage():
        device = pick_device(args.device, comm)
    check_amp(args.amp, device)
    with usage():
        for n in names:
            check_impl(n)
        if args.model in IMAGE_MODELS and (args.image_size or 224) < MIN_IMAGE_SIZE:
            raise ValueError(f"--image-size {args.image_size}: {args.model} needs images of at least "
                             f"{MIN_IMAGE_SIZE}x{MIN_IMAGE_SIZE}")
        gpt_flags = [f for f in ("seq_len", "layers", "heads", "embed", "vocab") if getattr(args, f) is not None]
        if gpt_flags and args.model not in GPT_MODELS:
            raise ValueError(f"--{gpt_flags[0].replace('_', '-')} shapes the GPTs ({', '.join(GPT_MODELS)}), "
                             f"not {args.model}")
        # flags that shape another kind of model, ignored by this one
        small = [f for f in ("width", "input_size", "batch_norm") if getattr(args, f)]
        if small and args.model not in MODELS:
            raise ValueError(f"--{small[0].replace('_', '-')} shapes {' and '.join(MODELS)}, not {args.model}")
        if args.num_classes is not None and args.model in GPT_MODELS:
            raise ValueError(f"--num-classes shapes the classifiers, not {args.model} (its outputs: --vocab)")
        if args.image_size is not None and args.model not in IMAGE_MODELS:
            raise ValueError(f"--image-size shapes the ResNets ({', '.join(IMAGE_MODELS)}), not {args.model}")
        if args.batch_size == 1 and (args.model in IMAGE_MODELS or args.model == "mlp" and args.batch_norm):
            raise ValueError(f"--batch-size 1: {args.model} normalizes over the batch, and one sample gives "
                             "BatchNorm one value per channel (a traceback, before; as train refuses); give 2 or more")
    args.width, args.input_size, args.image_size = args.width or 1024, args.input_size or 40, args.image_size or 224
    args.num_classes = args.num_classes or 10
    check_outputs(comm, [("--json", args.json, False)])
    threads = set_threads(args.threads, comm)
    skipped = unavailable(names, comm, str(device))
    names = [n for n in names if n not in skipped]
    w = Workload(**{**dataclass_values(Workload, args), "device": str(device)})
    with usage():
        nparams = parameters(w)  # checks the GPT's shape
    if w.model in GPT_MODELS:
        c = w.gpt_config()
        shape = (f"({c.layers} layers, {c.heads} heads, {c.embed} wide, vocabulary {c.vocab}; a sample is a "
                 f"sequence of {c.seq_len} tokens)")
    else:
        shape = f"at {w.image_size}x{w.image_size}" if w.model in IMAGE_MODELS else f"width {w.width}"
    if w.amp != "none":
        shape += f", autocast to {w.amp}"
    print0(f"# bench train: {w.model} {shape} ({nparams} parameters, {4 * nparams / 2**20:.1f} MiB "
           f"of fp32 gradients), batch {w.batch_size}/rank, {size} ranks on {device}, {threads} torch thread(s)/rank, "
           f"{args.num_iters} rounds x {args.num_batches_per_iter} steps")
    print0(f"# {w.buckets()}")
    for n, why in skipped.items():
        print0(f"# {n}: skipped ({why})")
    progress = (lambda done: print0(f"# round {done}/{args.num_iters}")) if args.progress else None
    results = bench_train(comm, names, w, args.num_warmup_batches, args.num_batches_per_iter, args.num_iters,
                          progress)
    lines, rows = table(results, size, [n for n in names if n in results])
    if comm.Get_rank() == 0:
        print("\n".join(lines), flush=True)
        if args.json:
            config = {k: v for k, v in vars(args).items()
                      if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None)))}
            with atomic_write(args.json) as f:
                json.dump({"ranks": size, "config": config, "results": rows}, f, indent=1)
            print(f"# wrote {args.json}", flush=True)
    return 1 if any(r.wrong for r in results.values()) else 0
