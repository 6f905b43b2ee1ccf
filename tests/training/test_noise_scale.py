"""The gradient noise scale (hpcjobs.convergence.noise_scale, McCandlish
et al. 2018): the estimator against its closed form, what a larger batch
costs in epochs, and DistributedOptimizer's squared norms against a
one-process reference of every rank's gradient."""

import pytest
import torch
from mpi4py import MPI

from equivalence import fresh_model, global_data
from hpcjobs.compression import FP16Compressor
from hpcjobs.convergence import epochs_factor, noise_scale
from hpcjobs.training import DistributedOptimizer

torch.set_num_threads(1)


@pytest.mark.parametrize("b,B", [(8, 32), (1, 2), (64, 1024)])
def test_the_estimator_returns_the_truth_from_the_expected_norms(b, B):
    # per-sample gradients with mean G and covariance trace S: a batch of n has E|G_n|^2 = |G|^2 + S/n
    g2, S = 0.7, 45.0
    est = noise_scale(g2 + S / b, g2 + S / B, b, B)
    assert est["grad_sq"] == pytest.approx(g2, rel=1e-12)
    assert est["grad_var"] == pytest.approx(S, rel=1e-12)
    assert est["noise_scale"] == pytest.approx(S / g2, rel=1e-12)


def test_a_non_positive_gradient_estimate_has_no_noise_scale():
    # the small batch's norm so far above the big one's that |G|^2 comes out negative
    assert noise_scale(10.0, 1.0, 8, 16)["noise_scale"] is None


@pytest.mark.parametrize("args,words", [((1.0, 0.5, 16, 16), "0 < small < big"), ((1.0, 0.5, 0, 4), "0 < small"),
                                        ((-1.0, 0.5, 4, 8), "negative")])
def test_bad_inputs_are_refused(args, words):
    with pytest.raises(ValueError, match=words):
        noise_scale(*args)


def test_a_larger_batch_costs_epochs_as_the_noise_scale_says():
    # E(B) = E_min (1 + B/Bn): at Bn = 1000, from 256 to 4096 costs 5.096 / 1.256 times the epochs
    assert epochs_factor(1000.0, 256, 4096) == pytest.approx((1 + 4.096) / (1 + 0.256), rel=1e-12)
    assert epochs_factor(1000.0, 256, 256) == 1.0
    assert epochs_factor(None, 256, 4096) == 1.0  # unknown: perfect linear scaling
    assert epochs_factor(1e12, 256, 4096) == pytest.approx(1.0, abs=1e-8)  # far below the noise scale: free
    with pytest.raises(ValueError, match="positive"):
        epochs_factor(0.0, 256, 4096)


def rank_gradients(x, y, size):
    """Every rank's flat gradient on its contiguous share of the batch, in one process."""
    grads = []
    for r in range(size):
        model = fresh_model(0).double()
        n = x.shape[0] // size
        torch.nn.functional.cross_entropy(model(x[r * n:(r + 1) * n].double()), y[r * n:(r + 1) * n]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return grads


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", ["none", "thread"])
def test_the_optimizer_sums_each_ranks_and_the_averaged_squared_norms(overlap):
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if overlap == "thread" and MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        pytest.skip("no thread support")
    x, y = global_data(2, 8 * size)
    model = fresh_model(0).double()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), comm=comm,
                               fusion_bytes=4096, overlap=overlap, noise_scale=True)  # several buckets
    assert opt.num_buckets > 1
    for step in range(2):  # lr 0: the same parameters both steps, the sums double
        opt.zero_grad()
        n = x.shape[1] // size
        torch.nn.functional.cross_entropy(model(x[step, rank * n:(rank + 1) * n].double()),
                                          y[step, rank * n:(rank + 1) * n]).backward()
        opt.step()
    want_rank, want_avg = 0.0, 0.0
    for step in range(2):
        grads = rank_gradients(x[step], y[step], size)
        want_rank += float(grads[rank].square().sum())
        want_avg += float((sum(grads) / size).square().sum())
    assert opt.stats["grad_sq_rank"] == pytest.approx(want_rank, rel=1e-9)
    assert opt.stats["grad_sq_avg"] == pytest.approx(want_avg, rel=1e-9)
    opt.reset_stats()
    assert opt.stats["grad_sq_rank"] == 0.0
    opt.close()


@pytest.mark.mpi(min_size=2)
def test_loss_scaled_and_overflowed_steps_do_not_bend_the_norms():
    """fp16's loss scaler multiplies the gradients by its scale S until it
    unscales the averages: the norms are divided by S² (``grad_scale``, set
    before each step). A step whose average overflowed (inf on one rank)
    counts nowhere, on every rank alike, and ``noise_steps`` says how many did."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = global_data(2, 8 * size)
    model = fresh_model(0).double()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), comm=comm,
                               fusion_bytes=4096, overlap="none", noise_scale=True)
    n = x.shape[1] // size
    for step, scale in ((0, 1024.0), (None, 512.0), (1, 512.0)):  # the middle step overflows on rank 0
        opt.zero_grad()
        opt.grad_scale = scale
        i = 0 if step is None else step
        loss = torch.nn.functional.cross_entropy(model(x[i, rank * n:(rank + 1) * n].double()),
                                                 y[i, rank * n:(rank + 1) * n])
        (loss * (float("inf") if step is None and rank == 0 else scale)).backward()
        opt.synchronize()  # as the loop does with a scaler, which then skips the overflowed step
    want_rank, want_avg = 0.0, 0.0
    for step in range(2):
        grads = rank_gradients(x[step], y[step], size)
        want_rank += float(grads[rank].square().sum())
        want_avg += float((sum(grads) / size).square().sum())
    assert opt.stats["noise_steps"] == 2 and opt.stats["steps"] == 3
    assert opt.stats["grad_sq_rank"] == pytest.approx(want_rank, rel=1e-9)
    assert opt.stats["grad_sq_avg"] == pytest.approx(want_avg, rel=1e-9)
    opt.close()


@pytest.mark.mpi(min_size=1)
def test_the_noise_scale_needs_two_ranks_and_exact_averages():
    comm = MPI.COMM_WORLD
    model = fresh_model(0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="uncompressed gradients on at least 2 ranks"):
        DistributedOptimizer(sgd, model.named_parameters(), comm=comm, compression=FP16Compressor(),
                             noise_scale=True)
    if comm.Get_size() == 1:
        with pytest.raises(ValueError, match="at least 2 ranks"):
            DistributedOptimizer(sgd, model.named_parameters(), comm=comm, noise_scale=True)
