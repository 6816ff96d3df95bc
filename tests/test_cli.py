"""`python -m attnkit info` and `demo` (harness only: no timings)."""

from __future__ import annotations

import subprocess
import sys

from attnkit.cli.main import main


def test_info_table_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "naive" in out and "sdpa" in out and "exact" in out


def test_info_explains_choice(capsys):
    assert main(["info", "--shape", "1,8,1024,64", "--mask", "causal"]) == 0
    out = capsys.readouterr().out
    assert "chosen: sdpa" in out and "naive" in out


def test_info_with_lse_passes_over_sdpa(capsys):
    assert main(["info", "--shape", "1,2,16,8", "--mask", "window:4,0", "--lse"]) == 0
    out = capsys.readouterr().out
    assert "sdpa: not used: cannot return the log-sum-exp" in out


def test_demo_runs_as_module():
    result = subprocess.run([sys.executable, "-m", "attnkit", "demo", "--length", "32"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "max |out - naive|" in result.stdout


def test_bad_shape_is_a_usage_error(capsys):
    import pytest

    with pytest.raises(SystemExit) as info:
        main(["info", "--shape", "1,2,3"])
    assert info.value.code == 2
    assert "--shape" in capsys.readouterr().err
