"""The fused backends (``native`` C++ kernel, compiled ``flex``) against SDPA and each other.

B=1, H=8, D=64. Every ratio is measured in this run, the cases of a figure interleaved
(``torch.utils.benchmark``, best of ``--rounds`` medians); peak memory comes from a fresh process
per case (max RSS growth over the process after its inputs exist). The load average is printed:
compare ratios, not seconds, and run it when nothing else shares the cores.

    python benchmarks/bench_fused.py            # every figure (about 5-6 min on 2 quiet cores)
    python benchmarks/bench_fused.py --quick    # tiny sizes: a smoke run (about 1-2 min, mostly Flex's compile)
    python benchmarks/bench_fused.py --no-flex  # skip the figures that compile Flex
    python benchmarks/bench_fused.py --only bf16,threads   # some sections (each <= 3 min on 2 quiet cores)

Sections: dense (fp32 fwd n=4096 vs SDPA), causal (fp32 fwd+bwd n=8192 vs SDPA), window
(``Causal() & SlidingWindow(256, 0)`` fwd n=16384 vs compiled Flex, steady state; compile and
BlockMask build reported apart), bigbird (fwd n=8192 vs density x SDPA dense), doc, bf16 (causal
fwd and fwd+bwd n=8192 vs SDPA bf16 and % of the measured bf16 matmul peak; SDPA fp32 on the same
data), threads (backward at B=1, Hkv=2: 2 threads over 1), flex (build and recompiles).

Writes ``bench-results/fused.json`` (``--out`` to change the directory).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit
from attnkit import Causal, Document, SlidingWindow
from attnkit.masks import BlockSparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_approximate import interleaved, seconds  # noqa: E402  (the shared timing helpers)

B, H, D = 1, 8, 64


def once(fn) -> float:
    """One timed call (for cases too slow to repeat, e.g. SDPA with a 16k x 16k mask, fwd+bwd)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rand(n: int, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g).to(dtype).requires_grad_(grad) for _ in range(3)]


def fwd(backend, q, k, v, mask, **kw):
    def run():
        with torch.no_grad():
            return attnkit.attention(q, k, v, mask=mask, backend=backend, **kw)
    return run


def train(backend, q, k, v, mask):
    do = torch.randn_like(q)

    def run():
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
        torch.autograd.grad(out, (q, k, v), do)
    return run


def sdpa_fwd(q, k, v, **kw):
    def run():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return run


def sdpa_train(q, k, v, **kw):
    do = torch.randn_like(q)

    def run():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        torch.autograd.grad(out, (q, k, v), do)
    return run


def matmul_peak(dtype) -> float:
    """FLOP/s of a 2048^3 matmul in ``dtype`` on this machine (the "% of peak" denominator)."""
    a = torch.randn(2048, 2048).to(dtype)
    return 2 * 2048**3 / seconds(lambda: a @ a, 0.5)


def flops(n: int, density: float, passes: str) -> float:
    return 4 * B * H * n * n * D * density * (3.5 if passes == "train" else 1.0)  # bwd = 2.5x fwd


def sizes(quick: bool) -> dict:
    if quick:
        return dict(dense=512, causal=1024, window=2048, bigbird=1024, doc=(4, 256), bf16=1024, build=8192, threads=512)
    return dict(dense=4096, causal=8192, window=16384, bigbird=8192, doc=(8, 1024), bf16=8192, build=8192,
                threads=4096)


