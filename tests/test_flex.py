"""The flex backend: attnkit masks through Flex's mask_mod and a BlockMask built from attnkit's own
structure. The correctness grid runs Flex eagerly (its reference path: no compile time); one slow
test compiles it and counts recompiles over lengths 1000..1100."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, Custom, Document, KeyPadding, SlidingWindow, longformer
from attnkit.backends import flex
from attnkit.masks import BlockSparse, Dense

from .reference import max_error, reference_attention

pytestmark = pytest.mark.xdist_group("flex")
EAGER = flex.FlexOptions(compile=False)


@pytest.fixture(autouse=True)
def _flex_on_cpu(request):
    if request.node.name.startswith("test_declines"):
        yield
        return
    with flex.allow_cpu():
        yield

MASKS = {
    "none": None,
    "Causal": Causal(),
    "SlidingWindow": SlidingWindow(40, 5),
    "Causal&KeyPadding": Causal() & KeyPadding([300, 77]),
    "Document": Document(torch.arange(400) // 90),
    "BigBird": BlockSparse.bigbird(25, 16, seed=3),
    "Dense": Dense(torch.rand(2, 1, 200, 260, generator=torch.Generator().manual_seed(0)) < 0.6),
    "Custom": Custom(lambda b, h, q, k: (q - k) % 3 != 1),
    "longformer": longformer(16, [0, 130]),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_gqa_and_ragged_blocks_match_reference(name):
    """Tq=200, Tk=260: neither a multiple of Flex's 128 block; GQA 4/2."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 200, 32, generator=g), torch.randn(2, 2, 260, 32, generator=g),
               torch.randn(2, 2, 260, 32, generator=g))
    mask = MASKS[name]
    out = attnkit.attention(q, k, v, mask=mask, backend="flex", options=EAGER)
    ref, _ = reference_attention(q, k, v, mask=mask)
    assert max_error(out, ref) < 1e-5


def test_offsets_bias_and_fully_masked_rows():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g) for n in (50, 90, 90))
    bias = torch.randn(1, 2, 50, 90, generator=g)
    mask = Causal() & KeyPadding([90, 0])  # batch 1 sees no key at all
    kw = dict(mask=mask, bias=bias, q_offset=20, kv_offset=10)
    out = attnkit.attention(q, k, v, backend="flex", options=EAGER, **kw)
    ref, _ = reference_attention(q, k, v, **kw)
    assert max_error(out, ref) < 1e-5
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_nan_in_keys_no_query_sees_changes_nothing():
    q, k, v = (torch.randn(2, 2, 60, 16) for _ in range(3))
    mask = Causal() & KeyPadding([60, 41])
    clean = attnkit.attention(q, k, v, mask=mask, backend="flex", options=EAGER)
    k[1, :, 41:], v[1, :, 41:] = float("nan"), float("inf")
    out = attnkit.attention(q, k, v, mask=mask, backend="flex", options=EAGER)
    assert torch.allclose(out, clean, atol=1e-6, rtol=0)


def test_block_mask_from_structure_without_evaluating(monkeypatch):
    """The causal n=8192 BlockMask comes from the tile grid: the mask is never evaluated, and the
    FULL/PARTIAL split is exact (64 diagonal blocks run the mask_mod, the rest below run unmasked)."""

    def refuse(*args, **kwargs):
        raise AssertionError("evaluated the mask")

    monkeypatch.setattr(Causal, "mask_mod", refuse)
    bm = flex.build_block_mask(Causal(), 1, 8, 8192, 8192, 0, 0, "cpu")
    assert int(bm.kv_num_blocks.sum()) == 64 and int(bm.full_kv_num_blocks.sum()) == 64 * 63 // 2
    assert bm.q_num_blocks is not None  # the transposed indices the backward pass needs


def test_new_custom_of_a_stateful_method_builds_its_own_block_mask():
    """The BlockMask cache must not hand a new Custom(m.keep) the blocks planned for an older one
    whose function read different state: the compiled kernel would skip blocks that now attend."""

    class PerBatch:
        lengths = torch.tensor([5, 40])

        def keep(self, b, h, q, k):
            return k < self.lengths[b]

    m = PerBatch()
    q = torch.randn(2, 2, 300, 8)
    for lengths in ([5, 40], [290, 140]):
        m.lengths = torch.tensor(lengths)
        mask = Custom(m.keep)
        inp = attnkit.inputs.AttentionInputs.create(q, q, q, mask=mask)
        cached, _ = flex.block_mask(mask, inp)
        fresh = flex.build_block_mask(mask, 2, 2, 300, 300, 0, 0, q.device)
        assert torch.equal(cached.kv_num_blocks, fresh.kv_num_blocks)
        assert torch.equal(cached.full_kv_num_blocks, fresh.full_kv_num_blocks)


