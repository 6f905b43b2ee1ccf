"""``hpcjobs.horovod.torch``: Horovod's torch API on our collectives. Every
collective against its closed form at any number of ranks; bad arguments
fail on every rank; DistributedOptimizer computes what one process computes
on the global batch; SyncBatchNorm is BatchNorm over the global batch."""

import math
import re
import warnings

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcjobs.horovod.torch as hvd
from hvd_common import every_rank, initialized  # noqa: F401 (initialized: the autouse fixture)
from hpcjobs.collectives import chunk_bounds
from hpcjobs.collectives.agreement import MismatchError, checking
from hpcjobs.horovod._optimizer import _DeviceReducer
from hpcjobs.horovod._state import world
from equivalence import flat_params, fresh_model, global_data, rel_diff
from hpcjobs.training.models import build_model

WORLD = MPI.COMM_WORLD


def same_on_every_rank(t: torch.Tensor) -> bool:
    arr = t.detach().double().reshape(-1).numpy()
    lo, hi = arr.copy(), arr.copy()
    WORLD.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
    WORLD.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
    return np.array_equal(lo, hi)


# -- the basics --------------------------------------------------------------

def test_calls_before_init_raise_horovods_error():
    hvd.shutdown()
    assert not hvd.is_initialized()
    for call in (hvd.size, hvd.rank, hvd.local_rank, hvd.cross_size, lambda: hvd.allreduce(torch.ones(2)),
                 lambda: hvd.broadcast_object(1)):
        with pytest.raises(ValueError, match=re.escape("Horovod has not been initialized; use hvd.init().")):
            call()
    hvd.init()
    assert hvd.is_initialized()


@pytest.mark.mpi(min_size=1)
def test_init_on_a_list_of_ranks_refused_frees_the_communicator_it_made(monkeypatch):
    from hpcjobs.collectives import watchdog
    from hpcjobs.horovod import _state

    made, real = [], _state._communicator
    monkeypatch.setattr(_state, "_communicator", lambda spec: made.append(real(spec)) or made[-1])
    monkeypatch.setattr(watchdog, "ENV_ERROR", "HPCJOBS_TIMEOUT='soon' is not a number of seconds")
    with pytest.raises(ValueError, match="HPCJOBS_TIMEOUT='soon'"):
        hvd.init(list(range(WORLD.Get_size())))
    (comm, owned), = made
    assert owned and comm == MPI.COMM_NULL and not hvd.is_initialized()
    monkeypatch.setattr(watchdog, "ENV_ERROR", None)
    hvd.init()


@pytest.mark.mpi(min_size=1)
def test_a_forked_child_still_knows_its_rank_and_leaves_the_parents_controller_alone():
    # a DataLoader worker forked after init: its shutdown (atexit) waited for ever on the controller thread, which
    # a child does not have
    from launch import in_a_forked_child

    rank = hvd.rank()
    assert in_a_forked_child(lambda: hvd.rank() == rank and hvd.shutdown() is None and not hvd.is_initialized()) == 0
    assert hvd.is_initialized() and hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


def test_what_this_implementation_is_built_with():
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not (hvd.gloo_built() or hvd.gloo_enabled() or hvd.ddl_built() or hvd.ccl_built() or hvd.rocm_built())
    assert hvd.nccl_built() == 0
    assert hvd.cuda_built() == (torch.version.cuda is not None)
    assert hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def test_what_is_not_implemented_says_so():
    t = torch.ones(3)
    with pytest.raises(ValueError, match="Adasum is not implemented in hpcjobs"):
        hvd.allreduce(t, op=hvd.Adasum)
    for name in ("elastic", "start_timeline"):
        with pytest.raises(NotImplementedError, match="not provided by hpcjobs"):
            getattr(hvd, name)
    with pytest.raises(ValueError, match="inside hvd.DistributedOptimizer only"):
        hvd.allreduce(t, compression=hvd.Compression.topk(0.5))
    with pytest.raises(ValueError, match="ratio"):
        hvd.Compression.topk(2.0)
    with pytest.raises(NotImplementedError, match="only supports AVERAGE and SUM"):
        hvd.reducescatter(t, op=hvd.Max)
    model = torch.nn.Linear(2, 1)
    for kwargs, match in [(dict(op=hvd.Adasum), "Adasum"), (dict(op=hvd.Min), "Average or op=hvd.Sum"),
                          (dict(op=hvd.Sum, gradient_predivide_factor=2.0), "gradient_predivide_factor"),
                          (dict(backward_passes_per_step=0), "backward_passes_per_step")]:
        with pytest.raises(ValueError, match=match):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), **kwargs)


