"""The research script benchmarks/claims.py (not part of attnkit) still measures what it claims."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from claims import scaling  # noqa: E402


def test_sqrt_dk_scaling_claim():
    rows = scaling(dims=(1024,), n=256)
    scaled = next(r for r in rows if r["scaled"])
    unscaled = next(r for r in rows if not r["scaled"])
    assert 0.5 < scaled["score_var"] < 2 and unscaled["score_var"] > 500  # the claim itself
    assert unscaled["saturated_rows"] > 0.3 and scaled["saturated_rows"] == 0
    assert unscaled["median_softmax_jacobian"] < scaled["median_softmax_jacobian"] / 10
