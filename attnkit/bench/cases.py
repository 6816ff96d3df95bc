"""What ``attnkit bench`` measures: the configuration, mask specs, cases, and their predicted cost.

A case is one (backend, length, mask, dtype, pass) point at shape ``(B, H, n, D)`` with ``Tq = Tk = n``.
Its useful FLOPs count only kept (query, key) pairs: ``4 * B * H * n^2 * D * density`` for the
forward pass (``Q Kᵀ`` and ``P V``), 3.5x that for forward+backward (the convention of flash-attn's
``benchmarks/benchmark_flash_attention.py``: backward = 2.5x forward). Approximate backends are
credited with the same exact-attention FLOPs, so their GFLOP/s reads as "exact-attention work per
second" and compares directly with the exact ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._validate import check_int_at_least
from ..masks import BlockSparse, Causal, KeyPadding, Mask, SlidingWindow

__all__ = ["BenchConfig", "MaskSpec", "Case", "MASK_SPECS", "mask_spec", "density", "useful_flops", "estimate_bytes"]

PASSES = ("forward", "train")  # train = forward + backward
DTYPES = ("float32", "bfloat16", "float16", "float64")
BACKWARD_FACTOR = 3.5  # fwd+bwd FLOPs / fwd FLOPs (flash-attn benchmark convention)


@dataclass
class BenchConfig:
    """Everything one sweep needs (the CLI fills it from its flags; defaults fit ~1 minute on 2 cores)."""

    backends: list[str] | None = None  # None: every registered backend, plus "auto"
    lengths: list[int] = field(default_factory=lambda: [256, 1024])
    masks: list[str] = field(default_factory=lambda: ["none", "causal", "window", "bigbird", "padding"])
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    passes: list[str] = field(default_factory=lambda: list(PASSES))
    device: str = "cpu"
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    window: int = 256  # SlidingWindow(window, 0), and the Longformer/BigBird window width
    block: int = 64  # BlockSparse block size for the BigBird/Longformer patterns
    time_budget_s: float = 0.25  # skip a case whose predicted time per call exceeds this
    memory_budget_bytes: int = 4 * 2**30  # skip a case whose predicted peak memory exceeds this
    min_run_time: float = 0.05  # torch.utils.benchmark blocked_autorange per case
    run_budget_s: float | None = None  # the whole sweep: cases left when it is spent are skipped (None: no limit)
    error_rows: int = 64  # error vs the float64 reference on the last rows (O(rows * n) cost)
    seed: int = 0

    def __post_init__(self):
        """Refuse values that would hang (NaN timing budgets), allocate absurd inputs, or mean nothing."""
        for name in ("batch", "heads", "head_dim", "window", "block", "error_rows"):
            check_int_at_least(_flag(name), getattr(self, name))
        if not isinstance(self.lengths, (list, tuple)) or not self.lengths:
            raise ValueError(f"{_flag('lengths')}: expected a non-empty list of lengths, got {self.lengths!r}")
        for n in self.lengths:
            check_int_at_least(_flag("lengths"), n)
        if self.run_budget_s is not None:
            value = self.run_budget_s
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"--budget: expected a finite number of seconds > 0, got {value!r}")
        for name in ("time_budget_s", "min_run_time"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{_flag(name)}: expected a finite number of seconds > 0, got {value!r}")
        if isinstance(self.memory_budget_bytes, bool) or not isinstance(self.memory_budget_bytes, int) \
                or self.memory_budget_bytes <= 0:
            raise ValueError(f"{_flag('memory_budget_bytes')}: expected a positive size, "
                             f"got {self.memory_budget_bytes!r}")
        for name, allowed in (("passes", PASSES), ("dtypes", DTYPES), ("masks", None)):
            values = getattr(self, name)
            allowed = allowed or tuple(MASK_SPECS)
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ValueError(f"{_flag(name)}: expected some of {','.join(allowed)}, "
                                 f"got {','.join(map(str, values))!r}")
        # the inputs alone must fit the memory budget: refuse before anything is allocated
        for dtype in self.dtypes:
            longest = max(self.lengths)
            need = estimate_bytes(self, None, longest, "none", getattr(torch, dtype), "forward")
            if need > self.memory_budget_bytes:
                raise ValueError(
                    f"--lengths {longest}: the q, k, v inputs alone ({self.batch}x{self.heads}x{longest}x"
                    f"{self.head_dim} {dtype}) need about {describe_bytes(need)}, over --memory-budget "
                    f"{describe_bytes(self.memory_budget_bytes)}; use shorter lengths or raise the budget")


# BenchConfig field -> the `attnkit bench` flag that sets it (for error messages)
_FLAGS = {"head_dim": "--head-dim", "time_budget_s": "--time-budget", "run_budget_s": "--budget",
          "memory_budget_bytes": "--memory-budget", "min_run_time": "--min-run-time",
          "error_rows": "BenchConfig.error_rows", "block": "BenchConfig.block"}


def _flag(field_name: str) -> str:
    return _FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


@dataclass(frozen=True)
class MaskSpec:
    """A named mask family: ``build(n, config)`` gives the mask for length n (None = no mask)."""

    name: str
    label: str
    build: Callable[[int, BenchConfig], Mask | None]


def _block_pattern(name: str) -> Callable[[int, BenchConfig], Mask]:
    """BigBird / Longformer block layouts (``attnkit.BlockSparse``): bidirectional,
    ``window // block`` blocks each side, block 0 global; BigBird adds one random block per row."""

    def build(n: int, c: BenchConfig) -> Mask:

        blocks, window = -(-n // c.block), max(1, c.window // c.block)
        if name == "longformer":
            return BlockSparse.window_global(blocks, c.block, window=window, global_blocks=(0,))
        return BlockSparse.bigbird(blocks, c.block, window=window, global_blocks=1, random_blocks=1, seed=c.seed)

    return build


def _mask_specs() -> dict[str, MaskSpec]:
    specs = [
        MaskSpec("none", "dense", lambda n, c: None),
        MaskSpec("causal", "causal", lambda n, c: Causal()),
        MaskSpec("window", "sliding window", lambda n, c: SlidingWindow(c.window, 0)),
        MaskSpec("padding", "key padding 25%", lambda n, c: KeyPadding([n - n // 4] * c.batch)),
        MaskSpec("bigbird", "BigBird", _block_pattern("bigbird")),
        MaskSpec("longformer", "Longformer", _block_pattern("longformer")),
    ]
    return {s.name: s for s in specs}


MASK_SPECS = _mask_specs()


def mask_spec(name: str) -> MaskSpec:
    if name not in MASK_SPECS:
        raise ValueError(f"--masks: unknown mask {name!r}; expected some of {sorted(MASK_SPECS)}.")
    return MASK_SPECS[name]


@dataclass(frozen=True)
class Case:
    backend: str
    n: int
    mask: str
    dtype: str
    passes: str  # "forward" or "train"

    @property
    def series(self) -> tuple[str, str, str, str]:
        """The curve this case belongs to (everything but n)."""
        return (self.backend, self.mask, self.dtype, self.passes)


def density(mask: Mask | None, n: int, rows: int = 256) -> float:
    """Fraction of kept (query, key) pairs at Tq = Tk = n (:meth:`Mask.density` on ``rows`` evenly
    spaced query rows, exact when n <= rows): O(rows * n), so it is cheap at any length."""
    return 1.0 if mask is None else mask.density(n, n, rows=rows)


def useful_flops(config: BenchConfig, n: int, dens: float, passes: str) -> float:
    fwd = 4.0 * config.batch * config.heads * n * n * config.head_dim * dens
    return fwd * (BACKWARD_FACTOR if passes == "train" else 1.0)


def estimate_bytes(config: BenchConfig, backend: str | None, n: int, mask: str, dtype: torch.dtype, passes: str) -> int:
    """A rough upper estimate of the memory a case allocates (its inputs included), used only to
    skip cases that would not fit (the reported peak is measured). Backends that build score
    matrices (naive; any backend that is given a mask it must materialize) pay O(B * H * n^2); the
    rest O(B * H * n * D); block layouts cost one byte per (head, block, block).
    ``backend=None``: only what every backend needs (the inputs and the mask), checked before
    anything is allocated."""
    B, H, D = config.batch, config.heads, config.head_dim
    item = torch.empty((), dtype=dtype).element_size()
    linear = 8 * B * H * n * D * item * (3 if passes == "train" else 1)
    blocks = -(-n // config.block)
    structure = 2 * blocks * blocks if mask in ("bigbird", "longformer") else 0
    quadratic = 0
    if backend == "naive":
        # fp32 scores + probabilities (+ their gradients and saved copies for backward)
        quadratic = B * H * n * n * 8 * (3 if passes == "train" else 1)
    materializes = mask != "none" and backend in ("naive", "sdpa") and not (mask == "causal" and backend == "sdpa")
    if materializes:
        quadratic += B * n * n  # the materialized bool mask
    if backend == "sdpa" and mask not in ("none", "causal"):
        # SDPA with an attn_mask may fall back to the math kernel: scores in the input dtype
        quadratic += B * H * n * n * max(item, 4) * (3 if passes == "train" else 1)
    return linear + structure + quadratic


def predicted_seconds(previous: dict[int, float], n: int) -> float | None:
    """Extrapolate a series' measured times to length n: with two or more shorter lengths measured,
    along the growth exponent observed between the last two (clamped to [1, 2], so O(n * window)
    backends are not charged n^2); with one, quadratically. None if nothing shorter was measured."""
    below = sorted(m for m in previous if m < n)
    if not below:
        return None
    m = below[-1]
    exponent = 2.0
    if len(below) >= 2 and previous[below[-2]] > 0:
        a = below[-2]
        exponent = min(2.0, max(1.0, math.log(previous[m] / previous[a]) / math.log(m / a)))
    return previous[m] * (n / m) ** exponent


def describe_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"
