"""Run a sweep: time, memory, throughput and error per case; skip what would not fit; calibrate.

Timing is ``torch.utils.benchmark.Timer.blocked_autorange`` (it synchronizes CUDA itself) after one
warm-up call; we keep the median, the interquartile range and the number of timed runs. Backends at
one (length, mask, dtype, pass) point are timed back to back, so they share the machine's state.
Two single timings of one kernel can still differ by more than two backends do, so the calibration's
points whose leaders are within that noise are timed again interleaved (:func:`resolve_ties`), and
whether ``auto`` picks the best is checked after the sweep by timing its pick and the best
interleaved (:func:`verify_auto`, :func:`verify_auto_before`).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict

from typing import TYPE_CHECKING

import torch

from .. import hardware
from ..dispatch import table as calibration
from ..dispatch import NoBackendError, select
from ..functional import attention
from ..inputs import AttentionInputs
from ..registry import list_backends
from .cases import (
    BenchConfig,
    Case,
    describe_bytes,
    density,
    estimate_bytes,
    mask_spec,
    predicted_seconds,
    useful_flops,
)
from .memory import PeakMemory

__all__ = ["run_sweep", "machine_description", "matmul_peak", "build_calibration", "resolve_ties", "verify_auto",
           "verify_auto_before", "confidence_interval", "estimate_seconds", "confirmed", "noise_floor", "sweep_cases"]


def machine_description(device: str) -> dict:
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return info


if TYPE_CHECKING:
    import torch.utils.benchmark as tb


def _time(fn: Callable[[], object], min_run_time: float) -> tb.Measurement:
    # imported here: torch.utils.benchmark imports torch.utils.cpp_extension, which logs a CUDA_HOME
    # warning on CPU-only installs of machines with a CUDA toolkit, and every command imports this module
    import torch.utils.benchmark as tb

    # num_threads: Timer's default is 1; the sweep measures the thread count the process (and auto's
    # decisions, and the table it writes) runs at
    return tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time)


def matmul_peak(device: str, dtype: torch.dtype, min_run_time: float = 0.2) -> float:
    """The machine's achievable matmul throughput in GFLOP/s for ``dtype`` (a square torch.mm;
    measured once per run, the denominator of "% of peak")."""
    slow = torch.device(device).type == "cpu" and dtype == torch.float16  # no fast fp16 GEMM on CPU
    n = 256 if slow else (4096 if torch.device(device).type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    m = _time(lambda: torch.mm(a, b), min_run_time)
    return 2 * n**3 / m.median / 1e9


def _inputs(config: BenchConfig, n: int, dtype: torch.dtype, grad: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (config.batch, config.heads, n, config.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(device=config.device, dtype=dtype) for _ in range(3))
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


def _error(out, exact: bool, q, k, v, mask, rows: int) -> tuple[float, str]:
    """Error of a forward output on its last ``rows`` query rows against the naive backend in
    float64 on the same rows (absolute positions keep the mask identical): O(rows * n)."""
    n = q.shape[2]
    r = min(rows, n)
    with torch.no_grad():
        q64, k64, v64 = (t.detach().double().cpu() for t in (q, k, v))
        ref = attention(q64[:, :, n - r :], k64, v64, mask=mask, q_offset=n - r, backend="naive")
    out = out[:, :, n - r :].double().cpu()
    if exact:
        return float((out - ref).abs().max()), "max abs"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300)), "relative"


def _call(q, k, v, mask, backend: str, grad_out) -> Callable[[], object]:
    """One timed call: the forward under no_grad, or (``grad_out`` given) forward + backward to
    q, k, v; both return the forward output."""
    if grad_out is not None:

        def train():
            out = attention(q, k, v, mask=mask, backend=backend)
            torch.autograd.grad(out, (q, k, v), grad_out)
            return out.detach()

        return train

    def forward():
        with torch.no_grad():
            return attention(q, k, v, mask=mask, backend=backend)

    return forward


def _skip(case: Case, reason: str, group: str | None = None, **extra) -> dict:
    """A skipped case; ``group`` is the short reason the terminal summary groups by (default: reason)."""
    return {**asdict(case), "status": "skipped", "reason": reason, "group": group or reason, **extra}


def run_sweep(config: BenchConfig, progress: Callable[[Iterable], Iterable] | None = None) -> dict:
    """Measure every case of ``config``; returns the JSON-ready results dict."""
    registry = list_backends()
    names = sweep_names(config)
    for m in config.masks:
        mask_spec(m)
    dtypes = {name: getattr(torch, name) for name in config.dtypes}
    memory = PeakMemory(config.device)
    start = time.perf_counter()
    peaks = {name: matmul_peak(config.device, dt) for name, dt in {"float32": torch.float32, **dtypes}.items()}
    # "% of peak" divides by the fastest matmul we measured for the case's dtype or float32: CPU
    # kernels often compute low precision in float32 (bf16 SDPA can outrun a slow bf16 torch.mm).
    reference_peak = {name: max(peaks[name], peaks["float32"]) for name in dtypes}
    cases = sweep_cases(config, names)
    measured: dict[tuple, dict[int, float]] = {}
    rows = []
    iterator = progress(cases) if progress else cases
    deadline = None if config.run_budget_s is None else start + config.run_budget_s
    for case in iterator:
        if deadline is not None and time.perf_counter() > deadline:
            rows.append(_skip(case, f"the run's time budget (--budget {config.run_budget_s:g} s) was spent",
                              "run time budget spent"))
            continue
        rows.append(_run_case(case, config, registry, dtypes[case.dtype], reference_peak[case.dtype], memory, measured))
    return {
        "schema": "attnkit.bench/1",
        "machine": machine_description(config.device),
        "config": asdict(config),
        "memory_method": memory.method,
        "matmul_peak_gflops": peaks,
        "pct_of_peak_convention": "% of max(matmul peak of the case dtype, float32 matmul peak); "
                                  "none for approximate backends and where a kernel outran that peak",
        "flops_convention": "useful (kept pairs) exact-attention FLOPs: 4*B*H*n^2*D*density forward, "
                            "x3.5 forward+backward",
        "error_convention": f"forward output on the last {config.error_rows} query rows vs naive float64: "
                            "exact backends max abs, approximate relative (Frobenius)",
        "elapsed_s": time.perf_counter() - start,
        "results": rows,
    }


def sweep_cases(config: BenchConfig, names: list[str]) -> list[Case]:
    """The cases in the order they run: shortest length first (a spent ``run_budget_s`` cuts the
    longest lengths), every dtype, pass, mask and backend at one length back to back."""
    return [Case(b, n, m, dt, p) for n in sorted(config.lengths) for dt in config.dtypes for p in config.passes
            for m in config.masks for b in names]


def sweep_names(config: BenchConfig) -> list[str]:
    """The backends a sweep measures: the named ones, or every registered backend that does not
    compile on first use (flex: minutes per mask kind on a CPU), plus ``auto``."""
    registry = list_backends()
    if config.backends is not None:
        for name in config.backends:
            if name != "auto" and name not in registry:
                raise ValueError(f"--backends: unknown backend {name!r}; "
                                 f"expected 'auto' or some of {sorted(registry)}.")
        return list(config.backends)
    return [name for name, impl in registry.items() if not impl.compiles] + ["auto"]


def estimate_seconds(config: BenchConfig) -> float:
    """How long :func:`run_sweep` will take on this machine: per case a warm-up call, the error check
    and at least ``min_run_time`` of timing, a call's time estimated from its exact-attention FLOPs
    at a tenth of this machine's float32 matrix-product rate (measured now, in milliseconds: the sweep
    also times the PyTorch-op backends, far from the peak);
    cases a backend cannot run or predicted over the per-call budget cost nothing. Capped by
    ``run_budget_s``."""
    rate = 0.1 * hardware.matmul_rate(torch.float32) * 1e9
    total = 0.0
    for case in sweep_cases(config, sweep_names(config)):
        flops = 4.0 * config.batch * config.heads * case.n * case.n * config.head_dim
        call = flops * (3.5 if case.passes == "train" else 1.0) / rate
        if call > config.time_budget_s and case.n > min(config.lengths):  # the runner extrapolates, then skips
            continue
        total += 0.02 + 2 * call + max(config.min_run_time, call)
    return total if config.run_budget_s is None else min(total, config.run_budget_s)


def confirmed(table: dict) -> dict:
    """What the table holds: the points where an interleaved timing confirmed a leader (no longer
    ``"tie"``) other than the one the static rule picks anyway (``"rule"``), which was measured beside it:
    exceptions to the rule, each measured twice. A point the rule already gets right, one not confirmed, or
    one whose sweep did not time the rule's pick (``--backends`` left it out) is left out."""
    entries = {key: [{k: v for k, v in p.items() if k != "rule"} for p in points
                     if not p.get("tie") and p["order"][0] != p.get("rule") and p.get("rule") in p["times"]]
               for key, points in table["entries"].items()}
    return {**table, "entries": {key: points for key, points in entries.items() if points}}


