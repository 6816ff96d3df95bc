"""The native C++ kernel: every mask kind (positional from integers/index vectors, BlockSparse from
its layout, the rest from keep tiles) against the float64 oracle, forward and backward; GQA, offsets,
LSE and its gradient, fully masked rows, NaN poison; the tile grid it skips by; the not-built path."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, Custom, Document, KeyPadding, Padding, SlidingWindow, longformer
from attnkit.backends import _tiles, native
from attnkit.masks import BlockSparse, BlockStatus, Dense

from .reference import max_error, reference_attention

BUILT = native.load_extension()[0] is not None
needs_build = pytest.mark.skipif(not BUILT, reason=f"{native.load_extension()[1]}")
pytestmark = pytest.mark.xdist_group("native")

T = 150


def _masks(B: int, H: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (B, 2 * T), generator=g).sort(dim=1).values
    return {
        "Causal": Causal(),
        "SlidingWindow": SlidingWindow(20, 3),
        "KeyPadding": KeyPadding([T - 40, 9][:B]),
        "Causal&KeyPadding1": Causal() & KeyPadding([T - 3]),  # one length for the whole batch
        "Padding": Causal() & Padding(torch.rand(B, 2 * T, generator=g) < 0.7),
        "Document": Causal() & Document(ids),
        "BlockSparse-heads": BlockSparse(torch.rand(H, 10, 10, generator=g) < 0.4, 32),
        "BigBird&Causal": BlockSparse.bigbird(10, 32, seed=1) & Causal(),
        "Dense": Dense(torch.rand(B, 1, T, T, generator=g) < 0.5),
        "Custom": Custom(lambda b, h, q, k: (q + k) % 4 != 0, name="mod4"),
        "longformer": longformer(8, [0, 77]),
        "Document&Custom&Window": Document(ids) & Custom(lambda b, h, q, k: k % 5 != 1) & SlidingWindow(30, 30),
    }


def _check(mask, *, B=2, Hq=4, Hkv=2, Tq=T, Tk=T, D=24, Dv=16, dtype=torch.float64, q_offset=None, kv_offset=0,
           block=None, tol=1e-10):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, Tq, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Tk, D, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Tk, Dv, generator=g, dtype=dtype, requires_grad=True)
    options = native.NativeOptions(*block) if block else None
    kw = dict(mask=mask, q_offset=q_offset, kv_offset=kv_offset)
    out, lse = attnkit.attention(q, k, v, backend="native", return_lse=True, options=options, **kw)
    ref, ref_lse = reference_attention(q, k, v, **kw)
    assert max_error(out.detach(), ref) < tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and max_error(lse.detach()[finite], ref_lse[finite]) < tol
    do = torch.randn(out.shape, generator=g, dtype=dtype)
    dl = torch.randn(lse.shape, generator=g, dtype=dtype)
    loss = lambda o, ls: (o * do).sum() + (torch.where(finite, ls, 0) * dl).sum()  # noqa: E731
    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    ref_grads = torch.autograd.grad(loss(ref, ref_lse), (q, k, v))
    for name, a, b in zip("qkv", grads, ref_grads):
        assert torch.isfinite(a).all() and max_error(a, b) < tol * 10, f"d{name}"


@needs_build
@pytest.mark.parametrize("name", list(_masks(2, 4)))
def test_every_mask_kind_matches_reference(name):
    """Outputs, LSE, and gradients through both (GQA 4/2, Dv != D), small tiles so every tile
    status (EMPTY, PARTIAL, FULL) occurs."""
    _check(_masks(2, 4)[name], block=(32, 48))


@needs_build
@pytest.mark.parametrize("q_offset,kv_offset,Tq,Tk",
                         [(None, 0, 40, T), (None, 0, T, 60), (100, 30, 37, 90), (5, 0, 1, 61)])
def test_offsets_and_lengths(q_offset, kv_offset, Tq, Tk):
    for mask in (Causal(), SlidingWindow(7, 0) & KeyPadding([80, 200]), Custom(lambda b, h, q, k: q - k != 2)):
        _check(mask, Tq=Tq, Tk=Tk, q_offset=q_offset, kv_offset=kv_offset, block=(16, 32))


class _PerBatchLengths:
    """A model-like object whose bound method reads state that changes between batches."""

    def __init__(self, lengths):
        self.lengths = torch.tensor(lengths)

    def keep(self, b, h, q, k):
        return (k < self.lengths[b]) & (k <= q)


@needs_build
def test_new_custom_of_a_stateful_method_never_reuses_a_plan():
    """Two calls, each with a new Custom(m.keep) after m's state changed: the second must not run
    with the first call's cached tile plan (its EMPTY/FULL tiles are wrong for the new lengths)."""
    m = _PerBatchLengths([250, 20])
    for lengths in ([250, 20], [9, 171]):
        m.lengths = torch.tensor(lengths)
        _check(Custom(m.keep), B=2, Hq=3, Hkv=1, Tq=201, Tk=260, block=(32, 64))


