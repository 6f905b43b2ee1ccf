"""A Horovod training script as users write them, making the calls
Horovod's own examples make (pytorch_synthetic_benchmark.py,
pytorch_mnist.py's loop, pytorch_imagenet_resnet50.py's learning-rate
warmup and metric averaging); the tests run it once with ``import
horovod.torch as hvd`` and once with ``import hpcjobs.horovod.torch as
hvd`` -- the only line that differs -- and compare.

    mpirun -n P python horovod_script.py --api hpcjobs|horovod --out params.pt
        [--model resnet18] [--image-size 32] [--batch-size 4] [--steps 6]
        [--fp16-allreduce] [--sync-bn] [--batches-per-allreduce 1]

``torchvision`` must import (the tests put a stand-in on the path that
serves hpcjobs' own ResNets). Prints the img/s as the synthetic benchmark
does, then ``final loss <x>`` on rank 0.
"""

import argparse
import timeit

import torch
import torch.nn.functional as F
import torch.optim as optim
from torchvision import models

parser = argparse.ArgumentParser()
parser.add_argument("--api", choices=["horovod", "hpcjobs"], required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--model", default="resnet18")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--timed-iters", type=int, default=0, help="synthetic-benchmark rounds of 2 steps after training")
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--sync-bn", action="store_true", help="Horovod's SyncBatchNorm (real Horovod: GPU only)")
parser.add_argument("--batches-per-allreduce", type=int, default=1)
parser.add_argument("--float64", action="store_true", help="compare runs to 1e-6: float32 noise grows in training")
args = parser.parse_args()

if args.api == "horovod":
    import horovod.torch as hvd
else:
    import hpcjobs.horovod.torch as hvd

torch.set_num_threads(1)
if args.float64:
    torch.set_default_dtype(torch.float64)
hvd.init()
torch.manual_seed(0)  # the same initial model everywhere; broadcast makes sure
kwargs = {"norm_layer": hvd.SyncBatchNorm} if args.sync_bn else {}
model = getattr(models, args.model)(num_classes=10, **kwargs)

base_lr, warmup_steps = 0.0125, 3
optimizer = optim.SGD(model.parameters(), lr=base_lr * args.batches_per_allreduce * hvd.size(), momentum=0.9,
                      weight_decay=5e-5)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression,
                                     backward_passes_per_step=args.batches_per_allreduce, op=hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
resume = hvd.broadcast(torch.tensor(0), root_rank=0, name="resume_from_epoch").item()
assert resume == 0


def adjust_learning_rate(step):
    """pytorch_imagenet_resnet50.py's gradual warmup to lr * size."""
    scale = (step + 1) / warmup_steps * (hvd.size() - 1) / hvd.size() + 1 / hvd.size() if step < warmup_steps \
        else 1.0
    for group in optimizer.param_groups:
        group["lr"] = base_lr * hvd.size() * args.batches_per_allreduce * scale


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


g = torch.Generator().manual_seed(1 + hvd.rank())  # each rank its own shard
size = args.image_size
data = torch.randn(args.steps, args.batches_per_allreduce, args.batch_size, 3, size, size, generator=g)
target = torch.randint(0, 10, (args.steps, args.batches_per_allreduce, args.batch_size), generator=g)
model.train()
loss = torch.tensor(0.0)
for step in range(args.steps):
    adjust_learning_rate(step)
    optimizer.zero_grad()
    for i in range(args.batches_per_allreduce):
        loss = F.cross_entropy(model(data[step, i]), target[step, i])
        (loss / args.batches_per_allreduce).backward()
    optimizer.step()
final = metric_average(loss.item(), "avg_loss")

if args.timed_iters:
    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data[0, 0]), target[0, 0]).backward()
        optimizer.step()

    timeit.timeit(benchmark_step, number=1)
    img_secs = [args.batch_size * 2 / timeit.timeit(benchmark_step, number=2) for _ in range(args.timed_iters)]
    if hvd.rank() == 0:
        print("Img/sec per CPU: %.1f" % (sum(img_secs) / len(img_secs)))
        print("img/sec rounds: " + " ".join("%.2f" % x for x in img_secs))

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = hvd.allgather(flat.unsqueeze(0))
assert all(torch.equal(row, flat) for row in everyone), "the ranks' parameters differ"
if hvd.rank() == 0:
    torch.save(flat, args.out)
    print("final loss %.6f" % final)
hvd.shutdown()
