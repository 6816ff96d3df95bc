import math

import pytest
import torch

from attnkit.nn import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
    sinusoidal,
    sinusoidal_2d,
)


def test_sinusoidal_matches_the_paper_formula():
    pos = torch.arange(10)
    out = sinusoidal(pos, 8)
    for p in range(10):
        for i in range(4):
            angle = p / 10000 ** (2 * i / 8)
            assert out[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert out[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_has_no_length_limit_and_no_state():
    module = SinusoidalPositionalEmbedding(16)
    assert not list(module.parameters()) and not list(module.buffers())
    far = module(torch.tensor([1_000_000, 5]))
    assert torch.allclose(far[1], sinusoidal(torch.arange(6), 16)[5])
    batched = module(torch.tensor([[0, 1], [2, 3]]))
    assert batched.shape == (2, 2, 16)


def test_learned_positions_raise_past_max_len():
    emb = LearnedPositionalEmbedding(8, 4)
    assert isinstance(emb, torch.nn.Embedding)
    assert emb(torch.arange(8)).shape == (8, 4)
    with pytest.raises(ValueError, match="max_len"):
        emb(torch.arange(9))


def _rope_reference(x, positions, base=10000.0):
    """Complex-number RoPE on (x_i, x_{i+D/2}) pairs, float64."""
    D = x.shape[-1]
    half = D // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64) * 2 / D)
    angles = positions.double()[:, None] * freqs  # (T, half)
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope_matches_complex_rotation_at_absolute_positions():
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, 5, 8)
    pos = torch.arange(100, 105)
    assert torch.allclose(rope(x, pos).double(), _rope_reference(x, pos), atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    s1 = (rope(q, torch.tensor([7])) * rope(k, torch.tensor([3]))).sum()
    s2 = (rope(q, torch.tensor([1007])) * rope(k, torch.tensor([1003]))).sum()
    assert torch.allclose(s1, s2, atol=1e-4)


def test_rope_per_row_positions_and_partial_rotary():
    rope = RotaryEmbedding(8, rotary_dim=4)
    x = torch.randn(2, 2, 3, 8)
    pos = torch.tensor([[0, 1, 2], [5, 6, 7]])
    out = rope(x, pos)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.allclose(out[1:], rope(x[1:], torch.arange(5, 8)))
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(8, rotary_dim=3)


def test_alibi_slopes():
    from attnkit.score_mods import ALiBi

    slopes = ALiBi.geometric
    assert torch.allclose(slopes(8).slopes, torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s12 = slopes(12).slopes  # 8 geometric + 4 interleaved from the 16-head sequence
    assert torch.allclose(s12[:8], slopes(8).slopes)
    assert torch.allclose(s12[8:], slopes(16).slopes[0::2][:4])
    assert slopes(2).slopes.tolist() == [2.0**-4, 2.0**-8]

def test_sinusoidal_2d_layout():
    table = sinusoidal_2d(3, 4, 16)
    assert table.shape == (12, 16)
    rows = torch.arange(3).repeat_interleave(4)
    cols = torch.arange(4).repeat(3)
    assert torch.allclose(table[:, :8], sinusoidal(rows, 8))
    assert torch.allclose(table[:, 8:], sinusoidal(cols, 8))
    with pytest.raises(ValueError):
        sinusoidal_2d(2, 2, 6)