@needs_build
def test_float32_default_tiles_and_mqa():
    _check(Causal() & Document(torch.arange(2 * 700) // 190), B=1, Hq=3, Hkv=1, Tq=700, Tk=700, D=64, Dv=64,
           dtype=torch.float32, tol=2e-5)
    _check(None, B=1, Hq=2, Hkv=1, Tq=333, Tk=513, dtype=torch.float32, tol=2e-5)


def test_default_tiles_follow_the_mask_structure():
    """Tiles across a band's edge compute scores in vain: a narrow window gets small tiles, another
    band edge (Causal()'s diagonal) square ones while rows keep few keys, a block layout aligned ones,
    no structure wide ones."""
    from attnkit.inputs import AttentionInputs

    x = torch.randn(1, 1, 300, 16)
    tiles = lambda mask: (lambda o: (o.block_q, o.block_k))(  # noqa: E731
        native.default_options(AttentionInputs.create(x, x, x, mask=mask)))
    assert tiles(None) == tiles(KeyPadding([200])) == (128, 256)
    assert tiles(Causal()) == tiles(Causal() & KeyPadding([200])) == tiles(SlidingWindow(4000, 0)) == (128, 128)
    long = torch.empty(1, 1, 4096, 16, device="meta")  # rows keep 2048 keys on average: 128 x 256 wastes little
    assert native.default_options(AttentionInputs.create(long, long, long, mask=Causal())).block_k == 256
    assert native.default_options(AttentionInputs.create(long[:, :, :1], long, long, mask=Causal())).block_k == 256
    assert tiles(SlidingWindow(100, 0)) == tiles(Causal() & SlidingWindow(64, 0)) == (64, 64)
    assert tiles(BlockSparse.bigbird(10, 32, seed=1)) == (32, 32)
    assert native.default_options(AttentionInputs.create(x, x, x, mask=Causal()), native.NativeOptions(64, 32)) == \
        native.NativeOptions(64, 32)  # given sizes win


@needs_build
def test_gradcheck_float64_keep_tiles():
    mask = Document(torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])) & Custom(lambda b, h, q, k: k != 1)
    qkv = [torch.randn(1, 2, 8, 5, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    fn = lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend="native", options=native.NativeOptions(8, 8))  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(qkv), eps=1e-6, atol=1e-6)


@needs_build
def test_nan_in_keys_no_query_sees_changes_nothing():
    """Poison in the middle of the sequence: keys between two documents' windows that no query sees."""
    ids = torch.tensor([0] * 40 + [1] * 40)
    mask = Document(ids) & SlidingWindow(5, 0) & Custom(lambda b, h, q, k: (k < 30) | (k >= 45))
    q, k, v = (torch.randn(1, 2, 80, 16) for _ in range(3))
    clean = attnkit.attention(q, k, v, mask=mask, backend="native")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:40], v2[:, :, 30:40] = float("nan"), float("inf")
    k2, v2 = k2.requires_grad_(), v2.requires_grad_()
    out = attnkit.attention(q, k2, v2, mask=mask, backend="native")
    assert torch.allclose(out, clean, atol=1e-6, rtol=0)
    out.sum().backward()
    assert torch.isfinite(k2.grad).all() and torch.isfinite(v2.grad).all()


@needs_build
def test_fully_masked_rows_zero_lse_minus_inf():
    mask = KeyPadding([0, 50]) & SlidingWindow(3, 0)
    q = torch.randn(2, 2, 60, 8, requires_grad=True)
    out, lse = attnkit.attention(q, q, q, mask=mask, backend="native", return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and (lse[0] == float("-inf")).all()
    assert torch.isfinite(lse[1, :, :50]).all() and (out[1, :, 50:53] != 0).any()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))