def _memory_skip(case: Case, config: BenchConfig, estimate: int) -> dict | None:
    if estimate <= config.memory_budget_bytes:
        return None
    budget = describe_bytes(config.memory_budget_bytes)
    return _skip(case, f"predicted memory {describe_bytes(estimate)} > budget {budget}", "predicted memory over budget",
                 memory_estimate_bytes=estimate)


def _run_case(case, config, registry, dtype, peak, memory, measured) -> dict:
    n, grad = case.n, case.passes == "train"
    # what every backend needs (inputs, mask structure), checked before anything is allocated
    skip = _memory_skip(case, config, estimate_bytes(config, None, n, case.mask, dtype, case.passes))
    if skip:
        return skip
    mask = mask_spec(case.mask).build(n, config)
    q, k, v = _inputs(config, n, dtype, grad, config.seed + n)
    inp = AttentionInputs.create(q, k, v, mask=mask)
    if case.backend == "auto":
        try:
            impl = select(inp)
        except NoBackendError as err:
            return _skip(case, str(err).splitlines()[0])
        chosen = impl.name
    else:
        impl = registry[case.backend]
        reasons = impl.not_supported_reasons(inp)
        if reasons:
            return _skip(case, "; ".join(reasons))
        chosen = impl.name
    dens = density(mask, n)
    estimate = estimate_bytes(config, chosen, n, case.mask, dtype, case.passes)
    skip = _memory_skip(case, config, estimate)
    if skip:
        return skip
    guess = predicted_seconds(measured.get(case.series, {}), n)
    if guess is not None and guess > config.time_budget_s:
        return _skip(case, f"predicted {guess:.2g} s per call > budget {config.time_budget_s:g} s "
                     "(extrapolated from the shorter lengths)", "predicted time over budget", predicted_s=guess)
    fn = _call(q, k, v, mask, case.backend, torch.randn_like(q) if grad else None)
    try:
        # The warm-up call is the one whose peak memory we measure (it includes any one-time
        # allocations) and whose output we check, so neither costs an extra call.
        holder: list = []
        peak_bytes = memory.measure(lambda: holder.append(fn()))
        err, err_kind = _error(holder.pop(), impl.exact, q, k, v, mask, config.error_rows)
        m = _time(fn, config.min_run_time)
    except Exception as exc:  # a backend bug must not end the sweep: record it
        return {**asdict(case), "status": "error", "reason": f"{type(exc).__name__}: {exc}",
                "group": type(exc).__name__}
    measured.setdefault(case.series, {})[n] = m.median
    flops = useful_flops(config, n, dens, case.passes)
    gflops = flops / m.median / 1e9
    return {
        **asdict(case),
        "status": "ok",
        "chosen": chosen,
        "exact": bool(impl.exact),
        "median_s": m.median,
        "iqr_s": m.iqr,
        "runs": len(m.times),
        "peak_bytes": peak_bytes,
        "memory_estimate_bytes": estimate,
        "density": dens,
        "flops": flops,
        "gflops": gflops,
        "pct_of_matmul_peak": pct_of_peak(gflops, peak, impl.exact),
        "error": err,
        "error_kind": err_kind,
    }


