"""Suite-wide settings and fixtures."""

import pytest
import torch

from attnkit import calibration

# Several test processes share 2 CPU cores: one intra-op thread each avoids oversubscription,
# which makes small matmuls ~50x slower under load.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_user_calibration(tmp_path_factory, monkeypatch):
    """Tests see the built-in dispatch defaults, never a calibration the user measured with
    `attnkit bench --calibrate` (tests that need one point ATTNKIT_CALIBRATION at a temp file)."""
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path_factory.getbasetemp() / "no-calibration.json"))
    calibration.reload()
    monkeypatch.setattr(calibration, "_CONSTANTS", [uniform_constants()])
    monkeypatch.setattr(calibration, "_CONSTANTS_THREADS", [None])  # kept whatever the thread count
    yield
    calibration.reload()


def uniform_constants(overhead: float = 1e-4, reference: float = 4e-3) -> dict:
    """Machine constants under which every backend has the same per-call overhead and the same time
    on each reference problem: ``auto``'s order then follows from structure alone, the same on every
    machine (tests of the cost model inject their own measurements). 4 ms on the 8-head references
    (a millisecond per two heads): a materializing backend's mask traffic stays a small part of it."""
    from attnkit import list_backends

    names = [name for name, impl in list_backends().items() if impl.exact]
    return {"gemm_gflops": {"float32": 100.0, "bfloat16": 100.0, "float16": 100.0}, "tile_gflops": 50.0,
            "bandwidth_gbs": 10.0, "op_seconds": 1e-6, "backend_seconds": {n: overhead for n in names},
            "train_backend_seconds": {n: 3 * overhead for n in names},
            "reference_seconds": {n: {c: reference for c in ("causal", "band", "layout", "decode")} for n in names},
            "half_reference_seconds": {n: {"bfloat16": reference, "float16": reference} for n in names}}


def pytest_report_header(config):
    """Print the rotating hypothesis seed, so a failure can be replayed."""
    from .reference import DEVICE, HYPOTHESIS_CI, ROTATING_SEED

    return (f"attnkit tests on {DEVICE}; hypothesis {'ci' if HYPOTHESIS_CI else 'dev'} profile "
            f"(ATTNKIT_HYPOTHESIS_PROFILE), rotating seed: ATTNKIT_HYPOTHESIS_SEED={ROTATING_SEED}")
