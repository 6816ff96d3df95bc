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
    yield
    calibration.reload()


def pytest_report_header(config):
    """Print the rotating hypothesis seed, so a failure can be replayed."""
    from .reference import DEVICE, HYPOTHESIS_CI, ROTATING_SEED

    return (f"attnkit tests on {DEVICE}; hypothesis {'ci' if HYPOTHESIS_CI else 'dev'} profile (ATTNKIT_HYPOTHESIS_PROFILE), "
            f"rotating seed: ATTNKIT_HYPOTHESIS_SEED={ROTATING_SEED}")
