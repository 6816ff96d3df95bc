"""Autoregressive generation for :class:`~attnkit.nn.GPT` and :class:`~attnkit.nn.EncoderDecoder`.

One prefill call over the prompt, then one call per new token with a KV cache (static by
default: preallocated, written in place). Each step's logits go through, in order: repetition
penalty (CTRL, https://arxiv.org/abs/1909.05858), temperature, top-k, top-p (nucleus), then
argmax (``temperature=0``, greedy) or sampling.

Batched prompts are left-padded with an ``attention_mask`` ``(B, P)`` (1 = token, 0 = padding):
positions come from the mask, padding keys are never attended, so each row generates what it
would alone::

    model = GPT(TransformerConfig(vocab_size=100, num_layers=2)).eval()
    out = generate(model, prompt_ids, max_new_tokens=20, top_k=50, temperature=0.8, stop_tokens=[0])
    for tokens in stream(model, prompt_ids, max_new_tokens=20):   # (B,) per step, as produced
        print(tokens.tolist())
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from .cache import KVCache

__all__ = ["generate", "stream", "process_logits"]


def _check_positive_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}.")


def process_logits(logits: Tensor, *, seen: Tensor | None = None, temperature: float = 0.0,
                   top_k: int | None = None, top_p: float | None = None, repetition_penalty: float = 1.0) -> Tensor:
    """Scores ``(B, V)`` after repetition penalty, temperature, top-k and top-p filtering (removed
    tokens get ``-inf``). ``seen (B, V)`` bool marks tokens already in each row's sequence."""
    logits = logits.float()
    if repetition_penalty != 1.0 and seen is not None:
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if temperature > 0:
        logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= top_p  # keep the smallest prefix reaching top_p (always the first)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _check_args(model, input_ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty, attention_mask):
    from .nn.models import GPT, EncoderDecoder

    if not isinstance(model, (GPT, EncoderDecoder)):
        raise TypeError(f"model: expected an attnkit GPT or EncoderDecoder, got {type(model).__name__}.")
    if (not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point
            or input_ids.shape[1] == 0):
        got = getattr(input_ids, "shape", type(input_ids).__name__)
        raise ValueError(
            f"input_ids: expected a non-empty integer tensor (B, P), got {got}. "
            "Fix: a single prompt is input_ids[None]."
        )
    _check_positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature: expected a float >= 0 (0 = greedy), got {temperature!r}.")
    if top_k is not None:
        _check_positive_int("top_k", top_k)
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p: expected a float in (0, 1], got {top_p!r}.")
    if not isinstance(repetition_penalty, (int, float)) or repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty: expected a float > 0 (1 = off), got {repetition_penalty!r}.")
    if attention_mask is not None and (
        not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape
    ):
        raise ValueError(
            f"attention_mask: expected shape {tuple(input_ids.shape)} like input_ids (1 = token, 0 = left padding), "
            "got "
            f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}."
        )
    return isinstance(model, EncoderDecoder)


def _make_cache(model, cache, max_len: int) -> KVCache:
    if isinstance(cache, KVCache):
        if cache.seq_len:
            raise ValueError(
                f"cache: expected an empty cache, got one holding {cache.seq_len} tokens. Fix: cache.reset()."
            )
        return cache
    if cache in ("sliding_window", "recurrent"):
        return model.make_cache(cache)
    if cache in ("static", "dynamic"):
        return model.make_cache(cache, max_len=max_len)
    raise ValueError(f"cache: expected 'static', 'dynamic', 'sliding_window', 'recurrent' or a KVCache, got {cache!r}.")


