"""The hpcjobs backend and DDP hooks where a script goes off the usual path:
a group or a hook used after it was closed (an error, where it waited
forever), a hook's error as DDP shows it, a hook made by hand, fused
residuals after DDP rebuilds its buckets, a copy into a Parameter under
no_grad, Work.result(), and calls the ranks disagree on."""

import re

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from hpcjobs import ddp_hooks
from hpcjobs.collectives.agreement import MismatchError
from hpcjobs.torch_backend import new_process_group

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pg():
    group = new_process_group()
    yield group
    group.shutdown()


def _opts(kind, **kw):
    o = getattr(dist, kind)()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def _ddp(group, shapes=((8, 8), (8, 8), (8, 8)), bias=False, cap=0.0002):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(*s, bias=bias) for s in shapes])
    return model, torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=cap)


def _steps(model, ddp, steps=4):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + MPI.COMM_WORLD.Get_rank())
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.mpi(min_size=1)
def test_a_group_used_after_shutdown_raises_at_once():
    group = new_process_group()
    group.shutdown()
    with pytest.raises(RuntimeError, match=r"the process group was shut down \(destroy_process_group\)"):
        group.allreduce([torch.ones(2)])
    with pytest.raises(RuntimeError, match="was shut down"):
        group.broadcast([torch.ones(2)], dist.BroadcastOptions())


@pytest.mark.mpi(min_size=1)
def test_a_hook_used_after_close_fails_ddp_at_once(pg):
    model, ddp = _ddp(pg)
    state = ddp_hooks.register(ddp, "fp16")
    ddp(torch.ones(3, 8)).sum().backward()
    state.close()
    with pytest.raises(RuntimeError, match=r"the hpcjobs DDP hook was closed \(HookState.close\(\)\)"):
        ddp(torch.ones(3, 8)).sum().backward()


@pytest.mark.mpi(min_size=2)
def test_a_hooks_error_reaches_ddp_as_itself_on_every_rank(pg):
    model, ddp = _ddp(pg)
    state = ddp_hooks.register(ddp, "topk:0.3" if pg.rank() == 0 else "topk:0.5")
    try:
        with pytest.raises(RuntimeError) as caught:
            ddp(torch.ones(3, 8)).sum().backward()
        assert "MismatchError: compressed_allreduce" in str(caught.value) and "Unable to cast" not in \
            str(caught.value), caught.value
    finally:
        state.close()


@pytest.mark.mpi(min_size=1)
def test_a_hook_state_made_by_hand_keeps_a_residual_per_parameter(pg):
    """Without names, each parameter was named by its place in its bucket:
    the first of every bucket shared one residual (a silent wrong step)."""
    model, ddp = _ddp(pg)
    by_hand = ddp_hooks.HookState("topk:0.3", error_feedback=True, comm=pg._own)
    ddp.register_comm_hook(by_hand, ddp_hooks.compression_hook)
    got = _steps(model, ddp)
    model, ddp = _ddp(pg)
    registered = ddp_hooks.register(ddp, "topk:0.3", error_feedback=True)
    want = _steps(model, ddp)
    try:
        assert len(by_hand.memory.residuals) == len(registered.memory.residuals) == 3
        assert torch.equal(got, want)
    finally:
        by_hand.close()
        registered.close()


@pytest.mark.mpi(min_size=1)
def test_a_fused_buckets_residuals_follow_ddps_rebuilt_buckets(pg):
    """fp16 keeps a residual per fused bucket, keyed by what it holds; the
    first step's layout (before DDP rebuilds it) stayed forever."""
    model, ddp = _ddp(pg, shapes=((8, 16), (16, 16), (16, 4)), bias=True, cap=0.0005)
    state = ddp_hooks.register(ddp, "fp16", error_feedback=True)
    try:
        _steps(model, ddp)
        kept = sum(r.numel() for r in state.memory.residuals.values())
        assert kept == sum(p.numel() for p in model.parameters()), sorted(state.memory.residuals)
    finally:
        state.close()


@pytest.mark.mpi(min_size=1)
def test_a_broadcast_into_a_parameter_under_no_grad_lands_as_on_gloo(pg):
    # grad mode is per thread: the worker copied into the Parameter with grad on, which torch refuses
    p = torch.nn.Parameter(torch.full((3, 2), float(pg.rank())).t())  # not contiguous: a copy back
    with torch.no_grad():
        pg.broadcast([p], _opts("BroadcastOptions", rootRank=0)).wait()
    assert torch.equal(p.detach(), torch.zeros(2, 3))


@pytest.mark.mpi(min_size=1)
def test_work_result_gives_the_operations_tensors(pg):
    t = torch.ones(2)
    work = pg.allreduce([t])
    result = work.result()
    assert len(result) == 1 and result[0] is t and t.tolist() == [pg.size()] * 2


@pytest.mark.mpi(min_size=2)
def test_calls_the_ranks_disagree_on_fail_on_every_rank(pg):
    r, p = pg.rank(), pg.size()
    with pytest.raises(MismatchError, match="root differs"):  # every rank kept the sum
        pg.reduce([torch.ones(2)], _opts("ReduceOptions", rootRank=r)).wait()
    with pytest.raises(MismatchError, match=r"reduce_scatter's output is torch.float64, its input torch.float32"):
        pg.reduce_scatter_single(torch.zeros(2, dtype=torch.float64), torch.ones(2 * p)).wait()
    with pytest.raises(MismatchError, match="does not implement reduce_scatter with .* on torch.bool"):
        pg.reduce_scatter_single(torch.zeros(2, dtype=torch.bool), torch.ones(2 * p, dtype=torch.bool)).wait()
    t = torch.ones(3)
    pg.reduce([t], _opts("ReduceOptions", rootRank=0)).wait()
    assert t.tolist() == ([p] * 3 if r == 0 else [1.0] * 3)