def masks(s: dict) -> dict:
    n_docs, doc_len = s["doc"]
    return {
        "window": Causal() & SlidingWindow(256, 0),
        "bigbird": BlockSparse.bigbird(s["bigbird"] // 64, 64, seed=0),
        "doc": Causal() & Document(torch.arange(n_docs * doc_len) // doc_len),
    }


SECTIONS = ("dense", "causal", "window", "bigbird", "doc", "bf16", "threads", "flex")


def backward_only(q, k, v, mask, threads: int):
    """The backward pass alone (the forward's graph kept) at ``threads`` intra-op threads."""
    out = attnkit.attention(q, k, v, mask=mask, backend="native")
    do = torch.randn_like(out)

    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        finally:
            torch.set_num_threads(before)
    return run


def run_figures(args) -> dict:
    s, m = sizes(args.quick), masks(sizes(args.quick))
    r, t = args.rounds, args.min_run_time
    fig: dict = {}
    want = set(args.only.split(",")) if args.only else set(SECTIONS)
    unknown = want - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--only {args.only}: unknown section(s) {sorted(unknown)}; expected some of {SECTIONS}")
    if args.no_flex:
        want.discard("flex")

    def report(name, result):
        fig[name] = result
        print(f"{name}: {json.dumps(result)}", flush=True)

    if "dense" in want:
        n = s["dense"]
        q, k, v = rand(n)
        tm = interleaved({"native": fwd("native", q, k, v, None), "sdpa": sdpa_fwd(q, k, v)}, r, t)
        report(f"dense fp32 fwd n={n}", {**tm, "native/sdpa time": tm["native"] / tm["sdpa"]})

    if "causal" in want:
        n = s["causal"]
        q, k, v = rand(n, grad=True)
        tm = interleaved({"native": train("native", q, k, v, Causal()), "sdpa": sdpa_train(q, k, v, is_causal=True)},
                         r, t)
        report(f"causal fp32 fwd+bwd n={n}", {**tm, "native/sdpa time": tm["native"] / tm["sdpa"]})

    if "window" in want:
        window(s, m, r, t, report, args.no_flex)

    if "bigbird" in want:
        n = s["bigbird"]
        q, k, v = rand(n)
        density = m["bigbird"].density(n, n)
        tm = interleaved({"native": fwd("native", q, k, v, m["bigbird"]),
                          "block_sparse": fwd("block_sparse", q, k, v, m["bigbird"]),
                          "sdpa dense": sdpa_fwd(q, k, v)}, r, t)
        qg, kg, vg = rand(n, grad=True)
        tr = interleaved({"native": train("native", qg, kg, vg, m["bigbird"]),
                          "block_sparse": train("block_sparse", qg, kg, vg, m["bigbird"])}, 1, t)
        report(f"bigbird n={n}", {**tm, "density": density,
                                 "native / (density x sdpa dense)": tm["native"] / (density * tm["sdpa dense"]),
                                 "fwd+bwd native s": tr["native"], "fwd+bwd block_sparse s": tr["block_sparse"]})

    if "doc" in want:
        n = s["doc"][0] * s["doc"][1]
        qg, kg, vg = rand(n, grad=True)
        keep = m["doc"].materialize(n, n)
        tm = interleaved({"native": train("native", qg, kg, vg, m["doc"]),
                          "sdpa+mask": sdpa_train(qg, kg, vg, attn_mask=keep)}, r, t)
        report(f"document {s['doc'][0]}x{s['doc'][1]} fwd+bwd n={n}",
               {**tm, "native speedup": tm["sdpa+mask"] / tm["native"]})

    if "bf16" in want:
        bf16(s, r, t, report)

    if "threads" in want:
        n = s["threads"]
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, H, n, D, generator=g).requires_grad_(True)
        k, v = (torch.randn(1, 2, n, D, generator=g).requires_grad_(True) for _ in range(2))
        tm = interleaved({"1 thread": backward_only(q, k, v, Causal(), 1),
                          "2 threads": backward_only(q, k, v, Causal(), 2)}, r, t)
        report(f"native causal backward B=1 Hq={H} Hkv=2 n={n}",
               {**tm, "2-thread speed-up": tm["1 thread"] / tm["2 threads"]})

    if "flex" in want:
        flex_build(s, report)
    return fig


def window(s, m, r, t, report, no_flex: bool):
    """``Causal() & SlidingWindow(256, 0)`` forward: native against compiled Flex in steady state."""
    n = s["window"]
    q, k, v = rand(n)
    entry = {}
    fns = {"native": fwd("native", q, k, v, m["window"])}
    if not no_flex:
        from attnkit.backends import flex

        start = time.perf_counter()
        try:
            fwd("flex", q, k, v, m["window"])()  # compiles (first call), builds and caches the BlockMask
        except RuntimeError as exc:  # torch's CPU Flex template fails to compile some mask_mods
            entry["flex error"] = str(exc)[:300]
        else:
            entry["flex first call (compile + build) s"] = time.perf_counter() - start
            flex._STATE["block_masks"].clear()
            build = once(lambda: flex.block_mask(m["window"],
                                                 attnkit.inputs.AttentionInputs.create(q, k, v, mask=m["window"])))
            entry["flex BlockMask build s (not in the steady state)"] = build
            fwd("flex", q, k, v, m["window"])()  # the BlockMask cached again
            fns["flex"] = fwd("flex", q, k, v, m["window"])
    tm = interleaved(fns, r, t)
    entry.update(tm)
    if "flex" in tm:
        entry["native speed / flex speed (steady state)"] = tm["flex"] / tm["native"]
    qg, kg, vg = rand(n, grad=True)
    keep = m["window"].materialize(n, n)
    entry["native fwd+bwd s"] = seconds(train("native", qg, kg, vg, m["window"]), t)
    entry["sdpa+mask fwd+bwd s (one call)"] = once(sdpa_train(qg, kg, vg, attn_mask=keep))
    entry["native speedup over sdpa+mask fwd+bwd"] = entry["sdpa+mask fwd+bwd s (one call)"] / entry["native fwd+bwd s"]
    del keep
    report(f"causal sliding window w=256 n={n}", entry)


def bf16(s, r, t, report):
    """bf16 causal n=8192: native (tiles in bf16 where this CPU's bf16 matmul is fast, else upcast)
    against SDPA bf16, SDPA fp32 on the same data, and the measured matmul peaks."""
    from attnkit.backends import native

    n = s["bf16"]
    peak = {"float32": matmul_peak(torch.float32), "bfloat16": matmul_peak(torch.bfloat16)}
    path = native.half_tiles_note(torch.bfloat16)
    q, k, v = rand(n, torch.bfloat16)
    q32, k32, v32 = (x.float() for x in (q, k, v))
    tm = interleaved({"native": fwd("native", q, k, v, Causal()), "sdpa": sdpa_fwd(q, k, v, is_causal=True),
                      "sdpa fp32": sdpa_fwd(q32, k32, v32, is_causal=True)}, r, t)
    f = flops(n, 0.5, "forward")
    report(f"bf16 causal fwd n={n}", {**tm, "native path": path,
                                      "native speed / sdpa bf16 speed": tm["sdpa"] / tm["native"],
                                      "native speed / sdpa fp32 speed": tm["sdpa fp32"] / tm["native"],
                                      "matmul peak GFLOP/s": {d: p / 1e9 for d, p in peak.items()},
                                      "% of bf16 matmul peak": {b: 100 * f / x / peak["bfloat16"]
                                                                for b, x in tm.items()}})
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    q32, k32, v32 = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    tm = interleaved({"native": train("native", q, k, v, Causal()), "sdpa": sdpa_train(q, k, v, is_causal=True),
                      "sdpa fp32": sdpa_train(q32, k32, v32, is_causal=True)}, 1, t)
    f = flops(n, 0.5, "train")
    report(f"bf16 causal fwd+bwd n={n}", {**tm, "native path": path,
                                          "native speed / sdpa bf16 speed": tm["sdpa"] / tm["native"],
                                          "native speed / sdpa fp32 speed": tm["sdpa fp32"] / tm["native"],
                                          "% of bf16 matmul peak": {b: 100 * f / x / peak["bfloat16"]
                                                                    for b, x in tm.items()}})


def flex_build(s, report):
    from torch._dynamo.utils import counters

    from attnkit.backends import flex

    n = s["build"]
    inp = attnkit.inputs.AttentionInputs.create(*rand(n)[:3], mask=Causal())
    times = []
    for _ in range(20):
        flex._STATE["block_masks"].clear()
        times.append(once(lambda: flex.block_mask(Causal(), inp)))
    before = counters["stats"]["unique_graphs"]
    entry = {f"BlockMask build causal n={n} ms (median of 20)": 1e3 * sorted(times)[10]}
    try:
        for length in range(1000, 1101, 25):
            qq, kk, vv = rand(length)
            entry[f"flex causal fwd n={length} s (first includes the compile)"] = once(
                fwd("flex", qq, kk, vv, Causal()))
    except RuntimeError as exc:
        entry["flex error"] = str(exc)[:300]
    entry["recompiles over lengths 1000..1100 (5 lengths)"] = counters["stats"]["unique_graphs"] - before
    entry["compile seconds (recorded by the backend)"] = flex._STATE["compile_seconds"].get("cpu")
    report("flex", entry)


MEMORY_CASES = ("native-window-train", "sdpa-window-train", "native-doc-train", "sdpa-doc-train", "native-causal-train",
                "sdpa-causal-train")


def one_case(name: str, quick: bool) -> None:
    """Run one case once in this (fresh) process and print its peak RSS growth in MiB."""
    s, m = sizes(quick), masks(sizes(quick))
    backend, kind, _ = name.split("-")
    # The window case at the causal length (n=8192 in the full run): SDPA's fwd+bwd with a
    # materialized 16k x 16k mask already takes most of a minute in the timed figure.
    n = {"window": s["causal"], "doc": s["doc"][0] * s["doc"][1], "causal": s["causal"]}[kind]
    q, k, v = rand(n, grad=True)
    mask = {"window": m["window"], "doc": m["doc"], "causal": Causal()}[kind]
    if backend == "sdpa":
        kw = dict(is_causal=True) if kind == "causal" else dict(attn_mask=mask.materialize(n, n))
        fn = sdpa_train(q, k, v, **kw)
    else:
        fn = train(backend, q, k, v, mask)
        from attnkit.backends import native

        native.load_extension()  # loading the library is not the case's memory
    # The high-water mark after the call minus the resident size before it (not the earlier
    # high-water mark, which importing torch may have set above this case's own peak).
    with open("/proc/self/statm") as f:
        before_kib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    fn()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"case": name, "n": n, "peak_mib": (peak_kib - before_kib) / 1024}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--no-flex", action="store_true", help="skip the figures that compile Flex")
    parser.add_argument("--only", help=f"comma-separated sections among {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory cases (fresh processes)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-run-time", type=float, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one memory case in a fresh process
    args = parser.parse_args()
    if args.one:
        one_case(args.one, args.quick)
        return 0
    if args.min_run_time is None:
        args.min_run_time = 0.2 if args.quick else 1.0
    if attnkit.get_backend("native").not_supported_reasons(attnkit.inputs.AttentionInputs.create(*rand(4))):
        print("native backend unavailable:", attnkit.explain(*rand(4), backend="native").reasons["native"])
        return 1
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    from attnkit.backends import flex

    with flex.allow_cpu():  # compiled Flex on CPU is opt-in
        figures = run_figures(args)
    results = {"load_average_start": os.getloadavg(), "threads": torch.get_num_threads(), "quick": args.quick,
               "shape": {"B": B, "H": H, "D": D}, "figures": figures, "peak_memory": []}
    for case in () if args.no_memory or args.only else MEMORY_CASES:
        cmd = [sys.executable, __file__, "--one", case] + (["--quick"] if args.quick else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None
        results["peak_memory"].append(json.loads(line) if line else {"case": case, "error": done.stderr.strip()[-300:]})
        print("peak memory:", results["peak_memory"][-1], flush=True)
    results["load_average_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fused.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"load average {os.getloadavg()}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
