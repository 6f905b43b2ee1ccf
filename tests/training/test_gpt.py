"""The GPT-style decoder: GPT-2's parameter count and names, causal
attention, the tied head, and clear errors for shapes it cannot take."""

import pytest
import torch

from hpcjobs.training.config import GPT_MODELS
from hpcjobs.training.gpt import PRESETS, GPT, GPTConfig, gpt, lm_loss


def test_the_presets_are_the_names_the_command_line_offers():
    assert tuple(PRESETS) == GPT_MODELS


def test_gpt2_small_has_gpt2s_124m_parameters_and_names():
    model = gpt("gpt2-small")
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small, head tied
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["wte.weight", "wpe.weight"] and names[-2:] == ["ln_f.weight", "ln_f.bias"]
    assert "h.11.attn.c_attn.weight" in names and "h.0.mlp.c_proj.bias" in names and len(names) == 148


def test_gpt_mini_size_and_overrides():
    assert sum(p.numel() for p in gpt("gpt-mini").parameters()) == 10_844_160
    small = gpt("gpt-mini", layers=2, embed=64, heads=4, seq_len=16, vocab=50)
    assert small.cfg == GPTConfig(vocab=50, seq_len=16, layers=2, heads=4, embed=64)
    # per block 12 d^2 + 13 d, plus the embeddings and the final norm
    assert sum(p.numel() for p in small.parameters()) == 2 * (12 * 64 ** 2 + 13 * 64) + (50 + 16) * 64 + 2 * 64


def test_a_position_sees_only_the_tokens_before_it():
    torch.manual_seed(0)
    model = gpt("gpt-mini", layers=2, embed=48, heads=3, seq_len=12).eval()
    tokens = torch.randint(0, 256, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    a, b = model(tokens), model(changed)
    assert a.shape == (2, 12, 256)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert (a[:, 7:] - b[:, 7:]).abs().amax(dim=-1).min() > 0


def test_the_head_is_the_token_embedding():
    torch.manual_seed(0)
    model = gpt("gpt-mini", layers=1, embed=32, heads=2, seq_len=8, vocab=20)
    x = torch.randint(0, 20, (3, 8))
    h = model.ln_f(model.h[0](model.wte(x) + model.wpe(torch.arange(8))))
    torch.testing.assert_close(model(x), h @ model.wte.weight.T)
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    assert model.wte.weight.grad is not None and not any("head" in n for n, _ in model.named_parameters())


def test_a_fresh_model_predicts_near_uniform():
    torch.manual_seed(0)
    model = gpt("gpt-mini", layers=2, seq_len=16)
    x = torch.randint(0, 256, (4, 17))
    with torch.no_grad():
        assert abs(float(lm_loss(model(x[:, :-1]), x[:, 1:])) - torch.log(torch.tensor(256.0)).item()) < 0.1


@pytest.mark.parametrize("fields,match", [({"embed": 100, "heads": 3}, "not a multiple of heads"),
                                          ({"layers": 0}, "layers must be >= 1")])
def test_shapes_it_cannot_build(fields, match):
    with pytest.raises(ValueError, match=match):
        gpt("gpt-mini", **fields)


def test_longer_sequences_than_positions_and_unknown_presets_are_refused():
    with pytest.raises(ValueError, match="sequence of 9 tokens; this GPT has 8 positions"):
        GPT(GPTConfig(seq_len=8, layers=1, embed=16, heads=2))(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown GPT preset 'gpt-3'"):
        gpt("gpt-3")
