"""What :class:`~hpcjobs.training.DistributedOptimizer` shows besides
stepping: its counters, its compression state for checkpoints, the
non-finite check of the averages, and the wrapped optimizer's fields as
torch code expects of an optimizer."""

from __future__ import annotations

__all__ = ["OptimizerState"]


class OptimizerState:
    """Mixed into DistributedOptimizer (``_buckets``, ``_alone``, ``_step``,
    ``_counted``, ``memory``, ``compression``, ``_optimizer`` are its)."""

    def nonfinite_parameters(self) -> list[str]:
        """Names of the parameters whose averaged gradient (after
        :meth:`synchronize`) holds a NaN or an Inf."""
        return [name for b in self._buckets for name in (b.nonfinite_grads() if self._alone else b.nonfinite())]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def reset_stats(self) -> None:
        """Zero the counters: ``comm_s`` (time in allreduce, on the thread), ``wait_s`` (time ``step()`` spent
        before the optimizer ran), ``steps``, ``skipped_steps`` (non-finite gradients), ``allreduces``,
        ``sent_bytes`` (bytes this rank sent, counted with compression or a message-passing algorithm, else 0),
        ``grad_sq_rank``/``grad_sq_avg`` (``noise_scale``: squared norms over ``noise_steps``, finite ones)."""
        self.stats = {"comm_s": 0.0, "wait_s": 0.0, "steps": 0, "allreduces": 0, "sent_bytes": 0,
                      "skipped_steps": 0, "grad_sq_rank": 0.0, "grad_sq_avg": 0.0, "noise_steps": 0}

    @property
    def counts_bytes(self) -> bool:
        """Whether ``stats["sent_bytes"]`` counts: with compression, or with
        a message-passing algorithm (shared memory sends no messages)."""
        return self._counted

    def compression_state_dict(self) -> dict:
        """This rank's compression state: the step count, the error-feedback
        residuals and the compressor's own state (PowerSGD's warm start).
        Residuals differ from rank to rank: checkpoint every rank's."""
        return {"step": self._step,
                "memory": self.memory.state_dict() if self.memory is not None else None,
                "compressor": self.compression.state_dict() if hasattr(self.compression, "state_dict") else None}

    def load_compression_state_dict(self, state: dict) -> None:
        self._step = int(state["step"])
        if self.memory is not None and state.get("memory") is not None:
            self.memory.load_state_dict(state["memory"])
        if state.get("compressor") is not None and hasattr(self.compression, "load_state_dict"):
            self.compression.load_state_dict(state["compressor"])

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    # the wrapped optimizer, and its fields as torch code expects of an optimizer
    optimizer = property(lambda self: self._optimizer)
    param_groups = property(lambda self: self._optimizer.param_groups)
    state = property(lambda self: self._optimizer.state)
    state_dict = property(lambda self: self._optimizer.state_dict)
    load_state_dict = property(lambda self: self._optimizer.load_state_dict)
