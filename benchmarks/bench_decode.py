"""Decode throughput of a GPT-2-small-sized model (12 layers, 768 wide, 12 heads) on CPU.

Measures, interleaved in one run (torch.utils.benchmark, median over rounds):

1. one decode step at context 512 with a static cache vs recomputing the whole prefix
   (baseline: a forward over all 512 tokens, LM head on the last position only) -> tokens/s, ratio;
2. dynamic, int8 static, paged and int8 paged caches vs the static cache at context 512;
3. per-token latency at several contexts with a sliding-window cache (window 256) vs a dynamic
   cache: the sliding-window latency should stay flat.

Caches are filled with random keys/values of the right shape (the latency does not depend on
their values), so no long prefill is timed. After each timed step the cache is cropped back to the
context (O(1) for static/dynamic); the ring buffer is never cropped (its cost does not depend on
how far it has advanced). The CPU is shared: read the ratios, not the absolute numbers, and repeat.

    python benchmarks/bench_decode.py [--threads 1] [--rounds 3] [--out bench-results/decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils import benchmark

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's attnkit

from attnkit.cache import KVCache
from attnkit.nn import GPT, TransformerConfig


def fill(cache: KVCache, context: int, heads: int, head_dim: int) -> None:
    for layer in cache:
        k = torch.randn(1, heads, context, head_dim)
        layer.update(k, torch.randn_like(k))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--contexts", default="256,1024,4096", help="contexts for the sliding-window sweep")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", default="bench-results/decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    config = TransformerConfig(vocab_size=50257, max_len=max(contexts + [args.context]) + 1024, embed_dim=768,
                               num_layers=args.layers, num_heads=12, activation="gelu_tanh",
                               sliding_window=args.window)
    # Dense GPT (no window) for the static/dynamic/recompute comparison; the windowed twin shares weights.
    dense = GPT(TransformerConfig(**{**config.__dict__, "sliding_window": None})).eval()
    windowed = GPT(config).eval()
    windowed.load_state_dict(dense.state_dict())
    H, D, C = 12, 64, args.context
    token = torch.randint(0, 50257, (1, 1))
    prefix = torch.randint(0, 50257, (1, C))
    caches = {"static": dense.make_cache("static", max_len=C + 1), "dynamic": dense.make_cache("dynamic"),
              "static int8": dense.make_cache("static", max_len=C + 1, quantize="int8"),
              "paged": dense.make_cache("paged", num_blocks=C // 16 + 2),
              "paged int8": dense.make_cache("paged", num_blocks=C // 16 + 2, quantize="int8")}
    for cache in caches.values():
        if hasattr(cache, "add_sequence"):  # a paged cache: one sequence
            cache.select([cache.add_sequence()])
        fill(cache, C, H, D)

    def timer(stmt: str, env: dict) -> benchmark.Timer:
        return benchmark.Timer(stmt=stmt, globals={**env, "torch": torch}, num_threads=args.threads)

    step = "m(t, cache=c, logits_to_keep=1); c.crop(n)"  # one token, then back to the context
    cases = {
        "static cache": timer(step, dict(m=dense, t=token, c=caches["static"], n=C)),
        "dynamic cache": timer(step, dict(m=dense, t=token, c=caches["dynamic"], n=C)),
        "static int8 cache": timer(step, dict(m=dense, t=token, c=caches["static int8"], n=C)),
        "paged cache": timer(step, dict(m=dense, t=token, c=caches["paged"], n=C)),
        "paged int8 cache": timer(step, dict(m=dense, t=token, c=caches["paged int8"], n=C)),
        "recompute prefix": timer("m(x, logits_to_keep=1)", dict(m=dense, x=prefix)),
    }
    sweep = {}
    for ctx in contexts:
        sw = windowed.make_cache("sliding_window")
        fill(sw, ctx, H, D)
        dyn = windowed.make_cache("dynamic")
        fill(dyn, ctx, H, D)
        sweep[ctx] = {
            "sliding_window": timer("m(t, cache=c, logits_to_keep=1)", dict(m=windowed, t=token, c=sw)),
            "dynamic": timer(step, dict(m=windowed, t=token, c=dyn, n=ctx)),
        }
    samples: dict[str, list[float]] = {}
    start = time.time()
    with torch.no_grad():
        for case in list(cases.values()) + [t for d in sweep.values() for t in d.values()]:
            case.timeit(1)  # warm-up
        for _ in range(args.rounds):  # interleaved rounds: load changes hit every case alike
            for name, t in cases.items():
                number = 1 if name == "recompute prefix" else 5
                samples.setdefault(name, []).append(t.timeit(number).median)
            for ctx, d in sweep.items():
                for kind, t in d.items():
                    samples.setdefault(f"{kind}@{ctx}", []).append(t.timeit(5).median)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"GPT-2-small-sized decode ({args.layers} layers, 768 wide, 12 heads), fp32, CPU, "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds, {time.time() - start:.0f} s, "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(f"\ncontext {C}: one new token")
    print(f"{'method':<18}{'ms/token':>10}{'tokens/s':>10}{'vs static':>11}")
    for name in cases:
        print(f"{name:<18}{med[name] * 1e3:>10.1f}{1 / med[name]:>10.1f}{med[name] / med['static cache']:>10.2f}x")
    print(f"\nstatic cache speed-up over recomputing the prefix: {med['recompute prefix'] / med['static cache']:.1f}x")
    print(f"dynamic / static time per token: {med['dynamic cache'] / med['static cache']:.2f}")
    print(f"\nper-token latency, window {args.window} (ms)")
    print(f"{'context':>8}{'sliding':>10}{'dynamic':>10}")
    for ctx in contexts:
        print(f"{ctx:>8}{med[f'sliding_window@{ctx}'] * 1e3:>10.1f}{med[f'dynamic@{ctx}'] * 1e3:>10.1f}")
    first, last = contexts[0], contexts[-1]
    growth = {kind: med[f"{kind}@{last}"] / med[f"{kind}@{first}"] for kind in ("sliding_window", "dynamic")}
    print(f"latency ratio context {last} / {first}: sliding {growth['sliding_window']:.2f}, "
          f"dynamic {growth['dynamic']:.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "median_s": med, "samples_s": samples}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