def pct_of_peak(gflops: float, peak: float, exact: bool) -> float | None:
    """Useful throughput as % of the matmul peak; None where it means nothing: approximate
    backends (they do not compute the exact-attention FLOPs they are credited with), and results
    above the peak (the peak's torch.mm is then slower than the kernel, so it is no ceiling)."""
    if not exact or peak <= 0:
        return None
    pct = 100 * gflops / peak
    return pct if pct <= 100 else None


def ok_rows(results: dict) -> list[dict]:
    return [r for r in results["results"] if r["status"] == "ok"]


def confidence_interval(median: float, iqr: float, runs: int) -> tuple[float, float]:
    """An approximate 95% confidence interval of a median from its interquartile range and run
    count (the notched box plot's ``median ± 1.57 · IQR / sqrt(runs)``, McGill et al. 1978)."""
    half = 1.57 * iqr / math.sqrt(max(runs, 1))
    return median - half, median + half


#: Timed runs from which a case's own interquartile range measures its noise.
MIN_RUNS_FOR_SPREAD = 4
#: The relative noise assumed when no case of a sweep was timed often enough to measure it.
DEFAULT_NOISE = 0.05


def noise_floor(results: dict) -> float:
    """The sweep's measured relative noise: the median ``IQR / median`` of its cases timed at least
    :data:`MIN_RUNS_FOR_SPREAD` times (:data:`DEFAULT_NOISE` when none was). A case timed fewer times
    is taken to be this uncertain, so one lucky run never makes a crossover."""
    spreads = [r["iqr_s"] / r["median_s"] for r in ok_rows(results)
               if r.get("runs", 0) >= MIN_RUNS_FOR_SPREAD and r["median_s"] > 0]
    return statistics.median(spreads) if spreads else DEFAULT_NOISE


