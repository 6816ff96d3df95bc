"""The latent KV cache and absorbed MLA decode (attnkit.cache.latent, attnkit.mla_decode).

Every storage kind (dynamic, static, int8, paged, paged int8) holds one row of
``kv_lora_rank + rope_dim`` numbers per token and hands attention values that alias its keys; the
absorbed decode on the native kernel and on its PyTorch-op twin meets flash-attn's rule against
float64 over awkward lengths, batch 1 with one K/V head included."""

import pytest
import torch

import attnkit
from attnkit import Causal, mla_decode
from attnkit.backends.decode_native import kernel_reasons, split_tokens
from attnkit.cache import (
    DynamicLayerCache,
    KVCache,
    LatentLayerCache,
    PagedKVCache,
    QuantizedLayerCache,
    StaticLayerCache,
)
from attnkit.inputs import AttentionInputs
from attnkit.kv_handle import KVHandle

from .reference import flash_rule_ok, max_error, reference_attention, reference_attention_lowp

R, P = 32, 8  # a small kv_lora_rank and rope dim (DeepSeek: 512 and 64)
SCALE = 24 ** -0.5  # the non-absorbed head dim's scale (DeepSeek: 192 ** -0.5)
STORAGES = ["dynamic", "static", "int8", "paged", "paged-int8"]


