"""Long-range benchmark: LSTM vs Transformers (each attention backend) on synthetic recall and copy tasks.

Every model gets the same step budget, the same batches and (within a few percent) the same number
of parameters; the dependency distance grows from 32 to 1024 tokens. The score is answer accuracy
(teacher-forced argmax over the answer tokens) on held-out batches.

    python benchmarks/long_range.py                       # CPU: distances 32..256, stops at 10 min
    python benchmarks/long_range.py --device cuda         # GPU: distances 32..1024
    python benchmarks/long_range.py --quick               # ~1-2 min smoke run
    python benchmarks/long_range.py --tasks copy --distances 32 64 --steps 100

Writes long_range.md (table), long_range.json and long_range.png into --out (default bench-results/long_range;
the plot needs matplotlib: pip install 'attnkit[bench]'). `--update-docs` writes the JSON and the plot into
docs/ instead (a figure for the manual needs its record on docs/figures.md: command, CPU, threads, torch);
`--replot` only redraws the plot from the JSON. Rerun time is bounded: steps x batch x length is fixed by the
flags, and `--time-limit` (default 600 s) skips the runs left once it is exceeded (they are listed as
skipped). On a 2-core CPU, distances up to 1024 cost minutes per step for every model, so the CPU default
stops at 256.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from attnkit.bench.plots import style  # noqa: E402
from attnkit.bench.report import command_line  # noqa: E402
from attnkit.bench.runner import machine_description  # noqa: E402
from attnkit.inputs import AttentionInputs  # noqa: E402
from attnkit.masks import Causal  # noqa: E402
from attnkit.registry import list_backends  # noqa: E402
from attnkit.train.loop import TrainConfig, build_model, num_params, train  # noqa: E402
from attnkit.train.lstm import LSTMConfig  # noqa: E402
from attnkit.train.tasks import TASKS, SyntheticTask  # noqa: E402


DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")


def causal_backends(length: int, device: str) -> list[str]:
    """Exact registered backends that can train causal self-attention on ``device`` at this length."""
    q = torch.randn(1, 2, length, 16, device=device, requires_grad=True)
    inp = AttentionInputs.create(q, q, q, mask=Causal())
    return [name for name, impl in list_backends().items()
            if impl.exact and impl.supports_backward and not impl.not_supported_reasons(inp)]


def gpt_config(task: SyntheticTask, width: int, layers: int, backend: str):
    from attnkit.nn.layers import TransformerConfig

    return TransformerConfig(vocab_size=task.vocab_size, max_len=task.seq_len, embed_dim=width, num_layers=layers,
                             num_heads=4, position="rope", backend=backend)


def matched_lstm(task: SyntheticTask, target_params: int) -> LSTMConfig:
    """The 2-layer LSTM whose parameter count is closest to ``target_params``."""
    best = None
    for hidden in range(16, 512, 4):
        cfg = LSTMConfig(vocab_size=task.vocab_size, embed_dim=64, hidden_dim=hidden, num_layers=2)
        gap = abs(num_params(build_model("lstm", vars(cfg))) - target_params)
        if best is None or gap < best[0]:
            best = (gap, cfg)
    return best[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--distances", nargs="+", type=int, default=None,
                   help="default: 32 64 128 256 on CPU, 32 64 128 256 512 1024 on CUDA")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per model, the step budget "
                                                           "(default: 150 on CPU, 300 on CUDA)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 16 on CPU, 32 on CUDA")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--width", type=int, default=64, help="Transformer width (the LSTM is matched in parameters)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--backends", nargs="*", default=None, help="attention backends (default: every exact one)")
    p.add_argument("--all-backends-at", type=int, nargs="*", default=None,
                   help="distances at which every backend trains (default: the shortest and the longest); "
                        "elsewhere only the first backend, since exact backends compute the same function")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds; later runs are skipped past it")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: copy task, distances 32 64, 30 steps")
    p.add_argument("--out", default=os.path.join("bench-results", "long_range"),
                   help="output directory (default bench-results/long_range)")
    p.add_argument("--update-docs", action="store_true",
                   help="write long_range.json and long_range.png into docs/ instead (the analysis in "
                        "docs/long_range.md is written by hand: update its table from the printed one)")
    p.add_argument("--replot", action="store_true", help="only redraw long_range.png from the output's long_range.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda'")
    args = p.parse_args(argv)
    if args.update_docs:
        args.out = DOCS
    if args.replot:
        with open(os.path.join(args.out, "long_range.json")) as f:
            plot(json.load(f)["rows"], os.path.join(args.out, "long_range.png"))
        return 0
    cuda = args.device.startswith("cuda")
    args.distances = args.distances or ([32, 64, 128, 256, 512, 1024] if cuda else [32, 64, 128, 256])
    args.steps = args.steps or (300 if cuda else 150)
    args.batch_size = args.batch_size or (32 if cuda else 16)
    if args.quick:
        args.tasks, args.distances, args.steps = ["copy"], [32, 64], 30
    all_at = set(args.all_backends_at if args.all_backends_at is not None
                 else [min(args.distances), max(args.distances)])
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    rows = []
    tmp = tempfile.mkdtemp(prefix="attnkit-long-range-")
    for task_name in args.tasks:
        for distance in args.distances:
            task = SyntheticTask(task_name, distance)
            names = args.backends or causal_backends(task.seq_len, args.device)
            if distance not in all_at:
                names = names[:1]
            gpt_params = num_params(build_model("gpt", vars(gpt_config(task, args.width, args.layers, "auto"))))
            models = [("lstm", matched_lstm(task, gpt_params))]
            models += [(f"gpt-{b}", gpt_config(task, args.width, args.layers, b)) for b in names]
            for label, model_cfg in models:
                if time.perf_counter() - start > args.time_limit:
                    print(f"time limit reached: skipping {task_name} d={distance} {label}", flush=True)
                    continue
                cfg = TrainConfig(data=f"task:{task_name}:{distance}", out=os.path.join(tmp, "run"), overwrite=True,
                                  steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                  warmup_steps=max(args.steps // 10, 1), eval_every=0, eval_batches=4,
                                  sample_tokens=0, progress=False, device=args.device, seed=args.seed,
                                  model="lstm" if label == "lstm" else "gpt")
                t0 = time.perf_counter()
                res = train(cfg, model_cfg)
                row = {"task": task_name, "distance": distance, "model": label, "params": res["params"],
                       "accuracy": res["eval"]["accuracy"], "eval_loss": res["eval"]["loss"],
                       "seconds": time.perf_counter() - t0}
                rows.append(row)
                print(f"{task_name:15s} d={distance:5d} {label:12s} params={row['params']:7d} "
                      f"acc={row['accuracy']:.3f} loss={row['eval_loss']:.3f} ({row['seconds']:.0f}s)", flush=True)
    elapsed = time.perf_counter() - start
    print(f"total {elapsed:.0f}s")
    os.makedirs(args.out, exist_ok=True)
    command = command_line("python benchmarks/long_range.py", list(argv if argv is not None else sys.argv[1:]))
    meta = {"command": command, "steps": args.steps, "batch_size": args.batch_size, "seconds": elapsed,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": args.device,
            "machine": machine_description(args.device)}
    with open(os.path.join(args.out, "long_range.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    table = markdown_table(rows)
    if not args.update_docs:  # never over the hand-written docs/long_range.md
        with open(os.path.join(args.out, "long_range.md"), "w") as f:
                f.write(f"# Long-range benchmark\n\nCommand: `{meta['command']}` ({elapsed:.0f} s, "
                    f"torch {torch.__version__}, {meta['threads']} threads, device {args.device}). "
                    f"Answer accuracy after {args.steps} steps of "
                    f"batch {args.batch_size}; every model has about the same parameter count (column `params`).\n\n"
                    f"{table}\n\n![accuracy vs distance](long_range.png)\n")
    print(table)
    plot(rows, os.path.join(args.out, "long_range.png"))
    return 0


def markdown_table(rows) -> str:
    distances = sorted({r["distance"] for r in rows})
    lines = ["| task | model | params | " + " | ".join(f"d={d}" for d in distances) + " |",
             "|---|---|---:|" + "---:|" * len(distances)]
    keys = []
    for r in rows:
        if (r["task"], r["model"]) not in keys:
            keys.append((r["task"], r["model"]))
    for task, model in keys:
        cells = {r["distance"]: r for r in rows if r["task"] == task and r["model"] == model}
        params = next(iter(cells.values()))["params"]
        accs = [f"{cells[d]['accuracy']:.2f}" if d in cells else "" for d in distances]
        lines.append(f"| {task} | {model} | {params} | " + " | ".join(accs) + " |")
    return "\n".join(lines)


def plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: pip install 'attnkit[bench]' for the plot")
        return
    if len({r["distance"] for r in rows}) < 2:
        print("(no plot: accuracy vs distance needs two distances or more)")
        return
    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        series = {model: sorted((r["distance"], r["accuracy"]) for r in rows
                                if r["task"] == task and r["model"] == model)
                  for model in sorted({r["model"] for r in rows if r["task"] == task})}
        full = max(len(pts) for pts in series.values())
        for model, pts in series.items():
            # the GPT takes its backend's colour and marker; the LSTM baseline is grey and dashed
            look = style(model.removeprefix("gpt-")) if model.startswith("gpt-") else \
                {"color": "#7f7f7f", "marker": "o", "linestyle": "--"}
            label = model
            if len(pts) < full:  # spot checks at a few distances: points, not a line through the gaps
                look, label = {**look, "linestyle": ""}, f"{model} (spot checks)"
            ax.plot([d for d, _ in pts], [a for _, a in pts], label=label, markersize=6, **look)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.set_title(task)
        ax.set_xlabel("dependency distance (tokens)")
        ax.set_ylabel("answer accuracy")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Answer accuracy vs dependency distance (same steps, batches and parameter count)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