def _calibration_points(results: dict) -> dict[tuple[str, int], dict[str, dict[str, dict]]]:
    """The sweep's rows of exact backends per calibration point: ``(entry key, n) -> {mask spec ->
    {backend -> row}}`` (a point pools the mask specs of one kind)."""
    config = results["config"]
    registry = list_backends()
    cfg = BenchConfig(**config)
    grouped: dict[tuple[str, int], dict[str, dict[str, dict]]] = {}
    for r in ok_rows(results):
        if r["backend"] == "auto" or not registry.get(r["backend"]) or not registry[r["backend"]].exact:
            continue
        kind = calibration.mask_kind(mask_spec(r["mask"]).build(r["n"], cfg))
        key = calibration.entry_key(torch.device(config["device"]).type, r["dtype"], kind, r["passes"],
                                    heads=cfg.heads, head_dim=cfg.head_dim)
        grouped.setdefault((key, r["n"]), {}).setdefault(r["mask"], {})[r["backend"]] = r
    return grouped


def build_calibration(results: dict) -> dict:
    """Rank the exact backends per (device, dtype, mask kind, pass, heads, head dim) and length.

    Mask specs of one kind (BigBird and Longformer are both ``BlockSparse``) are pooled: a
    backend's time is the sum over the specs, counted only for backends that ran all of them.
    Every point of two or more backends is stored with ``"tie": true`` until :func:`resolve_ties`
    has timed its leader against the runner-up, the static rule's pick (``"rule"``) and any other within
    the sweep's noise, interleaved; :func:`confirmed` then keeps the points whose confirmed leader is not
    the rule's pick: the table holds only exceptions to the rule, each measured twice."""
    floor = noise_floor(results)
    config = BenchConfig(**results["config"])
    entries: dict[str, list[dict]] = {}
    for (key, n), per_mask in sorted(_calibration_points(results).items()):
        times, spread = _pooled(per_mask, floor)
        order = sorted(times, key=times.get)
        point = {"n": n, "order": order, "times": times, "rule": rule_pick(per_mask, config)}
        if len(order) > 1:  # confirmed (or dropped) by resolve_ties, whatever the sweep's margin
            point["tie"] = True
        entries.setdefault(key, []).append(point)
    return {"machine": results["machine"], "entries": entries}


