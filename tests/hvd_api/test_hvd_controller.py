"""The Horovod door's controller: operations matched across ranks by name,
``join``, process sets, Horovod's exception types, sparse allreduce, the
stall warning. Every result against its closed form or a one-process
reference, at any number of ranks."""

import re
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcjobs.horovod.torch as hvd
from hvd_common import every_rank, initialized  # noqa: F401 (initialized: the autouse fixture)
from hpcjobs.collectives.agreement import MismatchError
from launch import mpirun_script

WORLD = MPI.COMM_WORLD


# -- order: by name, not by submission ----------------------------------------

@pytest.mark.mpi(min_size=1)
def test_ranks_may_submit_named_operations_in_different_orders():
    size, rank = hvd.size(), hvd.rank()
    names = [f"t{i}" for i in range(6)]
    order = names if rank % 2 == 0 else names[::-1]  # odd ranks submit backwards
    handles = {n: hvd.allreduce_async(torch.full((i + 1,), float(rank + i)), name=n, op=hvd.Sum)
               for n, i in ((n, names.index(n)) for n in order)}
    gathered = hvd.allgather_async(torch.full((1, 2), float(rank)), name="g")
    for i, n in enumerate(names):
        assert hvd.synchronize(handles[n]).tolist() == [float(sum(q + i for q in range(size)))] * (i + 1)
    assert hvd.synchronize(gathered)[:, 0].tolist() == [float(q) for q in range(size)]


@pytest.mark.mpi(min_size=2)
def test_a_name_is_in_use_until_its_operation_completes():
    t = torch.ones(4)
    if hvd.rank() == 0:  # the others have not submitted it: it cannot complete yet
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        with pytest.raises(ValueError, match="same name"):
            hvd.allreduce_async(t, name="dup")
    WORLD.Barrier()
    if hvd.rank() != 0:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
    assert hvd.synchronize(first).tolist() == [float(hvd.size())] * 4
    again = hvd.allreduce_async(t, name="dup", op=hvd.Sum)  # complete: the name is free
    assert hvd.synchronize(again).tolist() == [float(hvd.size())] * 4


@pytest.mark.mpi(min_size=2)
def test_a_name_is_free_once_synchronize_returns(monkeypatch):
    """The name was freed by a callback on the operation's future, which runs
    after the future has woken its waiter: with the controller's thread
    held up in between (here 0.2 s; preempted, on a loaded host), the same
    name submitted right after synchronize() was refused as in use. The late
    callback must not free the name submitted again meanwhile either."""
    from hpcjobs.horovod import _handles

    if hvd.world().controller._thread is None:
        pytest.skip("no controller thread (MPI_THREAD_MULTIPLE): the caller runs the callbacks itself")
    import threading

    real = _handles._release  # held up on the controller's thread only (the callback), not in synchronize()

    def late(request):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
        real(request)

    monkeypatch.setattr(_handles, "_release", late)
    t = torch.ones(4)
    for _ in range(2):
        h = hvd.allreduce_async(t, name="again", op=hvd.Sum)
        assert hvd.synchronize(h).tolist() == [float(hvd.size())] * 4
    if hvd.rank() == 0:  # submitted again, not yet complete (the others have not): in use
        h = hvd.allreduce_async(t, name="again", op=hvd.Sum)
        time.sleep(0.3)  # the late callback of the one before has run meanwhile
        with pytest.raises(ValueError, match="same name"):
            hvd.allreduce_async(t, name="again")
    WORLD.Barrier()
    if hvd.rank() != 0:
        h = hvd.allreduce_async(t, name="again", op=hvd.Sum)
    assert hvd.synchronize(h).tolist() == [float(hvd.size())] * 4