@needs_build
def test_bfloat16_runs_in_float32_and_casts_back():
    q, k, v = (torch.randn(1, 2, 100, 32).bfloat16() for _ in range(3))
    out = attnkit.attention(q, k, v, mask=Causal(), backend="native")
    ref, _ = reference_attention(q, k, v, mask=Causal())
    assert out.dtype == torch.bfloat16 and max_error(out, ref) < 2e-2


@needs_build
def test_auto_ranks_native_by_the_cost_model():
    # Which fused kernel wins is measured per machine (tests/test_dispatch.py injects figures);
    # for a long window, a backend that skips the masked tiles, never a materialized mask.
    big = torch.randn(1, 2, 1024, 16)
    assert attnkit.explain(big, big, big, mask=SlidingWindow(64, 0)).chosen in ("native", "sliding_window")
    assert attnkit.explain(big, big, big).chosen in ("sdpa", "native")


GRID_MASKS = {
    "Causal": Causal(), "Window": SlidingWindow(9, 4), "KeyPadding": KeyPadding([70, 33]),
    "Padding": Padding(torch.arange(200)[None].expand(2, -1) % 7 != 0),
    "Document": Document(torch.arange(200) // 45), "BigBird": BlockSparse.bigbird(13, 16, seed=2),
    "Or": SlidingWindow(3, 0) | Document(torch.arange(200) // 60),
}


@pytest.mark.parametrize("name", list(GRID_MASKS))
@pytest.mark.parametrize("q_offset,Tq,Tk", [(0, 100, 100), (30, 70, 100), (0, 100, 77)])
def test_tile_grid_agrees_with_evaluation(name, q_offset, Tq, Tk):
    """FULL tiles keep everything, EMPTY tiles nothing, and for positional masks the analytic grid
    is exact (PARTIAL only where the tile really is mixed)."""
    mask = GRID_MASKS[name]
    grid = _tiles.tile_grid(mask, Tq, Tk, q_offset, 0, 16, 24)
    keep = mask.materialize(Tq, Tk, q_offset=q_offset).any(0).any(0)  # (Tq, Tk): kept in some batch row or head
    every = mask.materialize(Tq, Tk, q_offset=q_offset).all(0).all(0)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            tile_any = keep[16 * i : 16 * i + 16, 24 * j : 24 * j + 24].any()
            tile_all = every[16 * i : 16 * i + 16, 24 * j : 24 * j + 24].all()
            status = int(grid[i, j])
            assert status != BlockStatus.EMPTY.value or not tile_any
            assert status != BlockStatus.FULL.value or tile_all
            if name in ("Causal", "Window", "KeyPadding", "Padding"):
                expected = BlockStatus.EMPTY if not tile_any else BlockStatus.FULL if tile_all else BlockStatus.PARTIAL
                assert status == expected.value


def test_tile_grid_is_analytic_for_positional_masks(monkeypatch):
    """Building the grid of positional masks never evaluates the mask element by element."""

    def refuse(*args, **kwargs):
        raise AssertionError("evaluated the mask")

    for cls in (Causal, SlidingWindow, KeyPadding, Document):
        monkeypatch.setattr(cls, "mask_mod", refuse)
    mask = Causal() & SlidingWindow(256, 0) & KeyPadding([8000]) & Document(torch.arange(8192) // 1024)
    grid = _tiles.tile_grid(mask, 8192, 8192, 0, 0, 128, 128)
    assert grid.shape == (64, 64) and int(grid[63, 0]) == BlockStatus.EMPTY.value


def test_not_built_declines_with_reason(monkeypatch, tmp_path):
    from attnkit.csrc import build

    monkeypatch.setattr(build, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(build, "STAMP", tmp_path / "stamp.json")
    native.load_extension.cache_clear()
    try:
        q = torch.randn(1, 1, 4, 8)
        reasons = attnkit.explain(q, q, q, backend="native").reasons["native"]
        assert any(r.startswith("native extension not built") for r in reasons)
        assert "native" not in attnkit.list_backends() or not attnkit.get_backend("native").available()
    finally:
        monkeypatch.undo()
        native.load_extension.cache_clear()


def test_options_are_validated():
    with pytest.raises(ValueError, match="block_q"):
        native.NativeOptions(block_q=0)


@needs_build
def test_equal_custom_masks_get_their_own_plan():
    """Two Custom masks built on one function: when the function reads state that changed between
    them, the second call must see the new state (no plan reused across mask values)."""
    state = {"cut": 20}
    fn = lambda b, h, q, k: k < state["cut"]  # noqa: E731
    q, k, v = (torch.randn(1, 3, 45, 12, dtype=torch.float64) for _ in range(3))
    first = Custom(fn)
    out1 = attnkit.attention(q, k, v, mask=first, backend="native", options=native.NativeOptions(16, 16))
    state["cut"] = 33
    second = Custom(fn)
    out2 = attnkit.attention(q, k, v, mask=second, backend="native", options=native.NativeOptions(16, 16))
    ref1, _ = reference_attention(q, k, v, mask=Custom(lambda b, h, q, k: k < 20))
    ref2, _ = reference_attention(q, k, v, mask=Custom(lambda b, h, q, k: k < 33))
    assert max_error(out1, ref1) < 1e-10 and max_error(out2, ref2) < 1e-10


@needs_build
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_flagged_key_changes_no_bit_of_rows_that_cannot_see_it(value):
    """Odd lengths and head dims, float32, several tiles: rows before the bad key are bitwise equal
    to the clean call's (the kernel runs the same GEMM shapes), rows that see a NaN key are NaN."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 97, 59, generator=g)
    k = torch.randn(1, 3, 97, 59, generator=g)
    v = torch.randn(1, 3, 97, 21, generator=g)
    mask = Causal() & SlidingWindow(40, 0)
    opts = native.NativeOptions(16, 32)
    clean = attnkit.attention(q, k, v, mask=mask, backend="native", options=opts)
    bad_v = v.clone()
    bad_v[0, 1, 61, 5] = value
    out = attnkit.attention(q, k, bad_v, mask=mask, backend="native", options=opts)
    seen = mask.materialize(97, 97)[0, 0][:, 61]  # (Tq,): rows 61..97 within the window
    untouched = torch.ones(out.shape[:3], dtype=torch.bool)
    untouched[0, 2:4, seen] = False  # kv head 1 serves query heads 2 and 3
    assert torch.equal(out[untouched], clean[untouched])
    if value != value:
        assert torch.isnan(out[0, 2:4][:, seen]).any(-1).all()


def test_copied_build_declines_on_a_cpu_lacking_its_flags(monkeypatch, tmp_path):
    from attnkit.csrc import build

    monkeypatch.setattr(build, "STAMP", tmp_path / "stamp.json")
    monkeypatch.setattr(build, "library_path", lambda family="prefill": tmp_path / "attnkit_native.so")
    (tmp_path / "attnkit_native.so").write_bytes(b"")
    build.STAMP.write_text('{"torch": "%s", "cpu_flags": ["sse2", "made_up_isa"], "families": {"prefill": {}}}'
                           % torch.__version__)
    monkeypatch.setattr(build, "cpu_flags", lambda: {"sse2", "avx2"})
    native.load_extension.cache_clear()
    try:
        reason = native.load_extension()[1]
        assert reason is not None and "made_up_isa" in reason and "rebuild" in reason
    finally:
        monkeypatch.undo()
        native.load_extension.cache_clear()


def test_build_failure_exits_non_zero_with_the_error(monkeypatch, capsys):
    from attnkit.csrc import build

    def fail(family, verbose=False):
        raise RuntimeError("attention.cpp:12: error: something the compiler said")

    monkeypatch.setattr(build, "build", fail)
    assert build.main() == 1
    assert "something the compiler said" in capsys.readouterr().err


@needs_build
def test_parallel_loops_are_compiled_as_openmp_regions_on_an_openmp_torch():
    """``at::parallel_for`` is a header template: on a torch whose ATen parallel backend is OpenMP its
    ``omp parallel`` region must be compiled into the extension (built with -fopenmp), or every
    kernel loop silently runs on one thread. The region calls the runtime torch has already loaded."""
    import shutil
    import subprocess

    from attnkit.csrc import build

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's ATen parallel backend is not OpenMP here")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no `nm` (binutils) to list the extension's symbols")
    symbols = subprocess.run([nm, "-D", str(build.library_path())], capture_output=True, text=True, check=True).stdout
    assert "GOMP_parallel" in symbols, "the native kernel's parallel loops were compiled without -fopenmp"


@needs_build
def test_eager_autograd_equals_the_operators_registered_autograd(monkeypatch):
    """Eager training goes through a plain autograd.Function (no per-call schema handling of
    torch.library's wrapper); the operator keeps its registered autograd (what torch.compile traces).
    Both run one backward formula on one deterministic kernel, so every gradient (q, k, v, bias, ALiBi
    slopes, sinks) is bitwise equal."""
    from attnkit.backends import native_ops
    from attnkit.score_mods import ALiBi

    g = torch.Generator().manual_seed(3)
    B, H, T_, D = 2, 4, 37, 16
    base = [torch.randn(B, H, T_, D, generator=g, dtype=torch.float64) for _ in range(3)]
    f64 = dict(generator=g, dtype=torch.float64)
    base += [torch.randn(1, H, T_, T_, **f64), torch.rand(H, **f64), torch.randn(H, **f64)]
    mask = Causal() & KeyPadding([30, 37])

    def grads():
        q, k, v, bias, slopes, sinks = inputs = [x.clone().requires_grad_() for x in base]
        out = attnkit.attention(q, k, v, mask=mask, bias=bias, score_mod=ALiBi(slopes), sinks=sinks, backend="native")
        loss = (out * torch.arange(out.numel(), dtype=out.dtype).view(out.shape).sin()).sum()
        nodes, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is not None and type(node).__name__ not in nodes:
                nodes.add(type(node).__name__)
                todo += [n for n, _ in node.next_functions]
        return torch.autograd.grad(loss, inputs), nodes

    eager, nodes = grads()
    assert "_EagerBackward" in nodes
    def operator(q, k, v, spec, block_q, block_k, bad):  # the registered operator, called as it is
        return torch.ops.attnkit_native.forward(q, k, v, spec.tensors, spec.ints, spec.floats, block_q, block_k, bad)

    monkeypatch.setattr(native_ops, "forward", operator)
    registered, nodes = grads()
    assert "_EagerBackward" not in nodes and any(n.startswith("GeneratedBackwardFor_attnkit_native") for n in nodes)
    for name, a, b in zip(("q", "k", "v", "bias", "slopes", "sinks"), eager, registered):
        assert a.shape == b.shape and torch.isfinite(a).all() and torch.equal(a, b), name


@needs_build
def test_memory_kept_between_calls_never_leaks_one_call_into_the_next():
    """The packed operands and the workers' tiles are kept between calls (grow-only): calls of other
    sizes, tiles, dtypes and masks in between leave each call's result what it is alone."""
    g = torch.Generator().manual_seed(3)

    def inputs(Tq, Tk, D, dtype):
        return [torch.randn(1, 2, t, D, generator=g).to(dtype) for t in (Tq, Tk, Tk)]

    first = inputs(70, 90, 40, torch.float32)
    alone = attnkit.attention(*first, mask=Causal(), backend="native")
    for Tq, Tk, D, dtype, mask, block in [
        (300, 520, 72, torch.float32, None, None),  # larger: every kept buffer grows
        (17, 33, 9, torch.float32, SlidingWindow(5, 2), (16, 16)),  # smaller, odd sizes, other tiles
        (129, 129, 59, torch.bfloat16, Causal(), None),  # another dtype (VNNI-packed where the CPU has it)
        (64, 200, 24, torch.float64, BlockSparse.bigbird(7, 32, seed=2), None),
    ]:
        q, k, v = inputs(Tq, Tk, D, dtype)
        options = native.NativeOptions(*block) if block else None
        out = attnkit.attention(q, k, v, mask=mask, backend="native", options=options)
        ref, _ = reference_attention(q.double(), k.double(), v.double(), mask=mask)
        assert max_error(out.double(), ref) < (2e-2 if dtype == torch.bfloat16 else 1e-4), (Tq, Tk, D, dtype)
    # the same call again, after the others wrote their data into the kept memory: the same bits
    # (one code path, the same shapes and tiles)
    assert torch.equal(attnkit.attention(*first, mask=Causal(), backend="native"), alone)