def rule_pick(per_mask: dict[str, dict[str, dict]], config: BenchConfig) -> str | None:
    """The backend the static rule (no table) picks for a point's first mask spec."""
    from ..dispatch import rule

    mask_name, rows = next(iter(per_mask.items()))
    row = next(iter(rows.values()))
    one = torch.zeros(1, 1, 1, 1, dtype=getattr(torch, row["dtype"]), device=config.device)
    x = one.requires_grad_(row["passes"] == "train").expand(config.batch, config.heads, row["n"], config.head_dim)
    inp = AttentionInputs.create(x, x, x, mask=mask_spec(mask_name).build(row["n"], config))
    known = list_backends()
    return next((b for b in rule.builtin_order(inp) if known[b].can_run(inp)), None)


def _pooled(per_mask: dict[str, dict[str, dict]], floor: float) -> tuple[dict[str, float], dict[str, float]]:
    """A point's time per backend (summed over its mask specs, for the backends that ran them all)
    and the half width of its confidence interval (summed likewise)."""
    common = set.intersection(*(set(rows) for rows in per_mask.values()))
    times = {b: sum(rows[b]["median_s"] for rows in per_mask.values()) for b in common}
    spread = {b: sum(_half_interval(rows[b], floor) for rows in per_mask.values()) for b in common}
    return times, spread


def _within_noise(order: list[str], times: dict[str, float], spread: dict[str, float]) -> list[str]:
    """The two fastest backends of ``order`` and every other whose confidence interval overlaps the
    fastest's (the runner-up is always timed against the leader: a point is written only when confirmed)."""
    best = order[0]
    return [b for i, b in enumerate(order) if i < 2 or times[best] + spread[best] >= times[b] - spread[b]]


def _half_interval(row: dict, floor: float) -> float:
    """Half the width of a row's confidence interval; a row timed fewer than
    :data:`MIN_RUNS_FOR_SPREAD` times is at least the sweep's noise ``floor`` uncertain."""
    low, high = confidence_interval(row["median_s"], row.get("iqr_s", 0.0), row.get("runs", 1))
    half = max(row["median_s"] - low, high - row["median_s"])
    if row.get("runs", 1) < MIN_RUNS_FOR_SPREAD:  # too few runs for their own spread: the sweep's
        half = max(half, floor * row["median_s"])
    return half


#: Alternating rounds of an interleaved comparison (:func:`resolve_ties`, :func:`verify_auto`): one
#: round's ratio on a busy machine can be several per cent off, and tied backends are closer than that.
INTERLEAVED_ROUNDS = 5
#: The least time an interleaved comparison gives each call over its rounds: calls so cheap that
#: INTERLEAVED_ROUNDS blocks time them for less get more rounds (at most three times as many), since
#: a round of a millisecond call is a few dozen calls, and on a shared machine two such backends'
#: per-round ratio wanders far more than the gap between tied ones.
INTERLEAVED_SECONDS = 0.5
#: A tie's fastest backend timed interleaved is told apart from another when the median of the
#: per-round ratios of their times is beyond 1 by more than this; closer, the point stays a tie.
TIE_MARGIN = 0.01


