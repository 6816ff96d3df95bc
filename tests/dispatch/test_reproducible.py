"""The same inputs choose the same backend in every process of one install: three fresh processes, one
started beside a busy loop, each with an empty cache folder, agree on ``explain()`` over a grid of calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

GRID = textwrap.dedent("""
    import json, sys, torch
    import attnkit
    from attnkit import BlockSparse, Causal, KeyPadding, SlidingWindow
    rows = []
    for n in (1, 16, 17, 64, 256, 1024, 4096):
        for name, mask in (("none", None), ("causal", Causal()), ("window", SlidingWindow(64, 0)),
                           ("padding", KeyPadding([max(1, n - 3)])),
                           ("bigbird", BlockSparse.bigbird(n // 16, 16, random_blocks=1) if n >= 64 else None)):
            for dtype in (torch.float32, torch.bfloat16):
                for grad in (False, True):
                    one = torch.zeros(1, 1, 1, 1, dtype=dtype)
                    q = one.clone().requires_grad_(grad).expand(1, 8, n, 64)
                    k = one.expand(1, 2, 4096 if n <= 16 else n, 64)
                    e = attnkit.explain(q, k, k, mask=mask)
                    rows.append([n, name, str(dtype), grad, e.chosen, e.order[:3]])
    json.dump(rows, sys.stdout)
""")


def _run(tmp_path, index: int) -> list:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / f"cache{index}"),
           "ATTNKIT_CALIBRATION": str(tmp_path / f"cache{index}" / "none.json")}
    env.pop("ATTNKIT_AUTOTUNE", None)
    out = subprocess.run([sys.executable, "-c", GRID], capture_output=True, text=True, env=env, timeout=300,
                         check=True)
    return json.loads(out.stdout)


@pytest.mark.slow
def test_three_fresh_processes_choose_alike_even_beside_a_busy_loop(tmp_path):
    first = _run(tmp_path, 0)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        second = _run(tmp_path, 1)
    finally:
        busy.kill()
        busy.wait()
    third = _run(tmp_path, 2)
    assert len(first) >= 30
    assert first == second == third
    assert not any((tmp_path / f"cache{i}").exists() for i in range(3))  # nothing written: no probe, no state file