# -- Horovod's exception types --------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_a_mismatch_is_a_runtime_error_for_horovod_users_on_every_rank():
    rank = hvd.rank()
    try:
        hvd.allreduce(torch.ones(3 + rank))
        caught = None
    except RuntimeError as e:  # what Horovod's tests catch
        caught = e
    assert every_rank(isinstance(caught, hvd.HorovodInternalError) and isinstance(caught, MismatchError))
    assert "shapes differs" in str(caught) and "rank 0: (3,)" in str(caught)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2  # nothing was sent


@pytest.mark.mpi(min_size=2)
def test_bad_arguments_on_one_rank_fail_every_rank_naming_it():
    rank, size = hvd.rank(), hvd.size()
    splits = [4 if rank == 0 else 3] + [0] * (size - 1)  # rank 0 asks for more rows than it has
    try:
        hvd.alltoall(torch.ones(3), splits=splits)
        caught = None
    except Exception as e:
        caught = e
    if rank == 0:  # its own error, as it would have raised alone
        assert type(caught) is ValueError and "splits [4" in str(caught)
    else:
        assert isinstance(caught, hvd.HorovodInternalError) and "rank 0: ValueError: splits [4" in str(caught)
    assert every_rank(caught is not None)


@pytest.mark.mpi(min_size=1)
def test_reducescatter_refuses_other_ops_as_horovod_does():
    for op in (hvd.Adasum, hvd.Max):
        with pytest.raises(NotImplementedError, match="only supports AVERAGE and SUM"):
            hvd.reducescatter(torch.ones(4), op=op)


# -- join -----------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_join_lets_the_others_reduce_with_zeros_and_returns_the_last_rank():
    size, rank = hvd.size(), hvd.rank()
    for first in range(size):
        a = torch.arange(5, dtype=torch.float64) + 10 * rank
        b = torch.full((3, 2), rank + 1, dtype=torch.int32)
        if rank == first:
            last = hvd.join()
        else:
            ha = hvd.allreduce_async(a, name="a")  # Average: over all ranks, the joined one adding zeros
            hb = hvd.allreduce_async(b, name="b", op=hvd.Sum)
            others = [q for q in range(size) if q != first]
            expect_a = sum(torch.arange(5, dtype=torch.float64) + 10 * q for q in others) / size
            assert torch.allclose(hvd.synchronize(ha), expect_a, rtol=0, atol=1e-12)
            assert hvd.synchronize(hb).tolist() == [[sum(q + 1 for q in others)] * 2] * 3
            with pytest.raises(RuntimeError, match="not supported with hvd.join"):
                hvd.allgather(torch.ones(1, 2))
            last = hvd.join()
        assert last != first
        assert hvd.allgather_object(last) == [last] * size


# -- process sets -----------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_collectives_on_process_sets_reduce_among_their_ranks():
    size, rank = hvd.size(), hvd.rank()
    even = hvd.add_process_set([q for q in range(size) if q % 2 == 0])
    odd = hvd.add_process_set([q for q in range(size) if q % 2 == 1])
    try:
        mine, other = (even, odd) if rank % 2 == 0 else (odd, even)
        ranks = mine.ranks
        assert mine.size() == len(ranks) and mine.rank() == ranks.index(rank) and mine.included()
        assert other.included() is False and other.rank() is None
        got = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum, process_set=mine)
        assert got.tolist() == [float(sum(ranks))] * 3
        gathered = hvd.allgather(torch.full((rank + 1, 2), rank), process_set=mine)
        assert gathered[:, 0].tolist() == [q for q in ranks for _ in range(q + 1)]
        root = ranks[-1]  # a root is an hvd.rank(), not a rank within the set
        assert hvd.broadcast(torch.full((2,), float(rank)), root_rank=root, process_set=mine).tolist() == [root] * 2
        assert hvd.broadcast_object(rank, root_rank=root, process_set=mine) == root
        assert hvd.allgather_object(rank, process_set=mine) == list(ranks)
        hvd.barrier(process_set=mine)
        with pytest.raises(ValueError, match="not in ProcessSet"):
            hvd.allreduce(torch.ones(1), process_set=other)
        with pytest.raises(ValueError, match="not one of the ranks"):
            hvd.broadcast(torch.ones(1), root_rank=other.ranks[0], process_set=mine)
        with pytest.raises(ValueError, match="duplicate process set"):
            hvd.add_process_set(list(even.ranks))
    finally:
        assert hvd.remove_process_set(odd) and hvd.remove_process_set(even)
    assert not hvd.remove_process_set(even) and not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="not a registered process set"):
        hvd.allreduce(torch.ones(1), process_set=even)


