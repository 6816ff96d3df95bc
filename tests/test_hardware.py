"""The half-precision matmul decision: from the CPU's features (never a timing), overridable, and it
decides the upcast."""

import pytest
import torch

import attnkit
from attnkit import hardware
from attnkit.backends import _common
from attnkit.inputs import AttentionInputs


@pytest.fixture
def half(monkeypatch):
    """A monkeypatch whose changes to the environment or the features are decided again, then undone."""
    monkeypatch.delenv("ATTNKIT_HALF_MATMUL", raising=False)
    yield monkeypatch
    monkeypatch.undo()
    hardware.refresh()


@pytest.mark.parametrize("features, bf16, fp16, bf16_reason", [
    ({}, False, False, "this CPU has none of avx512_bf16, amx_bf16"),
    ({"avx2": True, "avx512_bf16": False}, False, False, "this CPU has none of avx512_bf16, amx_bf16"),
    ({"avx512_bf16": True}, True, False, "this CPU has avx512_bf16"),
    ({"amx_bf16": True, "avx512_fp16": True}, True, True, "this CPU has amx_bf16"),
    ({"amx_fp16": True}, False, True, "this CPU has none of avx512_bf16, amx_bf16"),
])
def test_the_half_paths_follow_the_cpu_features_and_are_never_timed(half, features, bf16, fp16, bf16_reason):
    half.setattr(hardware, "cpu_features", lambda: dict(features))
    half.setattr(hardware, "matmul_rate", lambda *a, **kw: pytest.fail("half_matmul_is_fast timed a matmul"))
    hardware.refresh()
    assert hardware.half_matmul_is_fast(torch.bfloat16) is bf16
    assert hardware.half_matmul_is_fast(torch.float16) is fp16
    assert hardware.half_matmul_reason(torch.bfloat16) == bf16_reason
    assert hardware.half_matmul_is_fast(torch.float32) is False  # not a half dtype: nothing to decide


def test_the_decision_is_taken_once_not_per_call(half):
    calls = []
    half.setattr(hardware, "cpu_features", lambda: calls.append(1) or {"avx512_bf16": True})
    hardware.refresh()
    seen = len(calls)
    assert all(hardware.half_matmul_is_fast(torch.bfloat16) for _ in range(5)) and len(calls) == seen


@pytest.mark.parametrize("forced, upcast", [("fast", False), ("slow", True)])
def test_override_decides_the_upcast_of_forward_only_calls(half, forced, upcast):
    half.setenv("ATTNKIT_HALF_MATMUL", forced)
    hardware.refresh()
    assert hardware.half_matmul_reason(torch.bfloat16) == f"ATTNKIT_HALF_MATMUL={forced}"
    x = torch.randn(1, 2, 8, 16).bfloat16()
    inp = _common.upcast_on_cpu(AttentionInputs.create(x, x, x))
    assert (inp.dtype == torch.float32) is upcast
    grad = _common.upcast_on_cpu(AttentionInputs.create(x.clone().requires_grad_(), x, x))
    assert grad.dtype == torch.float32  # gradients always use float32 tiles
    out = attnkit.attention(x, x, x, mask=attnkit.SlidingWindow(3, 0), backend="sliding_window")
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["tiled", "sliding_window", "block_sparse"])
def test_float16_tiles_are_float32_even_where_float16_matmuls_are_fast(half, backend):
    """A float16 matmul rounds its result to float16 (range 65504): q = k = v = 256 at D = 80 give
    scores of 5.9e5 even after scaling, so float16 inputs run float32 tiles on every CPU."""
    half.setenv("ATTNKIT_HALF_MATMUL", "fast")
    hardware.refresh()
    assert hardware.half_matmul_is_fast(torch.float16)
    x = torch.randn(1, 2, 8, 16).half()
    assert _common.upcast_on_cpu(AttentionInputs.create(x, x, x)).dtype == torch.float32
    big = torch.full((1, 2, 16, 80), 256.0, dtype=torch.float16)
    mask = {"tiled": attnkit.Causal(), "sliding_window": attnkit.SlidingWindow(15, 0),
            "block_sparse": attnkit.BlockSparse.window_global(2, 8, causal=True)}[backend]
    out = attnkit.attention(big, big, big, mask=mask, backend=backend)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert (out.float() - 256.0).abs().max() <= 0.25


def test_the_override_is_read_only_by_refresh(half):
    hardware.refresh()
    before = hardware.half_matmul_is_fast(torch.bfloat16)
    half.setenv("ATTNKIT_HALF_MATMUL", "slow" if before else "fast")
    assert hardware.half_matmul_is_fast(torch.bfloat16) is before  # decided at import: no environment read per call
    hardware.refresh()
    assert hardware.half_matmul_is_fast(torch.bfloat16) is not before


def test_bad_override_is_refused(half):
    half.setenv("ATTNKIT_HALF_MATMUL", "maybe")
    hardware.refresh()
    with pytest.raises(ValueError, match="ATTNKIT_HALF_MATMUL='maybe': expected 'fast', 'slow' or unset"):
        hardware.half_matmul_is_fast(torch.float16)


def test_machine_id_and_the_matmul_rate_are_plain_figures():
    import json

    ident = hardware.machine_id()
    assert set(ident) == {"cpu", "capability", "threads", "torch", "attnkit", "native"}
    assert ident["torch"] == torch.__version__ and ident["attnkit"] == attnkit.__version__
    assert ident["threads"] == torch.get_num_threads()
    json.dumps(ident)
    assert hardware.matmul_rate(torch.float32, size=64, repeats=1) > 0
