"""Score modifiers and sinks: time and memory against the materialized alternatives.

    python benchmarks/bench_score_mods.py --section alibi     # ALiBi, causal (about 3 minutes on 2 cores)
    python benchmarks/bench_score_mods.py --section softcap   # soft-cap, causal (about 3 minutes)
    python benchmarks/bench_score_mods.py --section sinks     # sinks + sliding window (about 2 minutes)
    python benchmarks/bench_score_mods.py --section gemma     # Gemma-2-shaped vs HF eager
    python benchmarks/bench_score_mods.py --section generate  # gpt-oss-shaped generate() vs HF eager
    python benchmarks/bench_score_mods.py --quick             # every section at small sizes (smoke run)

Shapes B=1, H=8, D=64; every figure is fwd+bwd, timed interleaved in one process (median of
``--repeats``), the backend ``auto`` picks (printed) against SDPA with what it needs materialized:

* ``alibi``: ``ALiBi.geometric(8)`` + ``Causal()`` at ``--n`` (4096) vs SDPA with the ALiBi bias and
  the causal mask as one float ``attn_mask`` (built once, outside the timing); then at ``--n-large``
  (16384) each method alone in a fresh process: its time and peak RSS above the inputs (SDPA's bias
  alone is 8 GiB there; a case past ``--child-timeout`` seconds or out of memory reports the error);
* ``softcap``: ``SoftCap(50)`` + ``Causal()`` likewise (SDPA cannot soft-cap: its figure is SDPA with
  the causal mask materialized as a float ``attn_mask``, the cost a bias-capable kernel pays);
* ``sinks``: gpt-oss's local layers, per-head sinks + ``SlidingWindow(127, 0)`` at ``--n-sinks``
  (8192) vs SDPA with the window mask materialized and the sinks as one extra key column (a zero
  key and value whose float mask entry is the sink logit: exactly gpt-oss's softmax).

Results are printed and written to ``--out`` (default ``bench-results/score_mods.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attnkit
from attnkit import Causal, SlidingWindow
from attnkit.score_mods import ALiBi, SoftCap

H, D = 8, 64
SINK_WINDOW = 128  # gpt-oss's local layers


def qkv(n: int, grad: bool):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, n, D, generator=g).requires_grad_(grad) for _ in range(3)]


def causal_float_mask(n: int, bias: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``bias`` with the causal mask as one float (1, H|1, n, n) tensor: what SDPA needs."""
    pos = torch.arange(n)
    bias = torch.as_tensor(bias, dtype=torch.float32).expand(1, -1, n, n) if torch.is_tensor(bias) else \
        torch.zeros(1, 1, n, n)
    return bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))


