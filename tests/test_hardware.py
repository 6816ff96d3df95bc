"""The half-precision matmul probe: measured once, overridable, and it decides the upcast."""

import pytest
import torch

import attnkit
from attnkit import hardware
from attnkit.backends import _common
from attnkit.inputs import AttentionInputs


def test_probe_measures_and_caches():
    hardware.half_matmul_is_fast.cache_clear()
    first = hardware.half_matmul_is_fast(torch.bfloat16)
    assert isinstance(first, bool) and hardware.half_matmul_is_fast(torch.bfloat16) is first
    assert hardware.matmul_rate(torch.float32, size=64, repeats=1) > 0


@pytest.mark.parametrize("forced, upcast", [("fast", False), ("slow", True)])
def test_override_decides_the_upcast_of_forward_only_calls(monkeypatch, forced, upcast):
    monkeypatch.setenv("ATTNKIT_HALF_MATMUL", forced)
    hardware.half_matmul_is_fast.cache_clear()
    try:
        x = torch.randn(1, 2, 8, 16).bfloat16()
        inp = _common.upcast_on_cpu(AttentionInputs.create(x, x, x))
        assert (inp.dtype == torch.float32) is upcast
        grad = _common.upcast_on_cpu(AttentionInputs.create(x.clone().requires_grad_(), x, x))
        assert grad.dtype == torch.float32  # gradients always use float32 tiles
        out = attnkit.attention(x, x, x, mask=attnkit.SlidingWindow(3, 0), backend="sliding_window")
        assert out.dtype == torch.bfloat16
    finally:
        hardware.half_matmul_is_fast.cache_clear()


def test_bad_override_is_refused(monkeypatch):
    monkeypatch.setenv("ATTNKIT_HALF_MATMUL", "maybe")
    hardware.half_matmul_is_fast.cache_clear()
    try:
        with pytest.raises(ValueError, match="ATTNKIT_HALF_MATMUL"):
            hardware.half_matmul_is_fast(torch.float16)
    finally:
        hardware.half_matmul_is_fast.cache_clear()


def test_machine_id_and_probed_rates_are_plain_positive_figures():
    import json

    ident = hardware.machine_id()
    assert set(ident) == {"cpu", "capability", "threads", "torch", "attnkit", "native"}
    assert ident["torch"] == torch.__version__ and ident["attnkit"] == attnkit.__version__
    json.dumps(ident)
    rates = hardware.probe_rates()
    figures = [*rates["gemm_gflops"].values(), rates["tile_gflops"], rates["bandwidth_gbs"], rates["op_seconds"]]
    assert set(rates["gemm_gflops"]) == {"float32", "bfloat16", "float16"} and all(x > 0 for x in figures)


def test_best_seconds_stops_once_a_call_is_slower_than_enough():
    import time

    calls = []
    slow = lambda: calls.append(1) or time.sleep(0.002)  # noqa: E731
    assert hardware.best_seconds(slow, 5, enough=0.001) >= 0.002 and len(calls) == 2  # warm-up and one
    calls.clear()
    assert hardware.best_seconds(slow, 3) >= 0.002 and len(calls) == 4
