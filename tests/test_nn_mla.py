"""attnkit.nn.MultiHeadLatentAttention: the non-absorbed form (prefill, training) and the absorbed
form over a latent cache (decoding) are the same attention; gradients meet flash-attn's rule
against float64; the layer is transformers' DeepseekV3Attention (same state_dict, same output);
every exact backend runs Dk != Dv (192 / 128) correctly or declines with a reason."""

import math

import pytest
import torch

import attnkit
from attnkit import Causal
from attnkit.cache import DynamicLayerCache, KVCache, LatentLayerCache, PagedKVCache
from attnkit.inputs import AttentionInputs
from attnkit.nn import LatentAttentionConfig, MultiHeadLatentAttention

from .reference import flash_rule_ok, max_error, reference_attention

SMALL = dict(embed_dim=48, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def _layer(seed=0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    layer = MultiHeadLatentAttention(LatentAttentionConfig(**{**SMALL, **overrides})).eval()
    with torch.no_grad():  # RMS norm weights away from 1, so they matter
        for p in layer.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return layer.to(dtype)


def _cache(kind: str, B: int):
    if kind.startswith("paged"):
        cache = PagedKVCache(1, num_blocks=30, block_size=5, quantize="int8" if kind.endswith("int8") else None)
        cache.select([cache.add_sequence() for _ in range(B)])
        return cache[0]
    if kind == "latent":
        return LatentLayerCache(DynamicLayerCache(), SMALL["kv_lora_rank"])
    return KVCache.create("dynamic" if kind == "dynamic" else "static", 1, max_len=64,
                          quantize="int8" if kind == "int8" else None)[0]


@pytest.mark.parametrize("kind", ["latent", "dynamic", "static", "int8", "paged", "paged-int8"])
@pytest.mark.parametrize("variant", [dict(), dict(q_lora_rank=20, rope_interleave=False, bias=True)])
def test_cached_decoding_equals_the_full_forward(kind, variant):
    """A 19-token prompt (the per-head form), a 3-token chunk and single tokens (the absorbed form
    over the cache) give the full forward's outputs: fp32 within 1e-5 relative (int8: within its
    rounding, and not equal)."""
    layer = _layer(**variant)
    B, T = 2, 37
    x = torch.randn(B, T, SMALL["embed_dim"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = layer(x, mask=Causal())
        cache = _cache(kind, B)
        steps = [(0, 19), (19, 22)] + [(t, t + 1) for t in range(22, T)]
        out = torch.cat([layer(x[:, a:b], mask=Causal(), cache=cache) for a, b in steps], 1)
    err = (out - full).abs().max() / full.abs().max()
    if kind.endswith("int8"):
        assert 0 < err < 0.03
    else:
        assert err <= 1e-5, err


def _eager(layer: MultiHeadLatentAttention, x, dtype):
    """The layer's attention written out (expanded heads, explicit softmax), every op in ``dtype``:
    an independent reference sharing only the layer's weights."""
    c = layer.config
    w = {n: p.to(dtype) for n, p in layer.named_parameters()}
    x = x.to(dtype)
    B, T, _ = x.shape
    q = (x @ w["q_proj.weight"].T).view(B, T, c.num_heads, c.qk_head_dim).transpose(1, 2)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
    latent, k_pe = (x @ w["kv_a_proj_with_mqa.weight"].T).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
    latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w["kv_a_layernorm.weight"]
    pos = torch.arange(T, dtype=dtype)
    half = c.qk_rope_head_dim // 2
    ang = pos[:, None] * c.rope_base ** (-torch.arange(half, dtype=dtype) * 2 / c.qk_rope_head_dim)

    def rope(t):  # interleaved pairs (2i, 2i+1) rotated by ang[:, i], laid out as halves
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)

    kv = (latent @ w["kv_b_proj.weight"].T).view(B, T, c.num_heads, -1).transpose(1, 2)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
    k = torch.cat([k_nope, rope(k_pe)[:, None].expand(B, c.num_heads, T, c.qk_rope_head_dim)], -1)
    q = torch.cat([q_nope, rope(q_pe)], -1)
    s = (q @ k.transpose(-1, -2)) * c.softmax_scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
    return out @ w["o_proj.weight"].T


@pytest.mark.parametrize("T", [1, 17, 37])
def test_training_gradients_meet_the_flash_rule_against_float64(T):
    layer = _layer(seed=T).train()
    x = torch.randn(2, T, SMALL["embed_dim"], generator=torch.Generator().manual_seed(T))
    dy = torch.randn(2, T, SMALL["embed_dim"], generator=torch.Generator().manual_seed(T + 1))
    params = [p for _, p in layer.named_parameters()]
    xs = x.clone().requires_grad_()
    out = layer(xs, mask=Causal())
    got = torch.autograd.grad(out, [xs] + params, dy)
    refs = {}
    for dtype in (torch.float64, torch.float32):
        xr = x.to(dtype).requires_grad_()
        yr = _eager(layer, xr, dtype)
        refs[dtype] = (yr, torch.autograd.grad(yr, [xr] + params, dy.to(dtype)))
    (y64, g64), (y32, g32) = refs[torch.float64], refs[torch.float32]
    assert flash_rule_ok(max_error(out, y64), max_error(y32, y64), factor=2, dtype=torch.float32)
    for a, ref, low in zip(got, g64, g32):
        mag = float(ref.abs().max())
        assert flash_rule_ok(max_error(a, ref), max_error(low, ref), factor=3, dtype=torch.float32, magnitude=mag)


def test_the_layer_is_deepseek_v3_attention():
    """transformers' DeepseekV3Attention's weights load as they are and give the same output."""
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                           kv_lora_rank=32, q_lora_rank=20, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                           num_hidden_layers=1, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4,
                           num_experts_per_tok=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    theirs = modeling.DeepseekV3Attention(cfg, 0).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = MultiHeadLatentAttention(LatentAttentionConfig(**{**SMALL, "q_lora_rank": 20}, norm_eps=cfg.rms_norm_eps))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 11, 48)
    pos = torch.arange(11)[None].expand(2, 11)
    keep = torch.ones(11, 11, dtype=torch.bool).tril()
    with torch.no_grad():
        want, _ = theirs(x, modeling.DeepseekV3RotaryEmbedding(cfg)(x, pos),
                         torch.zeros(2, 1, 11, 11).masked_fill(~keep, float("-inf")))
        got = ours(x, mask=Causal())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_every_exact_backend_runs_unequal_key_and_value_dims_or_declines_with_a_reason():
    """DeepSeek's per-head shapes, Dk = 192 and Dv = 128, forward and backward."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 2, 37, 192, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 37, 128, generator=g, dtype=torch.float64)
    ref, _ = reference_attention(q, k, v, mask=Causal(), scale=192 ** -0.5)
    ran = []
    for name, impl in attnkit.list_backends().items():
        if not impl.exact or not impl.available():
            continue
        qq, kk, vv = (t.float().requires_grad_() for t in (q, k, v))
        if impl.not_supported_reasons(AttentionInputs.create(qq, kk, vv, mask=Causal(), scale=192 ** -0.5)):
            continue  # declined, with its reasons (explain() shows them)
        out = attnkit.attention(qq, kk, vv, mask=Causal(), scale=192 ** -0.5, backend=name)
        out.sum().backward()
        assert out.shape == (1, 2, 37, 128) and max_error(out, ref) < 1e-5, name
        assert all(torch.isfinite(t.grad).all() for t in (qq, kk, vv)), name
        ran.append(name)
    assert {"naive", "sdpa", "tiled"} <= set(ran)
    if attnkit.get_backend("native").available():  # the native prefill kernel, forward and backward
        assert "native" in ran


def test_bad_configuration_and_input_name_the_argument():
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        LatentAttentionConfig(embed_dim=8, num_heads=2, qk_rope_head_dim=7)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        LatentAttentionConfig(embed_dim=8, num_heads=2, kv_lora_rank=0)
    layer = _layer()
    with pytest.raises(ValueError, match="x: expected a tensor"):
        layer(torch.randn(2, 3, 5))
    with pytest.raises(TypeError, match="cache"):
        layer(torch.randn(1, 3, 48), cache=KVCache.dynamic(1))
    assert math.isclose(layer.config.softmax_scale, 24 ** -0.5)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_ragged_paged_rows_equal_their_full_forwards(quantize):
    """Continuous batching: two sequences of different lengths decode together over paged latent
    rows; each equals its own full forward (RoPE and the mask at each row's own positions)."""
    layer = _layer(seed=7)
    x = torch.randn(2, 21, SMALL["embed_dim"], generator=torch.Generator().manual_seed(8))
    cache = PagedKVCache(1, num_blocks=20, block_size=4, quantize=quantize)
    a, b = cache.add_sequence(), cache.add_sequence()
    with torch.no_grad():
        full = layer(x, mask=Causal())
        cache.select([a])
        first = layer(x[:1, :6], mask=Causal(), cache=cache[0])  # a runs 6 tokens ahead
        cache.select([a, b])
        steps = [layer(torch.stack([x[0, 6 + s:7 + s], x[1, s:s + 1]]), mask=Causal(), cache=cache[0])
                 for s in range(15)]
    out = torch.cat(steps, 1)
    assert cache.lengths() == [21, 15]
    tol = 0.03 if quantize else 1e-5
    assert (torch.cat([first, out[:1]], 1) - full[:1]).abs().max() <= tol * full.abs().max()
    assert (out[1:] - full[1:, :15]).abs().max() <= tol * full.abs().max()
