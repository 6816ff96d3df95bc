"""Textbook rules of thumb about attention, measured here (research beside attnkit, not part of it:
each has a script ``benchmarks/claim_*.py`` that runs it and prints its table).

1. ``scaling``: scores ``q·k`` of unit-variance vectors have variance ``d_k``; dividing by ``√d_k``
   brings it to ~1, while unscaled scores saturate the softmax (max weight -> 1) and the gradient
   through it vanishes.
2. ``score_memory``: one fp32 (n, n) score matrix at n = 16384 is 16384² · 4 B = 1 GiB (1.07 GB).
3. ``boundaries``: the rule of thumb "standard attention below 4k tokens, flash 4k-32k, sparse beyond"
   against this machine's measured crossovers (from a sweep).
4. ``multihead``: "multi-head is 3-5x faster than single-head at equal width for n > 1024".
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from attnkit.bench.memory import PeakMemory

__all__ = ["scaling", "score_memory", "boundaries", "multihead"]


def scaling(dims: tuple[int, ...] = (16, 64, 256, 1024), n: int = 256, seed: int = 0) -> list[dict]:
    """Score variance, softmax saturation and gradient norm with and without the 1/√d_k scale."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for d in dims:
        q, k, v = (torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64) for _ in range(3))
        target = torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
        for scaled in (True, False):
            qq = q.clone().requires_grad_()
            scores = qq @ k.transpose(-1, -2) * (d**-0.5 if scaled else 1.0)
            probs = scores.softmax(-1)
            loss = ((probs @ v) * target).sum()
            # through the softmax (what saturation kills) and on to q (which the 1/√d_k factor also scales)
            grad_scores, grad = torch.autograd.grad(loss, (scores, qq))
            scores, probs = scores.detach(), probs.detach()
            # Per-row softmax Jacobian J = diag(p) - p pᵀ: ‖J‖_F² = Σp² - 2Σp³ + (Σp²)²; -> 0 as a row saturates
            p2, p3 = (probs**2).sum(-1), (probs**3).sum(-1)
            jac = (p2 - 2 * p3 + p2**2).clamp_min(0).sqrt()
            rows.append({
                "d_k": d, "scaled": scaled, "score_var": float(scores.var()),
                "mean_max_weight": float(probs.max(-1).values.mean()),
                "saturated_rows": float((probs.max(-1).values > 0.99).double().mean()),
                "median_softmax_jacobian": float(jac.median()),
                "grad_norm_scores": float(grad_scores.norm()), "grad_norm_q": float(grad.norm()),
            })
    return rows


def score_memory(n: int = 16384, device: str = "cpu") -> dict:
    """Measure the memory of one fp32 (1, 1, n, n) score matrix ``q @ kᵀ`` (B = H = 1, D = 64)."""
    q = torch.randn(1, 1, n, 64, device=device)
    k = torch.randn(1, 1, n, 64, device=device)
    meter = PeakMemory(device)
    peak = meter.measure(lambda: q @ k.transpose(-1, -2))
    return {"n": n, "predicted_bytes": n * n * 4, "measured_bytes": peak, "method": meter.method,
            "extrapolated_to_16384_bytes": None if peak is None else peak * (16384 / n) ** 2}


def multihead(lengths: tuple[int, ...] = (1024, 2048), width: int = 512, heads: int = 8, rounds: int = 3,
              min_run_time: float = 0.1, device: str = "cpu") -> list[dict]:
    """Time SDPA forward with ``heads`` heads of width/heads against 1 head of full width (same
    FLOPs for Q Kᵀ and P V), interleaved ``rounds`` times; the ratio is single / multi."""
    import torch.utils.benchmark as tb  # here, not at import: see attnkit.bench.runner._time

    rows = []
    for n in lengths:
        multi = [torch.randn(1, heads, n, width // heads, device=device) for _ in range(3)]
        single = [torch.randn(1, 1, n, width, device=device) for _ in range(3)]
        timers = {
            name: tb.Timer("F.scaled_dot_product_attention(q, k, v)", globals={"F": F, "q": t[0], "k": t[1], "v": t[2]},
                             num_threads=torch.get_num_threads())
            for name, t in (("multi", multi), ("single", single))
        }
        times = {"multi": [], "single": []}
        for _ in range(rounds):
            for name, timer in timers.items():
                times[name].append(timer.blocked_autorange(min_run_time=min_run_time).median)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rows.append({"n": n, "width": width, "heads": heads, "multi_s": med["multi"], "single_s": med["single"],
                     "single_over_multi": med["single"] / med["multi"]})
    return rows


# The rule of thumb mapped onto attnkit backends: "standard" is the materialized softmax (naive),
# "flash" the fused/tiled exact kernels, "sparse" the structured-sparsity backends.
FAMILIES = {"naive": "standard", "sdpa": "flash", "tiled": "flash", "sliding_window": "sparse",
            "block_sparse": "sparse"}


def boundaries(crossover_points: dict) -> list[dict]:
    """Where this machine's fastest exact backend changes family, per (dtype, pass, mask), from
    :func:`attnkit.bench.report.crossovers`; compare with the rule of thumb's 4k (standard -> flash) and 32k
    (flash -> sparse)."""
    rows = []
    for (dtype, passes, mask), pts in crossover_points.items():
        fam = [(n, FAMILIES.get(best, best)) for n, best, _, _ in pts]
        seen = " -> ".join(f"{f} from n={n}" for i, (n, f) in enumerate(fam) if i == 0 or fam[i - 1][1] != f)
        rows.append({"dtype": dtype, "passes": passes, "mask": mask, "families": seen,
                     "lengths": [n for n, _ in fam]})
    return rows
