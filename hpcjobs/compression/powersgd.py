"""PowerSGD: low-rank gradient compression by one step of power iteration
(Vogels, Karimireddy & Jaggi, NeurIPS 2019; torch's
``ddp_comm_hooks/powerSGD_hook.py``).

A gradient of shape (n, ...) is seen as an n x m matrix M (m = the product
of the other dimensions). With a rank r and a matrix Q (m x r) that every
rank holds identically:

1. P = M Q                        (n x r, local)
2. allreduce P (mean)             -- linear in M because Q is shared, so
                                     the mean of the P's is mean(M) Q
3. P = orthonormalise(P)          (the same on every rank: same input)
4. Q = M^T P                      (m x r, local)
5. allreduce Q (mean)             -- linear in M because P is shared
6. M ~ P Q^T                      the rank-r approximation of mean(M)
7. warm start: keep Q for this tensor's next step (their Algorithm 1), so
   the power iteration goes on across steps instead of starting over.

Bytes: the allreduces carry (n + m) r values instead of n m. Tensors that
would not shrink by at least 2x -- 1-D tensors (biases, norms) and small
matrices -- are sent uncompressed through the same allreduce, as torch
does. Before ``start_iter`` every tensor is sent uncompressed (torch's
``start_powerSGD_iter``, a vanilla warm-up for the early, fast-changing
gradients).

Error feedback (their Algorithm 2) needs this rank's own part of the
approximation: P Q_local^T with Q_local from step 4 before the allreduce.
The ranks' local parts average to exactly the result of step 6, so with
residual e = M - P Q_local^T nothing is lost across the ranks.

State: the warm-start Q of every tensor, by name (``state_dict``); it is
the same on every rank.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from .base import Compressor, check_float, check_seed

__all__ = ["PowerSGDCompressor"]

MIN_COMPRESSION_RATE = 2


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` approximation by power iteration (summable factors)."""

    summable = True

    def __init__(self, rank: int = 2, warm_start: bool = True, start_iter: int = 0, seed: int = 0):
        if isinstance(rank, bool) or int(rank) != rank or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if isinstance(start_iter, bool) or int(start_iter) != start_iter or start_iter < 0:
            raise ValueError(f"start_iter must be an integer >= 0, got {start_iter!r}")
        self.rank = int(rank)
        self.warm_start = bool(warm_start)
        self.start_iter = int(start_iter)
        self.seed = check_seed(seed)
        # name -> Q (m x r, fp32) from the tensor's previous step; the same
        # on every rank, because it is the output of an allreduce.
        self._q: dict[str, torch.Tensor] = {}

    def compresses(self, shape: torch.Size, itemsize: int = 4) -> bool:
        """Whether a tensor of ``shape`` and ``itemsize`` bytes an entry is
        sent as factors (else whole), which travel as fp32: by bytes, so a
        half-precision tensor is not sent as factors that save it nothing."""
        if len(shape) < 2:
            return False
        n = shape[0]
        m = shape.numel() // n if n else 0
        return n * m > 0 and n * m * itemsize >= MIN_COMPRESSION_RATE * (n + m) * self.rank * 4

    def _initial_q(self, name: str | None, m: int, step: int) -> torch.Tensor:
        # From (seed, name[, step]) alone, so every rank starts from the same Q.
        key = [self.seed, zlib.crc32((name or "").encode())] + ([] if self.warm_start else [int(step)])
        g = torch.Generator().manual_seed(int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]))
        return torch.randn(m, self.rank, generator=g)

    def _q_for(self, name: str | None, m: int, step: int, device="cpu") -> torch.Tensor:
        q = self._q.get(name) if self.warm_start else None
        if q is None or q.shape != (m, self.rank):
            q = self._initial_q(name, m, step)  # drawn on the host: the same on every rank
        return q.to(device)

    @staticmethod
    def _orthonormalise(p: torch.Tensor) -> torch.Tensor:
        return torch.linalg.qr(p, mode="reduced").Q

    def compress(self, tensor: torch.Tensor, name=None, step=0):
        """One rank's steps 1-4 with no communication (what ``reduce_mean``
        computes when there is one rank): payload ``(P, Q)`` with P
        orthonormal, or ``(tensor,)`` for a tensor sent whole."""
        check_float(self, tensor)
        if step < self.start_iter or not self.compresses(tensor.shape, tensor.element_size()):
            return (tensor,), (tensor.shape, tensor.dtype, False)
        m_ = tensor.reshape(tensor.shape[0], -1).float()
        p = self._orthonormalise(m_ @ self._q_for(name, m_.shape[1], step, m_.device))
        return (p, m_.t() @ p), (tensor.shape, tensor.dtype, True)

    def decompress(self, payload, ctx) -> torch.Tensor:
        shape, dtype, factored = ctx
        if not factored:
            return payload[0].reshape(shape).to(dtype)
        p, q = payload
        r = self.rank
        return (p.reshape(shape[0], r) @ q.reshape(-1, r).t()).to(dtype).reshape(shape)

    def reduce_mean(self, tensor: torch.Tensor, allreduce_mean, name=None, step=0):
        """Steps 1-7 with ``allreduce_mean(buffer)`` (in place) for 2 and 5.

        Returns:
            ``(mean, local)``: the approximation of the mean over the ranks,
            and this rank's own part of it (for error feedback).
        """
        check_float(self, tensor)
        if step < self.start_iter or not self.compresses(tensor.shape, tensor.element_size()):
            mean = tensor.clone(memory_format=torch.contiguous_format)  # the allreduce takes flat memory
            allreduce_mean(mean)
            return mean, tensor
        shape, dtype = tensor.shape, tensor.dtype
        m_ = tensor.reshape(shape[0], -1).float()
        p = m_ @ self._q_for(name, m_.shape[1], step, m_.device)       # 1
        allreduce_mean(p)                                              # 2
        p = self._orthonormalise(p).contiguous()                       # 3
        q_local = m_.t() @ p                                           # 4
        q = q_local.clone()
        allreduce_mean(q)                                              # 5
        if self.warm_start:                                            # 7
            if bool(torch.isfinite(q).all()) and bool(torch.linalg.vector_norm(q, dim=0).gt(0).all()):
                self._q[name] = q
            else:  # start again from the seed's Q: not from an overflowed step's NaN (skipped by the caller),
                # nor from a zero column (a gradient of zeros: a parameter unused in a step), whose P is zero
                # and orthonormalised to a fixed basis, so Q = M^T e_1..e_r: zero for good where those rows are
                self._q.pop(name, None)
        mean = (p @ q.t()).to(dtype).reshape(shape)                    # 6
        local = (p @ q_local.t()).to(dtype).reshape(shape)
        return mean, local

    def state_dict(self) -> dict:
        return {"q": {k: v.clone() for k, v in self._q.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._q = {k: v.clone() for k, v in state["q"].items()}

    def __repr__(self) -> str:
        return (f"PowerSGDCompressor(rank={self.rank}, warm_start={self.warm_start}, "
                f"start_iter={self.start_iter}, seed={self.seed})")
