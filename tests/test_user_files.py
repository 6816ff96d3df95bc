"""The suite never reads or writes the user's own files: the calibration table and every cache or
config folder point into the test run's temp folder, for this process and the processes it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from attnkit.dispatch import table


def test_the_calibration_table_and_cache_folders_are_temp_paths(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    assert base in table.calibration_path().parents
    for name in ("ATTNKIT_CALIBRATION", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        assert base in Path(os.environ[name]).parents, name


def test_a_started_process_inherits_the_temp_paths(tmp_path_factory):
    code = "from attnkit.dispatch import table; print(table.calibration_path())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert tmp_path_factory.getbasetemp() in Path(out.stdout.strip()).parents
