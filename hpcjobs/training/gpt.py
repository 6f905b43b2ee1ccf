"""A GPT-style decoder: the transformer workload of the training jobs.

The layout is GPT-2's (Radford et al. 2019), with GPT-2's parameter names
(``h.0.attn.c_attn.weight``, ...; GPT-2's checkpoints store the projection
weights transposed):

- ``wte`` token and ``wpe`` position embeddings, added;
- ``layers`` pre-norm blocks, each ``x + attn(ln_1(x))`` then
  ``x + mlp(ln_2(x))``: causal multi-head self-attention through
  :func:`torch.nn.functional.scaled_dot_product_attention` (one fused
  ``c_attn`` projection to queries, keys and values, ``c_proj`` back) and an
  MLP of width ``4 * embed`` with GELU;
- a final LayerNorm ``ln_f`` and an output head that *shares* ``wte``'s
  weight (tied: the logits are ``h @ wte.weight.T``), so the head adds no
  parameters.

No dropout: the data-parallel equivalence tests compare one process with P
ranks step by step, which random masks would break.

Initialisation is GPT-2's: normal(0, 0.02) weights, zero biases, and the
residual projections (``attn.c_proj``, ``mlp.c_proj``) scaled by
``1/sqrt(2 * layers)`` so the residual stream's variance does not grow
with depth.

Presets (:data:`PRESETS`): ``gpt-mini`` (6 layers, 6 heads, 384 wide, 256
bytes of vocabulary, 256 tokens: 10.8M parameters, for CPUs) and
``gpt2-small`` (GPT-2's 124M: 12 layers, 12 heads, 768 wide, 50,257 tokens,
1,024 positions). :func:`gpt` builds a preset with any field replaced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "PRESETS", "GPT", "gpt", "lm_loss"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 256  # positions the model has (the longest input it takes)
    layers: int = 6
    heads: int = 6
    embed: int = 384

    def validate(self) -> None:
        for name in ("vocab", "seq_len", "layers", "heads", "embed"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPT {name} must be >= 1, got {getattr(self, name)}")
        if self.embed % self.heads:
            raise ValueError(f"GPT embed {self.embed} is not a multiple of heads {self.heads}")


PRESETS = {
    "gpt-mini": GPTConfig(vocab=256, seq_len=256, layers=6, heads=6, embed=384),
    "gpt2-small": GPTConfig(vocab=50257, seq_len=1024, layers=12, heads=12, embed=768),
}


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.c_attn = nn.Linear(cfg.embed, 3 * cfg.embed)
        self.c_proj = nn.Linear(cfg.embed, cfg.embed)

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        # (n, t, d) -> (n, heads, t, d / heads)
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(n, t, d))


class _MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.embed, 4 * cfg.embed)
        self.c_proj = nn.Linear(4 * cfg.embed, cfg.embed)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.embed)
        self.attn = _Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.embed)
        self.mlp = _MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(tokens)``: int64 ``(N, T)`` with ``T <= seq_len`` -> logits
    ``(N, T, vocab)``; position ``t``'s logits see tokens ``0..t`` only."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.embed)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.embed)
        self.h = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.embed)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens; this GPT has {self.cfg.seq_len} positions")
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # the head tied to the token embedding


def gpt(preset: str = "gpt-mini", **fields) -> GPT:
    """A GPT of ``preset``'s shape with any :class:`GPTConfig` field replaced
    (``None`` keeps the preset's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown GPT preset {preset!r}; choose from {', '.join(PRESETS)}")
    return GPT(replace(PRESETS[preset], **{k: v for k, v in fields.items() if v is not None}))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of every sequence."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
