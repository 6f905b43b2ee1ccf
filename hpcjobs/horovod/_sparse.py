"""``hvd.sparse_allreduce_async``: a sparse tensor's reduction, as Horovod
computes it -- an allgather of every rank's indices and one of its values
(requests to the controller named ``<name>.indices`` and ``<name>.values``),
the gathered pairs making one sparse tensor whose duplicate indices sum
(divided by the set's size for Average). It returns a function, not a
handle: call it to wait and get the result.

A third, small allgather (``<name>.size``) brings every rank's dense size:
where Horovod would build a tensor whose indices lie outside one rank's
shape, every rank here raises ValueError naming the sizes, and the result
is built with torch's invariant checks on.
"""

from __future__ import annotations

import torch

from ._ops import allgather_async
from ._handles import synchronize
from ._process_sets import ranks_of
from ._state import Average, Sum, global_process_set

__all__ = ["sparse_allreduce_async"]


def sparse_allreduce_async(tensor: torch.Tensor, name, op, process_set=global_process_set):
    """Start reducing the sparse ``tensor`` (op Average or Sum) over the set;
    returns a function that waits and returns the sparse result.

    Raises:
        ValueError: ``tensor`` is not sparse, or op is neither Average nor Sum.
    """
    if not tensor.is_sparse:
        raise ValueError(f"sparse_allreduce_async takes a sparse tensor (torch.sparse_coo), got {tensor.layout}")
    if op not in (Average, Sum):
        raise ValueError("sparse_allreduce_async reduces with op=hvd.Average or op=hvd.Sum")
    t = tensor.coalesce()
    size = len(ranks_of(process_set))
    # allgather joins along the first dimension: the indices travel as rows (nnz x ndim).
    indices = allgather_async(t.indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t.values().contiguous(), name=f"{name}.values", process_set=process_set)
    sizes = allgather_async(torch.tensor([list(t.size())], dtype=torch.int64), name=f"{name}.size",
                            process_set=process_set)

    def wait() -> torch.Tensor:
        v = synchronize(values)
        i = synchronize(indices)
        shapes = [tuple(row) for row in synchronize(sizes).tolist()]
        if len(set(shapes)) != 1:
            raise ValueError(f"sparse_allreduce_async '{name}': the ranks' tensors differ in size "
                             f"({', '.join(f'rank {r}: {list(s)}' for r, s in zip(ranks_of(process_set), shapes))}); "
                             "every rank must pass a tensor of the same dense size")
        if op == Average:
            v = v / size
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, t.size(), check_invariants=True).coalesce()

    return wait
