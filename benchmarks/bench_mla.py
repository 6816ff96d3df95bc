"""Absorbed MLA decode (attnkit.mla_decode) against this machine's matmul peak, measured in the same run.

One sequence (batch 1), one new token, DeepSeek-V3's latent rows (kv_lora_rank 512 + rope 64 = 576
numbers per token, one K/V head, values the first 512 columns of the keys) at 8k and 32k context,
16 and 128 query heads, float32 and bfloat16, every case interleaved in one process
(torch.utils.benchmark, median of ``--rounds``):

* ``native``: ``mla_decode(..., implementation="native")``, the decode kernel over the rows in place;
* ``torch``: the decode backend's PyTorch-op twin (``implementation="torch"``);
* ``int8``: the kernel over an int8 latent cache (one int8 row and a float32 scale per token) in place;
* ``matmul``: the same attention as two plain matmuls (``softmax(q Kᵀ) K[:, :512]`` in float32, the
  rows read twice): the straightforward baseline the ratios are taken against.

FLOP per call = 2·H·Tk·(576 + 512) (scores, then the latent output). Each row prints ms, GFLOP/s,
the share of the **matmul peak of that dtype** (``torch.mm`` of two 2048² matrices, measured in the
same run: float32 for fp32 rows, bfloat16 for bf16 rows) and the speed-up over the ``matmul`` row.
A last table gives the cache bytes per token and layer: the latent row (bf16, fp32, int8 with its
scale) against the expanded per-head keys and values the non-absorbed form would cache
(H·(192 + 128) numbers). Figures taken under load are indicative; the load average is printed.

    python benchmarks/bench_mla.py            # the figures (a few minutes)
    python benchmarks/bench_mla.py --quick    # smoke: 2k context, 16 heads, one round
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils import benchmark

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's attnkit

from attnkit import mla_decode  # noqa: E402
from attnkit.backends.decode_native import kernel_reasons  # noqa: E402
from attnkit.cache import LatentLayerCache, QuantizedLayerCache, StaticLayerCache  # noqa: E402
from attnkit.inputs import AttentionInputs  # noqa: E402

RANK, ROPE, NOPE, VDIM = 512, 64, 128, 128
SCALE = (NOPE + ROPE) ** -0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def flops(H: int, T: int) -> float:
    return 2.0 * H * T * (RANK + ROPE + RANK)


def matmul_peak(dtype: torch.dtype, n: int = 2048) -> benchmark.Timer:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return benchmark.Timer("torch.mm(a, b)", globals={"torch": torch, "a": a, "b": b})


def cases(T: int, H: int, dtype: torch.dtype, native: bool) -> dict:
    g = torch.Generator().manual_seed(T + H)
    rows = torch.randn(1, 1, T, RANK + ROPE, generator=g).to(dtype)  # (B, 1, Tk, 576)
    q = torch.randn(1, H, 1, RANK + ROPE, generator=g).to(dtype)  # (B, H, 1, 576)

    def run(impl):
        return lambda: mla_decode(q, rows, kv_lora_rank=RANK, scale=SCALE, implementation=impl, kv_finite=True)

    def matmul():
        r = rows[0, 0].float()
        p = torch.softmax((q[0, :, 0].float() @ r.T) * SCALE, dim=-1)  # (H, Tk)
        return p @ r[:, :RANK]  # (H, 512)

    fns = {"matmul": matmul, "torch": run("torch")}
    if native:
        fns["native"] = run("native")
        store = LatentLayerCache(QuantizedLayerCache(T), RANK)
        store.update(rows[:, :, :-1])
        handle, _, _ = store.update(rows[:, :, -1:])  # int8 rows, read in place
        fns["int8"] = lambda: mla_decode(q, handle, kv_lora_rank=RANK, scale=SCALE, implementation="native",
                                         kv_finite=True)
    return fns


def bytes_per_token(heads: list[int]) -> list[tuple[str, int]]:
    out = []
    for name, dtype in (("latent bf16", torch.bfloat16), ("latent fp32", torch.float32)):
        cache = LatentLayerCache(StaticLayerCache(64), RANK)
        cache.update(torch.zeros(1, 1, 1, RANK + ROPE, dtype=dtype))
        out.append((name, cache.memory_bytes() // 64))
    cache = LatentLayerCache(QuantizedLayerCache(64), RANK)
    cache.update(torch.zeros(1, 1, 1, RANK + ROPE))
    out.append(("latent int8", cache.memory_bytes() // 64))
    out += [(f"expanded bf16 (H={H})", H * (NOPE + ROPE + VDIM) * 2) for H in heads]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="2k context, 16 heads, one round")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.heads, args.rounds, args.min_run_time = [2048], [16], 1, 0.05
    x = torch.zeros(1, 1, 1, RANK + ROPE)
    reasons = kernel_reasons(AttentionInputs.create(x, x, x[..., :RANK]))
    native = not reasons
    print(f"threads={args.threads} load average={os.getloadavg()} native kernel: {'yes' if native else reasons}")
    timers = {("peak", d): matmul_peak(DTYPES[d]) for d in args.dtypes}
    fns = {}
    for d in args.dtypes:
        for T in args.contexts:
            for H in args.heads:
                for name, fn in cases(T, H, DTYPES[d], native).items():
                    fns[(d, T, H, name)] = fn
    for key, fn in fns.items():
        fn()  # warm up (and fail early)
        timers[key] = benchmark.Timer("fn()", globals={"fn": fn})
    times: dict = {key: [] for key in timers}
    for _ in range(args.rounds):  # interleaved: every case once per round
        for key, timer in timers.items():
            times[key].append(timer.blocked_autorange(min_run_time=args.min_run_time).median)
    med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    peak = {d: 2.0 * 2048 ** 3 / med[("peak", d)] for d in args.dtypes}
    rows = []
    print(f"{'dtype':5} {'Tk':>6} {'H':>4} {'case':7} {'ms':>9} {'GFLOP/s':>9} {'% peak':>7} {'vs matmul':>9}")
    for (d, T, H, name), t in ((k, v) for k, v in med.items() if k[0] != "peak"):
        rate = flops(H, T) / t
        speed = med[(d, T, H, "matmul")] / t
        rows.append(dict(dtype=d, context=T, heads=H, case=name, ms=t * 1e3, gflops=rate / 1e9,
                         peak_share=rate / peak[d], vs_matmul=speed))
        print(f"{d:5} {T:6} {H:4} {name:7} {t * 1e3:9.2f} {rate / 1e9:9.1f} {rate / peak[d]:7.1%} {speed:8.2f}x")
    for d in args.dtypes:
        print(f"matmul peak {d}: {peak[d] / 1e9:.1f} GFLOP/s")
    print("cache bytes per token and layer:")
    sizes = bytes_per_token(args.heads)
    for name, n in sizes:
        print(f"  {name:24} {n:7d}")
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, load_average=os.getloadavg(), rows=rows,
                           peak_gflops={d: p / 1e9 for d, p in peak.items()}, bytes_per_token=dict(sizes)), f, indent=1)


if __name__ == "__main__":
    main()
