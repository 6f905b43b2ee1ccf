"""Every torch.distributed call a script makes, on backend "hpcjobs" under
mpirun (``mpirun -n P python calls_script.py``), each checked against its
closed form; prints "rank r: all calls ok"."""

import torch
import torch.distributed as dist

import hpcjobs.torch_backend  # noqa: F401
from hpcjobs.collectives.agreement import MismatchError

dist.init_process_group("hpcjobs")  # no MASTER_ADDR: rank and size from MPI
r, P = dist.get_rank(), dist.get_world_size()
R = dist.ReduceOp
tri = P * (P + 1) // 2  # sum of rank+1 over the ranks


def full(v, n=5, dtype=torch.float32):
    return torch.full((n,), v, dtype=dtype)


for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64):
    for op, want in ((R.SUM, tri), (R.MIN, 1), (R.MAX, P)):
        t = full(r + 1, 7, dtype)
        dist.all_reduce(t, op=op)
        assert t.tolist() == [want] * 7, (dtype, op, t)
t = full(float(r + 1))
dist.all_reduce(t, op=R.AVG)
assert torch.allclose(t, full((P + 1) / 2)), t
t = full(float(r + 1))
dist.all_reduce(t, op=R.PRODUCT)
assert t.tolist() == [float(torch.arange(1, P + 1).prod())] * 5
t = torch.tensor([1 << r, 3], dtype=torch.int64)
dist.all_reduce(t, op=R.BOR)
assert t.tolist() == [(1 << P) - 1, 3]
t = torch.arange(12.).reshape(3, 4).t()  # not contiguous
dist.all_reduce(t)
assert torch.equal(t, P * torch.arange(12.).reshape(3, 4).t())
work = dist.all_reduce(full(1.0), async_op=True)
assert work.wait() and work.get_future().wait()[0].tolist() == [float(P)] * 5

ts = [full(float(r)), full(1.0, 3)]
dist.all_reduce_coalesced(ts)
assert ts[0].tolist() == [P * (P - 1) / 2] * 5 and ts[1].tolist() == [P] * 3

root = 1 % P
b = torch.arange(4.) if r == root else torch.zeros(4)
dist.broadcast(b, src=root)
assert b.tolist() == [0, 1, 2, 3]
objs = [{"rank": r}] if r == root else [None]
dist.broadcast_object_list(objs, src=root)
assert objs == [{"rank": root}]

outs = [torch.zeros(2) for _ in range(P)]
dist.all_gather(outs, full(float(r), 2))
assert [o.tolist() for o in outs] == [[q, q] for q in range(P)]
uneven = [torch.zeros(q + 1) for q in range(P)]  # rank q sends q+1 elements
dist.all_gather(uneven, full(float(r), r + 1))
assert [o.tolist() for o in uneven] == [[q] * (q + 1) for q in range(P)]
o = torch.zeros(2 * P)
dist.all_gather_into_tensor(o, full(float(r), 2))
assert o.tolist() == [q for q in range(P) for _ in range(2)]
o = torch.zeros(2, P).t()  # not contiguous: the results land in it, not in a reshaped copy
dist.all_gather_into_tensor(o, full(float(r), 2))
assert o.reshape(-1).tolist() == [q for q in range(P) for _ in range(2)]
gathered = [None] * P
dist.all_gather_object(gathered, ("r", r, "x" * r))
assert gathered == [("r", q, "x" * q) for q in range(P)]

inp = torch.arange(2. * P) + r
out = torch.zeros(2)
dist.reduce_scatter_tensor(out, inp)
total = P * torch.arange(2. * P) + P * (P - 1) / 2
assert out.tolist() == total[2 * r:2 * r + 2].tolist()
assert inp.tolist() == (torch.arange(2. * P) + r).tolist()  # the input is the caller's: left as it was
out = torch.zeros(2)
dist.reduce_scatter(out, [full(float(q + r), 2) for q in range(P)])
assert out.tolist() == [P * r + P * (P - 1) / 2] * 2

ins = torch.arange(P, dtype=torch.float32) + 10 * r
got = torch.zeros(P)
dist.all_to_all_single(got, ins)
assert got.tolist() == [10 * q + r for q in range(P)]
# uneven splits: rank r sends q+1 rows to rank q
send = torch.cat([full(float(10 * r + q), q + 1) for q in range(P)]).reshape(-1, 1)
recv = torch.zeros(P * (r + 1), 1)
dist.all_to_all_single(recv, send, output_split_sizes=[r + 1] * P, input_split_sizes=[q + 1 for q in range(P)])
assert recv.reshape(-1).tolist() == [10 * q + r for q in range(P) for _ in range(r + 1)]
lists_out = [torch.zeros(1) for _ in range(P)]
dist.all_to_all(lists_out, [full(float(10 * r + q), 1) for q in range(P)])
assert [x.item() for x in lists_out] == [10 * q + r for q in range(P)]

