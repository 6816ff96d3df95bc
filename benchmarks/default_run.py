"""The default `train` run against the LSTM baseline, in the same wall-clock budget, old vs new defaults.

    python benchmarks/default_run.py --budget-s 60            # about 4 minutes on 2 CPU cores

Three configurations train on the default corpus in one process, one after another:
``gpt-before`` (learned positions, lr 3e-3, warmup 30: the earlier defaults), ``gpt-now`` (the
current ``train`` defaults) and ``lstm`` (the baseline, default ``LSTMConfig``). Each first runs a
few steps (interleaved, twice) to measure its step time, then gets ``budget / step time`` steps, so
every model has the same time and a schedule fitted to it. Reported per configuration: steps, eval
loss, the largest early spike (max train loss over steps 10..60 minus the lowest loss before it),
a sample, and the eval loss relative to the LSTM's. Writes ``OUT/default_run.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from attnkit.nn.layers import TransformerConfig  # noqa: E402
from attnkit.train import LSTMConfig, TrainConfig, train  # noqa: E402
from attnkit.train.config import GPT_TRAIN_DEFAULTS  # noqa: E402
from attnkit.train.modeling import sample_text  # noqa: E402

TOKENS_PER_STEP = TrainConfig.batch_size * TrainConfig.seq_len  # the defaults every configuration uses

CONFIGS = {
    "gpt-before": (dict(lr=3e-3, warmup_steps=30),
                   lambda: TransformerConfig(**{**GPT_TRAIN_DEFAULTS, "position": "learned"})),
    "gpt-now": ({}, lambda: TransformerConfig(**GPT_TRAIN_DEFAULTS)),
    "lstm": (dict(model="lstm"), LSTMConfig),
}


def _run(out: str, steps: int, settings: dict, model_config, data: str, eval_batches: int) -> dict:
    cfg = TrainConfig(data=data, out=out, overwrite=True, steps=steps, eval_every=0, eval_batches=eval_batches,
                      sample_tokens=0, progress=False, log_every=0, device="cpu",
                      **{k: v for k, v in settings.items() if k != "warmup_steps" or steps > v})
    return train(cfg, model_config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=60.0, help="training seconds per configuration")
    parser.add_argument("--data", default="default", help="corpus (as train --data)")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--probe-steps", type=int, default=4, help="steps per step-time probe")
    parser.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    args = parser.parse_args()
    if not (args.budget_s > 0 and args.probe_steps >= 2):
        parser.error("--budget-s must be > 0 and --probe-steps >= 2")
    os.makedirs(args.out, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()}", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        step_times = {name: [] for name in CONFIGS}
        for _ in range(2):  # interleaved probes: the machine's load changes for all alike
            for name, (settings, make) in CONFIGS.items():
                res = _run(os.path.join(tmp, name), args.probe_steps, settings, make(), args.data, 1)
                tps = [r["tokens_per_s"] for r in res["history"][1:]]
                step_times[name] += [TOKENS_PER_STEP / t for t in tps]
        for name, (settings, make) in CONFIGS.items():
            step_s = statistics.median(step_times[name])
            steps = max(int(args.budget_s / step_s), 2)
            t0 = time.perf_counter()
            res = _run(os.path.join(tmp, name), steps, settings, make(), args.data, args.eval_batches)
            seconds = time.perf_counter() - t0
            losses = [r["loss"] for r in res["history"]]
            spike = max((losses[i] - min(losses[:i]) for i in range(10, min(60, len(losses)))), default=0.0)
            from attnkit.train import load_model

            model, _ = load_model(os.path.join(tmp, name))
            text = sample_text(model, "\n", 160, seed=1)
            rows[name] = {"steps": steps, "step_s": step_s, "seconds": seconds, "eval_loss": res["eval"]["loss"],
                          "early_spike": spike, "sample": text}
            print(f"{name:10s} {steps:5d} steps ({step_s * 1e3:6.1f} ms/step, {seconds:5.1f} s): eval loss "
                  f"{res['eval']['loss']:.4f}, early spike {spike:+.3f}", flush=True)
    base = rows["lstm"]["eval_loss"]
    print("\n| configuration | steps | eval loss | vs LSTM | early spike |\n|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['steps']} | {row['eval_loss']:.4f} | {row['eval_loss'] - base:+.4f} | "
              f"{row['early_spike']:+.3f} |")
    for name, row in rows.items():
        print(f"\n{name} sample:\n  " + row["sample"].rstrip().replace("\n", "\n  "))
    result = {"budget_s": args.budget_s, "data": args.data, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "load_average_end": os.getloadavg(), "rows": rows}
    path = os.path.join(args.out, "default_run.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
