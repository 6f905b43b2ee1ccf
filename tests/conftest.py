"""Shared fixtures: communicators, per-rank inputs and exact references.

Every rank's input comes from a seed, so any rank can generate *every*
rank's and compute the closed-form reduction in float64 (int64 for
integers) without trusting the collective under test; where the MPI has the
dtype, ``MPI_Allreduce`` on the same inputs is the second reference.
:func:`check_allreduce` has the ranks compare their results bitwise (a hash,
MIN and MAX through MPI) and rank 0 check its own against both references,
so every rank's result is checked while only rank 0 generates the others'
inputs (:class:`RankInputs` makes each when first read): on every rank that
was P times the work, the most of a 5-rank test run on 2 cores.
"""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Sequence

import numpy as np
import pytest
from mpi4py import MPI

OPS = ("sum", "avg", "min", "max", "prod")
INT_DTYPES = ("int32", "int64")
FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")
DTYPES = FLOAT_DTYPES + INT_DTYPES
MPI_DTYPES = ("float32", "float64", "int32", "int64")  # MPI_Allreduce is a reference for these
# (framework, dtype) of the buffers every algorithm's op x dtype x count matrix runs on...
BUFFERS = [("numpy", d) for d in ("float16", "float32", "float64", "int32", "int64")] + \
          [("torch", d) for d in ("float32", "int64", "bfloat16")]
# ... and the ring's, which takes every torch dtype too.
ALL_BUFFERS = [("numpy", d) for d in ("float16", "float32", "float64", "int32", "int64")] + \
              [("torch", d) for d in ("float16", "float32", "float64", "int32", "int64", "bfloat16")]
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}
_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}


def count_for(label: str, size: int) -> int:
    """Counts named relative to the group size P (0, 1, P-1, P+1, a prime)."""
    return {"0": 0, "1": 1, "P-1": size - 1, "P+1": size + 1, "prime": 1_000_003}[label]


COUNT_LABELS = ("0", "1", "P-1", "P+1", "prime")


def rank_input(rank: int, count: int, dtype: str, op: str, seed: int = 1234) -> np.ndarray:
    """Rank ``rank``'s input as float64/int64 values exactly representable in ``dtype``.

    Integers are small so sums and products of up to 8 ranks stay exact; prod
    uses factors near 1 (floats) or in [-3, 3] \\ {0} (integers) so nothing
    overflows.
    """
    rng = np.random.default_rng([seed, rank, count, len(op), len(dtype)])
    if dtype in INT_DTYPES:
        if op == "prod":
            vals = rng.integers(1, 4, count) * rng.choice([-1, 1], count)
        else:
            vals = rng.integers(-1000, 1000, count)
        return vals.astype(np.int64)
    vals = rng.uniform(0.5, 2.0, count) if op == "prod" else rng.standard_normal(count) * 10
    return to_float64(from_float64(vals, dtype), dtype)


class RankInputs(Sequence):
    """The inputs of ranks 0..size-1 (:func:`rank_input`), each generated
    when first read: a rank reads its own, and the rank that checks the
    closed form reads them all."""

    def __init__(self, size: int, count: int, dtype: str, op: str, seed: int = 1234):
        self.size, self.args, self._made = size, (count, dtype, op, seed), {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(self.size))]
        if not -self.size <= r < self.size:
            raise IndexError(r)
        r %= self.size
        if r not in self._made:
            self._made[r] = rank_input(r, *self.args)
        return self._made[r]


def from_float64(vals: np.ndarray, dtype: str):
    """float64 values -> numpy array of ``dtype`` (bfloat16: torch tensor)."""
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(np.ascontiguousarray(vals)).to(torch.bfloat16)
    return np.asarray(vals).astype(dtype)


def to_float64(arr, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return arr.to(dtype=__import__("torch").float64).numpy()
    return np.asarray(arr, dtype=np.int64 if dtype in INT_DTYPES else np.float64)


def make_buffer(values: np.ndarray, dtype: str, framework: str):
    """The buffer under test, holding ``values``, as numpy or torch."""
    if framework == "torch":
        import torch

        if dtype == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16)
        return torch.from_numpy(values.astype(dtype))
    return values.astype(dtype)


_FOLDS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def _fold(inputs: Sequence[np.ndarray], ufunc, each=None) -> np.ndarray:
    """``ufunc`` over the inputs in rank order, elementwise (``each`` applied
    to every input first), into one new array: no P x count stack."""
    out = np.array(inputs[0] if each is None else each(inputs[0]))
    for x in inputs[1:]:
        ufunc(out, x if each is None else each(x), out=out)
    return out


def closed_form(inputs: Sequence[np.ndarray], op: str) -> np.ndarray:
    out = _fold(inputs, _FOLDS[op])
    if op == "avg":
        out = out // len(inputs) if out.dtype.kind == "i" else out / len(inputs)
    return out


