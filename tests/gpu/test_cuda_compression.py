"""Every compressor on CUDA tensors (marked ``cuda``: skipped without a
GPU): compressed_allreduce on the GPU against the same call on a host copy
of the same data, residuals kept on the device, the same bytes on the wire."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs.compression import ErrorFeedback, NoneCompressor, compressed_allreduce
from hpcjobs.compression.names import make_compressor

pytestmark = pytest.mark.cuda

# (spec, relative tolerance): the summable ones (averaged by our allreduce,
# on the host) give the host's bits; top-k's sum of P payloads is divided on
# the GPU, which divides by 3 as a multiplication by 1/3 (1 ulp off at 3
# ranks); sign's scale is a sum the GPU rounds in another order, QSGD draws
# its rounding from the device's generator, PowerSGD's QR rounds differently.
SPECS = [("none", 0), ("fp16", 0), ("bf16", 0), ("topk:0.05", 1e-6), ("randomk:0.05", 0), ("sign", 1e-5),
         ("qsgd:127", 0.5), ("powersgd:2", 1e-3)]


def _compressor(spec):
    return NoneCompressor() if spec == "none" else make_compressor(spec)


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    import torch

    torch.cuda.set_device(0)
    yield


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("spec,tolerance", SPECS)
@pytest.mark.parametrize("feedback", [False, True])
def test_compressed_allreduce_on_the_gpu_matches_the_host(spec, tolerance, feedback):
    import torch

    comm = MPI.COMM_WORLD
    gen = torch.Generator().manual_seed(100 + comm.Get_rank())
    host = torch.randn(64, 33, generator=gen)
    device = host.to("cuda")
    memories = (ErrorFeedback(), ErrorFeedback()) if feedback else (None, None)
    for step in range(3):  # error feedback carries residuals from step to step
        want, sent_host = compressed_allreduce(host, _compressor(spec), memories[0], name="w", comm=comm,
                                               step=step)
        got, sent_device = compressed_allreduce(device, _compressor(spec), memories[1], name="w", comm=comm,
                                                step=step)
        assert got.is_cuda and got.shape == host.shape and got.dtype == host.dtype
        assert sent_device == sent_host
        diff = (got.cpu() - want).abs()
        if tolerance == 0:
            assert torch.equal(got.cpu(), want), (f"{spec} step {step}: {int((diff != 0).sum())} of {diff.numel()} "
                                                  f"differ, by up to {diff.max().item():g}")
        else:
            assert diff.max().item() <= tolerance * want.abs().max().item() + 1e-6, (spec, diff.max().item())
    if feedback:
        assert memories[1].residuals["w"].is_cuda
        if tolerance == 0:
            np.testing.assert_array_equal(memories[1].residuals["w"].cpu().numpy(),
                                          memories[0].residuals["w"].numpy())


def test_residuals_read_onto_the_host_follow_the_gradient_to_its_gpu():
    """A state saved on a GPU and read with map_location="cpu" (as
    load_checkpoint does) held its residuals on the host: the first
    compensation raised torch's "Expected all tensors to be on the same
    device". They move to the gradient's device."""
    import torch

    memory = ErrorFeedback()
    memory.load_state_dict({"residuals": {"w": torch.full((4,), 0.5)}})
    out = memory.compensate("w", torch.ones(4, device="cuda"))
    assert out.device.type == "cuda" and torch.equal(out.cpu(), torch.full((4,), 1.5))
    assert memory.residuals["w"].device.type == "cuda"
