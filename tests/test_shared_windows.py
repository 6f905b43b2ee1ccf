"""Shared windows: every one made is freed, by its owner or at exit in the
order made (hpcjobs.collectives._shared)."""

import textwrap

import pytest
from mpi4py import MPI

from hpcjobs.collectives import _shared
from hpcjobs.collectives._shared import allocate_shared, free_window, shared_window

# Three ranks whose histories of windows differ: one on ranks 0-1, made and freed; one on all; one on ranks 1-2;
# the last two left to the end of the script. MPI_Finalize frees what is left in the order of its table, whose
# freed slot 0 the third window took on rank 1 (where rank 2 holds the second there): rank 1 waited in the third's
# barrier, rank 2 in the second's, and the job hung at exit after printing everything.
_LEFT_AT_EXIT = textwrap.dedent("""
    from mpi4py import MPI
    from hpcjobs.collectives._shared import free_window, shared_window

    w = MPI.COMM_WORLD
    r = w.Get_rank()
    first = w.Split(0 if r < 2 else MPI.UNDEFINED, r)
    last = w.Split(0 if r > 0 else MPI.UNDEFINED, r)
    a = shared_window(64, first)[0] if r < 2 else None
    b, segments = shared_window(64, w)
    segments[r][:] = r
    if a is not None:
        free_window(a)
    c = shared_window(64, last)[0] if r > 0 else None
    print("rank", r, "leaves its windows", flush=True)
""")


def test_windows_left_at_exit_are_freed_in_the_order_made_and_the_job_ends():
    from launch import mpirun_script

    out = mpirun_script(3, _LEFT_AT_EXIT, timeout=120)
    assert out.returncode == 0 and sorted(out.stdout.splitlines()) == [
        f"rank {r} leaves its windows" for r in range(3)], out.stdout + out.stderr


@pytest.mark.mpi(min_size=1)
def test_a_window_is_kept_from_its_making_to_its_freeing_by_its_owner():
    comm = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)  # shared memory: one node's ranks
    before = dict(_shared._live)
    win, segments = shared_window(100, comm)
    other = allocate_shared(8, comm)
    made = [k for k in _shared._live if k not in before]
    assert [_shared._live[k] for k in made] == [win, other] and made == sorted(made)
    keys = comm.allgather(made)  # keyed alike on every rank: the order at exit is one order
    assert all(k == keys[0] for k in keys)
    assert len(segments) == comm.Get_size() and all(s.nbytes == 100 for s in segments)
    free_window(win)
    assert win == MPI.WIN_NULL and list(_shared._live) == [*before, made[1]]
    free_window(win)  # freed already: nothing to do
    free_window(other)
    assert _shared._live == before
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_rank_whose_unlock_fails_still_frees_the_window_with_its_peers():
    """Rank 1 unlocked its window already (as an exit hook's free after a
    script's own unlock): its unlock raised, it skipped the free, and the
    others waited in the free for good. It frees, then raises."""
    comm = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    before = dict(_shared._live)
    win = allocate_shared(64, comm)
    if comm.Get_rank() == 1:
        win.Unlock_all()
        with pytest.raises(MPI.Exception, match="RMA_SYNC"):
            free_window(win)
    else:
        free_window(win)
    assert win == MPI.WIN_NULL and _shared._live == before
    comm.Barrier()
    comm.Free()


@pytest.mark.mpi(min_size=2)  # one rank reduces without a window
def test_a_communicators_oneshot_segments_leave_the_list_when_it_is_freed():
    import numpy as np

    from hpcjobs.collectives import allreduce

    comm = MPI.COMM_WORLD.Dup()
    before = set(_shared._live)
    x = np.ones(16)
    allreduce(x, algorithm="oneshot", comm=comm)
    assert (x == comm.Get_size()).all() and set(_shared._live) > before
    comm.Free()
    assert set(_shared._live) == before


@pytest.mark.mpi(min_size=1)
def test_a_forked_child_has_no_window_nor_group_to_free_and_a_free_lock():
    # a child that ran the exit hooks would free its parent's windows and communicators (MPI calls in a fork), and
    # a lock another thread held at the fork would be held there for good
    from hpcjobs import _torch_group, ddp_hooks
    from launch import in_a_forked_child

    win, _ = shared_window(8, MPI.COMM_SELF)
    try:
        with _shared._lock:  # as a thread of the parent making a window at the fork
            code = in_a_forked_child(lambda: not _shared._live and _shared._lock.acquire(timeout=5)
                               and _torch_group._live == [] and ddp_hooks._live == [])
        assert code == 0 and _shared._live
    finally:
        free_window(win)