def test_declines_where_torch_cannot_run_it():
    q = torch.randn(1, 1, 8, 8, requires_grad=True)
    reasons = attnkit.explain(q.detach(), q.detach(), q.detach(), backend="flex").reasons["flex"]
    assert len(reasons) == 1 and "allow_cpu" in reasons[0]  # CPU is opt-in
    with flex.allow_cpu():
        assert not attnkit.explain(q.detach(), q.detach(), q.detach(), backend="flex").reasons["flex"]
        _check_cpu_limits(q)


def _check_cpu_limits(q):
    reasons = attnkit.explain(q, q, q, backend="flex").reasons["flex"]
    assert any("no backward on CPU" in r for r in reasons)
    reasons = attnkit.explain(q.detach(), q.detach(), q.detach(), backend="flex", return_lse=True).reasons["flex"]
    assert any("log-sum-exp on CPU" in r for r in reasons)
    assert "compiles" in attnkit.get_backend("flex").describe(attnkit.inputs.AttentionInputs.create(q, q, q))


@pytest.mark.slow
def test_compiled_once_over_lengths_1000_to_1100():
    """One compile (dynamic shapes) serves every length; recompiles over lengths 1000..1100 <= 2."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    for n in (1000, 1037, 1100):
        q, k, v = (torch.randn(1, 2, n, 32) for _ in range(3))
        out = attnkit.attention(q, k, v, mask=Causal(), backend="flex")
        ref, _ = reference_attention(q, k, v, mask=Causal())
        assert max_error(out, ref) < 1e-5
    assert counters["stats"]["unique_graphs"] - before <= 2
    assert "compiled for cpu already" in attnkit.get_backend("flex").describe(
        attnkit.inputs.AttentionInputs.create(q, k, v))


@pytest.mark.slow
def test_compiled_strides_never_recompile_and_the_limit_is_loud(monkeypatch):
    """Transposed, sliced and expanded inputs reuse the one compiled kernel (dynamo specializes
    on strides); a call past dynamo's recompile limit raises instead of running eagerly."""
    import torch._dynamo

    monkeypatch.setitem(flex._STATE, "compiled", {})
    limit = torch._dynamo.config.patch(recompile_limit=1)  # config.patch restores it (setattr/undo would not)
    limit.__enter__()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 3, 61, 40, generator=g)
    layouts = [
        torch.randn(2, 3, 61, 16, generator=g),  # contiguous
        torch.randn(2, 61, 3, 16, generator=g).transpose(1, 2),  # (B, T, H, D) storage
        wide[..., 7:23],  # a slice of a wider tensor
        torch.randn(2, 1, 61, 16, generator=g).expand(2, 3, 61, 16),  # broadcast heads
    ]
    mask = Causal()
    try:
        for i, x in enumerate(layouts):
            q, k, v = (x, x, x) if i % 2 else (x, x * 0.5, x.flip(2))  # one object for q, k, v or three
            out = attnkit.attention(q, k, v, mask=mask, backend="flex")
            ref, _ = reference_attention(q, k, v, mask=mask)
            assert max_error(out, ref) < 1e-5
        x = layouts[0]
        with pytest.raises(RuntimeError, match="recompile_limit"):  # a new mask kind needs a second compile
            attnkit.attention(x, x, x, mask=SlidingWindow(9, 2), backend="flex")
    finally:
        limit.__exit__(None, None, None)
        torch._dynamo.reset()


def test_score_mods_are_flex_score_mods():
    """ALiBi >> soft-cap >> a T5 relative bias at absolute positions (an offset call), with a bias,
    on Flex's eager reference path."""
    from attnkit.score_mods import ALiBi, RelativeBias, SoftCap

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 50, 16, generator=g), torch.randn(2, 2, 90, 16, generator=g),
               torch.randn(2, 2, 90, 16, generator=g))
    relative = RelativeBias(torch.randn(4, 16, generator=g), max_distance=32, bidirectional=False)
    kw = dict(mask=Causal() & KeyPadding([90, 70]), bias=torch.randn(1, 4, 1, 90, generator=g), q_offset=30,
              score_mod=ALiBi.geometric(4) >> SoftCap(2.0) >> relative)
    ref = attnkit.attention(q, k, v, backend="naive", **kw)
    assert max_error(attnkit.attention(q, k, v, backend="flex", options=EAGER, **kw), ref) < 1e-5


@pytest.mark.slow
def test_score_mods_compile():
    """ALiBi >> soft-cap compiled on the CPU (torch 2.13's CPU template fails to compile some
    combinations, e.g. with a bias and key padding: the backend then says so and names the fix)."""
    from attnkit.score_mods import ALiBi, SoftCap

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 50, 16, generator=g), torch.randn(2, 2, 90, 16, generator=g),
               torch.randn(2, 2, 90, 16, generator=g))
    kw = dict(mask=Causal(), q_offset=30, score_mod=ALiBi.geometric(4) >> SoftCap(2.0))
    ref = attnkit.attention(q, k, v, backend="naive", **kw)
    assert max_error(attnkit.attention(q, k, v, backend="flex", **kw), ref) < 1e-5
