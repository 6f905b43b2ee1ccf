"""The names the benchmarks are run by, here apart from the code so that the
command line can offer them without starting MPI."""

__all__ = ["BASELINES", "BUFFERS", "TRAIN_IMPLS", "COMPRESSORS"]

# The libraries measured beside ours (hpcjobs.bench.baselines).
# ddp-hpcjobs and hvd-hpcjobs are ours through the torch.distributed backend
# and the Horovod-compatible API (hpcjobs.bench.doors).
BASELINES = ("mpi", "gloo", "nccl", "horovod-gloo", "horovod", "ddp-hpcjobs", "hvd-hpcjobs")
# What the allreduce benchmark's buffers are: ordinary arrays, or symmetric
# allocations (hpcjobs.collectives.symmetric_empty) on which shm is zero-copy.
BUFFERS = ("private", "symmetric")
# bench train's implementations: ours:<algorithm>[+<compression>[:<param>]][/<overlap>],
# and the ones it compares against (hpcjobs.bench.train).
# ddp-hpcjobs: DDP on the hpcjobs torch.distributed backend; hvd-hpcjobs:
# our Horovod-compatible API's DistributedOptimizer.
TRAIN_IMPLS = ("single", "ours:auto", "ours:auto/thread", "ours:auto/none", "ours:ring", "ours:auto+fp16", "ddp",
               "horovod", "ddp-hpcjobs", "hvd-hpcjobs")
# bench compression's compressors, NAME[:PARAM] (hpcjobs.compression.names).
COMPRESSORS = ("fp16", "bf16", "topk:0.01", "randomk:0.01", "qsgd:127", "sign", "powersgd:2")
