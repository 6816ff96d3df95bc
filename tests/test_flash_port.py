"""flash-attn's test semantics, in our own words (after ``tests/test_flash_attn.py`` of
Dao-AILab/flash-attention): its local-window construction, random key/query padding with
per-sequence (varlen) causal alignment, the kv-cache case of appending new tokens to a cache, head
dims from 32 to 256 on uneven lengths, and the 2x/3x rule against an independent low-precision
reference (their ``attention_ref(..., upcast=False)``).
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, Dense, KeyPadding, SlidingWindow
from attnkit.cache import DynamicLayerCache
from attnkit.inputs import AttentionInputs

from .reference import (
    DEVICE, device_unavailable, flash_rule_ok, max_error, reference_attention, reference_attention_lowp,
)

if device_unavailable():
    pytest.skip(device_unavailable(), allow_module_level=True)

EXACT = [name for name, impl in attnkit.list_backends().items() if impl.exact]


def local_keep(Tq: int, Tk: int, left: int, right: int, q_lens=None, k_lens=None) -> torch.Tensor:
    """flash-attn's ``construct_local_mask``: query row i of a sequence with ``lq`` queries and ``lk``
    keys keeps key j when ``i + lk - lq - left <= j <= i + lk - lq + right`` (-1 = unbounded), and
    padded keys (j >= lk) never. ``(B, 1, Tq, Tk)``."""
    q_lens = torch.tensor([Tq]) if q_lens is None else q_lens
    k_lens = torch.tensor([Tk]) if k_lens is None else k_lens
    i = torch.arange(Tq).view(1, -1, 1)
    j = torch.arange(Tk).view(1, 1, -1)
    diag = i + (k_lens - q_lens).view(-1, 1, 1)
    keep = (j < k_lens.view(-1, 1, 1)) & (i >= 0)  # (B, Tq, Tk)
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    return keep[:, None]


def random_lengths(max_len: int, batch: int, mode: str, seed: int) -> torch.Tensor:
    """flash-attn's ``generate_random_padding_mask`` lengths: ``full``, ``random`` in
    [max_len - 20, max_len] or ``third`` in [max_len / 3, max_len]."""
    g = torch.Generator().manual_seed(seed)
    if mode == "full":
        return torch.full((batch,), max_len)
    low = max(1, max_len - 20) if mode == "random" else max(1, max_len // 3)
    return torch.randint(low, max_len + 1, (batch,), generator=g)


SEQLENS = [(113, 203), (128, 217), (108, 256), (256, 128), (1, 239), (3, 799)]
WINDOWS = [(-1, -1), (-1, 0), (16, 0), (7, 12), (0, 0)]


@pytest.mark.parametrize("Tq,Tk", SEQLENS)
@pytest.mark.parametrize("left,right", WINDOWS)
def test_window_semantics_match_flash_attn(Tq, Tk, left, right):
    """Our bottom-right SlidingWindow / Causal keep exactly flash-attn's window_size=(left, right)."""
    mask = (None if (left, right) == (-1, -1)
            else SlidingWindow(None if left < 0 else left, None if right < 0 else right))
    ours = torch.ones(1, 1, Tq, Tk, dtype=torch.bool) if mask is None else mask.materialize(Tq, Tk)
    assert torch.equal(ours.expand(1, 1, Tq, Tk), local_keep(Tq, Tk, left, right))
    if (left, right) == (-1, 0):
        assert torch.equal(Causal().materialize(Tq, Tk), ours)


def _qkv(B, Hq, Hkv, Tq, Tk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Hq, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, D), (B, Hq, Tq, D)]
    q, k, v, do = (torch.randn(*s, generator=g).to(DEVICE, dtype) for s in shapes)
    return q, k, v, do


def _check(backend, q, k, v, do, **kwargs):
    """flash-attn's rule: out within 2x, dq/dk/dv within 3x of the low-precision reference's error."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = attnkit.attention(*leaves, backend=backend, **kwargs)
    out.backward(do)
    results = {}
    for name, fn, cast in (("lowp", reference_attention_lowp, lambda x: x),
                           ("ref", reference_attention, torch.Tensor.double)):
        ls = [cast(x.detach()).requires_grad_(True) for x in (q, k, v)]
        o, _ = fn(*ls, **kwargs)
        o.backward(do.to(o.dtype))
        results[name] = (o.detach(), [x.grad for x in ls])
    (lp, lp_g), (ref, ref_g) = results["lowp"], results["ref"]
    dtype = q.dtype
    err, lp_err = max_error(out, ref), max_error(lp, ref)
    assert flash_rule_ok(err, lp_err, factor=2, dtype=dtype), f"out {err:.3g} vs {lp_err:.3g}"
    for name, x, lg, rg in zip(("dq", "dk", "dv"), leaves, lp_g, ref_g):
        err, lp_err = max_error(x.grad, rg), max_error(lg, rg)
        assert flash_rule_ok(err, lp_err, factor=3, dtype=dtype), f"{name} {err:.3g} vs {lp_err:.3g}"


HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
MASKS = {"none": None, "causal": Causal(), "window": SlidingWindow(16, 4)}
# Each head dim on one of flash-attn's uneven length pairs and one mask (the full product: 216 cases).
DIM_CASES = [(d, *SEQLENS[i % len(SEQLENS)], list(MASKS)[i % len(MASKS)]) for i, d in enumerate(HEAD_DIMS)]


def _accepting(kwargs_of, cases):
    """``pytest.param``s of (backend, *case) for the exact backends that take the case."""
    params = []
    for case in cases:
        kwargs = kwargs_of(*case)
        q, k, v, _ = _placeholders(*case)
        for b in EXACT:
            if not attnkit.get_backend(b).not_supported_reasons(AttentionInputs.create(q, k, v, **kwargs)):
                params.append(pytest.param(b, *case, id=f"{b}-" + "-".join(map(str, case))))
    return params


def _placeholders(D, Tq, Tk, *_):
    z = torch.zeros((), device=DEVICE, dtype=torch.bfloat16)
    return z.expand(3, 4, Tq, D), z.expand(3, 2, Tk, D), z.expand(3, 2, Tk, D), None


@pytest.mark.parametrize("backend,D,Tq,Tk,mask_name", _accepting(
    lambda D, Tq, Tk, m: dict(mask=MASKS[m]), DIM_CASES))
def test_head_dims_32_to_256(backend, D, Tq, Tk, mask_name):
    """bf16, GQA 4/2, uneven lengths: flash-attn's output and gradient rule."""
    q, k, v, do = _qkv(1, 4, 2, Tq, Tk, D, torch.bfloat16, seed=D)
    _check(backend, q, k, v, do, mask=MASKS[mask_name])