def _storage(kind: str, B: int, max_len: int = 1200):
    """A latent layer cache over ``kind`` storage, and the model-level cache that owns it."""
    if kind.startswith("paged"):
        owner = PagedKVCache(2, num_blocks=B * (max_len // 7 + 2), block_size=7,
                             quantize="int8" if kind.endswith("int8") else None)
        owner.select([owner.add_sequence() for _ in range(B)])
        return LatentLayerCache(owner[0], R), owner
    inner = {"dynamic": DynamicLayerCache, "static": lambda: StaticLayerCache(max_len),
             "int8": lambda: QuantizedLayerCache(max_len)}[kind]()
    return LatentLayerCache(inner, R), None


def _native_reason():
    x = torch.zeros(1, 1, 1, R + P)
    reasons = kernel_reasons(AttentionInputs.create(x, x, x[..., :R]))
    return "; ".join(reasons) if reasons else None


@pytest.mark.parametrize("kind", STORAGES)
def test_the_cache_holds_one_row_per_token_and_its_values_alias_its_keys(kind):
    g = torch.Generator().manual_seed(1)
    B, T = 2, 23
    rows = torch.randn(B, 1, T, R + P, generator=g)
    cache, _ = _storage(kind, B, max_len=40)
    k, v, offset = cache.update(rows[:, :, :20])
    assert offset == 0 and torch.equal(k, rows[:, :, :20]) and torch.equal(v, rows[:, :, :20, :R])  # the prefill's own
    k, v, offset = cache.update(rows[:, :, 20:], rows[:, :, 20:, :R])
    assert cache.seq_len == T and offset == 0
    if isinstance(k, KVHandle):
        assert v is k and k.v.data_ptr() == k.k.data_ptr() and k.v.shape[-1] == R and k.value_dim == R
        assert k.v_scale is k.k_scale
        kd, vd = k.dense(torch.float32)
    else:
        assert v.data_ptr() == k.data_ptr() and v.shape[-1] == R
        kd, vd = k, v
    assert torch.equal(vd, kd[..., :R])
    tol = 0.01 * rows.abs().max() if "int8" in kind else 0
    assert (kd - rows).abs().max() <= tol
    # one row per token: no stored values (int8: the row, its scale, and the empty values' unit scale)
    per_token = {"int8": R + P + 8, "paged-int8": R + P + 8}.get(kind, (R + P) * 4)
    slots = {"dynamic": T, "static": 40, "int8": 40}.get(kind)
    if slots is None:  # a paged layer holds its whole pool
        slots = cache.storage.pool.num_blocks * cache.storage.pool.block_size
    assert cache.memory_bytes() == B ** (kind in ("dynamic", "static", "int8")) * slots * per_token


@pytest.mark.parametrize("kind", ["dynamic", "static", "int8"])
def test_crop_reorder_reset_and_all_or_nothing_steps(kind):
    g = torch.Generator().manual_seed(2)
    layers = [_storage(kind, 3, max_len=30)[0] for _ in range(3)]
    cache = KVCache(layers)
    rows = torch.randn(3, 1, 12, R + P, generator=g)
    for layer in cache:
        layer.update(rows[:, :, :10])
    cache[0].update(rows[:, :, 10:])
    with pytest.raises(ValueError, match="kv_lora_rank"):
        cache[1].update(rows[:, :, 10:, :R])  # too narrow: refused, layer 0 rolled back
    assert [layer.seq_len for layer in cache] == [10, 10, 10]
    cache.crop(6)
    cache.reorder(torch.tensor([2, 0, 1]))
    k, v, _ = cache[2].update(rows[:, :, 6:7])
    kd = k.dense(torch.float32)[0] if isinstance(k, KVHandle) else k
    want = torch.cat([rows[[2, 0, 1], :, :6], rows[:, :, 6:7]], 2)
    assert (kd - want).abs().max() <= (0.01 * rows.abs().max() if kind == "int8" else 0)
    cache.reset()
    assert cache.seq_len == 0


def test_bad_input_names_the_argument():
    cache = LatentLayerCache(DynamicLayerCache(), R)
    rows = torch.randn(1, 1, 3, R + P)
    with pytest.raises(ValueError, match="v: the values of a latent cache"):
        cache.update(rows, rows[..., :R].clone())
    with pytest.raises(TypeError, match="storage"):
        LatentLayerCache(cache, R)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        LatentLayerCache(DynamicLayerCache(), 0)
    q = torch.randn(1, 4, 1, R + P)
    with pytest.raises(ValueError, match="scale"):
        mla_decode(q, rows, kv_lora_rank=R, scale=None)
    with pytest.raises(ValueError, match="k: expected latent rows"):
        mla_decode(q[..., :-1], rows, kv_lora_rank=R, scale=SCALE)
    with pytest.raises(ValueError, match="implementation"):
        mla_decode(q, rows, kv_lora_rank=R, scale=SCALE, implementation="fast")


def _check_decode(q, rows, out, dtype, mask=None):
    """``out`` against float64 MLA over ``rows`` (the rows the cache holds), by flash-attn's rule."""
    ref, _ = reference_attention(q.double(), rows.double(), rows[..., :R].double(), scale=SCALE, mask=mask)
    low, _ = reference_attention_lowp(q.to(dtype), rows.to(dtype), rows[..., :R].to(dtype), scale=SCALE, mask=mask)
    err, low_err = max_error(out, ref), max_error(low, ref)
    assert out.shape == ref.shape and out.dtype == dtype
    assert flash_rule_ok(err, low_err, factor=2, dtype=dtype), (err, low_err)


@pytest.mark.parametrize("implementation", ["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,Tk", [(1, 1, 1), (1, 16, 17), (2, 5, 37), (1, 16, 127), (2, 3, 1100)])
def test_absorbed_decode_equals_float64(implementation, dtype, B, H, Tk):
    if implementation == "native" and _native_reason():
        pytest.skip(_native_reason())
    g = torch.Generator().manual_seed(Tk + H)
    rows = torch.randn(B, 1, Tk, R + P, generator=g).to(dtype)
    q = torch.randn(B, H, 1, R + P, generator=g).to(dtype)
    out = mla_decode(q, rows, kv_lora_rank=R, scale=SCALE, implementation=implementation)
    _check_decode(q, rows, out, dtype)


@pytest.mark.parametrize("kind", STORAGES)
@pytest.mark.parametrize("implementation", ["auto", "torch"])
def test_absorbed_decode_over_every_storage_with_speculative_queries(kind, implementation):
    """Three queries at once (speculative decoding) under Causal(), over what each storage holds."""
    g = torch.Generator().manual_seed(3)
    B, H, T = 2, 6, 41
    rows = torch.randn(B, 1, T, R + P, generator=g)
    cache, _ = _storage(kind, B, max_len=64)
    cache.update(rows[:, :, :T - 3])
    k, _, _ = cache.update(rows[:, :, T - 3:])
    q = torch.randn(B, H, 3, R + P, generator=g)
    out = mla_decode(q, k, kv_lora_rank=R, scale=SCALE, mask=Causal(), implementation=implementation,
                     kv_finite=cache.finite)
    held = k.dense(torch.float32)[0] if isinstance(k, KVHandle) else k  # what the cache holds (int8: rounded)
    _check_decode(q, held, out, torch.float32, mask=Causal())
    if implementation == "auto" and not _native_reason():
        assert attnkit.explain(q, k, k, scale=SCALE, mask=Causal()).chosen == "decode"


def test_batch_one_with_one_kv_head_splits_over_the_keys():
    """MLA decode has one K/V head: the kernel's work items are splits of the keys, so a single
    sequence keeps several threads busy (the splits follow the length and the thread count)."""
    assert split_tokens(8192, 1, threads=2) * 2 <= 8192
    assert split_tokens(32768, 1, threads=16) * 16 <= 32768


def test_gradients_flow_through_the_absorbed_form():
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(1, 1, 19, R + P, generator=g, dtype=torch.float64, requires_grad=True)
    q = torch.randn(1, 4, 19, R + P, generator=g, dtype=torch.float64, requires_grad=True)
    out = mla_decode(q, rows, kv_lora_rank=R, scale=SCALE, mask=Causal())
    ref, _ = reference_attention(q, rows, rows[..., :R], scale=SCALE, mask=Causal())
    grads = torch.autograd.grad(out.sum(), (q, rows))
    want = torch.autograd.grad(ref.sum(), (q, rows))
    for a, b in zip(grads, want):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("implementation", ["torch", "native"])
def test_strided_rows_and_queries_and_fully_masked_rows(implementation):
    """Rows inside a wider buffer and queries laid out (B, T, H, D) are read in place; a query
    that may see no key gives 0."""
    if implementation == "native" and _native_reason():
        pytest.skip(_native_reason())
    g = torch.Generator().manual_seed(6)
    B, H, T = 2, 4, 37
    rows = torch.randn(B, 1, T, R + P + 5, generator=g)[..., :R + P]  # (B, 1, T, R + P), row stride R + P + 5
    q = torch.randn(B, 2, H, R + P, generator=g).transpose(1, 2)  # (B, H, 2, R + P), non-contiguous
    mask = attnkit.KeyPadding(torch.tensor([0, 30]))  # row 0 sees nothing
    out = mla_decode(q, rows, kv_lora_rank=R, scale=SCALE, mask=mask, implementation=implementation)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _check_decode(q[1:], rows[1:, :, :30], out[1:], torch.float32)


@pytest.mark.parametrize("kind", ["static", "int8", "paged", "paged-int8"])
def test_the_kernel_reads_the_values_as_a_view_of_the_keys(kind, monkeypatch):
    """No copy of the values is made on the way to the decode kernel: it gets the keys' storage
    with the values' strides (and, for int8, the keys' scales), so each row is read once."""
    if _native_reason():
        pytest.skip(_native_reason())
    from attnkit.backends import decode_native

    ext, _ = decode_native._extension()
    seen = []

    class Spy:
        decode_spans = ext.decode_spans

        @staticmethod
        def decode(q, k, v, cache, *rest):
            ks, vs = cache[:2]  # cache: k_scale, v_scale, block_table, rows
            seen.append((k.data_ptr() == v.data_ptr(), v.shape[-1], v.stride(), ks.data_ptr() == vs.data_ptr()))
            return ext.decode(q, k, v, cache, *rest)

    monkeypatch.setattr(decode_native, "_extension", lambda: (Spy, None))
    cache, _ = _storage(kind, 1, max_len=64)
    cache.update(torch.randn(1, 1, 30, R + P))
    k, _, _ = cache.update(torch.randn(1, 1, 1, R + P))
    mla_decode(torch.randn(1, 8, 1, R + P), k, kv_lora_rank=R, scale=SCALE, implementation="native")
    (same_storage, width, strides, same_scales), = seen
    assert same_storage and width == R and strides[2] == R + P
    assert same_scales or "int8" not in kind  # int8: the values' scales are the keys' own
