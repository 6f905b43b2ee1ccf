"""Models for the training jobs: an MLP and a 1-D CNN (the MNIST-1D paper's
baselines: an MLP with two hidden layers of 100, and a three-layer
convolutional net with 25 channels; here the widths are parameters), and
by name the real ones: ResNet-18/50 (:mod:`hpcjobs.training.resnet`) and
the GPTs (:mod:`hpcjobs.training.gpt`).

``batch_norm=True`` inserts BatchNorm after each hidden layer; its statistics
are per worker, computed over the rank's own ``b`` samples (Goyal et al. 2017
sec. 2.3: the BN batch is the per-worker batch, never the global one).
"""

from __future__ import annotations

import math

from torch import nn

from .config import DEFAULT_WIDTH, GPT_MODELS, IMAGE_MODELS, MIN_IMAGE_SIZE, MODELS

__all__ = ["MODELS", "MLP", "CNN1D", "build_model", "DEFAULT_WIDTH"]


class MLP(nn.Module):
    """Flatten -> [Linear -> (BN) -> ReLU] * len(hidden) -> Linear."""

    def __init__(self, in_features: int, num_classes: int, hidden: tuple[int, ...] = (256, 256),
                 batch_norm: bool = False):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers.append(nn.Linear(width, h))
            if batch_norm:
                layers.append(nn.BatchNorm1d(h))
            layers.append(nn.ReLU())
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class CNN1D(nn.Module):
    """Three strided 1-D convolutions (kernel 5, stride 2, padding 2), then a
    linear classifier over the flattened features. Input (N, L) or (N, C, L)."""

    def __init__(self, length: int, num_classes: int, in_channels: int = 1, channels: int = 32,
                 batch_norm: bool = False):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for _ in range(3):
            layers.append(nn.Conv1d(c, channels, kernel_size=5, stride=2, padding=2))
            if batch_norm:
                layers.append(nn.BatchNorm1d(channels))
            layers.append(nn.ReLU())
            c = channels
            length = (length + 2 * 2 - 5) // 2 + 1
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels * length, num_classes)
        self.in_channels = in_channels

    def forward(self, x):
        if x.ndim == 2:
            x = x.unsqueeze(1)
        return self.classifier(self.features(x).flatten(1))


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, *, width: int | None = None,
                batch_norm: bool = False, tokens: bool = False, **gpt_shape: int | None) -> nn.Module:
    """A model for inputs of ``input_shape`` (one sample, no batch dim).

    ``cnn1d`` reads (L,) as one channel and (C, H, W) images as C channels of
    length H*W. ``width``: hidden units of the MLP (two layers) or channels
    of the CNN. The ResNets take (3, H, W) images of at least 32 pixels a
    side. The GPTs take ``tokens`` (a text dataset): (T,) token ids from a
    vocabulary of ``num_classes``; ``gpt_shape``: ``layers``, ``heads``,
    ``embed`` (None: the preset's).

    Raises:
        ValueError: an unknown name, or data the model cannot take.
    """
    if name in GPT_MODELS and not tokens:
        raise ValueError(f"{name} is a language model: it trains on the text dataset")
    if tokens and name not in GPT_MODELS:
        raise ValueError(f"the text dataset is for the GPTs ({', '.join(GPT_MODELS)}), not {name}")
    if name in GPT_MODELS:
        from .gpt import gpt

        return gpt(name, vocab=num_classes, seq_len=input_shape[0], **gpt_shape)
    if name in IMAGE_MODELS:
        if len(input_shape) != 3 or input_shape[0] != 3 or min(input_shape[1:]) < MIN_IMAGE_SIZE:
            raise ValueError(f"{name} takes 3-channel images of at least {MIN_IMAGE_SIZE}x{MIN_IMAGE_SIZE} "
                             f"(cifar10); this dataset's samples are {tuple(input_shape)}")
        from . import resnet

        return getattr(resnet, name)(num_classes=num_classes)
    if name == "mlp":
        return MLP(math.prod(input_shape), num_classes, hidden=(width or DEFAULT_WIDTH["mlp"],) * 2,
                   batch_norm=batch_norm)
    if name == "cnn1d":
        if len(input_shape) == 1:
            channels, length = 1, input_shape[0]
        else:
            channels, length = input_shape[0], math.prod(input_shape[1:])
        return _Reshape(CNN1D(length, num_classes, in_channels=channels, channels=width or DEFAULT_WIDTH["cnn1d"],
                              batch_norm=batch_norm), (channels, length))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS + IMAGE_MODELS + GPT_MODELS)}")


class _Reshape(nn.Module):
    def __init__(self, inner: nn.Module, shape: tuple[int, int]):
        super().__init__()
        self.inner = inner
        self.shape = shape

    def forward(self, x):
        return self.inner(x.reshape(x.shape[0], *self.shape))