@pytest.mark.parametrize("mode", ["full", "random", "third"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_padding_equals_each_sequence_alone(mode, causal):
    """flash-attn's varlen semantics: a right-padded batch, each sequence with its own query and key
    length and causal aligned at *its* bottom-right, equals running each sequence alone."""
    B, Hq, Hkv, Tq, Tk, D = 3, 4, 2, 37, 53, 16
    q_lens, k_lens = random_lengths(Tq, B, mode, seed=1), random_lengths(Tk, B, mode, seed=2)
    q, k, v, _ = _qkv(B, Hq, Hkv, Tq, Tk, D, torch.float32)
    keep = local_keep(Tq, Tk, -1, 0 if causal else -1, q_lens, k_lens)
    out = attnkit.attention(q, k, v, mask=Dense(keep.to(DEVICE)))
    for b in range(B):
        lq, lk = int(q_lens[b]), int(k_lens[b])
        alone = attnkit.attention(q[b:b + 1, :, :lq], k[b:b + 1, :, :lk], v[b:b + 1, :, :lk],
                                  mask=Causal() if causal else None)
        torch.testing.assert_close(out[b:b + 1, :, :lq], alone, atol=2e-6, rtol=0)
        if causal and lq > lk:  # queries before every key of the sequence see nothing: 0
            assert torch.equal(alone[:, :, : lq - lk], torch.zeros_like(alone[:, :, : lq - lk]))


KP_LENGTHS = random_lengths(41, 3, "third", seed=3).tolist()


@pytest.mark.parametrize("backend,D,Tq,Tk",
                         _accepting(lambda D, Tq, Tk: dict(mask=KeyPadding(KP_LENGTHS)), [(32, 29, 41)]))
def test_key_padding_matches_flash_padding(backend, D, Tq, Tk):
    """KeyPadding(lengths) keeps what flash-attn's key_padding_mask keeps (queries all real)."""
    B = len(KP_LENGTHS)
    q, k, v, do = _qkv(B, 2, 2, Tq, Tk, D, torch.float32)
    mask = KeyPadding(KP_LENGTHS)
    flash = local_keep(Tq, Tk, -1, -1, torch.full((B,), Tq), torch.tensor(KP_LENGTHS))
    assert torch.equal(mask.materialize(Tq, Tk).expand(B, 1, Tq, Tk), flash)
    _check(backend, q, k, v, do, mask=mask)


@pytest.mark.parametrize("Tnew", [1, 3, 17])
@pytest.mark.parametrize("window", [None, 8])
def test_kv_cache_append_equals_full_forward(Tnew, window):
    """flash-attn's kvcache case: new tokens appended to a cache attend the cache and themselves
    (causal, bottom-right); the result equals the matching rows of one full forward."""
    B, H, Hkv, P, D = 2, 4, 2, 45, 32
    q, k, v, _ = _qkv(B, H, Hkv, P + Tnew, P + Tnew, D, torch.float32, seed=7)
    mask = Causal() if window is None else SlidingWindow(window, 0)
    full = attnkit.attention(q, k, v, mask=mask)
    cache = DynamicLayerCache()
    cache.update(k[:, :, :P], v[:, :, :P])
    k_all, v_all, kv_offset = cache.update(k[:, :, P:], v[:, :, P:])
    assert kv_offset == 0 and k_all.shape[2] == P + Tnew
    step = attnkit.attention(q[:, :, P:], k_all, v_all, mask=mask, q_offset=P, kv_offset=kv_offset)
    torch.testing.assert_close(step, full[:, :, P:], atol=2e-6, rtol=0)
    # and with ragged cache lengths per sequence (flash-attn's cache_seqlens), through a padded cache
    cache_lens = torch.tensor([P, P - 13])
    keep = local_keep(Tnew, P + Tnew, window if window else -1, 0, torch.full((B,), Tnew), cache_lens + Tnew)
    k_pad, v_pad = k.clone(), v.clone()
    for b, n in enumerate(cache_lens.tolist()):  # sequence b: n cached keys, then its new keys, then padding
        k_pad[b, :, n:n + Tnew], v_pad[b, :, n:n + Tnew] = k[b, :, P:], v[b, :, P:]
    out = attnkit.attention(q[:, :, P:], k_pad, v_pad, mask=Dense(keep.to(DEVICE)))
    for b, n in enumerate(cache_lens.tolist()):
        alone = attnkit.attention(q[b:b + 1, :, P:], k_pad[b:b + 1, :, :n + Tnew], v_pad[b:b + 1, :, :n + Tnew],
                                  mask=mask)
        torch.testing.assert_close(out[b:b + 1], alone, atol=2e-6, rtol=0)