@pytest.mark.mpi(min_size=2)
def test_process_sets_given_at_init_by_ranks_or_by_communicator():
    size, rank = hvd.size(), hvd.rank()
    split = WORLD.Split(rank % 2, rank)
    by_comm = hvd.ProcessSet(split)
    by_ranks = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[by_ranks, by_comm])
    try:
        assert by_comm.ranks == [q for q in range(size) if q % 2 == rank % 2]
        got = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=by_comm)
        assert got.item() == len(by_comm.ranks)
        if size == 2:  # [0, 1] is the global set: Horovod invalidates the object
            assert by_ranks.process_set_id is None
        elif rank < 2:
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=by_ranks).item() == 2
    finally:
        hvd.shutdown()
        split.Free()


@pytest.mark.mpi(min_size=2)
def test_every_rank_must_add_the_same_process_set():
    rank = hvd.rank()
    with pytest.raises(ValueError, match="every rank must pass the same process set"):
        hvd.add_process_set([0] if rank == 0 else [1])
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


# -- sparse ---------------------------------------------------------------------------

@pytest.mark.mpi(min_size=1)
def test_sparse_allreduce_equals_the_dense_reduction():
    size, rank = hvd.size(), hvd.rank()
    gen = torch.Generator().manual_seed(7)
    dense = [torch.rand(6, 3, generator=gen) * (torch.rand(6, 3, generator=gen) > 0.6) for _ in range(size)]
    for op, divide in ((hvd.Average, size), (hvd.Sum, 1)):
        wait = hvd.sparse_allreduce_async(dense[rank].to_sparse(), name=f"s{op}", op=op)
        got = wait()
        assert got.is_sparse
        assert torch.allclose(got.to_dense(), sum(dense) / divide, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="sparse tensor"):
        hvd.sparse_allreduce_async(torch.ones(2), name="d", op=hvd.Sum)


@pytest.mark.mpi(min_size=2)
def test_sparse_allreduce_of_tensors_of_different_sizes_fails_on_every_rank():
    # rank 0's rows 4 and 5 do not exist on the others: Horovod would build a tensor out of their bounds
    rows = 6 if hvd.rank() == 0 else 4
    mine = torch.zeros(rows, 2)
    mine[rows - 1, 1] = 1.0
    wait = hvd.sparse_allreduce_async(mine.to_sparse(), name="uneven", op=hvd.Sum)
    with pytest.raises(ValueError, match=r"differ in size \(rank 0: \[6, 2\], rank 1: \[4, 2\]"):
        wait()
    ok = hvd.sparse_allreduce_async(torch.eye(2).to_sparse(), name="even", op=hvd.Sum)()
    assert torch.equal(ok.to_dense(), torch.eye(2) * hvd.size())


class _Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(12, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.embedding(x).mean(dim=1)).squeeze(1)


