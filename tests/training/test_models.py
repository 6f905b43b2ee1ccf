"""Models: shapes and per-worker BatchNorm."""

import pytest
import torch

from hpcjobs.training.models import build_model


@pytest.mark.parametrize("name", ["mlp", "cnn1d"])
@pytest.mark.parametrize("shape", [(40,), (8, 8), (3, 32, 32)])
def test_models_map_inputs_to_class_scores(name, shape):
    model = build_model(name, shape, 10, width=16, batch_norm=True)
    out = model(torch.randn(4, *shape))
    assert out.shape == (4, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_batch_norm_layers_only_when_asked():
    plain = build_model("mlp", (40,), 10)
    bn = build_model("mlp", (40,), 10, batch_norm=True)
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in plain.modules())
    assert sum(isinstance(m, torch.nn.BatchNorm1d) for m in bn.modules()) == 2


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet", (40,), 10)