t = full(float(r + 1))
dist.reduce(t, dst=0)
assert t.tolist() == ([float(tri)] * 5 if r == 0 else [float(r + 1)] * 5)
gl = [torch.zeros(1) for _ in range(P)] if r == 0 else None
dist.gather(full(float(r), 1), gl, dst=0)
assert r != 0 or [x.item() for x in gl] == list(range(P))
sc = torch.zeros(2)
dist.scatter(sc, [full(float(q), 2) for q in range(P)] if r == 0 else None, src=0)
assert sc.tolist() == [r, r]

if r == 0:
    dist.send(torch.arange(3.), dst=P - 1)
if r == P - 1:
    x = torch.zeros(3)
    dist.recv(x, src=0)
    assert x.tolist() == [0, 1, 2]
# a receive from any source returns the rank it came from (it had raised on the receiver alone)
if P > 1 and r > 0:
    dist.send(full(float(r), 2), dst=0, tag=7)
elif P > 1:
    got = {}
    for _ in range(P - 1):
        x = torch.zeros(2)
        source = dist.recv(x, tag=7)
        got[source] = x.tolist()
    assert got == {q: [float(q)] * 2 for q in range(1, P)}, got
req = dist.isend(full(float(r), 1), dst=(r + 1) % P)
x = torch.zeros(1)
dist.irecv(x, src=(r - 1) % P).wait()
req.wait()
assert x.item() == (r - 1) % P
# both ways between neighbours, posted as batch_isend_irecv posts them, 16 MiB each: far above the eager
# limit, where blocking sends queued before the receives left every rank waiting in its send
if P > 1:  # torch refuses a rank's P2POp to itself
    big = [full(float(r), 1 << 22), torch.zeros(1 << 22), torch.zeros(1 << 22)]
    ops = [dist.P2POp(dist.isend, big[0], (r + 1) % P), dist.P2POp(dist.isend, big[0], (r - 1) % P),
           dist.P2POp(dist.irecv, big[1], (r - 1) % P), dist.P2POp(dist.irecv, big[2], (r + 1) % P)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert big[1][0] == big[1][-1] == (r - 1) % P and big[2][0] == big[2][-1] == (r + 1) % P
dist.barrier()

# bool tensors (DDP broadcasts bool buffers): moved as bytes; a bool all_reduce's SUM is any, PRODUCT all
flags = torch.tensor([r == root, True, False]) if r == root else torch.zeros(3, dtype=torch.bool)
dist.broadcast(flags, src=root)
assert flags.tolist() == [True, True, False]
bools = [torch.zeros(2, dtype=torch.bool) for _ in range(P)]
dist.all_gather(bools, torch.tensor([r % 2 == 1, True]))
assert [b.tolist() for b in bools] == [[q % 2 == 1, True] for q in range(P)]
anyone, everyone = torch.tensor([r == 0, False]), torch.tensor([r == 0, True])
dist.all_reduce(anyone)
dist.all_reduce(everyone, op=R.PRODUCT)
assert anyone.tolist() == [True, False] and everyone.tolist() == [P == 1, True]
masked = torch.nn.Linear(2, 2)
masked.register_buffer("mask", torch.tensor([r == 0, True]))
ddp = torch.nn.parallel.DistributedDataParallel(masked)  # broadcasts rank 0's buffers, the bool one too
assert ddp.module.mask.tolist() == [True, True]

# a subgroup: the even ranks
evens = list(range(0, P, 2))
sub = dist.new_group(evens, backend="hpcjobs")
if r in evens:
    t = full(1.0)
    dist.all_reduce(t, group=sub)
    assert t.tolist() == [len(evens)] * 5
    # torch keeps a group's name in the group: a Python group must too, or
    # destroying a subgroup fails ("ProcessGroup name not set")
    assert sub.group_name and sub.group_name != dist.group.WORLD.group_name, sub.group_name
    assert dist.distributed_c10d._world.pg_names[sub] == sub.group_name
    dist.destroy_process_group(sub)
    assert sub not in dist.distributed_c10d._world.pg_names

# a rank that differs fails on every rank, with one message, and nothing hangs
try:
    dist.all_reduce(torch.ones(3 + r))
    raise AssertionError("a count mismatch went through")
except MismatchError as e:
    assert "count differs" in str(e), e
try:
    dist.all_reduce(torch.ones(3, dtype=torch.float32 if r else torch.float64))
    raise AssertionError("a dtype mismatch went through")
except MismatchError as e:
    assert "dtype differs" in str(e), e
try:
    dist.broadcast(torch.ones(2 + r), src=0)
    raise AssertionError("a broadcast of different sizes went through")
except MismatchError as e:
    assert "count differs" in str(e), e
try:
    dist.monitored_barrier()
    raise AssertionError("monitored_barrier went through")
except (NotImplementedError, ValueError) as e:  # torch refuses it for any backend but Gloo
    assert "monitored_barrier" in str(e), e
t = full(1.0)
dist.all_reduce(t)  # still in step after the errors
assert t.tolist() == [float(P)] * 5
dist.destroy_process_group()
print(f"rank {r}: all calls ok")