@pytest.mark.mpi(min_size=1)
def test_a_tensor_through_a_call_can_still_be_resized_and_its_storage_freed(pg):
    """torch marks the storage of a tensor it hands numpy (``t.numpy()``) as never to be resized: after one
    call, ``t.resize_`` and ``t.untyped_storage().resize_(0)`` (how sharded training frees a gathered
    parameter) raised "Trying to resize storage that is not resizable", where Gloo's calls leave it."""
    from hpcjobs.collectives import allreduce

    t = torch.ones(3)
    pg.allreduce([t]).wait()
    pg.broadcast([t], _opts("BroadcastOptions", rootRank=0)).wait()
    t.resize_(5)
    t.fill_(1.0)
    pg.allreduce([t]).wait()
    assert t.tolist() == [pg.size()] * 5
    u = torch.ones(4, dtype=torch.bfloat16)
    allreduce(u, op="sum")
    assert u.tolist() == [pg.size()] * 4
    for x in (t, u):
        x.untyped_storage().resize_(0)
        assert x.untyped_storage().nbytes() == 0


@pytest.mark.mpi(min_size=2)
def test_gather_sends_to_the_root_alone_and_refuses_roots_the_ranks_disagree_on(pg):
    """gather had been an allgather that only the root kept (each rank held every rank's tensor: 589 MB
    more at 3 ranks of 100 MB where Gloo takes 1), and each rank naming itself as dst passed silently."""
    r, p = pg.rank(), pg.size()
    outs = [torch.zeros(q + 1) for q in range(p)] if r == 1 else []
    pg.gather([outs], [torch.full((r + 1,), float(r))], _opts("GatherOptions", rootRank=1)).wait()
    assert [o.tolist() for o in outs] == ([[float(q)] * (q + 1) for q in range(p)] if r == 1 else [])
    flags = [torch.zeros(2, dtype=torch.bool) for _ in range(p)] if r == 0 else []
    pg.gather([flags], [torch.tensor([True, r % 2 == 0])], _opts("GatherOptions", rootRank=0)).wait()
    assert [f.tolist() for f in flags] == ([[True, q % 2 == 0] for q in range(p)] if r == 0 else [])
    with pytest.raises(MismatchError, match="root differs"):
        pg.gather([[torch.zeros(1) for _ in range(p)]], [torch.ones(1)], _opts("GatherOptions", rootRank=r)).wait()
    short = [torch.zeros(1) for _ in range(p)] if r == 0 else []
    with pytest.raises(ValueError, match=r"the root's output tensors hold \[1, 1.*\] elements, the ranks' inputs "
                                         r"\[2, 2"):
        pg.gather([short], [torch.ones(2)], _opts("GatherOptions", rootRank=0)).wait()
    t = torch.ones(2)
    pg.allreduce([t]).wait()  # the group goes on
    assert t.tolist() == [p] * 2


@pytest.mark.mpi(min_size=2)
def test_a_bitwise_reduction_against_a_sum_names_the_ops_as_the_collectives_do(pg):
    """A rank's SUM (through the collectives) against another's BOR (on MPI) said "dtype differs: rank 0:
    int32; rank 1: torch.int32" for one dtype, and "op differs: sum; RedOpType.BOR"."""
    r = pg.rank()
    op = dist.ReduceOp.BOR if r == 1 else dist.ReduceOp.SUM
    with pytest.raises(MismatchError) as caught:
        pg.allreduce([torch.ones(4, dtype=torch.int32)], _opts("AllreduceOptions", reduceOp=op)).wait()
    said = str(caught.value)
    assert re.search(r"op differs: ranks? 0[,\d]*: sum; rank 1: bor", said) and "dtype differs" not in said, said


@pytest.mark.mpi(min_size=1)
def test_complex_tensors_are_summed_by_reduce_and_reduce_scatter_as_by_all_reduce(pg):
    """torch's all_reduce hands a complex tensor to the backend as its real pairs; its reduce and reduce_scatter
    hand it whole, and the backend refused it (Gloo sums it)."""
    r, p = pg.rank(), pg.size()
    z = torch.full((3,), complex(r, 1), dtype=torch.complex64)
    pg.reduce([z], _opts("ReduceOptions", rootRank=0)).wait()
    assert z.tolist() == ([complex(p * (p - 1) / 2, p)] * 3 if r == 0 else [complex(r, 1)] * 3)
    out = torch.zeros(2, dtype=torch.complex128)
    inp = torch.tensor([complex(q, r) for q in range(2 * p)], dtype=torch.complex128)
    pg.reduce_scatter_single(out, inp, _opts("ReduceScatterOptions", reduceOp=dist.ReduceOp.AVG)).wait()
    assert out.tolist() == [complex(2 * r + i, (p - 1) / 2) for i in range(2)]


@pytest.mark.mpi(min_size=1)
def test_a_callback_that_waits_for_a_later_operation_runs_it_in_order(pg):
    """A then-callback runs on the group's worker; one that waited there for an operation queued behind
    it waited for ever, with no collective in flight for the watchdog to see (3 of 3 runs)."""
    import time

    p = pg.size()
    a, b = torch.ones(1000), torch.ones(10)
    w1, w2 = pg.allreduce([a]), pg.allreduce([b])
    done = w1.get_future().then(lambda fut: (w2.wait(), b.sum().item())[1])
    deadline = time.monotonic() + 30
    while not done.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done.done(), "the callback's wait never returned"
    assert done.value() == 10.0 * p and a.tolist() == [p] * 1000