def interleaved_rounds(seconds: float, rounds: int, min_run_time: float) -> int:
    """The rounds an interleaved comparison of calls taking ``seconds`` each runs (see
    :data:`INTERLEAVED_SECONDS`): one round is one ``blocked_autorange`` of each call, at least
    ``min_run_time`` or one call."""
    return max(rounds, min(3 * rounds, math.ceil(INTERLEAVED_SECONDS / max(min_run_time, seconds, 1e-9))))


def resolve_ties(table: dict, results: dict, config: BenchConfig, budget_s: float | None = None,
                 rounds: int = INTERLEAVED_ROUNDS) -> dict:
    """``table`` (from :func:`build_calibration`) with its ties timed again, interleaved.

    The sweep times each case once, back to back with the others, so backends within a few per
    cent of each other come out in any order; an interleaved comparison tells them apart. At each
    tie point, the backends within the sweep's noise of the fastest (its two leaders, or more) run
    on that point's inputs (a point pooling several mask specs runs them all in one timed call: the
    sum, as the sweep's ranking) in ``rounds`` alternations or more (:func:`_interleaved_times`), each
    round one ``blocked_autorange`` of each in turn (as :func:`verify_auto` does). The fastest is
    the one whose largest median per-round ratio to any other is smallest (of two: the faster by
    that median); the point's order puts it first, then the others it timed by that ratio, then the
    rest as the sweep ranked them, and records ``"interleaved": {"ratio": ratio, "rounds": rounds
    run}``: the median over the rounds of the second's time over the first's. When that is beyond
    ``1 + TIE_MARGIN`` the point is no longer a tie and ``auto`` follows it; within the margin it
    stays a tie (and is not written: :func:`confirmed`).

    Cheaper points are timed first; a point whose predicted time (from the sweep's) does not fit in
    what is left of ``budget_s`` is not timed and stays as it was. ``table`` is not changed."""
    tied = [(key, i) for key, points in table["entries"].items() for i, p in enumerate(points) if p.get("tie")]
    if not tied:
        return table
    grouped = _calibration_points(results)
    floor = noise_floor(results)
    entries = {key: [dict(p) for p in points] for key, points in table["entries"].items()}

    def contenders(item: tuple[str, int]) -> list[str]:  # the leaders within noise, and the rule's pick
        key, i = item
        point = entries[key][i]
        times, spread = _pooled(grouped[key, point["n"]], floor)
        near = _within_noise(point["order"], times, spread)
        pick = point.get("rule")
        return near + [pick] if pick in times and pick not in near else near

    def cost(item: tuple[str, int]) -> float:  # warm-up calls, then each round's timings
        key, i = item
        per_call = {b: sum(rows[b]["median_s"] for rows in grouped[key, entries[key][i]["n"]].values())
                    for b in contenders(item)}
        n_rounds = interleaved_rounds(max(per_call.values()), rounds, config.min_run_time)
        return sum(t + n_rounds * max(config.min_run_time, t) for t in per_call.values())

    start = time.perf_counter()
    for item in sorted(tied, key=cost):
        if budget_s is not None and time.perf_counter() - start + cost(item) > budget_s:
            continue
        key, i = item
        point = entries[key][i]
        names = contenders(item)
        calls: dict[str, list[Callable[[], object]]] = {b: [] for b in names}
        for mask_name, rows in grouped[key, point["n"]].items():
            row = rows[names[0]]
            n, grad = row["n"], row["passes"] == "train"
            q, k, v = _inputs(config, n, getattr(torch, row["dtype"]), grad, config.seed + n)
            g = torch.randn_like(q) if grad else None
            mask = mask_spec(mask_name).build(n, config)
            for b in names:
                calls[b].append(_call(q, k, v, mask, b, g))
        per_round = _interleaved_times([_in_sequence(calls[b]) for b in names], rounds, config.min_run_time)

        def over(x: int, y: int) -> float:  # the median over the rounds of x's time over y's
            return statistics.median(t[x] / t[y] for t in per_round)

        fastest = min(range(len(names)), key=lambda x: max(over(x, y) for y in range(len(names))))
        rivals = sorted((y for y in range(len(names)) if y != fastest), key=lambda y: over(y, fastest))
        ratio = over(rivals[0], fastest)
        point["order"] = [names[fastest], *(names[y] for y in rivals), *(b for b in point["order"] if b not in names)]
        point["interleaved"] = {"ratio": ratio, "rounds": len(per_round)}
        if ratio > 1 + TIE_MARGIN:
            del point["tie"]
    return {**table, "entries": entries}