def test_the_distributed_optimizer_is_the_wrapped_optimizer():
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(inner)  # Horovod's default names
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05) and len(inner.state) == 2
    opt.load_state_dict(opt.state_dict())
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):  # step() after synchronize() outside the context
        opt.step()
    for named, match in [([p for p in model.parameters()], "tuples"),
                         ([("w", model.weight), ("w", model.bias)], "duplicates: w"),
                         ([("w", model.weight)], "were not named")]:
        with pytest.raises(ValueError, match=match):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named)


@pytest.mark.mpi(min_size=1)
def test_sizes_ranks_and_nodes():
    assert (hvd.size(), hvd.rank()) == (WORLD.Get_size(), WORLD.Get_rank())
    assert 0 <= hvd.local_rank() < hvd.local_size() and 0 <= hvd.cross_rank() < hvd.cross_size()
    places = hvd.allgather_object((hvd.cross_rank(), hvd.local_rank()))
    assert len(set(places)) == hvd.size()
    assert isinstance(hvd.is_homogeneous(), bool)


# -- allreduce ---------------------------------------------------------------

@pytest.mark.mpi(min_size=1)
def test_allreduce_ops_match_closed_forms():
    size, rank = hvd.size(), hvd.rank()
    mine = torch.full((3, 2), float(rank + 1), dtype=torch.float64)
    total = size * (size + 1) / 2
    for op, want in [(hvd.Average, total / size), (hvd.Sum, total), (hvd.Min, 1.0), (hvd.Max, float(size)),
                     (hvd.Product, float(math.factorial(size)))]:
        out = hvd.allreduce(mine, op=op)
        assert torch.equal(out, torch.full((3, 2), want, dtype=torch.float64)), (op, out)
    assert torch.equal(mine, torch.full((3, 2), float(rank + 1), dtype=torch.float64))  # input untouched
    assert hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)[0, 0] == 6 * total
    with pytest.warns(DeprecationWarning):
        assert hvd.allreduce(mine, average=False)[0, 0] == total
    for dtype in (torch.float16, torch.bfloat16, torch.int32):
        assert hvd.allreduce(mine.to(dtype), op=hvd.Sum)[0, 0].item() == total
    # integer Average: the sum scaled by 1/P, truncated toward zero (Horovod's)
    ints = torch.tensor([rank + 1, -(rank + 1)], dtype=torch.int64)
    whole = size * (size + 1) // 2
    assert hvd.allreduce(ints).tolist() == [math.trunc(whole / size), math.trunc(-whole / size)]


@pytest.mark.mpi(min_size=1)
def test_in_place_and_grouped_allreduce():
    size, rank = hvd.size(), hvd.rank()
    total = size * (size + 1) // 2
    t = torch.full((4,), float(rank + 1))
    assert hvd.allreduce_(t, op=hvd.Sum) is t and torch.equal(t, torch.full((4,), float(total)))
    tensors = [torch.full((2, 2), rank + 1.0), torch.full((3,), rank + 1, dtype=torch.int32),
               torch.full((1,), rank + 1.0, dtype=torch.float64)]
    out = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    assert [o.dtype for o in out] == [t.dtype for t in tensors]
    assert all((o == total).all() for o in out) and all((t == rank + 1).all() for t in tensors)
    back = hvd.grouped_allreduce_(tensors, op=hvd.Max)
    assert all(a is b for a, b in zip(back, tensors)) and all((t == size).all() for t in tensors)


@pytest.mark.mpi(min_size=1)
def test_async_calls_return_handles_and_names_are_per_kind():
    size = hvd.size()
    t = torch.ones(5)
    first = hvd.allreduce_async(t, name="grad", op=hvd.Sum)
    other_kind = hvd.allgather_async(t, name="grad")  # names are per kind, as in Horovod
    assert isinstance(hvd.poll(first), bool)
    assert torch.equal(hvd.synchronize(first), torch.full((5,), float(size)))
    assert hvd.synchronize(other_kind).shape == (5 * size,)
    assert hvd.synchronize(first) is None  # already synchronized
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.poll(first)
    again = hvd.allreduce_async_(t, name="grad", op=hvd.Sum)  # free again
    assert hvd.synchronize(again) is t and torch.equal(t, torch.full((5,), float(size)))
    h = hvd.grouped_allreduce_async([torch.ones(2), torch.ones(3)], op=hvd.Sum)
    assert [x.tolist() for x in hvd.synchronize(h)] == [[size] * 2, [size] * 3]


