"""Every allreduce across emulated hosts, checked against MPI_Allreduce and
the closed form (tests/conftest.py's check_allreduce), with the agreement
check on. Run by tests/cluster under ``scripts/emulated_cluster.sh mpirun``;
prints one line per case that went wrong, then, on rank 0, a summary:

    across: P ranks on N hosts, C cases, W wrong, R refused, K pipelined

(K: calls on rank 0 that took hierarchical's pipelined path.)
"""

import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpcjobs as hc  # noqa: E402
from hpcjobs.collectives import hierarchical_allreduce  # noqa: E402
from hpcjobs.collectives.agreement import MismatchError  # noqa: E402
from conftest import check_allreduce, make_buffer, rank_input  # noqa: E402
from hpcjobs.collectives.names import ALGORITHMS, MESSAGE_ALGORITHMS, SHARED_MEMORY  # noqa: E402
from hpcjobs.topology import detect  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
topo = detect()
COUNTS = (0, 1, size + 1, 1000, 262_147)  # 262147 float32: 1 MB, several segments per rank
CASES = [(a, {}) for a in ("auto", *ALGORITHMS) if a != "hierarchical"]
CASES += [("hierarchical", {"inter": inter, "intra": intra}) for inter in MESSAGE_ALGORITHMS
          for intra in ("ring", "shm")]
# The pipelined path (hierarchical's default across hosts): 4 segments by
# default at 1048583 float32s, and many small ones asked for.
PIPELINED = [({"intra": intra}, 1_048_583) for intra in ("ring", "shm")]
PIPELINED += [({"intra": "shm", "inter": "recursive_doubling", "segment_bytes": 65_536}, 262_147)]
DATA = [("sum", "float32", "numpy"), ("max", "float64", "numpy"), ("sum", "int64", "torch"), ("avg", "float32", "torch")]

from hpcjobs.collectives import hierarchical as _hier  # noqa: E402

pipelined = 0  # calls that took the pipelined path (equal hosts of 2+ ranks)
_run_pipelined = _hier._pipelined


def _counted(*args, **kwargs):
    global pipelined
    pipelined += 1
    return _run_pipelined(*args, **kwargs)


_hier._pipelined = _counted

cases = wrong = refused = 0
for name, kw, count, op, dtype, framework in (
        [(n, k, c, *d) for n, k in CASES for d in DATA for c in COUNTS]
        + [("hierarchical", k, c, *d) for k, c in PIPELINED for d in DATA]):
    inputs = [rank_input(r, count, dtype, op) for r in range(size)]
    buf = make_buffer(inputs[rank], dtype, framework)
    error = None
    try:
        if name == "hierarchical":
            hierarchical_allreduce(buf, op, **kw)
        else:
            hc.allreduce(buf, op, algorithm=name)
    except ValueError as e:  # refused, on every rank alike (the shared-memory ones across nodes)
        error = str(e)
    errors = comm.allgather(error)
    cases += 1
    label = f"{name}{kw or ''} {op} {dtype}/{framework} count={count}"
    if any(errors):
        if name in SHARED_MEMORY and topo.num_nodes > 1 and all(e and "one node" in e for e in errors):
            refused += 1
            continue
        wrong += 1
        print(f"rank {rank}: {label}: raised {errors}", flush=True)
        continue
    try:
        check_allreduce(buf, inputs, op, dtype, comm)
    except AssertionError:
        wrong += 1
        print(f"rank {rank}: {label}: wrong result\n{traceback.format_exc(limit=2)}", flush=True)

# The agreement check across hosts: the last rank (on the last host) passes
# one element more; every rank must get MismatchError, none a result.
for name in ("auto", "ring", "hierarchical"):
    buf = np.ones(10 + (rank == size - 1), np.float32)
    try:
        hc.allreduce(buf, algorithm=name)
        raised = None
    except MismatchError as e:
        raised = str(e)
    cases += 1
    if not all(comm.allgather(raised is not None)):
        wrong += 1
        print(f"rank {rank}: {name} with a count mismatch across hosts: {raised or 'no MismatchError'}", flush=True)

wrong = comm.allreduce(wrong, op=MPI.SUM)
if rank == 0:
    print(f"across: {size} ranks on {topo.num_nodes} hosts {list(topo.local_sizes)}, {cases} cases, {wrong} wrong, "
          f"{refused} refused, {pipelined} pipelined", flush=True)
sys.exit(1 if wrong else 0)