def alibi_float_mask(n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return causal_float_mask(n, -ALiBi.geometric(H).slopes.view(1, H, 1, 1) * (pos[:, None] - pos[None, :]).abs())


def sinks_sdpa_inputs(q, k, v, sinks, window: int):
    """gpt-oss attention for SDPA: one extra zero key/value per head whose float-mask entry is the
    sink logit (it joins the normaliser and adds nothing), the window mask as -inf."""
    n = q.shape[2]
    pos = torch.arange(n)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    mask = torch.zeros(1, H, n, n + 1)
    mask[..., :n] = mask[..., :n].masked_fill(~allowed, float("-inf"))
    mask[..., n] = sinks.detach().view(H, 1)
    zero = torch.zeros(1, H, 1, D)
    return lambda: (torch.cat([k, zero], 2), torch.cat([v, zero], 2), mask)


def fwd_bwd(out):
    out.backward(torch.ones_like(out))


def cases(section: str, n: int):
    """name -> setup(prebuilt=True) -> step: ``step()`` runs fwd+bwd once. With ``prebuilt=False``
    the step builds what it materializes itself (the memory figure counts it)."""
    if section in ("alibi", "softcap"):
        mod = ALiBi.geometric(H) if section == "alibi" else SoftCap(50.0)
        build = alibi_float_mask if section == "alibi" else causal_float_mask

        def attnkit_case(prebuilt=True):
            q, k, v = qkv(n, True)
            return lambda: fwd_bwd(attnkit.attention(q, k, v, mask=Causal(), score_mod=mod))

        def sdpa_case(prebuilt=True):
            q, k, v = qkv(n, True)
            if not prebuilt:
                return lambda: fwd_bwd(F.scaled_dot_product_attention(q, k, v, attn_mask=build(n)))
            mask = build(n)
            return lambda: fwd_bwd(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

        return {f"{section}_attnkit": attnkit_case, f"{section}_sdpa_materialized": sdpa_case}
    if section == "sinks":
        sinks = torch.randn(H, generator=torch.Generator().manual_seed(1)).requires_grad_()
        window = SlidingWindow(SINK_WINDOW - 1, 0)

        def attnkit_case(prebuilt=True):
            q, k, v = qkv(n, True)
            return lambda: fwd_bwd(attnkit.attention(q, k, v, mask=window, sinks=sinks))

        def sdpa_case(prebuilt=True):
            q, k, v = qkv(n, True)
            make = sinks_sdpa_inputs(q, k, v, sinks, SINK_WINDOW)
            if not prebuilt:
                return lambda: fwd_bwd(F.scaled_dot_product_attention(q, *make()))
            kx, vx, mask = make()
            return lambda: fwd_bwd(F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask))

        def native_case(prebuilt=True):  # the fused kernel named (auto may pick the banded backend)
            q, k, v = qkv(n, True)
            return lambda: fwd_bwd(attnkit.attention(q, k, v, mask=window, sinks=sinks, backend="native"))

        found = {"sinks_attnkit": attnkit_case, "sinks_sdpa_materialized": sdpa_case}
        if attnkit.get_backend("native").available():
            found["sinks_native"] = native_case
        return found
    if section == "gemma":
        window = 4096 if n >= 8192 else n // 4

        def gemma_attnkit(prebuilt=True):
            q, k, v = qkv(n, True)
            mask, mod = SlidingWindow(window - 1, 0), SoftCap(50.0)
            return lambda: fwd_bwd(attnkit.attention(q, k, v, mask=mask, score_mod=mod))

        def gemma_hf_eager(prebuilt=True):
            q, k, v = qkv(n, True)
            return lambda: fwd_bwd(gemma_eager(q, k, v, window, 50.0))

        return {"gemma_attnkit": gemma_attnkit, "gemma_hf_eager": gemma_hf_eager}
    raise ValueError(section)


def chosen_backend(section: str, n: int) -> str:
    q = torch.randn(1, H, n, D, requires_grad=True)
    kw = {"alibi": dict(mask=Causal(), score_mod=ALiBi.geometric(H)),
          "softcap": dict(mask=Causal(), score_mod=SoftCap(50.0)),
          "sinks": dict(mask=SlidingWindow(SINK_WINDOW - 1, 0), sinks=torch.zeros(H)),
          "gemma": dict(mask=SlidingWindow(n // 4, 0), score_mod=SoftCap(50.0))}[section]
    return attnkit.explain(q, q, q, **kw).chosen


def child(section: str, case: str, n: int) -> None:
    """One case in this (fresh) process: seconds and peak RSS above the inputs over one fwd+bwd."""
    cases(section, 128)[case](prebuilt=False)()  # one-time probes (dispatch, kernel load) left out of the figure
    step = cases(section, n)[case](prebuilt=False)

    def hwm_kib():
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))

    try:  # reset the peak to the current RSS (inputs allocated), so import-time peaks do not count
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pass
    base = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024
    start = time.perf_counter()
    step()
    print(json.dumps({"seconds": time.perf_counter() - start, "above_inputs_mib": (hwm_kib() - base) / 1024}))


def fresh_process(section: str, case: str, n: int, timeout: float) -> dict:
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", case, "--section", section, "--n", str(n)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"past {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"killed (exit {proc.returncode})"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(benchmark.Timer("fn()", globals={"fn": fn},
                                               num_threads=torch.get_num_threads()).timeit(1).mean)
    return {name: statistics.median(t) for name, t in times.items()}


def run_section(section: str, n: int, n_large: int | None, repeats: int, child_timeout: float) -> dict:
    result: dict = {"n": n, "backend": chosen_backend(section, n)}
    times = interleaved({name: setup() for name, setup in cases(section, n).items()}, repeats)
    result["seconds"] = times
    result["attnkit_over_baseline"] = times[f"{section}_attnkit"] / times[next(k for k in times if "_attnkit" not in k)]
    print(f"{section} n={n} ({result['backend']}): " + ", ".join(f"{k} {v:.3f} s" for k, v in times.items())
          + f"; ratio {result['attnkit_over_baseline']:.2f}", flush=True)
    if n_large:
        result["large"] = {"n": n_large, "backend": chosen_backend(section, n_large)}
        for case in list(cases(section, n_large))[:2]:
            result["large"][case] = fresh_process(section, case, n_large, child_timeout)
            print(f"{section} n={n_large} fresh process {case}: {result['large'][case]}", flush=True)
    return result


def gemma_eager(q, k, v, window: int, cap: float):
    """transformers' Gemma-2 eager attention (soft-capping, additive sliding-window mask)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    n = q.shape[2]
    pos = torch.arange(n)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 1, False
    out, _ = eager_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=D**-0.5, softcap=cap)
    return out


def generate_case(new_tokens: int) -> dict:
    import transformers

    from attnkit.interop import register_hf_attention

    register_hf_attention()
    config = transformers.GptOssConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
        max_position_embeddings=1024, layer_types=["sliding_attention", "full_attention"] * 2,
    )
    prompt = torch.randint(1, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    result = {}
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        model = transformers.GptOssForCausalLM(config).eval()
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                torch.nn.init.normal_(module.sinks, std=1.0)
        model.set_attn_implementation(impl)
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm up
            start = time.perf_counter()
            tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                    pad_token_id=0)
            seconds = time.perf_counter() - start
        result[impl] = {"tokens_per_s": new_tokens / seconds, "tokens": tokens[0, 16:].tolist()}
    result["same_tokens"] = result["eager"]["tokens"] == result["attnkit"]["tokens"]
    result["attnkit_over_eager"] = result["attnkit"]["tokens_per_s"] / result["eager"]["tokens_per_s"]
    for impl in ("eager", "attnkit"):
        del result[impl]["tokens"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=["alibi", "softcap", "sinks", "gemma", "generate", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--n", type=int, default=4096, help="alibi/softcap length (gemma: 8192 unless --quick)")
    parser.add_argument("--n-large", type=int, default=16384, help="alibi/softcap fresh-process length (0: skip)")
    parser.add_argument("--n-sinks", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child-timeout", type=float, default=150.0)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench-results/score_mods.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.section, args.child, args.n)
        return
    if args.quick:
        args.n, args.n_large, args.n_sinks, args.repeats, args.tokens = 256, 512, 512, 1, 8
    sections = ["alibi", "softcap", "sinks"] if args.section == "all" else [args.section]
    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": os.getloadavg()}
    for section in sections:
        if section == "generate":
            report["generate"] = generate_case(args.tokens)
            print("generate:", report["generate"], flush=True)
        elif section == "sinks":
            report[section] = run_section(section, args.n_sinks, None, args.repeats, args.child_timeout)
        elif section == "gemma":
            report[section] = run_section(section, args.n if args.quick else 8192, None, args.repeats,
                                          args.child_timeout)
        else:
            report[section] = run_section(section, args.n, args.n_large or None, args.repeats, args.child_timeout)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"saved -> {args.out}")


if __name__ == "__main__":
    main()
