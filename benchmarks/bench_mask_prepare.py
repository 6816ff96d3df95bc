"""A model forward prepares its mask once: padded GPT forward with the mask cache on vs off.

Figures: mask evaluations per padded forward (every layer shares the forward's mask) and the time
of a padded ``num_layers``-layer GPT forward (``torch.no_grad``, backend ``auto``) with the
prepared-mask cache of :meth:`attnkit.Mask.materialize` (the default) against the same forward
with the cache switched off (every layer rebuilds the keep-tensor), interleaved in one process with
torch.utils.benchmark; also the cost of one materialization alone. The ratio off / on is reported
per round; the table prints medians. Results go to ``--out`` (default ``bench-results/``) as JSON.

    python benchmarks/bench_mask_prepare.py                      # the real figures (~1-2 minutes)
    python benchmarks/bench_mask_prepare.py --tiny --repeats 1   # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.utils.benchmark as tb

import attnkit
from attnkit import Causal, Padding
from attnkit.masks import base as mask_base
from attnkit.nn import GPT, TransformerConfig


def median_time(stmt: str, env: dict, min_run_time: float) -> float:
    return tb.Timer(stmt=stmt, globals=env, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time).median


def count_evaluations(model, ids, attention_mask) -> int:
    calls = [0]
    original = mask_base.Mask.evaluate

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    mask_base.Mask.evaluate = counting
    try:
        with torch.no_grad():
            model(ids, attention_mask=attention_mask)
    finally:
        mask_base.Mask.evaluate = original
    return calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per timing (blocked_autorange)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes for a smoke run")
    parser.add_argument("--out", default="bench-results", help="output directory for the JSON figures")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.length, args.min_run_time = 2, 64, 0.05
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=256, max_len=args.length, embed_dim=256, num_layers=args.layers, num_heads=4)
    model = GPT(cfg).eval()
    ids = torch.randint(0, 256, (args.batch, args.length))
    attention_mask = torch.ones(args.batch, args.length, dtype=torch.long)
    attention_mask[1:, args.length * 3 // 4:] = 0  # every row but the first right-padded by a quarter
    valid = attention_mask.bool()
    env = dict(torch=torch, model=model, ids=ids, am=attention_mask, Causal=Causal, Padding=Padding, valid=valid,
               T=args.length, B=args.batch, H=cfg.num_heads)
    forward = "with torch.no_grad(): model(ids, attention_mask=am)"
    one = "(Causal() & Padding(valid)).materialize(T, T, batch_size=B, num_heads=H)"
    limit = mask_base._CACHE_BYTES
    evaluations = {}
    on, off, ratios, single = [], [], [], []
    for _ in range(args.repeats):
        for state, times in (("on", on), ("off", off)):
            mask_base._CACHE_BYTES = limit if state == "on" else -1
            evaluations[state] = count_evaluations(model, ids, attention_mask)
            times.append(median_time(forward, env, args.min_run_time))
        mask_base._CACHE_BYTES = limit
        ratios.append(off[-1] / on[-1])
        single.append(median_time(one, env, args.min_run_time / 4))
    load = os.getloadavg()
    row = dict(batch=args.batch, length=args.length, layers=args.layers, threads=torch.get_num_threads(),
               load_average=load, evaluations_cache_on=evaluations["on"], evaluations_cache_off=evaluations["off"],
               forward_ms_cache_on=statistics.median(on) * 1e3, forward_ms_cache_off=statistics.median(off) * 1e3,
               ratio_off_over_on=statistics.median(ratios), one_materialize_ms=statistics.median(single) * 1e3,
               chosen_backend=attnkit.explain(torch.empty(args.batch, 4, args.length, 64),
                                              torch.empty(args.batch, 4, args.length, 64),
                                              torch.empty(args.batch, 4, args.length, 64),
                                              mask=Causal() & Padding(valid)).chosen)
    print(f"torch {torch.__version__}, {row['threads']} threads, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; medians of {args.repeats} interleaved rounds")
    print(f"padded GPT forward B={args.batch} T={args.length} layers={args.layers} "
          f"(attention: {row['chosen_backend']})")
    print(f"  mask evaluations per forward: cache on {evaluations['on']}, off {evaluations['off']}")
    print(f"  forward ms: cache on {row['forward_ms_cache_on']:.2f}, off {row['forward_ms_cache_off']:.2f}, "
          f"off/on {row['ratio_off_over_on']:.3f}; one materialize {row['one_materialize_ms']:.3f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mask_prepare.json").write_text(json.dumps(row, indent=2))
    print(f"wrote {out / 'mask_prepare.json'}")


if __name__ == "__main__":
    main()
