"""Hierarchical allreduce on simulated nodes: 2 and 3 nodes, even and uneven."""

import re

import numpy as np
import pytest
from mpi4py import MPI

from conftest import COUNT_LABELS, RankInputs, check_allreduce, count_for
from hpcjobs.collectives import hierarchical_allreduce
from hpcjobs.topology import detect


def _layout(ranks_per_node: int, size: int) -> list[int]:
    return [min(ranks_per_node, size - s) for s in range(0, size, ranks_per_node)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("intra", ["ring", "shm"])
@pytest.mark.parametrize("inter", ["ring", "recursive_doubling", "rabenseifner"])
@pytest.mark.parametrize("count_label", COUNT_LABELS)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "prod"])
@pytest.mark.parametrize("ranks_per_node", [1, 2, 3])
def test_hierarchical_matches_closed_form_on_simulated_nodes(ranks_per_node, op, count_label, inter, intra):
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    count = count_for(count_label, size)
    inputs = RankInputs(size, count, "float64", op)
    buf = inputs[rank].copy()

    hierarchical_allreduce(buf, op, comm, inter=inter, intra=intra, ranks_per_node=ranks_per_node)

    check_allreduce(buf, inputs, op, "float64", comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks_per_node", [1, 2, 3])
def test_simulated_layout_is_as_asked(ranks_per_node):
    comm = MPI.COMM_WORLD
    topo = detect(comm, ranks_per_node=ranks_per_node)
    assert list(topo.local_sizes) == _layout(ranks_per_node, comm.Get_size())
    assert topo.node_id == comm.Get_rank() // ranks_per_node
    assert topo.local_rank == comm.Get_rank() % ranks_per_node
    assert topo.cross_comm.Get_size() == sum(1 for s in topo.local_sizes if s > topo.local_rank)


@pytest.mark.mpi(min_size=4)
def test_three_nodes_with_a_short_last_one_give_the_mpi_result():
    comm = MPI.COMM_WORLD  # at 4 ranks with 3 per node: nodes of 3 and 1; at 5: 3 and 2
    buf = (np.arange(100_003, dtype=np.int64) * (comm.Get_rank() + 7)) % 1009
    want = buf.copy()
    comm.Allreduce(MPI.IN_PLACE, want)
    hierarchical_allreduce(buf, "sum", comm, ranks_per_node=3, intra="shm")
    np.testing.assert_array_equal(buf, want)


def test_bad_stage_names_are_refused():
    with pytest.raises(ValueError, match="unknown intra='nvlink'"):
        hierarchical_allreduce(np.zeros(4), intra="nvlink")
    with pytest.raises(ValueError, match="flat message-passing algorithm"):
        hierarchical_allreduce(np.zeros(4), inter="shm")
    with pytest.raises(ValueError, match="unknown algorithm 'bogus'"):
        hierarchical_allreduce(np.zeros(4), inter="bogus")


@pytest.mark.mpi(min_size=2)
def test_topology_of_another_communicator_is_refused():
    sub = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())
    try:
        with pytest.raises(ValueError, match="another communicator"):
            hierarchical_allreduce(np.zeros(4), comm=sub, topology=detect(MPI.COMM_WORLD))
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("intra", ["ring", "shm"])
@pytest.mark.parametrize("inter", ["ring", "recursive_doubling"])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("ranks_per_node", [1, 2])
@pytest.mark.parametrize("segment_bytes", [0, 808, 40_000, 1 << 20])  # off; 101, 5000, 131072 float64s (rounded to L)
def test_pipelined_segments_match_closed_form(ranks_per_node, op, inter, intra, segment_bytes):
    """Many segments (a ragged last one, a tail of count % L), one segment,
    and the thread that carries the network stage: the same exact result."""
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    count = 20_011
    inputs = RankInputs(size, count, "float64", op)
    buf = inputs[rank].copy()

    hierarchical_allreduce(buf, op, comm, inter=inter, intra=intra, ranks_per_node=ranks_per_node,
                           segment_bytes=segment_bytes)

    check_allreduce(buf, inputs, op, "float64", comm)


@pytest.mark.parametrize("bad", [-1, 1.5, "1M", True])
def test_bad_segment_sizes_are_refused(bad):
    with pytest.raises(ValueError, match=r"segment_bytes must be an integer >= 0 \(0: not pipelined\) or None"):
        hierarchical_allreduce(np.zeros(4), segment_bytes=bad)


@pytest.mark.mpi(min_size=2)
def test_a_segment_size_on_some_ranks_only_is_a_mismatch_on_every_rank():
    """segment_bytes=None (the default) on one rank and a size on another
    would pipeline on one and not the other: the options the check compares
    differ (None is left out of them, and then they differ by a key)."""
    from hpcjobs.collectives.agreement import MismatchError

    comm = MPI.COMM_WORLD
    buf = np.ones(4096)
    with pytest.raises(MismatchError, match="segment_bytes"):
        hierarchical_allreduce(buf, comm=comm, ranks_per_node=1, segment_bytes=None if comm.rank else 1 << 12)


@pytest.mark.mpi(min_size=2)
def test_a_topology_detected_otherwise_on_one_rank_is_a_mismatch_on_every_rank():
    """A topology is an object, which the check left out: rank 0 passing
    one of nodes of 1, the others one of one node (both detected by every
    rank), ran other stages on the two sides and hung until the watchdog.
    Its layout is compared now."""
    from hpcjobs.collectives.agreement import MismatchError

    comm = MPI.COMM_WORLD
    apart, together = detect(comm, ranks_per_node=1), detect(comm, ranks_per_node=comm.size)
    topology = apart if comm.rank == 0 else together
    with pytest.raises(MismatchError, match=re.escape(f"'topology': '{comm.size} nodes of {[1] * comm.size} ranks "
                                                      "(override)'")):
        hierarchical_allreduce(np.ones(64), comm=comm, topology=topology)
    buf = np.ones(64)
    hierarchical_allreduce(buf, comm=comm, topology=apart)
    assert (buf == comm.size).all()


def test_the_pipelined_paths_thread_goes_with_its_communicator():
    """One worker thread per cross-node communicator, shut down as that is
    freed: kept by the communicator's id, each one left an idle thread."""
    from hpcjobs.collectives.hierarchical import _worker

    cross = MPI.COMM_SELF.Dup()
    worker = _worker(cross)
    assert _worker(cross) is worker and worker.submit(lambda: 7).result() == 7
    cross.Free()
    assert worker._shutdown
    other = MPI.COMM_SELF.Dup()
    assert _worker(other) is not worker
    other.Free()
