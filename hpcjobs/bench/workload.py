"""What ``hpcjobs bench train`` trains: the model, its fixed random batch
and its training step (plain, or under autocast with each library's
GradScaler recipe), the same for every implementation measured."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..runtime import autocast
from ..training.config import GPT_MODELS, IMAGE_MODELS
from ..training.gpt import lm_loss
from ..training.models import build_model

__all__ = ["Workload", "model", "data", "stepper", "flat_parameters", "reference_update", "update_error",
           "AVERAGED_WITHIN"]


@dataclass(frozen=True)
class Workload:
    """The model and batch every implementation trains."""

    model: str
    width: int
    batch_norm: bool
    input_size: int  # features per sample (mlp, cnn1d)
    image_size: int  # pixels per side (the ResNets: 3 x image_size x image_size)
    num_classes: int
    batch_size: int  # samples per rank per step
    fusion_bytes: int  # our bucket size
    lr: float
    seed: int
    # the GPTs (hpcjobs.training.gpt): None keeps the preset's value
    seq_len: int | None = None
    layers: int | None = None
    heads: int | None = None
    embed: int | None = None
    vocab: int | None = None
    amp: str = "none"  # mixed precision: none, bf16 (autocast) or fp16 (autocast and a GradScaler)
    same_buckets: bool = False  # DDP and Horovod fuse fusion_bytes too, rather than their defaults
    device: str = "cpu"  # where the model and its batch live: "cpu" or this rank's "cuda:N"

    def buckets(self) -> str:
        """Which bucket size each row uses, for the run's header."""
        mib = f"{self.fusion_bytes / 2**20:g} MiB"
        if self.same_buckets:
            return f"buckets: {mib} for every implementation (--same-buckets)"
        env = os.environ.get("HOROVOD_FUSION_THRESHOLD")
        hvd = (f"horovod and hvd-hpcjobs {int(env) / 2**20:g} MiB (HOROVOD_FUSION_THRESHOLD)" if env else
               "horovod 64 MiB (its default), hvd-hpcjobs 1 MiB (its default)")
        return f"buckets: ours {mib} (--fusion-bytes), ddp and ddp-hpcjobs 25 MiB (DDP's default), {hvd}"

    def gpt_config(self):
        """The GPT's :class:`~hpcjobs.training.gpt.GPTConfig` (the preset,
        with the fields set here)."""
        from ..training.gpt import PRESETS

        fields = {k: getattr(self, k) for k in ("seq_len", "layers", "heads", "embed", "vocab")}
        return replace(PRESETS[self.model], **{k: v for k, v in fields.items() if v is not None})


def model(w: Workload):
    """A fresh model of ``w``'s kind (its initial weights come from torch's
    global generator: seed it first)."""
    if w.model in GPT_MODELS:
        from ..training.gpt import GPT

        return GPT(w.gpt_config())
    if w.model in IMAGE_MODELS:
        from ..training import resnet

        return getattr(resnet, w.model)(num_classes=w.num_classes)
    return build_model(w.model, (w.input_size,), w.num_classes, width=w.width, batch_norm=w.batch_norm)


def data(w: Workload, g: torch.Generator):
    """This rank's fixed batch, on its device: random images, features or tokens."""
    if w.model in GPT_MODELS:
        cfg = w.gpt_config()
        tokens = torch.randint(0, cfg.vocab, (w.batch_size, cfg.seq_len + 1), generator=g).to(w.device)
        return tokens[:, :-1], tokens[:, 1:]  # next-token prediction
    shape = (3, w.image_size, w.image_size) if w.model in IMAGE_MODELS else (w.input_size,)
    x = torch.randn(w.batch_size, *shape, generator=g)
    return x.to(w.device), torch.randint(0, w.num_classes, (w.batch_size,), generator=g).to(w.device)


def stepper(w: Workload, net, x, y):
    """``make(opt, sync)``: a training step of ``net`` with ``opt``.

    ``sync`` says how ``opt`` averages gradients, which matters only for
    fp16's GradScaler, whose unscale must see the averaged gradients: None
    (``opt.step()`` needs nothing first: one process, or DDP that averages
    in backward), ``("ours", inner)`` (our DistributedOptimizer:
    synchronize, then unscale and step the wrapped optimizer) or
    ``"horovod"`` (Horovod's recipe: synchronize, unscale, step under
    ``skip_synchronize()``)."""
    lm = w.model in GPT_MODELS

    def loss():
        with autocast(w.amp, torch.device(w.device)):
            out = net(x)
            return lm_loss(out, y) if lm else F.cross_entropy(out, y)

    def make(opt, sync=None):
        if w.amp != "fp16":
            def step():
                opt.zero_grad()
                loss().backward()
                opt.step()
            return step
        scaler = torch.amp.GradScaler(torch.device(w.device).type)

        def scaled_step():
            opt.zero_grad()
            scaler.scale(loss()).backward()
            if sync is None:
                scaler.step(opt)
            elif sync == "horovod":
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                opt.synchronize()
                scaler.unscale_(sync[1])
                scaler.step(sync[1])
            scaler.update()
        return scaled_step
    return make


def flat_parameters(net) -> torch.Tensor:
    """``net``'s parameters, flat, in float64 on the CPU."""
    return torch.cat([p.detach().reshape(-1).double() for p in net.parameters()]).cpu()


def reference_update(w: Workload, net, x, y, comm) -> tuple[torch.Tensor, float] | None:
    """The first step every implementation measured ought to take from ``net``'s
    weights: the ranks' gradients averaged with ``MPI_Allreduce`` (in float64),
    then SGD, whose momentum buffer starts as the gradient. Returns ``net``'s
    parameters after it (flat, float32, on the CPU) and the step's length
    (collective); None under fp16, whose GradScaler may skip a step."""
    if w.amp == "fp16":
        return None
    import types

    import numpy as np
    from mpi4py import MPI

    sgd = torch.optim.SGD(net.parameters(), lr=w.lr, momentum=0.9)

    def step():  # what stepper() drives as the optimizer: average, then SGD's step
        for p in net.parameters():
            g = np.zeros(p.numel()) if p.grad is None else p.grad.detach().reshape(-1).double().cpu().numpy()
            comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            if p.grad is not None:
                p.grad.copy_(torch.from_numpy(g / comm.Get_size()).reshape(p.shape))
        sgd.step()

    before = flat_parameters(net)
    stepper(w, net, x, y)(types.SimpleNamespace(zero_grad=sgd.zero_grad, step=step))()  # (no cycle: freed now)
    after = flat_parameters(net)
    return after.float(), float(torch.linalg.vector_norm(after - before))


AVERAGED_WITHIN = 0.05  # an update_error above this is wrong (bf16's rounding gives about 0.003; a sum, P - 1)


def update_error(net, reference, comm) -> float:
    """How far ``net``'s weights, one step in, land from the reference's
    (:func:`reference_update`), over the length of the reference's step: the
    max over ranks (collective; inf where not finite on some rank). About 0
    where the step averaged the ranks' gradients; P - 1 where it summed them."""
    from mpi4py import MPI

    after, length = reference
    error = float(torch.linalg.vector_norm(flat_parameters(net) - after.double())) / max(length, 1e-300)
    return comm.allreduce(error if math.isfinite(error) else math.inf, op=MPI.MAX)
