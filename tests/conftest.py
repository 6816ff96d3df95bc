"""Suite-wide settings and fixtures."""

import pytest
import torch

from attnkit.dispatch import table

# Several test processes share 2 CPU cores: one intra-op thread each avoids oversubscription,
# which makes small matmuls ~50x slower under load.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_user_calibration(tmp_path_factory, monkeypatch):
    """Tests see the static dispatch rule, never a table the user measured with `attnkit bench` and
    never the user's cache folder (tests that need a table point ATTNKIT_CALIBRATION at a temp file)."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(base / "no-calibration.json"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(base / "xdg-cache"))
    table.reload()
    yield
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(base / "no-calibration.json"))  # a test may have pointed it elsewhere
    table.reload()


def pytest_report_header(config):
    """Print the rotating hypothesis seed, so a failure can be replayed."""
    from .reference import DEVICE, HYPOTHESIS_CI, ROTATING_SEED

    return (f"attnkit tests on {DEVICE}; hypothesis {'ci' if HYPOTHESIS_CI else 'dev'} profile "
            f"(ATTNKIT_HYPOTHESIS_PROFILE), rotating seed: ATTNKIT_HYPOTHESIS_SEED={ROTATING_SEED}")