def tolerance(inputs: Sequence[np.ndarray], op: str, dtype: str) -> np.ndarray | float:
    """Elementwise bound on |result - exact| for ``dtype`` arithmetic.

    Each of the P-1 additions rounds once (relative error eps/2), so a sum is
    within (P-1)·eps/2·Σ|x| of the exact sum, plus the final rounding; avg
    adds one rounded division; a product of P factors is within about
    P·eps relative. We allow twice these. Integers, min and max are exact.
    """
    if dtype in INT_DTYPES or op in ("min", "max"):
        return 0.0
    eps, size = _EPS[dtype], len(inputs)
    abs_sum = _fold(inputs, np.add, np.abs)
    if op == "sum":
        return 2 * size * eps * abs_sum
    if op == "avg":
        return 2 * size * eps * abs_sum / size + 2 * eps * np.abs(closed_form(inputs, op))
    return 2 * size * eps * np.abs(closed_form(inputs, op))


def assert_close(result, inputs: Sequence[np.ndarray], op: str, dtype: str) -> None:
    got = to_float64(result, dtype)
    want = closed_form(inputs, op)
    tol = tolerance(inputs, op, dtype)
    bad = np.abs(got - want) > tol
    assert not bad.any(), (
        f"{int(bad.sum())} of {got.size} elements off; first at {int(np.argmax(bad))}: "
        f"got {got[bad][:3]}, want {want[bad][:3]}"
    )


def mpi_reference(values: np.ndarray, dtype: str, op: str, comm: MPI.Comm) -> np.ndarray:
    """``MPI_Allreduce`` of this rank's ``values`` as ``dtype`` (avg = sum, then divide)."""
    buf = values.astype(dtype)
    comm.Allreduce(MPI.IN_PLACE, buf, op=_MPI_OPS[op])
    if op == "avg":
        buf = buf // comm.Get_size() if buf.dtype.kind == "i" else (buf / buf.dtype.type(comm.Get_size())).astype(dtype)
    return buf


def assert_same_on_every_rank(result, comm: MPI.Comm) -> None:
    """Every rank must hold bitwise the same result."""
    if hasattr(result, "numpy"):
        result = result.view(__import__("torch").int16) if result.dtype.is_floating_point and result.element_size() == 2 else result
        result = result.numpy()
    digest = np.frombuffer(hashlib.blake2b(result.tobytes(), digest_size=8).digest(), dtype=np.int64).copy()
    lo, hi = digest.copy(), digest.copy()
    comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
    comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
    assert lo[0] == hi[0], "ranks disagree on the result"


def check_allreduce(out, inputs: Sequence[np.ndarray], op: str, dtype: str, comm: MPI.Comm) -> None:
    """The result of an allreduce of ``inputs`` on this rank: bitwise equal
    on every rank and, checked on rank 0 (so on every rank), the closed form
    within the rounding bound and equal to ``MPI_Allreduce`` of the same data
    where the MPI has the dtype. Every collective call comes before the
    first assert: a rank failing alone must not leave the others waiting in
    an Allreduce it skipped."""
    ref = mpi_reference(inputs[comm.Get_rank()], dtype, op, comm) if dtype in MPI_DTYPES else None
    assert_same_on_every_rank(out, comm)
    if comm.Get_rank() != 0:
        return  # bitwise rank 0's, which is checked below
    assert_close(out, inputs, op, dtype)
    if ref is not None:
        diff = np.abs(to_float64(out, dtype) - ref.astype(np.float64))
        assert (diff <= 2 * tolerance(inputs, op, dtype)).all()


def pytest_configure(config):
    """A SIGTERM (``scripts/test.sh`` stopped by Ctrl-C or CI, or its stage's
    timeout) ends the session as Ctrl-C does: ``finally`` blocks and the
    fixtures' teardown run, so what the tests started in sessions of their
    own (``tests/launch.py``: mpirun and its ranks, jobs on the emulated
    cluster) is killed and the cluster taken down. Python's default ended
    pytest at once and left them running into the next stage."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupted)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip, saying why, where no GPU is visible."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    try:
        import torch

        reason = None if torch.cuda.is_available() else "no CUDA GPU is visible (scripts/gpu_check.sh runs these)"
    except ImportError as e:
        reason = f"torch is not importable: {e}"
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def split_comm():
    """COMM_WORLD split into even and odd ranks (sizes ceil(P/2), floor(P/2))."""
    world = MPI.COMM_WORLD
    sub = world.Split(world.Get_rank() % 2, world.Get_rank())
    yield sub
    sub.Free()


@pytest.fixture(params=("world", "split"))
def comm(request, split_comm):
    return MPI.COMM_WORLD if request.param == "world" else split_comm


@pytest.fixture(scope="session")
def emulated_cluster():
    """The emulated cluster (tests/emulated.py): 3 hosts, brought up once per
    session by scripts/emulated_cluster.sh and down at the end."""
    import emulated

    cluster = emulated.start()
    yield cluster
    cluster.down()
