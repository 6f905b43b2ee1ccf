"""What :class:`~hpcjobs.training.DistributedOptimizer` shows besides
stepping: its counters, its compression state for checkpoints, the
non-finite check of the averages, and the wrapped optimizer's fields as
torch code expects of an optimizer.

It is a ``torch.optim.Optimizer`` (without that class's ``__init__``), so
that what insists on one takes it: learning-rate schedulers
(``torch.optim.lr_scheduler``, which count its ``step()``), a GradScaler.
``param_groups``, ``state``, ``defaults``, ``state_dict()`` and
``load_state_dict()`` are the wrapped optimizer's, as are the hooks
registered through it (``register_step_pre_hook`` and the like: they run
around the wrapped optimizer's step, on the averages, and are passed it).
``add_param_group`` is refused (the new parameters would not be reduced), as
are pickling and copying (hooks, a thread, a communicator)."""

from __future__ import annotations

import torch

__all__ = ["OptimizerState"]


class OptimizerState(torch.optim.Optimizer):
    """Mixed into DistributedOptimizer (``_buckets``, ``_alone``, ``_step``,
    ``_counted``, ``memory``, ``compression``, ``_optimizer`` are its)."""

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("add_param_group() on a DistributedOptimizer: its parameters are laid out in buckets "
                           "when it is made and new ones would not be reduced; add the group to the optimizer "
                           "before wrapping it")

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer cannot be pickled or copied (it holds hooks, a thread and a "
                        "communicator): save its state_dict() and compression_state_dict()")

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
    defaults = property(lambda self: self._optimizer.defaults)
    register_step_pre_hook = property(lambda self: self._optimizer.register_step_pre_hook)
    register_step_post_hook = property(lambda self: self._optimizer.register_step_post_hook)
    register_state_dict_pre_hook = property(lambda self: self._optimizer.register_state_dict_pre_hook)
    register_state_dict_post_hook = property(lambda self: self._optimizer.register_state_dict_post_hook)
    register_load_state_dict_pre_hook = property(lambda self: self._optimizer.register_load_state_dict_pre_hook)
    register_load_state_dict_post_hook = property(lambda self: self._optimizer.register_load_state_dict_post_hook)
