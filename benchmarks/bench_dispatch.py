"""Dispatch overhead at decode: ``attention(backend="auto")`` against a direct call of the backend
``auto`` chose, at B=1, H=8, Tq=1, Tk=512, D=64, causal, one thread (aim: <= 5 us), plus the
first-use probe of the machine constants (aim: well under a second).

Both calls are timed in interleaved rounds with torch.utils.benchmark (blocked_autorange); the
overhead is the median of the per-round differences. The direct call is the chosen backend's
``forward`` on prepared inputs, so the difference is validation + selection.

    python benchmarks/bench_dispatch.py            # about 20 seconds
    python benchmarks/bench_dispatch.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.utils.benchmark as tb

import attnkit
from attnkit import calibration
from attnkit.dispatch import select
from attnkit.inputs import AttentionInputs


def probe_seconds() -> float:
    start = time.perf_counter()
    calibration.probe_constants()
    return time.perf_counter() - start


def decode_overhead(rounds: int, min_run_time: float) -> dict:
    torch.set_num_threads(1)
    q = torch.randn(1, 8, 1, 64)
    k, v = torch.randn(1, 8, 512, 64), torch.randn(1, 8, 512, 64)
    mask = attnkit.Causal()
    inp = AttentionInputs.create(q, k, v, mask=mask)
    impl = select(inp)
    auto = lambda: attnkit.attention(q, k, v, mask=mask)  # noqa: E731
    direct = lambda: impl.forward(inp, None)  # noqa: E731
    times = {"auto": [], "direct": []}
    with torch.no_grad():
        auto(), direct()
        for _ in range(rounds):
            for name, fn in (("auto", auto), ("direct", direct)):
                m = tb.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time)
                times[name].append(m.median)
    diffs = [a - d for a, d in zip(times["auto"], times["direct"])]
    return {"chosen": impl.name, "auto_us": 1e6 * statistics.median(times["auto"]),
            "direct_us": 1e6 * statistics.median(times["direct"]), "overhead_us": 1e6 * statistics.median(diffs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (seconds)")
    args = parser.parse_args()
    rounds, min_run = (2, 0.01) if args.quick else (10, 0.2)
    print(f"first-use probe of the machine constants: {probe_seconds():.3f} s")
    r = decode_overhead(rounds, min_run)
    print(f"decode B=1 H=8 Tq=1 Tk=512 D=64 causal, 1 thread: auto chose {r['chosen']}; auto {r['auto_us']:.1f} us, "
          f"direct {r['direct_us']:.1f} us, overhead {r['overhead_us']:.1f} us (aim <= 5 us)")


if __name__ == "__main__":
    main()
