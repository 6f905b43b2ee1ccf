"""Topology detection from each source: override, Slurm, shared memory."""

import pytest
from mpi4py import MPI

from hpcjobs.topology import detect


@pytest.fixture
def fresh_comm():
    # detect() caches per communicator: a fresh one sees the environment anew.
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


@pytest.mark.mpi(min_size=1)
def test_shared_memory_puts_every_local_rank_on_one_node(fresh_comm, monkeypatch):
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    monkeypatch.delenv("HPCJOBS_RANKS_PER_NODE", raising=False)
    topo = detect(fresh_comm)
    size = fresh_comm.Get_size()
    assert (topo.source, topo.num_nodes, topo.local_sizes) == ("shared-memory", 1, (size,))
    assert topo.local_rank == fresh_comm.Get_rank() and topo.cross_comm.Get_size() == 1


@pytest.mark.mpi(min_size=2)
def test_slurm_nodeid_wins_over_shared_memory_and_numbers_nodes_by_lowest_rank(fresh_comm, monkeypatch):
    rank, size = fresh_comm.Get_rank(), fresh_comm.Get_size()
    # Slurm's node ids need not start at 0 nor follow rank order.
    monkeypatch.setenv("SLURM_NODEID", str(10 - rank % 2))
    monkeypatch.setenv("SLURM_PROCID", str(MPI.COMM_WORLD.Get_rank()))  # srun started each rank
    monkeypatch.delenv("HPCJOBS_RANKS_PER_NODE", raising=False)
    topo = detect(fresh_comm)
    assert topo.source == "slurm"
    assert topo.num_nodes == 2 and topo.node_id == rank % 2
    assert topo.local_sizes == ((size + 1) // 2, size // 2)
    assert topo.local_rank == rank // 2


@pytest.mark.mpi(min_size=2)
def test_slurm_is_ignored_unless_every_rank_has_it(fresh_comm, monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", str(MPI.COMM_WORLD.Get_rank()))
    if fresh_comm.Get_rank() == 0:
        monkeypatch.setenv("SLURM_NODEID", "0")
    else:
        monkeypatch.delenv("SLURM_NODEID", raising=False)
    monkeypatch.delenv("HPCJOBS_RANKS_PER_NODE", raising=False)
    assert detect(fresh_comm).source == "shared-memory"


@pytest.mark.mpi(min_size=2)
def test_slurm_is_ignored_under_mpirun_inside_an_allocation(fresh_comm, monkeypatch):
    # mpirun in a batch job: every rank inherits the batch shell's SLURM_NODEID
    # and SLURM_PROCID (0), whichever host it runs on (seen on emulated hosts,
    # tests/slurm); shared memory tells the hosts apart there.
    monkeypatch.setenv("SLURM_NODEID", str(fresh_comm.Get_rank() % 2))
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.delenv("HPCJOBS_RANKS_PER_NODE", raising=False)
    assert detect(fresh_comm).source == "shared-memory"


@pytest.mark.mpi(min_size=2)
def test_override_wins_over_slurm_from_argument_and_environment(fresh_comm, monkeypatch):
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert detect(fresh_comm, ranks_per_node=1).num_nodes == fresh_comm.Get_size()
    monkeypatch.setenv("HPCJOBS_RANKS_PER_NODE", "1")
    topo = detect(fresh_comm)
    assert topo.source == "override" and topo.num_nodes == fresh_comm.Get_size()


@pytest.mark.parametrize("bad", [0, -2, "two", 1.5, True])  # True: int(True) == 1, one rank per node
def test_bad_ranks_per_node_is_refused(bad, monkeypatch):
    with pytest.raises(ValueError, match="ranks_per_node must be a positive integer"):
        detect(ranks_per_node=bad)
    if bad is True:
        return  # (as a variable it is the string "True", refused as before)
    monkeypatch.setenv("HPCJOBS_RANKS_PER_NODE", str(bad))
    with pytest.raises(ValueError, match="HPCJOBS_RANKS_PER_NODE must be a positive integer"):
        detect()


@pytest.mark.mpi(min_size=2)
def test_ranks_per_node_that_differs_across_ranks_raises_on_every_rank(fresh_comm, monkeypatch):
    # HPCJOBS_RANKS_PER_NODE on one host only: that rank split at once while the others ran the shared-memory
    # detection's collectives, and the job hung (a 2-rank soak, 2026-11-28)
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    monkeypatch.delenv("HPCJOBS_RANKS_PER_NODE", raising=False)
    last = fresh_comm.Get_size() - 1
    others = "rank 0" if last == 1 else f"ranks {','.join(map(str, range(last)))}"
    with pytest.raises(ValueError) as e:
        detect(fresh_comm, ranks_per_node=1 if fresh_comm.Get_rank() == last else None)
    assert str(e.value) == (f"ranks_per_node differs across ranks ({others}: unset; rank {last}: 1): give every "
                            "rank the same (HPCJOBS_RANKS_PER_NODE on every host, or none)")
    topo = detect(fresh_comm, ranks_per_node=1)  # nothing was split: the same call everywhere works
    assert topo.num_nodes == fresh_comm.Get_size() and fresh_comm.allreduce(1) == fresh_comm.Get_size()


@pytest.mark.mpi(min_size=2)
def test_ranks_per_node_invalid_on_one_rank_raises_on_every_rank(fresh_comm, monkeypatch):
    # raised on that rank alone, it left the others waiting in the comparison
    monkeypatch.delenv("HPCJOBS_RANKS_PER_NODE", raising=False)
    last = fresh_comm.Get_size() - 1
    with pytest.raises(ValueError) as e:
        detect(fresh_comm, ranks_per_node=0 if fresh_comm.Get_rank() == last else 1)
    assert str(e.value).startswith("ranks_per_node differs across ranks (") and str(e.value).count(": 1;") == 1
    assert f"rank {last}: ranks_per_node must be a positive integer, got 0)" in str(e.value), str(e.value)
