"""ResNet-18/50 keep torchvision's layout: its parameter counts and state
dict keys (so weights load either way; the GPU check compares with
torchvision itself where it imports)."""

import pytest
import torch

from hpcjobs.training.resnet import resnet18, resnet50


@pytest.mark.parametrize("build,params,entries", [(resnet18, 11_689_512, 122), (resnet50, 25_557_032, 320)])
def test_torchvisions_parameter_counts_and_state_dict(build, params, entries):
    model = build()
    assert sum(p.numel() for p in model.parameters()) == params
    keys = list(model.state_dict())
    assert len(keys) == entries
    assert keys[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"] and keys[-2:] == ["fc.weight", "fc.bias"]
    assert "layer2.0.downsample.1.running_var" in keys and "layer4.1.bn2.num_batches_tracked" in keys


def test_small_images_and_another_norm_layer():
    model = resnet18(num_classes=10, norm_layer=lambda c: torch.nn.GroupNorm(1, c))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_the_same_names_and_shapes_as_torchvision(name):
    """Where torchvision imports (the GPU machine; PyPI's CUDA wheels do not
    import with CPU torch, so CI skips this), its ResNets and ours have the
    same state-dict keys and shapes, and its weights load into ours."""
    try:
        import torchvision.models as tv
    except Exception as e:  # noqa: BLE001 -- ImportError, or a wheel built for another torch
        pytest.skip(f"torchvision does not import here ({type(e).__name__}: {e})")
    import hpcjobs.training.resnet as ours

    theirs = getattr(tv, name)(weights=None).state_dict()
    mine = getattr(ours, name)()
    assert [(k, tuple(v.shape)) for k, v in mine.state_dict().items()] == \
        [(k, tuple(v.shape)) for k, v in theirs.items()]
    mine.load_state_dict(theirs)
    x = torch.randn(2, 3, 64, 64)
    reference = getattr(tv, name)(weights=None)
    reference.load_state_dict(theirs)
    torch.testing.assert_close(mine.eval()(x), reference.eval()(x))