def correct_calibration(table: dict, results: dict, verified: Iterable[dict]) -> tuple[dict, int]:
    """``table`` with every point where a verification timed another backend faster than the
    sweep's best, interleaved (a row of :func:`verify_auto` with ``auto_over_best`` below
    ``1 - TIE_MARGIN``), led by that backend, with the measured ratio as its ``"interleaved"``; and
    how many points it changed. The sweep times each case once, back to back with the others, and
    two backends a fifth apart can come out in the wrong order beyond its measured noise; the
    interleaved comparison is the better measurement. Only points of one mask spec (a pooled point
    ranks the sum over its specs). ``table`` is not changed."""
    grouped = _calibration_points(results)
    entries = {key: [dict(p) for p in points] for key, points in table["entries"].items()}
    points = {(key, p["n"]): p for key, ps in entries.items() for p in ps}
    changed = 0
    for row in verified:
        if not row.get("timed") or not row.get("rounds") or row["auto_over_best"] >= 1 - TIE_MARGIN:
            continue
        for (key, n), per_mask in grouped.items():
            rows = per_mask.get(row["mask"], {})
            if (n != row["n"] or len(per_mask) != 1 or (key, n) not in points or not rows
                    or any(r["dtype"] != row["dtype"] or r["passes"] != row["passes"] for r in rows.values())):
                continue
            point, faster = points[key, n], row["auto_chose"]
            if point["order"][0] != faster and faster in point["order"]:
                point["order"] = [faster, *(b for b in point["order"] if b != faster)]
                point["interleaved"] = {"ratio": 1 / row["auto_over_best"], "rounds": row["rounds"]}
                point.pop("tie", None)
                changed += 1
    return {**table, "entries": entries}, changed