# -- the other collectives ---------------------------------------------------

@pytest.mark.mpi(min_size=1)
def test_allgather_with_a_first_dimension_that_differs_by_rank():
    size, rank = hvd.size(), hvd.rank()
    mine = torch.full((rank + 1, 2), rank, dtype=torch.bfloat16)
    out = hvd.allgather(mine)
    want = torch.cat([torch.full((q + 1, 2), q, dtype=torch.bfloat16) for q in range(size)])
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    ints, empty_on_0 = hvd.grouped_allgather([torch.arange(3) + 10 * rank, torch.ones(rank, 3, dtype=torch.bool)])
    assert ints.tolist() == [10 * q + i for q in range(size) for i in range(3)]
    assert empty_on_0.shape == (size * (size - 1) // 2, 3) and empty_on_0.all()


@pytest.mark.mpi(min_size=1)
def test_broadcast_from_a_root_other_than_zero():
    size, rank = hvd.size(), hvd.rank()
    root = 1 % size
    mine = torch.full((2, 3), float(rank))
    out = hvd.broadcast(mine, root_rank=root)
    assert torch.equal(out, torch.full((2, 3), float(root))) and mine[0, 0] == rank
    flags = torch.tensor([rank == root, True])
    assert hvd.broadcast_(flags, root) is flags and flags.tolist() == [True, True]
    model = build_model("mlp", (6,), 3, width=4)
    torch.manual_seed(rank)
    for p in model.parameters():
        p.data.normal_()
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    assert all(same_on_every_rank(p) for p in model.parameters())


@pytest.mark.mpi(min_size=1)
def test_alltoall_with_and_without_splits():
    size, rank = hvd.size(), hvd.rank()
    even = torch.arange(2 * size, dtype=torch.float32).unsqueeze(1) + 100 * rank
    out = hvd.alltoall(even)  # without splits: just the rows
    assert out.reshape(-1).tolist() == [100 * q + 2 * rank + k for q in range(size) for k in range(2)]

    def splits_of(q):  # rank q sends splits_of(q)[r] rows to rank r
        return [(q + r) % 3 + 1 for r in range(size)]

    mine = splits_of(rank)
    rows = (torch.arange(sum(mine), dtype=torch.float64) + 1000 * rank).unsqueeze(1).repeat(1, 2)
    out, received = hvd.alltoall(rows, splits=mine)
    want = [1000 * q + sum(splits_of(q)[:rank]) + k for q in range(size) for k in range(splits_of(q)[rank])]
    assert out[:, 0].tolist() == want and torch.equal(out[:, 0], out[:, 1])
    assert received.dtype == torch.int32 and received.tolist() == [splits_of(q)[rank] for q in range(size)]
    _, received = hvd.alltoall(rows, splits=torch.tensor(mine, dtype=torch.int64))
    assert received.dtype == torch.int64


@pytest.mark.mpi(min_size=1)
def test_reducescatter_gives_the_first_ranks_the_extra_rows():
    size, rank = hvd.size(), hvd.rank()
    rows = 2 * size + 1
    base = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2)
    bounds = chunk_bounds(rows, size)
    total = size * (size + 1) / 2
    out = hvd.reducescatter(base * (rank + 1), op=hvd.Sum)
    assert torch.equal(out, base[bounds[rank]:bounds[rank + 1]] * total)
    assert out.shape[0] == (3 if rank == 0 else 2)
    avg, ints = hvd.grouped_reducescatter([base * (rank + 1), torch.full((size, 3), rank + 1)])
    assert torch.allclose(avg, base[bounds[rank]:bounds[rank + 1]] * total / size)
    assert ints.tolist() == [[math.trunc(total / size)] * 3]


