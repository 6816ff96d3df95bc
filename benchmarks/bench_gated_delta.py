"""Gated delta rule on CPU: attnkit's chunked form vs transformers' torch path and causal SDPA.

Measured in one process, interleaved (median of ``--rounds`` rounds), B=1, H=8, D=128, fp32:

1. forward and forward+backward at T=4096: ``attnkit.gated_linear_attention`` vs transformers'
   ``torch_chunk_gated_delta_rule`` on the same inputs (its gradients by autograd) -> speed-up;
2. forward+backward vs causal softmax SDPA on the same q, k, v shapes at each ``--lengths``
   (4096 by default; add 16384,65536 for the long figures) -> time ratio (SDPA skipped, with a
   note, above ``--sdpa-max``);
3. one decode step (one token, state cached) vs one SDPA decode step over ``--decode-context`` keys;
4. peak memory of forward+backward at each length, each in a fresh subprocess: the resident
   high-water mark (``/proc/self/status`` VmHWM, reset just before the run) minus the resident size
   with the inputs built (also with ``recompute_segment=1024``; SDPA up to ``--sdpa-max``);
5. error vs a float64 recurrence (fp32 relative; bf16 vs a bf16 recurrence), at ``--check-length``;
6. ``kernel``: the native gated kernel (``attnkit build``) at each ``--kernel-lengths`` (4096 and
   16384): forward and forward+backward of ``gated_linear_attention`` with the kernel, with the
   PyTorch chunked path (``native=False``) and transformers' ``torch_chunk_gated_delta_rule``, and a
   2048x2048 fp32 matmul, interleaved round by round with ``torch.utils.benchmark`` (median per
   case): the kernel's matmul FLOP rate as a share of the matmul's fastest round in the same run;
   and the raw decode-step op vs SDPA decode at ``--decode-context`` keys. ``--kernel-dtype bf16`` runs
   the same with bfloat16 inputs on every side (the peak then a bfloat16 matmul).

``--quick`` runs every section at toy sizes (a smoke run, seconds).

The CPU may be shared: read the ratios and repeat. Nothing here asserts a timing.

    python benchmarks/bench_gated_delta.py [--threads 2] [--rounds 3] [--lengths 4096,16384,65536]
        [--out bench-results/gated_delta.json]
    python benchmarks/bench_gated_delta.py --length 256 --lengths 256 --heads 2 --dim 32   # smoke run
    python benchmarks/bench_gated_delta.py --sections sdpa,memory --lengths 4096,16384,65536  # long figures
    python benchmarks/bench_gated_delta.py --sections kernel --rounds 5   # the native kernel's figures
    python benchmarks/bench_gated_delta.py --quick                         # smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's attnkit

import attnkit  # noqa: E402
from attnkit.backends.kernelized.gated import recurrent_rule  # noqa: E402


def inputs(T: int, H: int, D: int, *, dtype=torch.float32, grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, T, D, generator=gen)
    k = F.normalize(torch.randn(1, H, T, D, generator=gen), dim=-1)
    v = torch.randn(1, H, T, D, generator=gen)
    g = -F.softplus(torch.randn(1, H, T, generator=gen))  # log-decays in (-inf, 0)
    beta = torch.rand(1, H, T, generator=gen)
    xs = [x.to(dtype) for x in (q, k, v, g, beta)]
    return [x.requires_grad_() for x in xs] if grad else xs


def ours(q, k, v, g, beta):
    return attnkit.gated_linear_attention(q, k, v, g, beta)


def ours_recompute(q, k, v, g, beta):
    return attnkit.gated_linear_attention(q, k, v, g, beta, recompute_segment=1024)


def transformers_rule():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    def run(q, k, v, g, beta):  # its layout is (B, T, H, D); its q is scaled inside, as ours
        t = [x.transpose(1, 2) for x in (q, k, v, g, beta)]
        return torch_chunk_gated_delta_rule(*t[:3], g=t[3], beta=t[4])[0].transpose(1, 2)
    return run


def ours_pytorch(q, k, v, g, beta):
    return attnkit.gated_linear_attention(q, k, v, g, beta, native=False)


def ours_native(q, k, v, g, beta):
    return attnkit.gated_linear_attention(q, k, v, g, beta, native=True)


def kernel_flops(T: int, H: int, D: int, C: int = 64) -> tuple[float, float]:
    """The chunked kernel's matmul FLOPs (forward, backward) for B=1: per chunk of ``C`` tokens,
    forward ``10 C² D + 6 C D²`` (K Kᵀ, Q Kᵀ, u, w, A v_new; w S, K_dᵀ v_new, Q_g S) and backward
    ``26 C² D + 12 C D²`` (the forward's four intra-chunk products recomputed, then 9 of each kind)."""
    chunks = H * -(-T // C)
    return chunks * (10 * C * C * D + 6 * C * D * D), chunks * (26 * C * C * D + 12 * C * D * D)


def kernel_section(lengths: list[int], H: int, D: int, rounds: int, context: int, matmul_n: int,
                   dtype: torch.dtype = torch.float32) -> dict:
    """Section 6 (see the module docstring)."""
    from torch.utils import benchmark

    from attnkit.backends.kernelized.gated import kernel

    if kernel.extension_reason() is not None:
        print(f"kernel section skipped: {kernel.extension_reason()}")
        return {"skipped": kernel.extension_reason()}
    out = {}
    a = torch.randn(matmul_n, matmul_n).to(dtype)  # the peak of the inputs' dtype
    trans = transformers_rule()
    for L in lengths:
        cases = {"kernel": ours_native, "pytorch": ours_pytorch, "transformers": trans}
        row = {}
        for backward in (False, True):
            key = "fwd_bwd" if backward else "fwd"
            x = inputs(L, H, D, dtype=dtype, grad=backward)

            def run(fn, x=x, backward=backward):
                with torch.set_grad_enabled(backward):
                    o = fn(*x)
                    if backward:
                        for t in x:
                            t.grad = None
                        o.sum().backward()

            timers = {name: benchmark.Timer("run(fn)", globals={"run": run, "fn": fn}) for name, fn in cases.items()}
            timers["matmul"] = benchmark.Timer("a @ a", globals={"a": a})
            for t in timers.values():  # warm-up
                t.timeit(1)
            times = {name: [] for name in timers}
            for _ in range(rounds):  # interleaved: every case once per round (the matmul 3 times)
                for name, t in timers.items():
                    times[name].append(t.timeit(3 if name == "matmul" else 1).median)
            med = {name: statistics.median(ts) for name, ts in times.items() if name != "matmul"}
            peak = 2 * matmul_n ** 3 / min(times["matmul"])  # the fastest round: the rate this run reached
            fwd, bwd = kernel_flops(L, H, D)
            flops = fwd + (bwd if backward else 0)
            row[key] = {**{f"{n}_s": t for n, t in med.items()}, "matmul_peak_gflops": peak / 1e9,
                        "kernel_gflops": flops / med["kernel"] / 1e9,
                        "kernel_share_of_peak": flops / med["kernel"] / peak,
                        "speedup_vs_transformers": med["transformers"] / med["kernel"],
                        "speedup_vs_pytorch": med["pytorch"] / med["kernel"]}
            r = row[key]
            name = str(dtype).removeprefix("torch.")
            print(f"kernel {name} T={L} {key}: kernel {med['kernel'] * 1e3:.1f} ms ({r['kernel_gflops']:.0f} GFLOP/s, "
                  f"{r['kernel_share_of_peak']:.0%} of the {r['matmul_peak_gflops']:.0f} GFLOP/s matmul), "
                  f"pytorch {med['pytorch'] * 1e3:.1f} ms, transformers {med['transformers'] * 1e3:.1f} ms "
                  f"({r['speedup_vs_transformers']:.1f}x)")
        out[L] = row
    # the decode step: the op alone (state in place) and through GatedLinearState, vs SDPA decode
    q1, k1, v1, g1, b1 = inputs(1, H, D, seed=1)
    qs = q1 * D ** -0.5
    S = torch.randn(1, H, D, D) * 0.01
    kc, vc = torch.randn(1, H, context + 1, D), torch.randn(1, H, context + 1, D)
    state = attnkit.GatedLinearState()
    state.state = S.clone()
    timers = {"step_op": benchmark.Timer("step(q, k, v, g, b, S)", globals={
                  "step": kernel.step, "q": qs, "k": k1, "v": v1, "g": g1, "b": b1, "S": S}),
              "step_layer": benchmark.Timer("state.step(q, k, v, g=g, beta=b)", globals={
                  "state": state, "q": q1, "k": k1, "v": v1, "g": g1, "b": b1}),
              "sdpa": benchmark.Timer("sdpa(q, k, v)", globals={
                  "sdpa": F.scaled_dot_product_attention, "q": q1, "k": kc, "v": vc})}
    with torch.no_grad():
        med = {name: t.blocked_autorange(min_run_time=0.2).median for name, t in timers.items()}
    out["decode"] = {**{f"{n}_s": t for n, t in med.items()}, "context": context,
                     "op_ratio_vs_sdpa": med["step_op"] / med["sdpa"],
                     "layer_ratio_vs_sdpa": med["step_layer"] / med["sdpa"]}
    print(f"decode step (H={H}, D={D}): kernel op {med['step_op'] * 1e6:.0f} us, through GatedLinearState "
          f"{med['step_layer'] * 1e6:.0f} us, SDPA decode at Tk={context} {med['sdpa'] * 1e6:.0f} us "
          f"(op {out['decode']['op_ratio_vs_sdpa']:.2f}x, layer {out['decode']['layer_ratio_vs_sdpa']:.2f}x)")
    return out


def sdpa(q, k, v, g, beta):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def timed(fn, args, backward: bool) -> float:
    start = time.perf_counter()
    out = fn(*args)
    if backward:
        out.sum().backward()
    return time.perf_counter() - start


def median_interleaved(cases: dict, args_of, backward: bool, rounds: int) -> dict:
    times = {name: [] for name in cases}
    for name, fn in cases.items():  # warm-up, untimed (first-call allocations, lazy imports)
        with torch.set_grad_enabled(backward):
            timed(fn, args_of(), backward)
    for _ in range(rounds):
        for name, fn in cases.items():
            args = args_of()
            if backward:
                for x in args:
                    x.grad = None
            with torch.set_grad_enabled(backward):
                times[name].append(timed(fn, args, backward))
    return {name: statistics.median(ts) for name, ts in times.items()}


def decode_step(H: int, D: int, context: int, rounds: int) -> dict:
    state = attnkit.GatedLinearState()
    q, k, v, g, beta = inputs(context, H, D)
    state.step(q, k, v, g=g, beta=beta)
    kc, vc = torch.randn(1, H, context, D), torch.randn(1, H, context, D)
    q1, k1, v1, g1, b1 = inputs(1, H, D, seed=1)
    ours_t, sdpa_t = [], []
    with torch.no_grad():
        for _ in range(rounds * 20):
            saved = state.state
            start = time.perf_counter()
            state.step(q1, k1, v1, g=g1, beta=b1)
            ours_t.append(time.perf_counter() - start)
            state.state = saved
            start = time.perf_counter()
            F.scaled_dot_product_attention(q1, torch.cat([kc, k1], 2), torch.cat([vc, v1], 2))
            sdpa_t.append(time.perf_counter() - start)
    return {"gated_delta_step_s": statistics.median(ours_t), "sdpa_step_s": statistics.median(sdpa_t),
            "ratio": statistics.median(ours_t) / statistics.median(sdpa_t)}


def errors(T: int, H: int, D: int) -> dict:
    q, k, v, g, beta = inputs(T, H, D)
    d = [x.double() for x in (q, k, v, g, beta)]
    ref, _ = recurrent_rule(d[0] * D**-0.5, *d[1:])
    fp32 = ours(q, k, v, g, beta)
    bf = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    bf16 = ours(*bf)
    naive_bf16, _ = recurrent_rule(bf[0] * D**-0.5, *bf[1:])
    rel = lambda x: ((x.double() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    return {"fp32_rel": rel(fp32), "bf16_rel": rel(bf16), "bf16_naive_recurrence_rel": rel(naive_bf16)}


def _proc_status(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_peak(T: int, H: int, D: int, which: str) -> None:
    """In this (fresh) process: build the inputs, reset the resident high-water mark, run one
    forward+backward, print the peak resident MiB above the resident size before the run."""
    x = inputs(T, H, D, grad=True)
    before = _proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")
    fn = {"gated_delta": ours, "gated_delta_recompute": ours_recompute, "sdpa": sdpa}[which]
    fn(*x).sum().backward()
    print(json.dumps({"peak_growth_mib": _proc_status("VmHWM") - before, "inputs_mib": before}))


def peak_memory(T: int, H: int, D: int, which: str) -> float:
    """Peak resident memory growth (MiB) of one forward+backward, measured in a fresh interpreter
    (``/proc/self/status`` VmHWM after a reset, minus VmRSS before the run)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--measure-peak", f"{T},{H},{D},{which}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"peak-memory subprocess failed ({which}, T={T}): {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--length", type=int, default=4096, help="T for the transformers comparison")
    parser.add_argument("--lengths", default="4096", help="T list for the SDPA ratio and peak memory")
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--check-length", type=int, default=512)
    parser.add_argument("--sdpa-max", type=int, default=16384,
                        help="longest T at which causal SDPA fwd+bwd is timed (its CPU backward is slow)")
    parser.add_argument("--chunk-sizes", default="", help="also time attnkit fwd+bwd at these chunk sizes")
    parser.add_argument("--sections", default="transformers,sdpa,memory,decode,error,kernel",
                        help="comma list of sections to run")
    parser.add_argument("--kernel-lengths", default="4096,16384", help="T list for the native kernel section")
    parser.add_argument("--kernel-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the kernel section's input dtype (the same inputs on every side; the peak is a "
                             "matmul in this dtype)")
    parser.add_argument("--quick", action="store_true", help="every section at toy sizes (a smoke run)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--measure-peak", default=None, help=argparse.SUPPRESS)  # T,H,D,which: internal
    args = parser.parse_args()
    if args.measure_peak:
        T, H, D, which = args.measure_peak.split(",")
        torch.set_num_threads(args.threads)
        measure_peak(int(T), int(H), int(D), which)
        return
    matmul_n = 2048
    if args.quick:
        args.rounds, args.heads, args.dim, args.length, args.lengths = 1, 2, 32, 256, "256"
        args.kernel_lengths, args.decode_context, args.check_length, matmul_n = "256", 64, 64, 256
    sections = set(args.sections.split(","))
    torch.set_num_threads(args.threads)
    H, D, T = args.heads, args.dim, args.length
    result = {"config": vars(args)}
    lengths = [int(x) for x in args.lengths.split(",")]
    if "transformers" in sections:
        cases = {"attnkit": ours, "transformers": transformers_rule()}
        for backward in (False, True):
            key = "fwd_bwd" if backward else "fwd"
            times = median_interleaved(cases, functools.partial(inputs, T, H, D, grad=backward), backward, args.rounds)
            result[f"vs_transformers_{key}"] = {**times, "speedup": times["transformers"] / times["attnkit"]}
            print(f"T={T} {key}: attnkit {times['attnkit'] * 1e3:.1f} ms, transformers "
                  f"{times['transformers'] * 1e3:.1f} ms, speed-up {times['transformers'] / times['attnkit']:.1f}x")
    if args.chunk_sizes:
        sweep = {f"chunk {c}": functools.partial(attnkit.gated_linear_attention, chunk_size=int(c))
                 for c in args.chunk_sizes.split(",")}
        times = median_interleaved(sweep, functools.partial(inputs, T, H, D, grad=True), True, args.rounds)
        result["chunk_sweep_fwd_bwd"] = times
        print(f"T={T} fwd+bwd by chunk size: " + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in times.items()))
    if "sdpa" in sections:
        result["vs_sdpa_fwd_bwd"] = {}
        for L in lengths:
            cases = {"attnkit": ours} if L > args.sdpa_max else {"attnkit": ours, "sdpa": sdpa}
            times = median_interleaved(cases, functools.partial(inputs, L, H, D, grad=True), True, args.rounds)
            if "sdpa" in times:
                times["ratio"] = times["attnkit"] / times["sdpa"]
                note = f"SDPA {times['sdpa'] * 1e3:.1f} ms, ratio {times['ratio']:.2f}"
            else:
                note = f"SDPA not timed above --sdpa-max={args.sdpa_max}"
            result["vs_sdpa_fwd_bwd"][L] = times
            print(f"T={L} fwd+bwd: attnkit {times['attnkit'] * 1e3:.1f} ms, {note}")
    if "memory" in sections:
        result["peak_growth_mib"] = {}
        for L in lengths:
            names = ("gated_delta", "gated_delta_recompute") + (("sdpa",) if L <= args.sdpa_max else ())
            mem = {name: peak_memory(L, H, D, name) for name in names}
            result["peak_growth_mib"][L] = mem
            print(f"T={L} fwd+bwd peak memory above the inputs (fresh process): "
                  + ", ".join(f"{n} {m:.0f} MiB" for n, m in mem.items()))
    if "decode" in sections:
        result["decode"] = decode_step(H, D, args.decode_context, args.rounds)
        print(f"decode step: {result['decode']['gated_delta_step_s'] * 1e6:.0f} us vs SDPA at "
              f"Tk={args.decode_context} {result['decode']['sdpa_step_s'] * 1e6:.0f} us, "
              f"ratio {result['decode']['ratio']:.2f}")
    if "error" in sections:
        result["error"] = errors(args.check_length, H, D)
        print("error vs float64 recurrence:", {k: f"{v:.2e}" for k, v in result["error"].items()})
    if "kernel" in sections:
        result["kernel"] = kernel_section([int(x) for x in args.kernel_lengths.split(",")], H, D, args.rounds,
                                          args.decode_context, matmul_n,
                                          {"fp32": torch.float32, "bf16": torch.bfloat16}[args.kernel_dtype])
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
