"""The data, model and measures of the equivalence tests (P ranks with
batch b against one process with batch P*b), shared by the optimizer's and
the Horovod API's tests."""

import torch

from hpcjobs.training.models import build_model


def global_data(steps, global_batch, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, global_batch, 40, generator=g), torch.randint(0, 10, (steps, global_batch), generator=g)


def fresh_model(seed):
    torch.manual_seed(seed)
    return build_model("mlp", (40,), 10, width=24)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def rel_diff(a, b):
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))
