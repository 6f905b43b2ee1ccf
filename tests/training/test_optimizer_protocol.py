"""DistributedOptimizer as torch code uses an optimizer: learning-rate
schedulers and a GradScaler take it, its hooks run on the averages, and a
gradient changed between backward and step() is an error on every rank
rather than a change the averages silently overwrite."""

import copy
import pickle
import warnings

import pytest
import torch
from mpi4py import MPI

from hpcjobs.training import DistributedOptimizer, broadcast_parameters
from equivalence import flat_params, fresh_model, global_data, rel_diff

torch.set_num_threads(1)
MAX_NORM = 0.05  # below every step's gradient norm here: the clip acts on each


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def reference(x, y, clip=False):
    """One process, the whole global batch per step, StepLR halving the rate."""
    model = fresh_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    norms = []
    for xs, ys in zip(x, y):
        opt.zero_grad()
        loss_of(model, xs, ys).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        sched.step()
    return flat_params(model), norms


def wrapped(comm, overlap="thread"):
    model = fresh_model(0)
    broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model.named_parameters(),
                               comm=comm, overlap=overlap)
    return model, opt


def mine(xs, ys, comm):
    b = xs.shape[0] // comm.Get_size()
    r = comm.Get_rank()
    return xs[r * b:(r + 1) * b], ys[r * b:(r + 1) * b]


@pytest.mark.mpi(min_size=1)
def test_a_learning_rate_scheduler_takes_the_wrapper_and_counts_its_steps():
    comm = MPI.COMM_WORLD
    x, y = global_data(3, 12 * comm.Get_size())
    model, opt = wrapped(comm)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would be one
        for xs, ys in zip(x, y):
            opt.zero_grad()
            loss_of(model, *mine(xs, ys, comm)).backward()
            opt.step()
            sched.step()
    opt.close()
    assert opt.param_groups[0]["lr"] == opt.optimizer.param_groups[0]["lr"] == 0.5 * 0.5 ** 3
    assert rel_diff(flat_params(model), reference(x, y)[0]) < 1e-5


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("overlap", ["thread", "none"])
def test_a_grad_scaler_and_a_clip_after_synchronize_step_on_the_unscaled_clipped_average(overlap):
    comm = MPI.COMM_WORLD
    x, y = global_data(3, 12 * comm.Get_size())
    expected, norms = reference(x, y, clip=True)
    assert min(norms) > MAX_NORM  # so a clip that was undone would show
    model, opt = wrapped(comm, overlap)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for xs, ys in zip(x, y):
        opt.zero_grad()
        scaler.scale(loss_of(model, *mine(xs, ys, comm))).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        sched.step()
    opt.close()
    assert scaler.get_scale() == 2.0 ** 12  # no step overflowed or was skipped
    assert rel_diff(flat_params(model), expected) < 1e-5


EDITS = {
    "scaler.step(opt)": lambda model, opt, scaler: scaler.step(opt),  # unscales .grad in place first
    "unscale_": lambda model, opt, scaler: (scaler.unscale_(opt), opt.step()),
    "clip_grad_norm_": lambda model, opt, scaler: (torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
                                                   opt.step()),
    "replaced": lambda model, opt, scaler: (setattr(model.net[5].bias, "grad", model.net[5].bias.grad * 0.5),
                                            opt.step()),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", ["thread", "none"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_gradient_changed_between_backward_and_step_is_an_error_on_every_rank(edit, overlap):
    comm = MPI.COMM_WORLD
    x, y = global_data(1, 12 * comm.Get_size())
    model, opt = wrapped(comm, overlap)
    before = flat_params(model).clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler.scale(loss_of(model, *mine(x[0], y[0], comm))).backward()
    with pytest.raises(RuntimeError, match=r"changed between backward and step\(\).*opt\.synchronize\(\)"):
        EDITS[edit](model, opt, scaler)
    assert torch.equal(flat_params(model), before)  # nothing stepped
    # the optimizer goes on: the next step, done as the error says, is the reference's first
    opt.zero_grad()
    loss_of(model, *mine(x[0], y[0], comm)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.close()
    ref = fresh_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    loss_of(ref, x[0], y[0]).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    ref_opt.step()
    assert rel_diff(flat_params(model), flat_params(ref)) < 1e-5


@pytest.mark.mpi(min_size=2)
def test_a_change_only_some_ranks_can_see_is_an_error_on_every_rank():
    """GradScaler's unscale_ is seen in 8 sampled values of each gradient: on a rank whose gradient is zeros there
    they do not change. That rank stepped on the scaled average (65,536x too far), then waited in the next
    reduction for the ranks that had raised."""
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1, bias=False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    before = model.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x = torch.ones(4, 16) if comm.rank == 0 else torch.zeros(4, 16)  # a zero gradient on every rank but 0
    scaler.scale(model(x).sum()).backward()
    words = "weight" if comm.rank == 0 else "a parameter on another rank"
    with pytest.raises(RuntimeError, match=f"the gradient of {words} changed between backward and step"):
        scaler.step(opt)
    assert torch.equal(model.weight.detach(), before)
    opt.zero_grad()  # and the optimizer goes on, done as the error says
    model(x).sum().backward()
    opt.synchronize()
    opt.step()
    opt.close()
    assert torch.allclose(model.weight.detach(), before - 0.1 * 4 / comm.size)


def test_each_gradients_probes_lie_inside_it_above_2_to_the_24_too():
    from hpcjobs.training.buckets import PROBES, Slot

    for n in (1, 2, 7, 8, 9, 1000, 2 ** 24 + 3, 50257 * 768):  # (float32 had put GPT-2's wte's last one past it)
        probe = Slot("p", torch.zeros(1), 0, n).probe.tolist()
        assert probe[0] == 0 and probe[-1] == n - 1 and len(set(probe)) == min(n, PROBES) == len(probe), (n, probe)


@pytest.mark.mpi(min_size=1)
def test_alone_a_change_to_the_gradient_is_stepped_on():
    """One rank reduces nothing: .grad is the average and a clip before step() counts."""
    x, y = global_data(3, 12)
    model, opt = wrapped(MPI.COMM_SELF)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for xs, ys in zip(x, y):
        opt.zero_grad()
        loss_of(model, xs, ys).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
    opt.close()
    assert rel_diff(flat_params(model), reference(x, y, clip=True)[0]) < 1e-6


@pytest.mark.mpi(min_size=1)
def test_step_hooks_registered_on_the_wrapper_see_the_averages():
    comm = MPI.COMM_WORLD
    x, y = global_data(1, 12 * comm.Get_size())
    model, opt = wrapped(comm)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append((o, model.net[5].bias.grad.clone())))
    loss_of(model, *mine(x[0], y[0], comm)).backward()
    opt.step()
    opt.close()
    ref = fresh_model(0)
    loss_of(ref, x[0], y[0]).backward()
    assert len(seen) == 1 and seen[0][0] is opt.optimizer
    assert rel_diff(seen[0][1], ref.net[5].bias.grad) < 1e-5


def test_what_the_wrapper_cannot_do_is_refused():
    model, opt = wrapped(MPI.COMM_SELF)
    with pytest.raises(RuntimeError, match="new ones would not be reduced"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    for copier in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            copier(opt)
    with pytest.raises(TypeError, match="not yet wrapped"):
        DistributedOptimizer(opt, model.named_parameters(), comm=MPI.COMM_SELF)
    assert opt.defaults is opt.optimizer.defaults and opt.state_dict()["param_groups"][0]["lr"] == 0.5
    opt.close()