def _train_bag(distributed: bool, sparse_as_dense: bool):
    size, rank = (hvd.size(), hvd.rank()) if distributed else (1, 0)
    model = _Bag()
    params = list(model.parameters())
    opts = [torch.optim.SGD([params[0]], lr=0.5), torch.optim.SGD(params[1:], lr=0.5)]
    if distributed:
        opts = [hvd.DistributedOptimizer(o, named_parameters=[(f"p{i}", p) for i, p in enumerate(params)
                                                               if any(p is q for q in o.param_groups[0]["params"])],
                                         sparse_as_dense=sparse_as_dense) for o in opts]
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randint(0, 12, (4 * hvd.size(), 5), generator=gen)
        y = torch.randn(4 * hvd.size(), generator=gen)
        b = x.shape[0] // size
        for o in opts:
            o.zero_grad()
        loss = ((model(x[rank * b:(rank + 1) * b]) - y[rank * b:(rank + 1) * b]) ** 2).mean()
        loss.backward()
        if distributed:
            assert params[0].grad.is_sparse
        for o in opts:
            o.step()
        assert params[0].grad.is_sparse  # the update sees a sparse gradient, as in Horovod
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_train_as_one_process_on_the_global_batch(sparse_as_dense):
    ours = _train_bag(True, sparse_as_dense)
    reference = _train_bag(False, sparse_as_dense)
    assert torch.allclose(ours, reference, rtol=0, atol=1e-5), (ours - reference).abs().max()


@pytest.mark.mpi(min_size=2)
def test_distributed_optimizer_on_a_process_set_averages_among_its_ranks():
    size, rank = hvd.size(), hvd.rank()
    first = hvd.add_process_set(list(range(size - 1)))  # every rank but the last
    try:
        w = torch.nn.Parameter(torch.zeros(3))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                       process_set=first)
        (w * torch.full((3,), float(rank + 1))).sum().backward()
        opt.step()
        members = list(range(size - 1)) if rank < size - 1 else [rank]  # outside the set: its own gradient
        expect = -sum(q + 1 for q in members) / len(members)
        assert w.detach().tolist() == pytest.approx([expect] * 3)
        assert opt._parameter_names == {w: "w"}
    finally:
        hvd.remove_process_set(first)


@pytest.mark.mpi(min_size=3)
def test_a_process_sets_optimizer_and_its_collectives_reduce_on_communicators_of_their_own():
    # the optimizer's overlap thread and the controller's thread both ran collectives on the set's one
    # communicator, where two threads' calls can match across ranks crossed; the global set's were apart already
    from hpcjobs.horovod import _process_sets

    size, rank = hvd.size(), hvd.rank()
    m = size - 1
    first = hvd.add_process_set(list(range(m)))  # every rank but the last
    try:
        if rank < m:
            ours, theirs = (f(first.process_set_id) for f in (_process_sets.engine_of, _process_sets.comm_of))
            assert ours is not theirs and MPI.Comm.Compare(ours, theirs) == MPI.CONGRUENT
            w = torch.nn.Parameter(torch.zeros(1 << 12))
            opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                           process_set=first)
            for step in range(3):  # each step's gradients reduce beside the set's own allreduces
                handles = [hvd.allreduce_async(torch.full((1 << 12,), float(rank + k)), op=hvd.Sum,
                                               process_set=first) for k in range(4)]
                opt.zero_grad()
                (w * float(rank + 1)).sum().backward()
                opt.step()
                for k, h in enumerate(handles):
                    assert (hvd.synchronize(h) == float(sum(q + k for q in range(m)))).all()
                assert (w.detach() == -(step + 1) * (m + 1) / 2).all()
    finally:
        hvd.remove_process_set(first)
    if rank < m:
        assert ours == MPI.COMM_NULL and theirs == MPI.COMM_NULL


@pytest.mark.mpi(min_size=2)
def test_a_process_set_its_ranks_refuse_is_refused_on_every_rank(monkeypatch):
    # refused on its ranks alone, the others numbered it and went on: adding it again was a duplicate there only,
    # and the set's ranks waited for them in the split
    from hpcjobs.collectives import watchdog

    size, rank = hvd.size(), hvd.rank()
    ranks = list(range(max(size - 1, 1)))
    if rank == 0:
        monkeypatch.setattr(watchdog, "ENV_ERROR", "HPCJOBS_TIMEOUT='soon' is not a number of seconds")
    with pytest.raises(ValueError, match="HPCJOBS_TIMEOUT='soon' is not a number of seconds"):
        hvd.add_process_set(ranks)
    monkeypatch.setattr(watchdog, "ENV_ERROR", None)
    again = hvd.add_process_set(ranks)
    try:
        if rank in ranks:
            assert hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=again).tolist() == [float(len(ranks))] * 2
        else:
            assert again.included() is False
    finally:
        hvd.remove_process_set(again)


