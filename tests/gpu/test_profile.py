"""``plan --measure``'s step profile (hpcjobs/bench/profile.py) on the CPU
and, marked ``cuda``, on a GPU (CUDA events in the gradient hooks): the
gradients come out in the order backward makes them, the classifier's first
and the stem convolution's last, with their bytes and shapes."""

import pytest

torch = pytest.importorskip("torch")

from hpcjobs.bench.profile import profile_step  # noqa: E402
from hpcjobs.bench.workload import Workload  # noqa: E402


@pytest.mark.parametrize("device,amp,image,batch", [
    ("cpu", "none", 32, 4),
    # on the GPU a batch the device lags behind: an event recorded on the wrong stream, or the host's clock,
    # would put the stem's gradient early in backward, not at its end
    pytest.param("cuda", "none", 224, 32, marks=pytest.mark.cuda),
    pytest.param("cuda", "bf16", 224, 32, marks=pytest.mark.cuda),
])
def test_gradients_are_ready_in_backwards_order(device, amp, image, batch):
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    w = Workload(model="resnet18", width=64, batch_norm=False, input_size=40, image_size=image, num_classes=1000,
                 batch_size=batch, fusion_bytes=1 << 20, lr=0.01, seed=0, device=device, amp=amp)
    step = profile_step(w, steps=2, warmup=1)
    shapes = [t[2] for t in step.tensors]
    fractions = [t[1] for t in step.tensors]
    assert {shapes[0], shapes[1]} == {(1000, 512), (1000,)}  # fc: the first made
    assert shapes[-1] == (64, 3, 7, 7)  # conv1, the stem: the last, at the end of backward
    # the stem's gradient in the second half of backward, not early in it (a wrong stream or clock). Not near 1.0 on
    # every GPU: the fractions are of the host's backward, and on an H200 (2026-11-27) autograd's own work after the
    # last gradient was 22% of it (the stem at 0.78), time the last bucket's allreduce does overlap in training
    assert fractions[0] < 0.5 < fractions[-1], fractions
    assert len(shapes) == 62  # every parameter of torchvision's layout, once
    assert sum(t[0] for t in step.tensors) == 11_689_512 * 4
    assert min(step.forward_s, step.backward_s, step.update_s) > 0