@torch.no_grad()
def stream(
    model,
    input_ids: Tensor,
    max_new_tokens: int = 32,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    stop_tokens: Sequence[int] | None = None,
    cache: str | KVCache = "static",
    attention_mask: Tensor | None = None,
    pad_token_id: int = 0,
    decoder_start_token: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[Tensor]:
    """Yield the next token of every row, ``(B,)`` per step, as it is produced.

    At most ``max_new_tokens`` steps (the token budget). A row that emitted one of
    ``stop_tokens`` yields ``pad_token_id`` afterwards; the stream ends when every row stopped.
    ``temperature=0`` is greedy; otherwise tokens are sampled (``generator`` for reproducibility).
    ``cache``: ``"static"`` (default, fastest), ``"dynamic"``, ``"sliding_window"`` (models with
    ``sliding_window``), ``"recurrent"`` (linear-attention models) or an empty :class:`KVCache`.
    ``attention_mask (B, P)``: 1 = token, 0 = left padding. For an :class:`EncoderDecoder`,
    ``input_ids`` is the source and decoding starts from ``decoder_start_token``."""
    seq2seq = _check_args(model, input_ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                          attention_mask)
    stop = torch.tensor(sorted(set(stop_tokens or ())), dtype=torch.long, device=input_ids.device)
    B, P = input_ids.shape
    V = model.config.vocab_size
    device = input_ids.device
    if seq2seq:
        if decoder_start_token is None:
            raise ValueError(
                "decoder_start_token: an EncoderDecoder needs the token that starts the target (e.g. BOS)."
            )
        memory = model.encode(input_ids, attention_mask=attention_mask)
        kv = _make_cache(model, cache, 1 + max_new_tokens)
        ids = torch.full((B, 1), decoder_start_token, dtype=torch.long, device=device)
        history, history_valid = ids, None

        def forward(step_ids: Tensor) -> Tensor:
            return model.decode(step_ids, memory, attention_mask=attention_mask, cache=kv)
    else:
        kv = _make_cache(model, cache, P + max_new_tokens)
        ids, history = input_ids, input_ids
        valid = None
        history_valid = None if attention_mask is None else attention_mask.bool()
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            valid = torch.ones(B, P + max_new_tokens, dtype=torch.bool, device=device)  # grows by slicing, no copies
            valid[:, :P] = attention_mask.bool()

        def forward(step_ids: Tensor) -> Tensor:
            past = kv.seq_len
            mask = None if valid is None else valid[:, : past + step_ids.shape[1]]
            return model(step_ids, cache=kv, attention_mask=mask, logits_to_keep=1)

    seen = None
    if repetition_penalty != 1.0:
        weights = torch.ones_like(history, dtype=torch.float) if history_valid is None else history_valid.float()
        seen = torch.zeros(B, V, device=device).scatter_add_(1, history, weights) > 0  # (B, V)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        logits = forward(ids)[:, -1]  # (B, V)
        scores = process_logits(logits, seen=seen, temperature=temperature, top_k=top_k, top_p=top_p,
                                repetition_penalty=repetition_penalty)
        if temperature > 0:
            token = torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1)
        else:
            token = scores.argmax(-1)
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        yield token
        if stop.numel():
            finished |= torch.isin(token, stop)
        if bool(finished.all()):
            return
        if seen is not None:
            seen[torch.arange(B, device=device), token] |= ~finished
        ids = token[:, None]


def generate(model, input_ids: Tensor, max_new_tokens: int = 32, **kwargs) -> Tensor:
    """Run :func:`stream` to the end. Returns ``(B, P + n)`` (prompt then new tokens) for a GPT,
    ``(B, 1 + n)`` (start token then new tokens) for an EncoderDecoder; ``n <= max_new_tokens``
    (fewer when every row stopped early; stopped rows are filled with ``pad_token_id``)."""
    steps = list(stream(model, input_ids, max_new_tokens, **kwargs))
    new = torch.stack(steps, dim=1) if steps else input_ids.new_zeros(input_ids.shape[0], 0)
    from .nn.models import EncoderDecoder

    if isinstance(model, EncoderDecoder):
        start = torch.full((input_ids.shape[0], 1), kwargs["decoder_start_token"], dtype=torch.long, device=new.device)
        return torch.cat([start, new], dim=1)
    return torch.cat([input_ids, new], dim=1)
