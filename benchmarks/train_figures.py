"""Training and deployment figures on CPU, as ratios measured in one run.

    python benchmarks/train_figures.py --cores 0,1 --out runs/figures

Runs `python -m attnkit train` as subprocesses pinned to ``--cores`` (taskset) and reports:
1. the default training run (time, eval loss before/after) and its int8 dynamic quantization
   (forward speedup, eval-loss change);
2. training tokens/s, fp32 vs bf16 autocast (alternating short runs, median step throughput);
3. 2-process DDP (gloo, 1 thread each) vs 1 process (2 threads), same global batch: tokens/s and
   the largest per-step loss difference;
4. distillation: a smaller student trained from the default run's checkpoint vs the same student
   trained on the data alone, with both models' eval loss and size.
Writes ``OUT/figures.json`` and prints a Markdown summary. Takes about 8 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def attnkit_train(out, flags, cores, threads, nproc=1):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), GLOO_SOCKET_IFNAME="lo", PYTHONPATH=ROOT)
    pin = ["taskset", "-c", cores] if cores else []
    if nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
                  "--master_addr", "127.0.0.1", "--master_port", str(port)]
    else:
        launch = [sys.executable]
    cmd = pin + launch + ["-m", "attnkit", "train", "--out", out, "--overwrite", "--device", "cpu", "--no-progress",
                          *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)  # the thread count is the comparison
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    seconds = time.perf_counter() - t0
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    results["seconds"] = seconds
    results["history"] = history
    results["stdout"] = proc.stdout
    return results


def median_tps(history, skip=3):
    return statistics.median(r["tokens_per_s"] for r in history[skip:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cores", default="0,1", help="CPU cores to pin to (taskset); '' for none")
    p.add_argument("--out", default="runs/figures")
    p.add_argument("--steps", type=int, default=300, help="steps of the default run (and the students)")
    p.add_argument("--short", type=int, default=25, help="steps of each throughput run")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fig = {"cores": args.cores}
    o = lambda name: os.path.join(args.out, name)  # noqa: E731

    def save():  # after every part, so a run cut short keeps what it measured
        with open(o("figures.json"), "w") as f:
            json.dump(fig, f, indent=1)

    # 1. the default run, then int8 on its checkpoint
    base = attnkit_train(o("default"), ["--steps", str(args.steps), "--quantize", "int8"], args.cores, 2)
    first_eval = next((e for e in base["evals"] if e["step"] < args.steps), None)
    fig["default"] = {"seconds": base["seconds"], "steps": args.steps, "first_loss": base["history"][0]["loss"],
                      "eval_at_first_eval": first_eval, "final_eval": base["eval"],
                      "tokens_per_s": median_tps(base["history"])}
    fig["int8"] = base["quantize"]
    print(base["stdout"][-1500:], flush=True)
    save()

    # 2. fp32 vs bf16 autocast, alternating
    short = ["--steps", str(args.short), "--eval-every", "0", "--sample-tokens", "0", "--eval-batches", "1"]
    tps = {"fp32": [], "bf16": []}
    for rep in range(2):
        for precision in ("fp32", "bf16"):
            r = attnkit_train(o(f"{precision}-{rep}"), short + ["--precision", precision], args.cores, 2)
            tps[precision].append(median_tps(r["history"]))
    fig["precision"] = {"fp32_tokens_per_s": tps["fp32"], "bf16_tokens_per_s": tps["bf16"],
                        "bf16_over_fp32": statistics.median(tps["bf16"]) / statistics.median(tps["fp32"])}
    save()

    # 3. DDP: 2 processes x 1 thread vs 1 process x 2 threads, same global batch and seed
    one = attnkit_train(o("ddp-1"), short, args.cores, 2)
    two = attnkit_train(o("ddp-2"), short, args.cores, 1, nproc=2)
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(one["history"], two["history"])]
    fig["ddp"] = {"one_process_tokens_per_s": median_tps(one["history"]),
                  "two_process_tokens_per_s": median_tps(two["history"]),
                  "two_over_one": median_tps(two["history"]) / median_tps(one["history"]),
                  "max_abs_loss_diff": max(diffs), "final_loss": one["history"][-1]["loss"]}
    save()

    # 4. distillation: student (2 layers x 64) from the default run vs the same student alone
    student = ["--steps", str(args.steps), "--embed-dim", "64", "--num-layers", "2", "--num-heads", "2",
               "--sample-tokens", "0"]
    dist = attnkit_train(o("student-distilled"), student + ["--distill-from", o("default")], args.cores, 2)
    alone = attnkit_train(o("student-alone"), student, args.cores, 2)
    fig["distill"] = dict(dist["distill"], student_alone_loss=alone["eval"]["loss"])

    save()
    d, q, pr, dd, ds = fig["default"], fig["int8"], fig["precision"], fig["ddp"], fig["distill"]
    print("\n"
          "| figure | result |\n"
          "|---|---|\n"
          f"| default run | {d['steps']} steps in {d['seconds']:.0f} s; train loss {d['first_loss']:.2f} -> "
          f"eval {d['final_eval']['loss']:.3f} (ppl {d['final_eval']['perplexity']:.2f}); "
          f"{d['tokens_per_s']:.0f} tok/s |\n"
          f"| bf16 autocast vs fp32 | {pr['bf16_over_fp32']:.2f}x tokens/s (fp32 {pr['fp32_tokens_per_s']}, "
          f"bf16 {pr['bf16_tokens_per_s']}) |\n"
          f"| DDP 2 procs vs 1 | {dd['two_over_one']:.2f}x tokens/s; "
          f"max per-step loss difference {dd['max_abs_loss_diff']:.1e} |\n"
          f"| int8 dynamic | {q['speedup']:.2f}x forward; eval loss {q['fp32_loss']:.4f} -> {q['int8_loss']:.4f} "
          f"({q['loss_delta']:+.4f}); {q['fp32_bytes'] / 2**20:.2f} -> {q['int8_bytes'] / 2**20:.2f} MiB |\n"
          f"| distillation | teacher {ds['teacher_loss']:.3f} ({ds['teacher_params'] / 1e6:.2f}M params) / "
          f"student {ds['student_loss']:.3f} ({ds['student_params'] / 1e6:.2f}M) / "
          f"same student without teacher {ds['student_alone_loss']:.3f} |\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
