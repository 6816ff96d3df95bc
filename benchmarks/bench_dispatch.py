"""What ``auto`` costs and whether it picks the fastest backend.

1. ``newshape``: what a call of a new shape class costs over a cached one, at decode shapes (B=1, 8 query
   and 2 key/value heads, D=64, one thread, ``kv_finite=True``): one pass of 201 calls with Tk growing by
   one from 1024 (every call misses the per-call cache, as a decoding loop over a growing cache does)
   against one pass of 201 calls at Tk=1124 (every call a hit), interleaved; aim <= 30 us per call.
   Also the lines of the dispatch package (aim: no file over 400, the whole under 900).
2. ``decode``: per-call dispatch overhead at decode (B=1, H=8, Tq=1, Tk=512, D=64, causal, one
   thread; aim <= 5 us): ``attention()`` against a direct ``forward`` of the backend ``auto`` chose,
   with plain tensors (the NaN/Inf policy then reads q, K and V once each: part of the contract) and
   with ``kv_finite=True`` (what KV caches pass: only q is read). The time of the policy's scan of
   q (:func:`attnkit._validate.finite_only`: in C with the built extension, else a sum) is printed
   beside it, and the same calls with the backend's forward a no-op (dispatch alone).
3. ``window``: ``Causal() & SlidingWindow(256, 0)`` at n=16384, forward, B=1, H=8, D=64 (aim: auto
   within 1.05x of the fastest backend).
4. ``bigbird``: ``BlockSparse.bigbird(128, 64, seed=0)`` (blocks of 64: one each side, one global,
   two random per row; as ``bench_fused.py``) at n=8192, same shape.

Timing: ``torch.utils.benchmark`` (blocked_autorange); the compared calls are interleaved in rounds
(in sections 3 and 4 in an order rotated each round) and medians of the rounds are compared (auto/best:
the median over the rounds of auto's time over the best backend's in the same round).
Sections 3 and 4 time every exact backend that can run the
input without materializing the whole mask (those are memory-bound there by construction), plus
``auto``; each section stops adding rounds after ``--section-budget`` seconds (default 150).

    python benchmarks/bench_dispatch.py                     # about 5 minutes on 2 cores
    python benchmarks/bench_dispatch.py --sections decode   # one section
    python benchmarks/bench_dispatch.py --quick             # a smoke run at small sizes (seconds)

Run it alone on an idle machine; on a shared one the figures mean little. The auto/best figures
depend on this machine's measured table (``python -m attnkit bench`` writes it): point
``ATTNKIT_CALIBRATION`` at a missing file to measure the static rule alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.utils.benchmark as tb

import attnkit
from attnkit._validate import finite_only
from attnkit.dispatch import MATERIALIZE_LIMIT, calls, select, table
from attnkit.inputs import AttentionInputs

SECTIONS = ("newshape", "decode", "window", "bigbird")


def _median_time(fn, min_run_time: float) -> float:
    return tb.Timer(stmt="fn()", globals={"fn": fn},
                    num_threads=torch.get_num_threads()).blocked_autorange(min_run_time=min_run_time).median


def new_shape_overhead(rounds: int, min_run_time: float) -> dict:
    """Per call: a pass over growing key lengths (each a miss) and a pass at one length (each a hit)."""
    torch.set_num_threads(1)
    q = torch.randn(1, 8, 1, 64)
    store = torch.randn(1, 2, 1224, 64)
    growing = [store[:, :, :n] for n in range(1024, 1225)]
    fixed = [store[:, :, :1124]] * len(growing)
    mask = attnkit.Causal()

    def run(keys):
        calls.clear()  # a fresh per-call cache each pass: the growing pass misses on every call
        for k in keys:
            attnkit.attention(q, k, k, mask=mask, kv_finite=True)

    times: dict[str, list[float]] = {"new": [], "cached": []}
    with torch.no_grad():
        run(growing)
        for _ in range(rounds):
            times["new"].append(_median_time(lambda: run(growing), min_run_time) / len(growing))
            times["cached"].append(_median_time(lambda: run(fixed), min_run_time) / len(fixed))
    return {"new_us": 1e6 * statistics.median(times["new"]), "cached_us": 1e6 * statistics.median(times["cached"]),
            "over_us": 1e6 * statistics.median(a - b for a, b in zip(times["new"], times["cached"]))}


def dispatch_lines() -> dict[str, int]:
    from pathlib import Path

    folder = Path(attnkit.dispatch.__file__).parent
    return {p.name: len(p.read_text().splitlines()) for p in sorted(folder.glob("*.py"))}


def decode_overhead(rounds: int, min_run_time: float, Tk: int = 512) -> dict:
    torch.set_num_threads(1)
    q = torch.randn(1, 8, 1, 64)
    k, v = torch.randn(1, 8, Tk, 64), torch.randn(1, 8, Tk, 64)
    mask = attnkit.Causal()
    inp = AttentionInputs.create(q, k, v, mask=mask)
    impl = select(inp)
    calls = {
        "auto": lambda: attnkit.attention(q, k, v, mask=mask),
        "auto kv_finite": lambda: attnkit.attention(q, k, v, mask=mask, kv_finite=True),
        "direct": lambda: impl.forward(inp, None),
        "q scan": lambda: finite_only(q),  # what the NaN/Inf policy reads when kv_finite=True
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for fn in calls.values():
            fn()
        for _ in range(rounds):
            for name, fn in calls.items():
                times[name].append(_median_time(fn, min_run_time))
    med = {name: 1e6 * statistics.median(ts) for name, ts in times.items()}
    over = {name: 1e6 * statistics.median(a - d for a, d in zip(times[name], times["direct"]))
            for name in ("auto", "auto kv_finite")}
    return {"chosen": impl.name, "us": med, "overhead_us": over, "alone_us": _dispatch_alone(impl, calls, rounds)}


def _dispatch_alone(impl, calls: dict, rounds: int) -> dict:
    """The same calls with the chosen backend's forward a no-op: what dispatch and the NaN/Inf
    policy cost by themselves (on a shared machine, the difference of two ~100 us medians above
    moves by more than the whole of it; this one is the figure the code controls)."""
    own = impl.__dict__.get("forward")
    impl.forward = classmethod(lambda cls, inp, options: inp.q)
    try:
        times: dict[str, list[float]] = {name: [] for name in ("auto", "auto kv_finite", "q scan")}
        with torch.no_grad():
            for _ in range(rounds):
                for name in times:
                    times[name].append(_median_time(calls[name], 0.05))
    finally:
        if own is None:
            del impl.forward
        else:
            impl.forward = own
    return {name: 1e6 * statistics.median(ts) for name, ts in times.items()}


def long_case(name: str, mask, n: int, rounds: int, min_run_time: float, budget_s: float) -> None:
    """auto against every exact backend that can run the input, interleaved rounds, forward."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, generator=gen) for _ in range(3))
    inp = AttentionInputs.create(q, k, v, mask=mask)
    chosen = select(inp).name
    candidates, left_out = {}, []
    for backend, impl in attnkit.list_backends().items():
        if not impl.exact or getattr(impl, "compiles", False) or not impl.can_run(inp):
            continue
        elements = impl.dense_mask_elements(inp)
        if impl.work.materializes:
            elements = max(elements, inp.B * inp.Hq * inp.Tq * inp.Tk)
        if elements > MATERIALIZE_LIMIT:
            left_out.append(f"{backend} (would materialize {elements / 2**20:.0f} Mi mask elements)")
            continue
        candidates[backend] = lambda b=backend: attnkit.attention(q, k, v, mask=mask, backend=b)
    calls = {"auto": lambda: attnkit.attention(q, k, v, mask=mask), **candidates}
    times: dict[str, list[float]] = {c: [] for c in calls}
    start = time.perf_counter()
    with torch.no_grad():
        for c, fn in list(calls.items()):  # warm up; a backend over a third of the budget per call is dropped
            t0 = time.perf_counter()
            fn()
            if c != "auto" and c != chosen and time.perf_counter() - t0 > budget_s / 3:
                left_out.append(f"{c} ({time.perf_counter() - t0:.1f} s per call)")
                del calls[c], times[c]
        names = list(calls)
        for r in range(rounds):
            if r >= 2 and time.perf_counter() - start > budget_s:
                break
            # a rotated order each round: no call always follows the same one (a backend that frees
            # gigabytes leaves the next call's allocations to fault their pages in again)
            for c in names[r % len(names):] + names[:r % len(names)]:
                times[c].append(_median_time(calls[c], min_run_time))
    med = {c: statistics.median(ts) for c, ts in times.items()}
    best = min((c for c in med if c != "auto"), key=med.get)
    # the median of the per-round ratios: a slower stretch of the machine falls on both calls of a round
    ratio = statistics.median(a / b for a, b in zip(times["auto"], times[best]))
    print(f"{name} n={n} (B=1 H=8 D=64 float32 forward, {len(times['auto'])} interleaved rounds): auto chose {chosen}; "
          + ", ".join(f"{c} {med[c] * 1e3:.1f} ms" for c in sorted(med, key=med.get))
          + f"; auto/best = {ratio:.3f} (median of the rounds' ratios; best {best}; aim <= 1.05)")
    if left_out:
        print(f"  not timed: {', '.join(left_out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    parser.add_argument("--rounds", type=int, default=15,
                        help="interleaved rounds per section (default 15: one round of a long call moves by a tenth "
                             "on a shared machine)")
    parser.add_argument("--section-budget", type=float, default=150.0,
                        help="seconds after which a long section stops adding rounds (default 150)")
    parser.add_argument("--quick", action="store_true", help="a smoke run at small sizes (seconds)")
    args = parser.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {','.join(unknown)}; expected some of {','.join(SECTIONS)}")
    rounds, min_run = (2, 0.01) if args.quick else (args.rounds, 0.2)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads (decode: 1); {table.status()}")
    if "newshape" in sections:
        r = new_shape_overhead(rounds, min_run)
        print("new shape class at decode (B=1 8/2 heads D=64, Tk 1024..1224 growing by one, kv_finite=True, "
              f"1 thread): {r['new_us']:.1f} us per call, cached {r['cached_us']:.1f} us; "
              f"a new shape costs {r['over_us']:.1f} us more (aim <= 30 us)")
        lines = dispatch_lines()
        print(f"dispatch package: {sum(lines.values())} lines ({', '.join(f'{k} {v}' for k, v in lines.items())}); "
              "aim: no file over 400, under 900 in all")
        torch.set_num_threads(threads)
    if "decode" in sections:
        r = decode_overhead(rounds, min_run)
        us, over = r["us"], r["overhead_us"]
        print(f"decode B=1 H=8 Tq=1 Tk=512 D=64 causal, 1 thread: auto chose {r['chosen']}; "
              f"direct {us['direct']:.1f} us")
        print(f"  plain tensors:  auto {us['auto']:.1f} us, overhead {over['auto']:.1f} us (includes the NaN/Inf "
              "policy's finiteness scans of q, K and V: part of the contract)")
        print(f"  kv_finite=True: auto {us['auto kv_finite']:.1f} us, overhead {over['auto kv_finite']:.1f} us "
              f"(aim <= 5 us; of which the policy's scan of q alone: {us['q scan']:.1f} us)")
        alone = r["alone_us"]
        print(f"  dispatch alone (the backend's forward a no-op): plain tensors {alone['auto']:.1f} us, "
              f"kv_finite=True {alone['auto kv_finite']:.1f} us (q scan {alone['q scan']:.1f} us)")
        torch.set_num_threads(threads)
    if "window" in sections:
        long_case("Causal() & SlidingWindow(256, 0)", attnkit.Causal() & attnkit.SlidingWindow(256, 0),
                  2048 if args.quick else 16384, rounds, min_run, args.section_budget)
    if "bigbird" in sections:
        n = 1024 if args.quick else 8192
        mask = attnkit.BlockSparse.bigbird(n // 64, 64, seed=0)  # benchmarks/bench_fused.py's BigBird
        long_case("BigBird", mask, n, rounds, min_run, args.section_budget)


if __name__ == "__main__":
    main()
