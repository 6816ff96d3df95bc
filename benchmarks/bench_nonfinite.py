"""What the NaN/Inf contract costs: attention() against a direct F.scaled_dot_product_attention call.

One process, interleaved rounds (every statement of a case timed once per round with
torch.utils.benchmark's blocked_autorange, so all share the machine's load), at each thread count.
The direct SDPA call gets the same inputs and the same bool mask (materialized once, outside the
timing). Cases and aims (B=1, H=8, D=64; the padded decode B=4):

* padded decode ``Causal() & KeyPadding``, Tq=1, Tk in {512, 4096}: ratio <= 1.15;
* unmasked decode, Tq=1, Tk in {32, 512}: overhead <= 5 us;
* causal prefill, n in {1024, 4096}: ratio <= 1.03.

Every decode case is timed twice: as given (K/V are scanned, one read-only sum each) and with
``kv_finite=True`` (what a cache that checks each token as it is written passes: only q is scanned).
The table prints medians over rounds; the overhead is the median of per-round differences.

    python benchmarks/bench_nonfinite.py --threads 1,2            # the figures (a few minutes)
    python benchmarks/bench_nonfinite.py --quick                  # seconds: a smoke run, not figures
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tb

import attnkit
from attnkit import Causal, KeyPadding


def cases(quick: bool):
    """``(name, B, Tq, Tk, mask kind, aim)``; aim ``("ratio", x)`` or ``("overhead_us", x)``."""
    if quick:
        return [("padded decode Tk=64", 2, 1, 64, "padded", ("ratio", 1.15)),
                ("unmasked decode Tk=16", 1, 1, 16, None, ("overhead_us", 5.0)),
                ("causal prefill n=64", 1, 64, 64, "causal", ("ratio", 1.03))]
    out = [(f"padded decode Tk={n}", 4, 1, n, "padded", ("ratio", 1.15)) for n in (512, 4096)]
    out += [(f"unmasked decode Tk={n}", 1, 1, n, None, ("overhead_us", 5.0)) for n in (32, 512)]
    out += [(f"causal prefill n={n}", 1, n, n, "causal", ("ratio", 1.03)) for n in (1024, 4096)]
    return out


def statements(B: int, Tq: int, Tk: int, kind: str | None) -> tuple[dict, dict]:
    """The timed statements of one case and their globals."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 8, Tq, 64, generator=g)
    k, v = torch.randn(B, 8, Tk, 64, generator=g), torch.randn(B, 8, Tk, 64, generator=g)
    env = dict(F=F, attnkit=attnkit, q=q, k=k, v=v)
    if kind == "padded":
        lengths = torch.tensor([Tk - 7 * i * Tk // (8 * B) for i in range(B)])  # ragged, every row non-empty
        env["mask"] = Causal() & KeyPadding(lengths)
        env["keep"] = env["mask"].materialize(Tq, Tk, q_offset=Tk - Tq, kv_offset=0, batch_size=B, num_heads=8)
        sdpa = "F.scaled_dot_product_attention(q, k, v, attn_mask=keep)"
        ours = "attnkit.attention(q, k, v, mask=mask{})"
    elif kind == "causal":
        sdpa = "F.scaled_dot_product_attention(q, k, v, is_causal=True)"
        ours = "attnkit.attention(q, k, v, mask=attnkit.Causal(){})"
    else:
        sdpa = "F.scaled_dot_product_attention(q, k, v)"
        ours = "attnkit.attention(q, k, v{})"
    stmts = {"sdpa": sdpa, "attnkit": ours.format("")}
    if Tq == 1:
        stmts["attnkit kv_finite"] = ours.format(", kv_finite=True")
    return stmts, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per case")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per blocked_autorange")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (a smoke run, not figures)")
    parser.add_argument("--out", default="bench-results", help="directory for nonfinite.json")
    args = parser.parse_args()
    rounds, min_run = (2, 0.01) if args.quick else (args.rounds, args.min_run_time)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name, B, Tq, Tk, kind, (aim_kind, aim) in cases(args.quick):
            stmts, env = statements(B, Tq, Tk, kind)
            for stmt in stmts.values():  # warm up (mask caches, first-call costs)
                eval(stmt, env)
            times = {label: [] for label in stmts}
            for _ in range(rounds):
                for label, stmt in stmts.items():
                    t = tb.Timer(stmt=stmt, globals=env, num_threads=threads).blocked_autorange(min_run_time=min_run)
                    times[label].append(t.median)
            base = statistics.median(times["sdpa"])
            for label in stmts:
                if label == "sdpa":
                    continue
                med = statistics.median(times[label])
                over = statistics.median(a - b for a, b in zip(times[label], times["sdpa"]))
                ratio = med / base
                ok = ratio <= aim if aim_kind == "ratio" else over * 1e6 <= aim
                rows.append(dict(threads=threads, case=name, impl=label, sdpa_us=base * 1e6, us=med * 1e6,
                                 ratio=ratio, overhead_us=over * 1e6, aim=f"{aim_kind} <= {aim}", meets_aim=ok))
                print(f"{threads} thr  {name:26s} {label:18s} {med * 1e6:10.1f} us  sdpa {base * 1e6:10.1f} us  "
                      f"x{ratio:5.2f}  +{over * 1e6:8.1f} us  aim {aim_kind} <= {aim}: {'yes' if ok else 'NO'}",
                      flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nonfinite.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'nonfinite.json'}")


if __name__ == "__main__":
    main()
