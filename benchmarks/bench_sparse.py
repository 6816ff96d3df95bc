"""Exact attention at scale: tiled, sliding_window and block_sparse against SDPA (and FlexAttention).

Prints one table of ratios, every ratio against a baseline measured in the same run, interleaved
(A, B, A, B, ...) because the CPU is shared; the median of ``--repeats`` runs is reported.
Peak memory comes from a fresh subprocess per case (``resource.getrusage`` max RSS).

    python benchmarks/bench_sparse.py              # everything, about 10 minutes on 2 cores
    python benchmarks/bench_sparse.py --quick      # smaller sizes, a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attnkit
from attnkit import BlockSparse, Causal, SlidingWindow

B, H, D = 1, 8, 64


def qkv(n: int, dtype=torch.float32, grad: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=torch.float32).to(dtype).requires_grad_(grad) for _ in range(3)]


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, measured in turns."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    if repeats > 1:
        for fn in fns.values():  # warm up (allocator, first-call overheads)
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(benchmark.Timer("fn()", globals={"fn": fn},
                                               num_threads=torch.get_num_threads()).timeit(1).mean)
    return {name: statistics.median(t) for name, t in times.items()}


def row(label: str, value: str, note: str = "") -> None:
    print(f"{label:<58} {value:>14}  {note}", flush=True)


def sliding_window(n: int, w: int, repeats: int) -> None:
    q, k, v = qkv(n)
    mask = SlidingWindow(w, 0)
    keep = mask.materialize(n, n)
    t = interleaved(
        {
            "sliding_window": lambda: attnkit.attention(q, k, v, mask=mask, backend="sliding_window"),
            "sdpa_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
        },
        repeats,
    )
    row(f"sliding window w={w} n={n} fwd: sdpa(mask) / sliding_window", f"{t['sdpa_mask'] / t['sliding_window']:.1f}x",
        f"({t['sliding_window'] * 1e3:.0f} ms vs {t['sdpa_mask'] * 1e3:.0f} ms; aim >= 10x)")


def bigbird(n: int, bs: int, repeats: int) -> None:
    q, k, v = qkv(n)
    mask = BlockSparse.bigbird(n // bs, bs, window=1, global_blocks=1, random_blocks=2, seed=0)
    density = mask.density()
    t = interleaved(
        {
            "block_sparse": lambda: attnkit.attention(q, k, v, mask=mask, backend="block_sparse"),
            "sdpa_dense": lambda: F.scaled_dot_product_attention(q, k, v),
        },
        repeats,
    )
    ratio = t["block_sparse"] / (density * t["sdpa_dense"])
    row(f"bigbird n={n} bs={bs} density={density:.3f}: time / (density*sdpa)", f"{ratio:.2f}",
        f"({t['block_sparse'] * 1e3:.0f} ms vs sdpa dense {t['sdpa_dense'] * 1e3:.0f} ms; aim <= 1.5)")


def dense(n: int, dtype: torch.dtype, repeats: int, aim: str) -> None:
    q, k, v = qkv(n, dtype)
    t = interleaved(
        {
            "tiled": lambda: attnkit.attention(q, k, v, backend="tiled"),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        },
        repeats,
    )
    row(f"tiled dense {str(dtype)[6:]} n={n} fwd: sdpa / tiled (speedup)", f"{t['sdpa'] / t['tiled']:.2f}x",
        f"({t['tiled'] * 1e3:.0f} ms vs {t['sdpa'] * 1e3:.0f} ms; {aim})")


CHILD = textwrap.dedent(
    """
    import json, resource, sys, time, torch, torch.nn.functional as F, attnkit
    backend, n = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    def hwm():  # peak RSS (KiB) since the last reset; getrusage's max RSS cannot be reset
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
    try:  # reset the peak to the current RSS, so that import-time peaks do not count
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pass
    base = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 1024  # current RSS, KiB
    start = time.perf_counter()
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = attnkit.attention(q, k, v, mask=attnkit.Causal(), backend=backend)
    out.backward(torch.ones_like(out))
    seconds = time.perf_counter() - start
    peak = hwm()
    print(json.dumps({"seconds": seconds, "peak_mib": peak / 1024, "above_inputs_mib": (peak - base) / 1024}))
    """
)


def causal_training(n: int) -> None:
    """Fresh process per case: peak RSS (VmHWM, reset after the inputs are allocated) over the
    whole fwd+bwd, minus the RSS with q, k, v allocated (their gradients, 3 x B*H*n*D*4 bytes, are
    part of the "above" figure)."""
    res = {}
    for backend in ("tiled", "sdpa"):
        proc = subprocess.run([sys.executable, "-c", CHILD, backend, str(n)], capture_output=True, text=True)
        if proc.returncode != 0:
            row(f"causal fwd+bwd n={n} {backend}", "failed", proc.stderr.strip().splitlines()[-1:])
            return
        res[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
    grads_mib = 3 * B * H * n * D * 4 / 2**20
    for backend, r in res.items():
        row(f"causal fwd+bwd n={n} {backend}: peak RSS above inputs", f"{r['above_inputs_mib']:.0f} MiB",
            f"(incl. {grads_mib:.0f} MiB of grads; {r['seconds']:.1f} s)")
    row(f"causal fwd+bwd n={n}: time tiled / sdpa", f"{res['tiled']['seconds'] / res['sdpa']['seconds']:.2f}",
        "(one run each, separate processes)")


def causal_training_time(n: int, repeats: int) -> None:
    """fwd+bwd time ratio in one process, interleaved (fairer on a shared CPU than the two
    separate processes of ``causal_training``)."""
    q, k, v = qkv(n, grad=True)

    def step(fn):
        out = fn()
        out.backward(torch.ones_like(out))

    t = interleaved(
        {
            "tiled": lambda: step(lambda: attnkit.attention(q, k, v, mask=Causal(), backend="tiled")),
            "sdpa": lambda: step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        },
        repeats,
    )
    row(f"causal fwd+bwd n={n}: time tiled / sdpa (interleaved)", f"{t['tiled'] / t['sdpa']:.2f}",
        f"({t['tiled']:.1f} s vs {t['sdpa']:.1f} s)")


def flex(n_window: int, w: int, n_bigbird: int, bs: int, repeats: int) -> None:
    """FlexAttention compiled (forward) on CPU against our backends, if it runs here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        for label, n, mask, mod, backend in (
            (f"sliding window w={w} n={n_window}", n_window, SlidingWindow(w, 0),
             lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= w), "sliding_window"),
            (f"bigbird n={n_bigbird}", n_bigbird, BlockSparse.bigbird(n_bigbird // bs, bs, seed=0), None,
             "block_sparse"),
        ):
            q, k, v = qkv(n)
            if mod is None:
                layout = mask.layout[0]
                mod = lambda b, h, qi, ki, layout=layout: layout[qi // bs, ki // bs]  # noqa: E731
            block_mask = create_block_mask(mod, None, None, n, n, device="cpu",
                                           BLOCK_SIZE=bs if mod is not None else 128)
            t = interleaved(
                {
                    "ours": lambda: attnkit.attention(q, k, v, mask=mask, backend=backend),
                    "flex": lambda: compiled(q, k, v, block_mask=block_mask),
                },
                repeats,
            )
            row(f"{label} fwd: flex(compiled) / {backend}", f"{t['flex'] / t['ours']:.2f}x",
                f"({t['ours'] * 1e3:.0f} ms vs flex {t['flex'] * 1e3:.0f} ms; aim >= 1)")
    except Exception as exc:  # report, don't hide: FlexAttention on CPU needs inductor + a C++ compiler
        row("FlexAttention (compiled, CPU)", "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["window", "bigbird", "dense", "bf16", "training", "training_time", "flex"])
    args = parser.parse_args()
    s = 8 if args.quick else 1
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={B} H={H} D={D}, median of {args.repeats}")
    if "window" not in args.skip:
        sliding_window(16384 // s, 256, args.repeats)
    if "bigbird" not in args.skip:
        bigbird(8192 // s, 64, args.repeats)
    if "dense" not in args.skip:
        dense(4096 // s, torch.float32, args.repeats, "aim: ratio >= 0.5")
    if "bf16" not in args.skip:
        dense(8192 // s, torch.bfloat16, args.repeats, "aim: >= 1.3x")
    if "training" not in args.skip:
        causal_training(32768 // s)
    if "training_time" not in args.skip:
        causal_training_time(8192 // s, args.repeats)
    if "flex" not in args.skip:
        flex(16384 // s, 256, 8192 // s, 64, args.repeats)


if __name__ == "__main__":
    main()
