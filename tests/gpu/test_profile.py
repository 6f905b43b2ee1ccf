"""``plan --measure``'s step profile (hpcjobs/bench/profile.py) on the CPU
and, marked ``cuda``, on a GPU (CUDA events in the gradient hooks): the
gradients come out in the order backward makes them, the classifier's first
and the stem convolution's last, with their bytes and shapes."""

import pytest

torch = pytest.importorskip("torch")

from hpcjobs.bench.profile import profile_step  # noqa: E402
from hpcjobs.bench.workload import Workload  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gradients_are_ready_in_backwards_order(device):
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    w = Workload(model="resnet18", width=64, batch_norm=False, input_size=40, image_size=32, num_classes=1000,
                 batch_size=4, fusion_bytes=1 << 20, lr=0.01, seed=0, device=device)
    step = profile_step(w, steps=2, warmup=1)
    shapes = [t[2] for t in step.tensors]
    fractions = [t[1] for t in step.tensors]
    assert shapes[0] in ((1000, 512), (1000,)) and shapes[1] in ((1000, 512), (1000,))  # fc: the first made
    assert shapes[-1] == (64, 3, 7, 7)  # conv1, the stem: the last
    assert fractions == sorted(fractions) and 0 <= fractions[0] < fractions[-1] <= 1
    assert fractions[0] < 0.5 < fractions[-1]
    assert len(shapes) == 62  # every parameter of torchvision's layout, once
    assert sum(t[0] for t in step.tensors) == 11_689_512 * 4
    assert min(step.forward_s, step.backward_s, step.update_s) > 0
