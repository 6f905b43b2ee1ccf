"""Training on the GPU (marked ``cuda``: skipped without one): a run with
QSGD, whose rounding draws from the device's generator, stopped and resumed
ends with the parameters of the run never stopped."""

import pytest
import torch
from mpi4py import MPI

from hpcjobs.training.loop import TrainConfig, load_checkpoint, train

pytestmark = pytest.mark.cuda


@pytest.mark.mpi(min_size=1)
def test_a_resumed_gpu_run_with_qsgd_ends_where_the_unbroken_one_does(tmp_path_factory):
    """The checkpoint holds each rank's CUDA generator: without it, the
    resumed run drew other roundings and ended elsewhere."""
    comm = MPI.COMM_WORLD
    d = comm.bcast(str(tmp_path_factory.mktemp("gpu-resume")) if comm.rank == 0 else None)
    kw = dict(model="mlp", width=32, dataset="synthetic", num_samples=600, batch_per_rank=8, lr=0.05,
              warmup="none", seed=3, quiet=True, progress=False, device="cuda", compression="qsgd:4",
              error_feedback=True)
    straight = train(TrainConfig(checkpoint=f"{d}/a.pt", epochs=4, **kw), comm)
    train(TrainConfig(checkpoint=f"{d}/b.pt", epochs=2, **kw), comm)
    resumed = train(TrainConfig(checkpoint=f"{d}/b.pt", epochs=4, resume=True, **kw), comm)
    assert [h["epoch"] for h in resumed] == [1, 2, 3, 4]
    # (QSGD at 4 levels with other roundings ends far off; the GPU's own reduction orders, not at all)
    assert resumed[-1]["loss"] == pytest.approx(straight[-1]["loss"], rel=1e-5)
    if comm.rank == 0:
        a, b = load_checkpoint(f"{d}/a.pt"), load_checkpoint(f"{d}/b.pt")
        assert all("cuda_rng" in r for r in b["ranks"])
        for k in a["model"]:
            torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_broadcast_parameters_of_a_model_on_its_gpu():
    """numpy() refused a CUDA tensor on every rank: the model already on its
    GPU, as DistributedOptimizer's example has it, takes root's values."""
    from hpcjobs.training import broadcast_parameters

    comm = MPI.COMM_WORLD
    torch.manual_seed(comm.rank)  # every rank its own values
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).cuda()
    broadcast_parameters(model.state_dict(), root_rank=0)
    mine = torch.cat([t.detach().float().reshape(-1).cpu() for t in model.state_dict().values()])
    torch.testing.assert_close(mine, comm.bcast(mine, root=0), rtol=0, atol=0)