# -- stalls and shutdown --------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_a_name_some_ranks_never_submit_prints_horovods_stall_warning(monkeypatch, capfd):
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "0.2")
    hvd.shutdown()
    hvd.init()  # the controller reads the setting at init
    rank = hvd.rank()
    try:
        handle = hvd.allreduce_async(torch.ones(2), name="lonely", op=hvd.Sum) if rank != 0 else None
        if rank == 0:  # the coordinator warns; it submits once it has seen the warning
            deadline, seen = time.monotonic() + 120, ""
            while "Missing ranks" not in seen and time.monotonic() < deadline:
                time.sleep(0.05)
                seen += capfd.readouterr().err
            assert re.search(r"Missing ranks:\n0: \[allreduce\.lonely\]", seen), seen
            handle = hvd.allreduce_async(torch.ones(2), name="lonely", op=hvd.Sum)
        assert hvd.synchronize(handle).tolist() == [float(hvd.size())] * 2
    finally:
        monkeypatch.delenv("HOROVOD_STALL_CHECK_TIME_SECONDS")
        hvd.shutdown()


@pytest.mark.mpi(min_size=1)
def test_an_operation_pending_at_shutdown_fails_instead_of_hanging():
    handle = hvd.allreduce_async(torch.ones(2), name=f"never-on-other-ranks.{hvd.rank()}")
    if hvd.size() > 1:
        hvd.shutdown()
        with pytest.raises(hvd.HorovodInternalError, match="shut down"):
            hvd.synchronize(handle)
    else:
        assert hvd.synchronize(handle).tolist() == [1.0, 1.0]
    hvd.shutdown()
    WORLD.Barrier()  # no rank starts the next init while another still talks on the old one


@pytest.mark.mpi(min_size=1)
def test_controller_counts_what_it_ran(monkeypatch):
    """Counted before a response runs: running it wakes the caller, who read
    the counts short where the controller's thread was held up before it
    counted (here 0.2 s after each response; preempted, on a loaded host)."""
    controller = hvd.world().controller
    if controller._thread is not None:
        real = controller._run
        monkeypatch.setattr(controller, "_run", lambda response: (real(response), time.sleep(0.2)))
    stats = controller.stats
    before = dict(stats)
    hs = [hvd.allreduce_async(torch.ones(3), name=f"c{i}", op=hvd.Sum) for i in range(4)]
    for h in hs:
        hvd.synchronize(h)
    assert stats["requests"] - before["requests"] == 4
    assert 1 <= stats["responses"] - before["responses"] <= 4  # fused or not, every request ran once
    assert np.isclose(stats["tensors"] - before["tensors"], 4)


_SERIALIZED = '''
import mpi4py
mpi4py.rc.thread_level = "serialized"   # no MPI_THREAD_MULTIPLE: no controller thread
import torch
from mpi4py import MPI
import hpcjobs.horovod.torch as hvd
hvd.init()
rank, size = hvd.rank(), hvd.size()
assert not hvd.mpi_threads_supported() and hvd.world().controller._thread is None
names = ["x", "y"] if rank == 0 else ["y", "x"]          # submitted in different orders
handles = {n: hvd.allreduce_async(torch.full((2,), float(rank + (n == "y"))), name=n, op=hvd.Sum) for n in names}
assert hvd.synchronize(handles["x"]).tolist() == [float(sum(range(size)))] * 2
assert hvd.synchronize(handles["y"]).tolist() == [float(sum(range(size)) + size)] * 2
if rank == 0:
    last = hvd.join()
else:
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size - 1   # the joined rank adds zeros
    last = hvd.join()
assert hvd.allgather_object(last) == [last] * size and last != 0
hvd.shutdown()
print("ok", rank)
'''