@pytest.mark.mpi(min_size=1)
def test_broadcast_optimizer_state_initializes_as_horovod_does():
    """A fresh optimizer's state is made by one local step on zero gradients,
    every gradient set to zeros as Horovod sets them: a gradient left from a
    backward would step each rank by its own and part them. SparseAdam takes
    only sparse gradients, so its zeros are sparse."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.full((1, 3), float(hvd.rank() + 1))).sum().backward()  # a different gradient on every rank
    sgd = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(same_on_every_rank(sgd.state[p]["momentum_buffer"]) for p in model.parameters())
    emb = torch.nn.Embedding(5, 2, sparse=True)
    hvd.broadcast_optimizer_state(torch.optim.SparseAdam(emb.parameters()), root_rank=0)


@pytest.mark.mpi(min_size=1)
def test_objects_barrier_and_join():
    size, rank = hvd.size(), hvd.rank()
    got = hvd.broadcast_object({"from": rank, "data": list(range(rank + 2))}, root_rank=size - 1)
    assert got == {"from": size - 1, "data": list(range(size + 1))}
    assert hvd.allgather_object(rank * rank) == [q * q for q in range(size)]
    hvd.barrier()
    last = hvd.join()
    assert 0 <= last < size and hvd.allgather_object(last) == [last] * size
    # the usual idiom, objects of other types on the other ranks: named by its type (as Horovod does), rank 0's
    # broadcast_object.dict waited for the others' broadcast_object.NoneType until the watchdog
    config = {"lr": 0.1} if rank == 0 else None
    assert hvd.broadcast_object(config) == {"lr": 0.1}
    assert hvd.allgather_object(config) == [{"lr": 0.1}] + [None] * (size - 1)


@pytest.mark.mpi(min_size=2)
def test_an_object_that_does_not_pickle_raises_on_every_rank():
    """Root's lock does not pickle: root raised alone and the others waited
    in the broadcast for the watchdog. A lambda does, as Horovod's
    cloudpickle sends it; and an object a rank cannot pickle in an allgather."""
    import threading

    size, rank = hvd.size(), hvd.rank()
    with pytest.raises(TypeError, match=r"broadcast_object: rank 1's object does not pickle \(TypeError: cannot "
                                        r"pickle '_thread.lock' object\)"):
        hvd.broadcast_object(threading.Lock() if rank == 1 else None, root_rank=1, name="lock")
    assert hvd.broadcast_object(lambda x: x + size, root_rank=0)(1) == size + 1
    with pytest.raises(TypeError, match=r"allgather_object: the object does not pickle on rank 0 \(TypeError"):
        hvd.allgather_object(threading.Lock() if rank == 0 else rank, name="locks")
    assert hvd.allgather_object(rank) == list(range(size))  # and the next call goes on


@pytest.mark.mpi(min_size=2)
def test_mismatched_arguments_raise_on_every_rank():
    rank = hvd.rank()

    def raises_everywhere(call, *words):
        try:
            with checking(True):
                call()
            raised, message = False, ""
        except ValueError as e:  # a MismatchError; the rank whose own arguments failed: its ValueError
            raised, message = True, str(e)
        assert every_rank(raised), "some rank did not raise"
        assert all(w in message for w in words), message

    raises_everywhere(lambda: hvd.allreduce(torch.ones(3 if rank == 0 else 4)), "shapes differs", "rank 0: (3,)")
    raises_everywhere(lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if rank == 0 else hvd.Max), "op differs")
    raises_everywhere(lambda: hvd.broadcast(torch.ones(2, dtype=torch.float32 if rank else torch.float64), 0),
                      "dtypes differs")
    raises_everywhere(lambda: hvd.allgather(torch.ones(rank + 1, 2 if rank == 0 else 3)), "shapes after dim 0")
    splits = [4 if rank == 0 else 3] + [0] * (hvd.size() - 1)  # rank 0 asks for more rows than it has
    raises_everywhere(lambda: hvd.alltoall(torch.ones(3), splits=splits),
                      "splits [4" if rank == 0 else "rank 0: ValueError: splits [4")
    # nothing was sent: the collectives still work
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2


# -- DistributedOptimizer ----------------------------------------------------


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def train(make_opt, x, y, distributed: bool, clip=None, **hvd_kwargs):
    """Five steps: one process on the global batch, or each rank on its slice."""
    size, rank = (hvd.size(), hvd.rank()) if distributed else (1, 0)
    model = fresh_model(0 if rank == 0 else 100 + rank)
    opt = make_opt(model.parameters())
    if distributed:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **hvd_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))
    b = x.shape[1] // size
    for xs, ys in zip(x, y):
        opt.zero_grad()
        loss_of(model, xs[rank * b:(rank + 1) * b], ys[rank * b:(rank + 1) * b]).backward()
        if clip is None:
            opt.step()
        else:  # Horovod's pattern for changing the reduced gradients
            if distributed:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if distributed:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        scheduler.step()
    return flat_params(model)


CASES = {
    "momentum-average": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), {}, {}),
    "adam-predivide": (lambda p: torch.optim.Adam(p, lr=1e-3), {}, dict(gradient_predivide_factor=2.0)),
    "sum": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), dict(sum_lr=0.05), dict(op=hvd.Sum)),
    "fp16": (lambda p: torch.optim.SGD(p, lr=0.05), dict(tol=2e-3), dict(compression=hvd.Compression.fp16)),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", list(CASES))
def test_distributed_optimizer_equals_one_process_on_the_global_batch(case):
    make_opt, opts, kwargs = CASES[case]
    size = hvd.size()
    x, y = global_data(5, 4 * size)
    want = train(make_opt, x, y, distributed=False)
    if "sum_lr" in opts:  # summed gradients with lr / P step as averaged ones with lr
        got = train(lambda p: torch.optim.SGD(p, lr=opts["sum_lr"] / size, momentum=0.9), x, y, True, **kwargs)
    else:
        got = train(make_opt, x, y, distributed=True, **kwargs)
    assert rel_diff(got, want) <= opts.get("tol", 1e-5), rel_diff(got, want)
    assert same_on_every_rank(got)


def _uneven(opt_kwargs, size, rank, b=4):
    """The last rank takes 2 steps and joins, the others 4: the parameters after each, the controller's
    requests in each, and what ``join()`` returned."""
    steps = [2 if q == size - 1 else 4 for q in range(size)]
    x, y = global_data(4, b * size)
    model = fresh_model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), **opt_kwargs)
    requests = []
    for s in range(steps[rank]):
        before = world().controller.stats["requests"]
        opt.zero_grad()
        loss_of(model, x[s, rank * b:(rank + 1) * b], y[s, rank * b:(rank + 1) * b]).backward()
        opt.step()
        requests.append(world().controller.stats["requests"] - before)
    return model, opt, requests, steps, (x, y)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compression,tol", [("none", 1e-5), ("fp16", 2e-3)])
def test_distributed_optimizer_on_the_cpu_steps_on_while_a_rank_has_joined(compression, tol):
    """Uneven data: the last rank runs out after 2 steps and joins; the others take 4, their averages over every
    rank with zeros for the joined one, as in Horovod (it hung: the CPU buckets went by the engine's communicator,
    where the joined rank never came). Against one process that sums the active ranks' slices' gradients / P;
    the controller's requests per step: 1 (who steps) while every rank does, + 1 per bucket and 1 (whether a rank
    changed its gradients before step()) after the join."""
    size, rank, b = hvd.size(), hvd.rank(), 4
    model, opt, requests, steps, (x, y) = _uneven({"compression": getattr(hvd.Compression, compression)}, size,
                                                  rank, b)
    ref = fresh_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = []  # the one process's parameters after each step
    for s in range(4):
        ref_opt.zero_grad()
        for q in (q for q in range(size) if steps[q] > s):
            (loss_of(ref, x[s, q * b:(q + 1) * b], y[s, q * b:(q + 1) * b]) / size).backward()
        ref_opt.step()
        want.append(flat_params(ref))
    buckets = len(opt._hvd_reducer._buckets)
    assert requests == [1, 1] + ([2 + buckets] * 2 if rank < size - 1 else []), requests
    last = hvd.join()  # one of the ranks that took 4 steps, the same on every rank
    assert last < size - 1 and hvd.allgather_object(last) == [last] * size
    assert rel_diff(flat_params(model), want[steps[rank] - 1]) <= tol


@pytest.mark.mpi(min_size=2)
def test_a_compressor_with_residuals_refuses_a_joined_rank_on_every_rank_that_steps():
    """Top-k keeps residuals, which a joined rank's zeros cannot enter: every rank still stepping raises
    (it waited for the joined rank until the watchdog), and the joins that follow end the test."""
    size, rank = hvd.size(), hvd.rank()
    if rank < size - 1:
        with pytest.raises(RuntimeError, match="cannot reduce with its zeros"):
            _uneven({"compression": hvd.Compression.topk(0.5)}, size, rank)
    else:
        _uneven({"compression": hvd.Compression.topk(0.5)}, size, rank)
    hvd.join()


@pytest.mark.mpi(min_size=1)
def test_synchronize_then_clip_then_step_inside_skip_synchronize():
    x, y = global_data(5, 4 * hvd.size())
    make_opt = CASES["momentum-average"][0]
    want = train(make_opt, x, y, distributed=False, clip=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(make_opt, x, y, distributed=True, clip=0.5)
    assert not [w for w in caught if "skip_synchronize" in str(w.message)]
    assert rel_diff(got, want) <= 1e-5 and same_on_every_rank(got)


@pytest.mark.mpi(min_size=1)
def test_gpu_path_reduces_gradients_with_grouped_allreduce():
    """The reducer for parameters on a GPU, run here on CPU parameters."""
    size, rank = hvd.size(), hvd.rank()
    a, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.full((2, 2), rank + 1.0)  # b.grad never computed here: contributes zeros
    _DeviceReducer([a, b], hvd.Compression.none, hvd.Average, 0.5, 2.0).synchronize()
    assert torch.equal(a.grad, torch.full((2, 2), (size + 1) / 2)) and torch.equal(b.grad, torch.zeros(3))


# -- SyncBatchNorm -----------------------------------------------------------

@pytest.mark.mpi(min_size=1)
def test_sync_batch_norm_is_batch_norm_on_the_global_batch():
    size, rank = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(3)
    x_all = torch.randn(3 * size, 4, 5, generator=g, dtype=torch.float64) * 2 + 1
    w_all = torch.randn(3 * size, 4, 5, generator=g, dtype=torch.float64)
    ref = torch.nn.BatchNorm1d(4).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 2.0, generator=g)
        ref.bias.uniform_(-1.0, 1.0, generator=g)
    sync = hvd.SyncBatchNorm(4).double()
    sync.load_state_dict(ref.state_dict())
    x_all.requires_grad_()
    mine = slice(3 * rank, 3 * rank + 3)
    x = x_all.detach()[mine].clone().requires_grad_()
    for _ in range(2):  # the running statistics move twice
        y_all, y = ref(x_all), sync(x)
    torch.testing.assert_close(y, y_all[mine])
    (y_all * w_all).sum().backward()
    (y * w_all[mine]).sum().backward()  # the sum over ranks is the reference's loss
    torch.testing.assert_close(x.grad, x_all.grad[mine])
    torch.testing.assert_close(hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad)
    torch.testing.assert_close(hvd.allreduce(sync.bias.grad, op=hvd.Sum), ref.bias.grad)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(sync, name), getattr(ref, name))
    ref.eval()
    sync.eval()
    torch.testing.assert_close(sync(x.detach()), ref(x_all.detach())[mine])


@pytest.mark.mpi(min_size=2)
def test_horovod_fusion_threshold_sets_the_bucket_size(monkeypatch):
    """HOROVOD_FUSION_THRESHOLD (bytes) sizes the buckets, as in Horovod (0:
    no fusion, a bucket per tensor); unset, hpcjobs' 1 MiB; a value that is
    not a size is refused."""
    model = build_model("mlp", (40,), 10, width=256)  # 6 tensors, 77,834 floats (311 KB)
    sizes = {}
    for value in (None, "4096", str(1 << 30), "0"):
        if value is None:
            monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
        else:
            monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", value)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        sizes[value] = opt._hvd_reducer.num_buckets
        del opt
    assert sizes[None] == sizes[str(1 << 30)] == 1 and sizes["4096"] > 1 and sizes["0"] == 6, sizes
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='64MB' is not a number of bytes"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())


@pytest.mark.mpi(min_size=1)
def test_a_tensor_broadcast_or_gathered_can_still_be_resized():
    """The door's byte views were t.numpy(), which marks a storage as never to be resized: after
    hvd.broadcast_ or broadcast_parameters a resize_ raised, where real Horovod leaves it."""
    t = torch.full((3,), float(hvd.rank()))
    hvd.broadcast_(t, root_rank=0)
    hvd.allgather(t)
    model = torch.nn.Linear(2, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for x in (t, model.weight.data):
        x.resize_(7)
        x.untyped_storage().resize_(0)
