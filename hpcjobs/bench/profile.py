"""One device's training step, timed in parts for the planner
(``hpcjobs plan --measure``): forward, backward and the optimizer's update,
and when, during backward, each parameter's gradient is ready (a
``post_accumulate_grad`` hook on every parameter), averaged over steps. On
a GPU the hook records a CUDA event, read once backward is done: waiting
for the device in every hook would leave it idle while the host queues the
next kernels, and time a slower backward than training runs."""

from __future__ import annotations

import statistics
import time

import torch

from ..runtime import autocast
from ..training.config import GPT_MODELS
from ..training.gpt import lm_loss
from .workload import Workload, data, model

__all__ = ["profile_step"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def profile_step(w: Workload, steps: int = 10, warmup: int = 3, progress=None):
    """Time ``steps`` training steps of ``w`` (SGD with momentum, after
    ``warmup`` untimed ones) and return a :class:`hpcjobs.planner.Workload`:
    median forward, backward and update seconds, and each gradient's bytes,
    shape and median ready time as a fraction of backward, in the order they
    were ready."""
    from ..planner import Workload as Step

    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    torch.manual_seed(w.seed)
    net = model(w).to(w.device)
    x, y = data(w, torch.Generator().manual_seed(w.seed))
    opt = torch.optim.SGD(net.parameters(), lr=w.lr, momentum=0.9)
    params = [p for p in net.parameters() if p.requires_grad]
    ready: dict[int, float] = {}
    mark = [0.0]
    cuda = w.device.startswith("cuda")
    events: dict[int, object] = {}
    begin = torch.cuda.Event(enable_timing=True) if cuda else None

    def hook(p):
        if cuda:  # on the stream the gradient was made on
            events[id(p)] = torch.cuda.Event(enable_timing=True)
            events[id(p)].record()
        else:
            ready[id(p)] = time.perf_counter() - mark[0]

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    scaler = torch.amp.GradScaler(torch.device(w.device).type) if w.amp == "fp16" else None  # as training does
    lm = w.model in GPT_MODELS
    times, fractions = [], {id(p): [] for p in params}
    try:
        for i in range(warmup + steps):
            opt.zero_grad()
            _sync(w.device)
            t0 = time.perf_counter()
            with autocast(w.amp, torch.device(w.device)):
                out = net(x)
                loss = lm_loss(out, y) if lm else torch.nn.functional.cross_entropy(out, y)
            _sync(w.device)
            ready.clear()
            events.clear()
            t1 = mark[0] = time.perf_counter()
            if cuda:  # on w.device's stream, where its hooks record theirs
                begin.record(torch.cuda.current_stream(torch.device(w.device)))
            (scaler.scale(loss) if scaler else loss).backward()
            _sync(w.device)
            t2 = time.perf_counter()
            if cuda:  # the device was idle at begin, so its clock and the host's start together
                ready.update((k, begin.elapsed_time(e) / 1e3) for k, e in events.items())
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            _sync(w.device)
            t3 = time.perf_counter()
            if i >= warmup:
                times.append((t1 - t0, t2 - t1, t3 - t2))
                for p in params:
                    fractions[id(p)].append(min(1.0, ready.get(id(p), t2 - t1) / (t2 - t1)))
            if progress:
                progress(i + 1, warmup + steps)
    finally:
        for h in handles:
            h.remove()
    # statistics.median, as every benchmark here: torch's median of an even count is the lower middle value
    med = [statistics.median(col) for col in zip(*times)]
    order = sorted(params, key=lambda p: statistics.median(fractions[id(p)]))
    tensors = tuple((p.numel() * p.element_size(), statistics.median(fractions[id(p)]), tuple(p.shape)) for p in order)
    return Step(w.batch_size, med[0], med[1], med[2], tensors)