def test_without_thread_support_the_caller_drives_the_controller():
    out = mpirun_script(2, _SERIALIZED, timeout=120, env={"HPCJOBS_TIMEOUT": "60"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(out.stdout.split("\n")[:-1]) == ["ok 0", "ok 1"], out.stdout


_JOINED_WHILE_OTHERS_TRAIN = '''
import sys, time
import mpi4py
if sys.argv[1:] == ["serialized"]:
    mpi4py.rc.thread_level = "serialized"   # the caller drives the controller in its wait
import torch
import hpcjobs.horovod.torch as hvd
hvd.init()
if hvd.rank() == 0:
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < float(sys.argv[2]):   # longer than HPCJOBS_TIMEOUT: uneven data
        hvd.allreduce(torch.ones(4), name=f"x{n}")
        n, _ = n + 1, time.sleep(0.05)
    print("steps", n, flush=True)
print("joined", hvd.rank(), hvd.join(), flush=True)
hvd.shutdown()
'''


@pytest.mark.parametrize("threads", ["multiple", "serialized"])
def test_a_joined_rank_waits_as_long_as_the_others_train_and_no_longer_than_the_timeout_after_they_stop(threads):
    """The joined rank's wait was watched as one call: once the others had
    trained HPCJOBS_TIMEOUT past its join, the watchdog aborted a healthy
    job, naming the rank that was working. Now each collective the others
    run restarts the wait's clock: 12 s of training against a 5 s timeout
    ends well; 12 s of nothing (no collective, no join) still ends the job."""
    script = f"import sys; sys.argv[1:] = {[threads, '12']!r}\n" + _JOINED_WHILE_OTHERS_TRAIN
    out = mpirun_script(2, script, timeout=120, env={"HPCJOBS_TIMEOUT": "5"})
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert sorted(l for l in out.stdout.splitlines() if l.startswith("joined")) == ["joined 0 0", "joined 1 0"]
    assert int(re.search(r"^steps (\d+)$", out.stdout, re.M).group(1)) > 20
    idle = script.replace("hvd.allreduce(torch.ones(4), name=f\"x{n}\")", "pass")
    out = mpirun_script(2, idle, timeout=120, env={"HPCJOBS_TIMEOUT": "5"})
    assert out.returncode != 0 and "did not complete within 5 s" in out.stderr, out.stdout + out.stderr[-2000:]
    assert "joined 1" not in out.stdout


_ONE_RANK_FAILS = '''
import torch
import hpcjobs.horovod.torch as hvd
hvd.init()
if hvd.rank() == 1:
    raise RuntimeError("rank 1 fails mid-run")
hvd.allreduce(torch.ones(2))  # waits for rank 1
print("rank 0 went on", flush=True)
'''


def test_a_rank_that_fails_ends_the_job_at_once():
    """Rank 1 raised: its exit's shutdown waited for every rank to ask, rank 0
    waited in its allreduce for rank 1, and the job ended only at the
    watchdog's HPCJOBS_TIMEOUT (90 s here). Horovod shuts every rank down
    when one does; the failing rank ends the job now."""
    import time

    t0 = time.monotonic()
    out = mpirun_script(2, _ONE_RANK_FAILS, timeout=150, env={"HPCJOBS_TIMEOUT": "90"})
    seconds = time.monotonic() - t0
    assert out.returncode != 0 and "rank 0 went on" not in out.stdout, out.stdout + out.stderr[-2000:]
    assert "RuntimeError: rank 1 fails mid-run" in out.stderr, out.stderr[-2000:]
    assert "hpcjobs.horovod: rank 1 is ending on RuntimeError; ending the job" in out.stderr, out.stderr[-2000:]
    # not the watchdog (its report, or its 90 s: two imports of torch on a loaded machine take well under 80)
    assert "did not complete" not in out.stderr and seconds < 80, (seconds, out.stderr[-2000:])
