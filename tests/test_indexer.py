"""The lightning indexer equals DeepSeek-V3.2's reference formula, its top-k lists feed TopK, and its
key store decodes like the whole sequence."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, TopK
from attnkit.cache import DynamicLayerCache, IndexerKeyCache, QuantizedLayerCache, StaticLayerCache
from attnkit.nn import indexer_scores, lightning_indexer, varlen_lightning_indexer


def reference_scores(q, k, weights, scale):
    """DeepSeek-V3.2's formula in transformers' layout (q (B, S, H, D), k (B, T, D), w (B, S, H)), float64."""
    q, k, weights = q.transpose(1, 2).double(), k[:, 0].double(), weights.transpose(1, 2).double()
    scores = torch.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * scale)  # (B, S, H, T)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, S, T)


def inputs(B=2, H=5, Tq=19, Tk=19, D=24, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Tq, D, generator=g).to(dtype), torch.randn(B, 1, Tk, D, generator=g).to(dtype),
            torch.randn(B, H, Tq, generator=g).to(dtype) * H ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scores_equal_the_reference_formula(dtype, monkeypatch):
    import attnkit.nn.indexer as indexer

    q, k, w = inputs(dtype=dtype)
    ref = reference_scores(q, k, w, 24 ** -0.5)
    got = indexer_scores(q, k, w)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(indexer, "BLOCK_ELEMENTS", 1)  # one query per block
    assert torch.allclose(indexer_scores(q, k, w, scale=0.3).double(), reference_scores(q, k, w, 0.3), atol=1e-5)


@pytest.mark.parametrize("Tq,Tk,topk", [(19, 19, 4), (3, 40, 8), (1, 33, 64), (7, 7, 7)])
def test_top_k_lists_are_the_best_allowed_keys(Tq, Tk, topk):
    q, k, w = inputs(Tq=Tq, Tk=Tk)
    idx = lightning_indexer(q, k, w, topk)
    assert idx.shape == (2, 1, Tq, min(topk, Tk)) and idx.dtype == torch.long
    scores = reference_scores(q, k, w, 24 ** -0.5)
    pos = torch.arange(Tq)[:, None] + Tk - Tq  # bottom-right: the last query sees every key
    allowed = torch.arange(Tk)[None, :] <= pos
    for b in range(2):
        for i in range(Tq):
            got = sorted(j for j in idx[b, 0, i].tolist() if j >= 0)
            n = min(topk, int(allowed[i].sum()))
            want = scores[b, i].masked_fill(~allowed[i], float("-inf")).topk(n).indices.tolist()
            assert got == sorted(want)  # the best n allowed keys, the rest -1


def test_offsets_and_an_extra_mask():
    q, k, w = inputs(B=2, Tq=4, Tk=12)
    idx = lightning_indexer(q, k, w, 12, causal=False, mask=KeyPadding([112, 105]), kv_offset=100, q_offset=103)
    assert ((idx[1] < 105) | (idx[1] == -1)).all() and (idx[1] >= 100).sum() == 4 * 5  # row 1: keys 100..104
    assert (idx[0] >= 100).all()  # row 0: every key (no causality)


def test_lists_feed_the_sparse_attention():
    q, k, w = inputs(B=1, Tq=16, Tk=16)
    idx = lightning_indexer(q, k, w, 5)
    v = torch.randn(1, 1, 16, 24)
    qa = torch.randn(1, 4, 16, 24)
    mask = TopK(idx) & Causal()
    out = attnkit.attention(qa, k, v, mask=mask)
    assert torch.allclose(out, attnkit.attention(qa, k, v, mask=mask, backend="naive"), atol=1e-6)


def test_varlen_equals_each_sequence_alone():
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [5, 0, 9, 1], [5, 4, 12, 1]
    H, D = 3, 8
    # float64: the lists compare exactly, and the batched and per-sequence scores come from matmuls of
    # other shapes, so a near tie could swap two float32 keys on another CPU
    q = torch.randn(sum(lens_q), H, D, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), D, generator=g, dtype=torch.float64)
    w = torch.randn(sum(lens_q), H, generator=g, dtype=torch.float64)
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0)  # noqa: E731
    idx = varlen_lightning_indexer(q, k, w, 6, cu(lens_q), cu(lens_k))
    assert idx.shape == (sum(lens_q), 6)
    q0, k0 = 0, 0
    for lq, lk in zip(lens_q, lens_k):
        if lq:
            alone = lightning_indexer(q[q0:q0 + lq].transpose(0, 1)[None], k[None, None, k0:k0 + lk],
                                      w[q0:q0 + lq].T[None], 6)[0, 0]
            got = idx[q0:q0 + lq]
            assert torch.equal(got[:, :alone.shape[1]], torch.where(alone >= 0, alone + k0, -1))
            assert (got[:, alone.shape[1]:] == -1).all()
        q0, k0 = q0 + lq, k0 + lk


@pytest.mark.parametrize("make", [DynamicLayerCache, lambda: StaticLayerCache(40), lambda: QuantizedLayerCache(40)],
                         ids=["dynamic", "static", "int8"])
def test_key_store_decodes_like_the_whole_sequence(make):
    # float64 where the lists compare exactly (one query's scores and the whole sequence's are matmuls of
    # other shapes); the int8 store holds float32 keys and is checked loosely
    int8 = isinstance(make(), QuantizedLayerCache)
    q, k, w = inputs(B=1, Tq=24, Tk=24, dtype=torch.float32 if int8 else torch.float64)
    store = IndexerKeyCache(make())
    keys, offset = store.update(k[:, :, :20])
    assert offset == 0 and keys.shape == (1, 1, 20, 24)
    full = lightning_indexer(q, k, w, 6)
    for t in range(20, 24):
        keys, offset = store.update(k[:, :, t:t + 1])
        step = lightning_indexer(q[:, :, t:t + 1], keys, w[:, :, t:t + 1], 6, kv_offset=offset)
        if isinstance(store.storage, QuantizedLayerCache):  # int8 keys: the same keys up to rounding
            assert (step >= 0).all() and (step <= t).all()
        else:
            assert torch.equal(step.sort(-1).values, full[:, :, t:t + 1].sort(-1).values)
    assert store.seq_len == 24
    store.crop(22)
    assert store.seq_len == 22
    store.reset()
    assert store.seq_len == 0


@pytest.mark.parametrize("call,error,phrase", [
    (lambda q, k, w: indexer_scores(q, k[:, :, :, :3], w), ValueError, "(B, 1, Tk, D)"),
    (lambda q, k, w: indexer_scores(q, k, w[:, :2]), ValueError, "weights"),
    (lambda q, k, w: lightning_indexer(q, k, w, 0), ValueError, "topk"),
    (lambda q, k, w: lightning_indexer(q, k, w, 3, causal=1), TypeError, "causal"),
    (lambda q, k, w: IndexerKeyCache(DynamicLayerCache()).update(k[0]), ValueError, "(B, 1, Tnew, D)"),
])
def test_bad_arguments_name_themselves(call, error, phrase):
    with pytest.raises(error) as info:
        call(*inputs())
    assert phrase in str(info.value)
