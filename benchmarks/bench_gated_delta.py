"""Gated delta rule on CPU: attnkit's chunked form vs transformers' torch path and causal SDPA.

Measured in one process, interleaved (median of ``--rounds`` rounds), B=1, H=8, D=128, fp32:

1. forward and forward+backward at T=4096: ``attnkit.gated_linear_attention`` vs transformers'
   ``torch_chunk_gated_delta_rule`` on the same inputs (its gradients by autograd) -> speed-up;
2. forward+backward vs causal softmax SDPA on the same q, k, v shapes at each ``--lengths``
   (4096 by default; add 16384,65536 for the long figures) -> time ratio;
3. one decode step (one token, state cached) vs one SDPA decode step over ``--decode-context`` keys;
4. peak memory (max RSS growth) of forward+backward at each length, each in a fresh subprocess
   (also with ``recompute_segment=1024``);
5. error vs a float64 recurrence (fp32 relative; bf16 vs a bf16 recurrence), at ``--check-length``.

The CPU may be shared: read the ratios and repeat. Nothing here asserts a timing.

    python benchmarks/bench_gated_delta.py [--threads 2] [--rounds 3] [--lengths 4096,16384,65536]
        [--out bench-results/gated_delta.json]
    python benchmarks/bench_gated_delta.py --length 256 --lengths 256 --heads 2 --dim 32   # smoke run
"""

from __future__ import annotations

import argparse
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


def peak_memory(T: int, H: int, D: int, which: str) -> float:
    """Max RSS growth (MiB) of one forward+backward, measured in a fresh interpreter."""
    code = (f"import sys, resource; sys.argv=['x']; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r});"
            f"import bench_gated_delta as b; import torch; x = b.inputs({T}, {H}, {D}, grad=True);"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
            f"fn = {{'gated_delta': b.ours, 'gated_delta_recompute': b.ours_recompute, 'sdpa': b.sdpa}}[{which!r}];"
            "fn(*x).sum().backward();"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


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
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    H, D, T = args.heads, args.dim, args.length
    result = {"config": vars(args)}
    cases = {"attnkit": ours, "transformers": transformers_rule()}
    for backward in (False, True):
        key = "fwd_bwd" if backward else "fwd"
        times = median_interleaved(cases, lambda: inputs(T, H, D, grad=backward), backward, args.rounds)
        result[f"vs_transformers_{key}"] = {**times, "speedup": times["transformers"] / times["attnkit"]}
        print(f"T={T} {key}: attnkit {times['attnkit'] * 1e3:.1f} ms, transformers "
              f"{times['transformers'] * 1e3:.1f} ms, speed-up {times['transformers'] / times['attnkit']:.1f}x")
    result["vs_sdpa_fwd_bwd"] = {}
    for L in (int(x) for x in args.lengths.split(",")):
        times = median_interleaved({"attnkit": ours, "sdpa": sdpa}, lambda: inputs(L, H, D, grad=True), True,
                                   args.rounds)
        mem = {name: peak_memory(L, H, D, name) for name in ("gated_delta", "gated_delta_recompute", "sdpa")}
        result["vs_sdpa_fwd_bwd"][L] = {**times, "ratio": times["attnkit"] / times["sdpa"], "peak_mib": mem}
        print(f"T={L} fwd+bwd: attnkit {times['attnkit'] * 1e3:.1f} ms, SDPA {times['sdpa'] * 1e3:.1f} ms, "
              f"ratio {times['attnkit'] / times['sdpa']:.2f}; peak MiB attnkit {mem['gated_delta']:.0f} "
              f"(recompute_segment=1024: {mem['gated_delta_recompute']:.0f}), SDPA {mem['sdpa']:.0f}")
    result["decode"] = decode_step(H, D, args.decode_context, args.rounds)
    print(f"decode step: {result['decode']['gated_delta_step_s'] * 1e6:.0f} us vs SDPA at Tk={args.decode_context} "
          f"{result['decode']['sdpa_step_s'] * 1e6:.0f} us, ratio {result['decode']['ratio']:.2f}")
    result["error"] = errors(args.check_length, H, D)
    print("error vs float64 recurrence:", {k: f"{v:.2e}" for k, v in result["error"].items()})
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
