"""Serving many prompts: continuous batching over a paged cache vs one at a time vs HF generate().

A GPT-2-small-shaped model (12 layers, 768 wide, 12 heads, vocab 50257; random weights, shared by
attnkit and Hugging Face through ``gpt2_from_hf``) serves ``--num-seqs`` prompts of random lengths
in ``--min-len .. --max-len`` (seeded), generating ``--new-tokens`` tokens each, greedy, no stop
token. Modes, each in a fresh process (its wall time and peak RSS; run one mode per command when
the machine is shared):

* ``continuous``       ``generate(model, prompts, cache="paged")``: at most ``--max-batch-size``
                       sequences run at once; prompts join as rows free up, finished ones leave;
* ``continuous-int8``  the same with int8 pages (``quantize_cache="int8"``);
* ``one-at-a-time``    ``generate(model, p[None], cache="static")`` per prompt — the baseline;
* ``hf``               HF ``GPT2LMHeadModel.generate()`` on left-padded batches of ``--hf-batch``.

Reported: tokens/s (new tokens / wall time, prefill included), the ratios to ``one-at-a-time``
and to ``hf``, the share of sequences whose tokens equal the baseline's (greedy: they should all
match up to float ties), per-token latency p50/p99 of the streaming modes (the gaps between a
sequence's consecutive tokens, through ``on_token``; prompts are prefilled ``--prefill-chunk``
tokens at a time between decode steps), peak RSS, and the KV-cache bytes per sequence for the
static (padded to the longest), paged and paged int8 layouts at these lengths.

    python benchmarks/bench_serving.py --modes continuous,continuous-int8   # about 2-3 minutes
    python benchmarks/bench_serving.py --modes one-at-a-time                # about 3-4 minutes
    python benchmarks/bench_serving.py --modes hf                           # about 3-4 minutes
    python benchmarks/bench_serving.py --layers 2 --num-seqs 4 --max-len 64 --new-tokens 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's attnkit

MODES = ("continuous", "continuous-int8", "one-at-a-time", "hf")


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnkit.interop import gpt2_from_hf

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, vocab_size=50257,
                        n_positions=args.max_len + args.new_tokens)
    hf = GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.num_seqs,), generator=g).tolist()
    prompts = [torch.randint(0, 50257, (n,), generator=g) for n in lengths]
    return hf, gpt2_from_hf(hf), prompts


@torch.no_grad()
def run_mode(mode: str, args) -> dict:
    from attnkit.generation import generate

    hf, model, prompts = build(args)
    start = time.perf_counter()
    stamps: dict[int, list[float]] = {}  # per sequence: the time each token was chosen
    if mode.startswith("continuous"):
        outs = generate(model, prompts, args.new_tokens, cache="paged", max_batch_size=args.max_batch_size,
                        block_size=args.block_size, quantize_cache="int8" if mode.endswith("int8") else None,
                        prefill_chunk=args.prefill_chunk,
                        on_token=lambda i, t: stamps.setdefault(i, []).append(time.perf_counter()))
        new = [o[len(p):] for o, p in zip(outs, prompts)]
    elif mode == "one-at-a-time":
        new = [generate(model, p[None], args.new_tokens, cache="static")[0, len(p):] for p in prompts]
    else:
        new = []
        for i in range(0, len(prompts), args.hf_batch):
            chunk = prompts[i:i + args.hf_batch]
            P = max(len(p) for p in chunk)
            ids = torch.zeros(len(chunk), P, dtype=torch.long)
            mask = torch.zeros(len(chunk), P, dtype=torch.long)
            for j, p in enumerate(chunk):  # left padding, as HF recommends for decoder-only generation
                ids[j, P - len(p):], mask[j, P - len(p):] = p, 1
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            new += list(out[:, P:])
    seconds = time.perf_counter() - start
    # per-token latency: the gaps between a sequence's consecutive tokens (streaming modes only)
    gaps = sorted(b - a for ts in stamps.values() for a, b in zip(ts, ts[1:]))
    latency = {f"p{q}_ms": 1e3 * gaps[min(len(gaps) - 1, int(q / 100 * len(gaps)))] for q in (50, 99)} if gaps else {}
    first = sorted(ts[0] - start for ts in stamps.values())
    if first:
        latency["first_token_p50_s"] = first[len(first) // 2]
    return dict(mode=mode, seconds=seconds, new_tokens=sum(len(t) for t in new), latency=latency,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                tokens=[t.tolist() for t in new])


def cache_bytes_per_sequence(lengths: list[int], args) -> dict:
    """KV bytes per sequence: static (every row padded to the longest), paged (whole blocks), int8."""
    per_token_fp32 = args.layers * 2 * 768 * 4  # K and V, all heads, float32
    per_token_int8 = args.layers * 2 * 12 * (64 + 4)  # int8 values + a float32 scale per head
    longest = max(lengths) + args.new_tokens
    blocks = [-(-(n + args.new_tokens) // args.block_size) * args.block_size for n in lengths]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return dict(static=longest * per_token_fp32, paged=mean(blocks) * per_token_fp32,
                paged_int8=mean(blocks) * per_token_int8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens prefilled between decode steps")
    parser.add_argument("--hf-batch", type=int, default=8, help="prompts per HF generate() call (padded batch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="bench-results/serving.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:  # a fresh process per mode: its own peak memory
        print(json.dumps(run_mode(args.one, args)))
        return
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: unknown mode {m!r}; expected some of {', '.join(MODES)}")
    print(f"threads={args.threads} load average={os.getloadavg()} seqs={args.num_seqs} lengths "
          f"{args.min_len}..{args.max_len} new={args.new_tokens} layers={args.layers}")
    settings = {k: v for k, v in vars(args).items() if k not in ("one", "out", "modes")}
    forwarded = [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    results = {}
    for mode in modes:
        cmd = [sys.executable, __file__, *forwarded, "--one", mode]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    previous = {}
    if os.path.exists(args.out):  # modes measured by earlier commands with the same settings
        with open(args.out) as f:
            saved = json.load(f)
        if saved.get("settings") == settings:
            previous = saved.get("modes", {})
    results = {**previous, **results}
    base, hf = results.get("one-at-a-time"), results.get("hf")
    print(f"{'mode':<16} {'seconds':>8} {'tokens/s':>9} {'vs one-at-a-time':>17} {'vs hf':>7} {'same tokens':>12} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'peak RSS':>9}")
    for mode, r in results.items():
        r["tokens_per_s"] = r["new_tokens"] / r["seconds"]
        ratio = same = vs_hf = ""
        if base is not None:
            r["speedup_vs_one_at_a_time"] = r["tokens_per_s"] / (base["new_tokens"] / base["seconds"])
            r["same_tokens_fraction"] = sum(a == b for a, b in zip(r["tokens"], base["tokens"])) / len(base["tokens"])
            ratio, same = f"{r['speedup_vs_one_at_a_time']:.2f}x", f"{100 * r['same_tokens_fraction']:.0f}%"
        if hf is not None:
            r["speedup_vs_hf"] = r["tokens_per_s"] / (hf["new_tokens"] / hf["seconds"])
            vs_hf = f"{r['speedup_vs_hf']:.2f}x"
        lat = r.get("latency", {})
        p50, p99 = (f"{lat[k]:.1f}" if k in lat else "" for k in ("p50_ms", "p99_ms"))
        print(f"{mode:<16} {r['seconds']:8.1f} {r['tokens_per_s']:9.1f} {ratio:>17} {vs_hf:>7} {same:>12} "
              f"{p50:>7} {p99:>7} {r['peak_rss_bytes'] / 2**30:7.2f} GiB")
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.num_seqs,), generator=g).tolist()
    memory = cache_bytes_per_sequence(lengths, args)
    print("KV cache per sequence: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in memory.items()))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(settings=settings, load_average=os.getloadavg(), cache_bytes_per_sequence=memory,
                       modes=results), f)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