def _in_sequence(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call that makes each of ``calls`` in turn (its time is their sum)."""
    if len(calls) == 1:
        return calls[0]
    return lambda: [call() for call in calls]


def _interleaved_times(fns: list[Callable[[], object]], rounds: int, min_run_time: float) -> list[list[float]]:
    """Each of ``fns`` timed interleaved: all warmed, then ``rounds`` rounds (more for cheap calls:
    :func:`interleaved_rounds`, from the slowest of a second call each) of one ``blocked_autorange`` of each
    in turn, the order reversed every other round (whatever a position in the round costs falls on
    each alike); per round, each one's median time, in the order of ``fns``."""
    for fn in fns:  # warm them all
        fn()
    warm = 0.0  # the slowest of a second call each (the first pays one-time costs)
    for fn in fns:
        start = time.perf_counter()
        fn()
        warm = max(warm, time.perf_counter() - start)
    out = []
    for r in range(interleaved_rounds(warm, rounds, min_run_time)):
        order = range(len(fns)) if r % 2 == 0 else range(len(fns) - 1, -1, -1)
        times = {i: _time(fns[i], min_run_time).median for i in order}
        out.append([times[i] for i in range(len(fns))])
    return out


def verify_auto(results: dict, config: BenchConfig, rounds: int = INTERLEAVED_ROUNDS, budget_s: float | None = None,
                picks: dict[tuple, tuple[str, float | None]] | None = None,
                known: Iterable[dict] = ()) -> list[dict]:
    """At every point (n, mask, dtype, pass) the sweep measured an exact backend at: a pick's time
    over the measured best backend's, as ``auto_over_best``.

    ``picks`` (default: the backend ``auto`` picks now, called as ``backend="auto"``) maps a point to
    the backend to check, called by its name, and that pick's time in the sweep (or None); points
    without a pick are left out. Where the pick is the best itself the ratio is 1 by construction
    (one backend timed against itself only measures noise; ``"timed": false``); elsewhere both are
    timed interleaved (``rounds`` alternations or more: :func:`_interleaved_times`) and the median of
    the per-round ratios is reported (``"timed": true``). A point whose pick a row of ``known``
    (another column's verification) already timed takes that row's figure (``"from_known": true``):
    one backend gets one figure.
    Once ``budget_s`` is spent, the remaining points take the sweep's own times of the two backends
    (back to back, ``"timed": false``); a point whose pick the sweep did not time is then left out.
    Every row keeps that sweep figure as ``auto_over_best_sweep`` where there is one."""
    best: dict[tuple, dict] = {}
    swept: dict[tuple, dict[str, float]] = {}
    for r in ok_rows(results):
        if r["backend"] == "auto" or not r["exact"]:
            continue
        key = (r["n"], r["mask"], r["dtype"], r["passes"])
        swept.setdefault(key, {})[r["backend"]] = r["median_s"]
        if key not in best or r["median_s"] < best[key]["median_s"]:
            best[key] = r
    reuse = {(r["n"], r["mask"], r["dtype"], r["passes"], r["auto_chose"]): r for r in known if r.get("timed")}
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    out = []
    for key, row in sorted(best.items()):
        if picks is not None and key not in picks:
            continue
        n, mask_name, dtype_name, passes = key
        mask = mask_spec(mask_name).build(n, config)
        grad = passes == "train"
        q, k, v = _inputs(config, n, getattr(torch, dtype_name), grad, config.seed + n)
        if picks is None:
            chosen, call_as = select(AttentionInputs.create(q, k, v, mask=mask)).name, "auto"
            swept_s = swept[key].get(chosen)
        else:
            (chosen, swept_s), call_as = picks[key], picks[key][0]
        point = {"n": n, "mask": mask_name, "dtype": dtype_name, "passes": passes, "best": row["backend"],
                 "auto_chose": chosen}
        if swept_s is not None:
            point["auto_over_best_sweep"] = swept_s / row["median_s"]
        if chosen == row["backend"]:
            out.append({**point, "auto_over_best": 1.0, "timed": False})
        elif (*key, chosen) in reuse:
            out.append({**point, "auto_over_best": reuse[(*key, chosen)]["auto_over_best"], "timed": True,
                        "from_known": True})
        elif deadline is not None and time.perf_counter() > deadline:
            if swept_s is not None:
                out.append({**point, "auto_over_best": point["auto_over_best_sweep"], "timed": False})
        else:
            g = torch.randn_like(q) if grad else None
            fa, fb = _call(q, k, v, mask, call_as, g), _call(q, k, v, mask, row["backend"], g)
            per_round = _interleaved_times([fa, fb], rounds, config.min_run_time)
            out.append({**point, "auto_over_best": statistics.median(ta / tb_ for ta, tb_ in per_round),
                        "timed": True, "rounds": len(per_round)})
    return out


def verify_auto_before(results: dict, config: BenchConfig, rounds: int = INTERLEAVED_ROUNDS,
                       budget_s: float | None = None, known: Iterable[dict] = ()) -> list[dict]:
    """:func:`verify_auto` for the picks ``auto`` made during the sweep (each ``auto`` row's
    ``chosen``, called by its name: after a calibration ``auto`` may pick another), so the column
    "before calibration" is measured as the one after it. ``auto_over_best_sweep`` is then the
    sweep's auto row over the best backend's (two back-to-back timings)."""
    picks = {(r["n"], r["mask"], r["dtype"], r["passes"]): (r["chosen"], r["median_s"])
             for r in ok_rows(results) if r["backend"] == "auto"}
    return verify_auto(results, config, rounds=rounds, budget_s=budget_s, picks=picks, known=known)
