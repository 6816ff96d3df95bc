"""Decode throughput of a GPT-2-small-sized model (12 layers, 768 wide, 12 heads) on CPU.

Measures, interleaved in one run (torch.utils.benchmark, median over rounds):

1. one decode step at context 512 with a static cache vs recomputing the whole prefix
   (baseline: a forward over all 512 tokens, LM head on the last position only) -> tokens/s, ratio;
2. dynamic, int8 static, paged and int8 paged caches vs the static cache at context 512;
3. per-token latency at several contexts with a sliding-window cache (window 256) vs a dynamic
   cache: the sliding-window latency should stay flat;
4. (``--sections mha``) one ``MultiHeadAttention`` decode step over a static cache vs the same layer
   written by hand (fused projection, ``copy_`` into the preallocated buffer, direct
   ``F.scaled_dot_product_attention``, output projection), at 1 and 2 threads (aim: <= 1.1x);
5. (``--sections padded``) a padded batch through ``generate()`` (GPT-2-small shape, random
   weights shared with Hugging Face, 8 prompts of 64..512 tokens left-padded, 128 new tokens,
   greedy) vs HF ``generate()`` on the same weights and mask: tokens/s (aim: >= 1.2x). Needs
   ``transformers``.

Caches are filled with random keys/values of the right shape (the latency does not depend on
their values), so no long prefill is timed. After each timed step the cache is cropped back to the
context (O(1) for static/dynamic); the ring buffer is never cropped (its cost does not depend on
how far it has advanced). The CPU is shared: read the ratios, not the absolute numbers, and repeat.

    python benchmarks/bench_decode.py [--threads 1] [--rounds 3] [--sections decode,mha,padded]
    python benchmarks/bench_decode.py --sections mha,padded --layers 1 --context 32 --new-tokens 2 \
        --prompt-lengths 8,16 --rounds 1          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils import benchmark

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's attnkit

import torch.nn.functional as F

from attnkit.cache import KVCache, StaticLayerCache
from attnkit.nn import GPT, AttentionConfig, MultiHeadAttention, TransformerConfig


def fill(cache: KVCache, context: int, heads: int, head_dim: int) -> None:
    for layer in cache:
        k = torch.randn(1, heads, context, head_dim)
        layer.update(k, torch.randn_like(k))


def mha_section(args) -> dict:
    """One decode step of one attention layer (GPT-2-small widths) over a static cache holding
    ``--context`` tokens: attnkit's layer vs the hand-written layer, interleaved, 1 and 2 threads."""
    torch.manual_seed(0)
    E, H, C = 768, 12, args.context
    D = E // H
    layer = MultiHeadAttention(AttentionConfig(embed_dim=E, num_heads=H)).eval()
    cache = StaticLayerCache(C + 1)
    k = torch.randn(1, H, C, D)
    cache.update(k, torch.randn_like(k))
    kbuf, vbuf = torch.zeros(1, H, C + 1, D), torch.zeros(1, H, C + 1, D)
    kbuf[:, :, :C], vbuf[:, :, :C] = cache.k[:, :, :C], cache.v[:, :, :C]
    x = torch.randn(1, 1, E)
    qkv_proj, out_proj = layer.qkv_proj, layer.out_proj

    def by_hand(x):
        q, k, v = qkv_proj(x).view(1, 1, 3 * H, D).transpose(1, 2).split(H, dim=1)  # (1, H, 1, D) each
        kbuf[:, :, C:C + 1].copy_(k)
        vbuf[:, :, C:C + 1].copy_(v)
        o = F.scaled_dot_product_attention(q, kbuf[:, :, :C + 1], vbuf[:, :, :C + 1])
        return out_proj(o.transpose(1, 2).reshape(1, 1, E))

    with torch.no_grad():  # the two compute the same thing
        ours = layer(x, cache=cache)
        cache.crop(C)
        assert torch.allclose(ours, by_hand(x), atol=1e-5)
    samples: dict[str, list[float]] = {}
    timers = {}
    for threads in (1, 2):
        g = {"layer": layer, "x": x, "c": cache, "n": C, "by_hand": by_hand}
        timers[f"attnkit MHA, {threads} thread(s)"] = benchmark.Timer(
            "layer(x, cache=c); c.crop(n)", globals=g, num_threads=threads)
        timers[f"by hand, {threads} thread(s)"] = benchmark.Timer("by_hand(x)", globals=g, num_threads=threads)
    with torch.no_grad():
        for t in timers.values():
            t.timeit(20)  # warm-up
        for _ in range(args.rounds):
            for name, t in timers.items():
                samples.setdefault(name, []).append(t.timeit(200).median)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\none MHA decode step over a static cache, context {C}, E={E}, H={H}, fp32 ({args.rounds} rounds)")
    print(f"{'threads':>8}{'attnkit us':>12}{'by hand us':>12}{'ratio':>8}")
    result = {}
    for threads in (1, 2):
        a, b = med[f"attnkit MHA, {threads} thread(s)"], med[f"by hand, {threads} thread(s)"]
        print(f"{threads:>8}{a * 1e6:>12.1f}{b * 1e6:>12.1f}{a / b:>7.2f}x")
        result[threads] = {"attnkit_s": a, "by_hand_s": b, "ratio": a / b}
    return {"context": C, "median_s": med, "samples_s": samples, "by_threads": result}


