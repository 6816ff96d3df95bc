"""``attnkit bench``: measure every registered backend on this machine (see :mod:`attnkit.cli.bench`)."""

from .cases import BenchConfig, Case, MaskSpec, mask_spec
from .report import crossover_table, crossovers, terminal_table
from .runner import build_calibration, matmul_peak, resolve_ties, run_sweep, verify_auto, verify_auto_before

__all__ = [
    "BenchConfig",
    "Case",
    "MaskSpec",
    "mask_spec",
    "run_sweep",
    "build_calibration",
    "resolve_ties",
    "verify_auto",
    "verify_auto_before",
    "matmul_peak",
    "terminal_table",
    "crossovers",
    "crossover_table",
]
