"""Our compressors as DDP comm hooks on a GPU model (marked ``cuda``:
skipped without one), backward on a stream of its own: the hook's worker
waits for backward's writes into the bucket, and DDP's stream for the
worker's result, through CUDA events."""

import pytest
import torch
from mpi4py import MPI

pytestmark = pytest.mark.cuda


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("compression", ["fp16", "topk:1.0"])
def test_a_hook_on_a_gpu_model_with_backward_on_a_side_stream_averages(compression):
    from hpcjobs import ddp_hooks
    from hpcjobs.torch_backend import new_process_group

    comm = MPI.COMM_WORLD
    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    group = new_process_group()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device], process_group=group,
                                                        bucket_cap_mb=1)
        state = ddp_hooks.register(ddp, compression)
        x = torch.randn(64, 256, device=device) * (comm.rank + 1)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            ddp(x).square().mean().backward()
        torch.cuda.current_stream(device).wait_stream(side)
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().cpu()
        # the exact average: each rank's own gradient, from a copy of the model, summed over the ranks
        ref = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).to(device)
        ref.load_state_dict(model.state_dict())
        ref(x).square().mean().backward()
        mine = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).double().cpu().numpy()
        comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.SUM)
        want = torch.from_numpy(mine) / comm.size
        rel = float((got - want).norm() / want.norm())
        assert rel < (1e-3 if compression == "fp16" else 1e-6), rel
        state.close()
    finally:
        group.shutdown()
