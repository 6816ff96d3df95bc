"""Stream text from a trained checkpoint with the KV cache and the sampling options.

Examples:
  python -m attnkit generate runs/attnkit --prompt "ROMEO." --max-new-tokens 300 --temperature 0.8 --top-k 40
  python -m attnkit generate runs/attnkit --quantize int8        # int8 linear layers; reports speedup and loss
  python -m attnkit generate runs/attnkit --cache static --cache-quantize int8   # int8 KV cache
  python -m attnkit generate runs/attnkit --prompts-file prompts.txt --max-batch-size 16   # serve a file of prompts
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from ..train.data import decode, encode
from .options import nonnegative_int, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("checkpoint", help="run directory of `attnkit train` (its latest checkpoint) or a step-* dir")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=200, help="bytes to generate (>= 1)")
    parser.add_argument("--temperature", type=_real(lambda x: x >= 0, "a finite float >= 0"),
                        default=0.8, help="softmax temperature (0 = greedy)")
    parser.add_argument("--top-k", type=nonnegative_int, default=40, help="sample among the k likeliest (0 = off)")
    parser.add_argument("--top-p", type=_real(lambda x: 0 < x <= 1, "a float in (0, 1]"), default=1.0,
                        help="nucleus sampling mass (1 = off)")
    parser.add_argument("--repetition-penalty", type=_real(lambda x: x > 0, "a finite float > 0"),
                        default=1.0, help="CTRL-style penalty (1 = off)")
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic", help="KV cache kind")
    parser.add_argument("--cache-quantize", choices=("none", "int8"), default="none",
                        help="int8: store the KV cache in int8 (per-token, per-head scales; about 4x less memory)")
    parser.add_argument("--prompts-file", default=None,
                        help="serve every line of this UTF-8 file as a prompt (continuous batching over a paged "
                             "cache); each completion is printed as '[line] text' when it finishes")
    parser.add_argument("--max-batch-size", type=positive_int, default=16,
                        help="with --prompts-file: sequences decoded together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantize", choices=("none", "int8"), default="none",
                        help="int8: dynamic int8 linear layers (CPU); prints speedup and eval-loss change first")


def _real(ok, expected: str):
    """An argparse type: a finite float satisfying ``ok``, else a clear usage error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def _prompt_ids(flag: str, text: str, vocab_size: int) -> torch.Tensor:
    """``text`` as the model's token ids (its UTF-8 bytes), or a ``ValueError`` naming ``flag`` when it
    is empty or holds a byte the checkpoint's vocabulary does not (a model trained on a task)."""
    ids = encode(text)
    if ids.numel() == 0:
        raise ValueError(f"{flag}: expected at least one character, got ''. Fix: give text to continue "
                         "(the default is a newline).")
    outside = (ids >= vocab_size).nonzero()
    if outside.numel():
        at = int(outside[0])
        raise ValueError(f"{flag}: byte {int(ids[at])} (at byte {at} of {text[:40]!r}) is not in this checkpoint's "
                         f"vocabulary of {vocab_size} tokens (ids 0..{vocab_size - 1}). Fix: use only characters "
                         f"whose UTF-8 bytes are below {vocab_size}, as in the model's training data.")
    return ids


def run(args: argparse.Namespace) -> int:
    from ..train.loop import TrainConfig, load_data, load_model

    if args.quantize == "int8" and args.device != "cpu":
        raise ValueError(f"--quantize int8 runs on the CPU (dynamic int8 kernels); got --device {args.device}. "
                         "Fix: drop --device or use --device cpu.")
    model, meta = load_model(args.checkpoint, args.device)
    if meta["model_kind"] != "gpt":
        raise ValueError(f"checkpoint: {args.checkpoint!r} holds a {meta['model_kind']!r} model; generate needs a "
                         "GPT. Fix: give the run directory of a GPT trained with `attnkit train`.")
    if args.quantize == "int8":
        from ..train.deploy import quantize_model_int8, quantize_report

        tc = meta["train_config"]
        cfg = TrainConfig(**{k: v for k, v in tc.items() if k in TrainConfig.__dataclass_fields__})
        quantize_report(model, load_data(cfg.data), cfg, log=lambda m: print(m, file=sys.stderr))
        model = quantize_model_int8(model)
    if args.prompts_file is not None:
        return _serve_file(model, args)
    ids = _prompt_ids("--prompt", args.prompt, model.config.vocab_size)[None].to(args.device)
    sys.stdout.write(args.prompt)
    pending = b""
    for token in _token_stream(model, ids, args):
        pending += bytes([int(token) % 256])
        text = pending.decode("utf-8", errors="ignore")
        if text:  # print whole characters as soon as their bytes are complete
            sys.stdout.write(text)
            sys.stdout.flush()
            pending = b""
    sys.stdout.write(decode(pending) + "\n")
    return 0


def _serve_file(model, args) -> int:
    """Every line of ``--prompts-file`` served by ``generate(cache="paged")``; completions print as
    they finish (their tokens stream in through ``on_token``)."""
    from ..generation import generate

    try:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)  # not "[Errno 2] ... 'x'"
        raise ValueError(f"--prompts-file: cannot read {args.prompts_file!r} ({why}). Fix: give a UTF-8 text "
                         "file with one prompt per line.") from None
    prompts = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    for i, line in prompts:
        _prompt_ids(f"--prompts-file line {i}", line, model.config.vocab_size)
    if not prompts:
        raise ValueError(f"--prompts-file: {args.prompts_file!r} holds no prompt (every line is empty). "
                         "Fix: write one prompt per line.")
    budget = args.max_new_tokens
    if model.config.position == "learned":
        budget = min(budget, model.config.max_len - max(len(encode(p)) for _, p in prompts))
        if budget < 1:
            raise ValueError(f"--prompts-file: the longest prompt fills learned positions up to max_len="
                             f"{model.config.max_len}. Fix: shorten it.")
    pieces: dict[int, list[int]] = {}

    def on_token(index: int, token: int) -> None:
        pieces.setdefault(index, []).append(int(token) % 256)
        if len(pieces[index]) == budget:  # this sequence is done: print it whole
            line, text = prompts[index]
            sys.stdout.write(f"[{line}] {text}{decode(bytes(pieces.pop(index)))}\n")
            sys.stdout.flush()

    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    generate(model, [encode(p).to(args.device) for _, p in prompts], budget, cache="paged",
             quantize_cache=None if args.cache_quantize == "none" else args.cache_quantize,
             max_batch_size=args.max_batch_size, on_token=on_token, temperature=args.temperature,
             top_k=args.top_k or None, top_p=args.top_p if args.top_p < 1.0 else None,
             repetition_penalty=args.repetition_penalty, generator=generator)
    return 0


def _token_stream(model, ids, args):
    from ..generation import stream

    budget = args.max_new_tokens
    config = model.config
    if config.position == "learned" and ids.shape[1] + budget > config.max_len:
        budget = max(config.max_len - ids.shape[1], 0)
        print(f"(learned positions end at max_len={config.max_len}: generating {budget} tokens)", file=sys.stderr)
    if budget == 0:
        return
    generator = torch.Generator(device=ids.device).manual_seed(args.seed)
    for token in stream(model, ids, budget, temperature=args.temperature, top_k=args.top_k or None,
                        top_p=args.top_p if args.top_p < 1.0 else None, repetition_penalty=args.repetition_penalty,
                        cache=args.cache, quantize_cache=None if args.cache_quantize == "none" else args.cache_quantize,
                        generator=generator):
        yield token[0]