def padded_section(args) -> dict:
    """Greedy ``generate()`` over a left-padded batch vs HF ``generate()`` on the same weights."""
    import transformers
    from bench_hf import hf_vs_attnkit

    from attnkit.generation import generate
    from attnkit.interop import gpt2_from_hf

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=args.layers)).eval()
    ours = gpt2_from_hf(hf).eval()
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    if len(lengths) == 2:  # a range: 8 prompts spread over it
        lengths = [round(lengths[0] + i * (lengths[1] - lengths[0]) / 7) for i in range(8)]
    P, n = max(lengths), args.new_tokens
    ids = torch.zeros(len(lengths), P, dtype=torch.long)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for row, L in enumerate(lengths):  # left padding, as HF expects for generation
        ids[row, P - L:] = torch.randint(1, hf.config.vocab_size, (L,))
        mask[row, P - L:] = 1

    def run_hf():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)

    def run_ours():
        return generate(ours, ids, n, attention_mask=mask, temperature=0.0, cache="static")

    times, same = hf_vs_attnkit(run_hf, lambda: run_ours()[:, -ids.shape[1] - n:], args.rounds)
    tps = {k: len(lengths) * n / statistics.median(v) for k, v in times.items()}
    print(f"\npadded-batch generate(): {len(lengths)} prompts of {lengths} tokens, {n} new tokens each, "
          f"{args.layers} layers ({args.rounds} rounds, {torch.get_num_threads()} thread(s))")
    print(f"  HF generate()      {tps['hf']:8.1f} tokens/s")
    print(f"  attnkit generate() {tps['attnkit']:8.1f} tokens/s  ({tps['attnkit'] / tps['hf']:.2f}x HF)"
          f"  same tokens: {same}")
    return {"lengths": lengths, "new_tokens": n, "tokens_per_s": tps, "ratio": tps["attnkit"] / tps["hf"],
            "same_tokens": bool(same), "runs_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--contexts", default="256,1024,4096", help="contexts for the sliding-window sweep")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", default="bench-results/decode.json")
    parser.add_argument("--sections", default="decode,mha,padded", help="any of decode, mha, padded")
    parser.add_argument("--new-tokens", type=int, default=128, help="padded section: tokens per prompt")
    parser.add_argument("--prompt-lengths", default="64,512",
                        help="padded section: 'lo,hi' (8 prompts spread over it) or 8+ explicit lengths")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    extra = {}
    if "mha" in sections:
        extra["mha"] = mha_section(args)
    if "padded" in sections:
        extra["padded"] = padded_section(args)
    if "decode" not in sections:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **extra}, f, indent=2)
        print(f"\nwrote {args.out}")
        return
    torch.manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    config = TransformerConfig(vocab_size=50257, max_len=max(contexts + [args.context]) + 1024, embed_dim=768,
                               num_layers=args.layers, num_heads=12, activation="gelu_tanh",
                               sliding_window=args.window)
    # Dense GPT (no window) for the static/dynamic/recompute comparison; the windowed twin shares weights.
    dense = GPT(TransformerConfig(**{**config.__dict__, "sliding_window": None})).eval()
    windowed = GPT(config).eval()
    windowed.load_state_dict(dense.state_dict())
    H, D, C = 12, 64, args.context
    token = torch.randint(0, 50257, (1, 1))
    prefix = torch.randint(0, 50257, (1, C))
    caches = {"static": dense.make_cache("static", max_len=C + 1), "dynamic": dense.make_cache("dynamic"),
              "static int8": dense.make_cache("static", max_len=C + 1, quantize="int8"),
              "paged": dense.make_cache("paged", num_blocks=C // 16 + 2),
              "paged int8": dense.make_cache("paged", num_blocks=C // 16 + 2, quantize="int8")}
    for cache in caches.values():
        if hasattr(cache, "add_sequence"):  # a paged cache: one sequence
            cache.select([cache.add_sequence()])
        fill(cache, C, H, D)

    def timer(stmt: str, env: dict) -> benchmark.Timer:
        return benchmark.Timer(stmt=stmt, globals={**env, "torch": torch}, num_threads=args.threads)

    step = "m(t, cache=c, logits_to_keep=1); c.crop(n)"  # one token, then back to the context
    cases = {
        "static cache": timer(step, dict(m=dense, t=token, c=caches["static"], n=C)),
        "dynamic cache": timer(step, dict(m=dense, t=token, c=caches["dynamic"], n=C)),
        "static int8 cache": timer(step, dict(m=dense, t=token, c=caches["static int8"], n=C)),
        "paged cache": timer(step, dict(m=dense, t=token, c=caches["paged"], n=C)),
        "paged int8 cache": timer(step, dict(m=dense, t=token, c=caches["paged int8"], n=C)),
        "recompute prefix": timer("m(x, logits_to_keep=1)", dict(m=dense, x=prefix)),
    }
    sweep = {}
    for ctx in contexts:
        sw = windowed.make_cache("sliding_window")
        fill(sw, ctx, H, D)
        dyn = windowed.make_cache("dynamic")
        fill(dyn, ctx, H, D)
        sweep[ctx] = {
            "sliding_window": timer("m(t, cache=c, logits_to_keep=1)", dict(m=windowed, t=token, c=sw)),
            "dynamic": timer(step, dict(m=windowed, t=token, c=dyn, n=ctx)),
        }
    samples: dict[str, list[float]] = {}
    start = time.time()
    with torch.no_grad():
        for case in list(cases.values()) + [t for d in sweep.values() for t in d.values()]:
            case.timeit(1)  # warm-up
        for _ in range(args.rounds):  # interleaved rounds: load changes hit every case alike
            for name, t in cases.items():
                number = 1 if name == "recompute prefix" else 5
                samples.setdefault(name, []).append(t.timeit(number).median)
            for ctx, d in sweep.items():
                for kind, t in d.items():
                    samples.setdefault(f"{kind}@{ctx}", []).append(t.timeit(5).median)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"GPT-2-small-sized decode ({args.layers} layers, 768 wide, 12 heads), fp32, CPU, "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds, {time.time() - start:.0f} s, "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(f"\ncontext {C}: one new token")
    print(f"{'method':<18}{'ms/token':>10}{'tokens/s':>10}{'vs static':>11}")
    for name in cases:
        print(f"{name:<18}{med[name] * 1e3:>10.1f}{1 / med[name]:>10.1f}{med[name] / med['static cache']:>10.2f}x")
    print(f"\nstatic cache speed-up over recomputing the prefix: {med['recompute prefix'] / med['static cache']:.1f}x")
    print(f"dynamic / static time per token: {med['dynamic cache'] / med['static cache']:.2f}")
    print(f"\nper-token latency, window {args.window} (ms)")
    print(f"{'context':>8}{'sliding':>10}{'dynamic':>10}")
    for ctx in contexts:
        print(f"{ctx:>8}{med[f'sliding_window@{ctx}'] * 1e3:>10.1f}{med[f'dynamic@{ctx}'] * 1e3:>10.1f}")
    first, last = contexts[0], contexts[-1]
    growth = {kind: med[f"{kind}@{last}"] / med[f"{kind}@{first}"] for kind in ("sliding_window", "dynamic")}
    print(f"latency ratio context {last} / {first}: sliding {growth['sliding_window']:.2f}, "
          f"dynamic {growth['dynamic']:.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "median_s": med, "samples_s": samples, **extra}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
