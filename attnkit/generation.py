"""Autoregressive generation for models that mix in :class:`GenerationMixin` (attnkit's ``GPT``
and ``EncoderDecoder``).

One prefill call over the prompt, then one call per new token with a KV cache (static by
default: preallocated, written in place). Each step's logits go through, in order: repetition
penalty (CTRL, https://arxiv.org/abs/1909.05858), temperature, top-k, top-p (nucleus), then
argmax (``temperature=0``, greedy) or sampling.

Batched prompts come with an ``attention_mask`` ``(B, P)`` (1 = token, 0 = padding), padded on
either side (HF tokenizers pad on the right by default): rows are moved to left padding
internally, positions come from the mask and padding keys are never attended, so each row
generates what it would alone::

    model = GPT(TransformerConfig(vocab_size=100, num_layers=2)).eval()
    out = generate(model, prompt_ids, max_new_tokens=20, top_k=50, temperature=0.8, stop_tokens=[0])
    for tokens in stream(model, prompt_ids, max_new_tokens=20):   # (B,) per step, as produced
        print(tokens.tolist())

**Serving many prompts** (continuous batching): ``generate(model, [p1, p2, ...], cache="paged")``
runs a batch of at most ``max_batch_size`` sequences over one :class:`~attnkit.cache.PagedKVCache`;
a prompt joins as soon as a row and its blocks are free, a sequence leaves (and returns its
blocks) when it stops, so short and long requests never wait for each other. Each sequence gets
the tokens it would get alone (greedy; batched float rounding could only flip exact ties).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from ._validate import finite_float, positive_int
from ._validate import padding_mask
from .cache import KVCache, PagedKVCache

__all__ = ["generate", "stream", "process_logits", "GenerationMixin"]


class GenerationMixin:
    """Adds ``generate()`` to a model. The model provides ``config.vocab_size``, ``make_cache``
    and either ``forward(ids, cache=, attention_mask=, positions=, logits_to_keep=)`` (decoder-only)
    or ``encode``/``decode`` (``is_encoder_decoder = True``)."""

    is_encoder_decoder: ClassVar[bool] = False

    def generate(self, input_ids, max_new_tokens: int = 32, **kwargs):
        """See :func:`attnkit.generation.generate` (an encoder-decoder needs ``decoder_start_token``)."""
        return generate(self, input_ids, max_new_tokens, **kwargs)


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


def _check_sampling(max_new_tokens, temperature, top_k, top_p, repetition_penalty) -> None:
    positive_int(max_new_tokens, "max_new_tokens", fix="pass how many tokens to add, e.g. max_new_tokens=32")
    finite_float(temperature, "temperature", low=0, fix="0 = greedy; e.g. temperature=0.8 samples")
    if top_k is not None:
        positive_int(top_k, "top_k", fix="top_k=None keeps every token; e.g. top_k=50 keeps the 50 likeliest")
    if top_p is not None:
        finite_float(top_p, "top_p", low=0, low_inclusive=False, high=1, fix="top_p=None or 1 keeps every token")
    finite_float(repetition_penalty, "repetition_penalty", low=0, low_inclusive=False, fix="1 = off")


def _check_model(model) -> bool:
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"model: expected an attnkit GPT or EncoderDecoder, got {type(model).__name__}.")
    return model.is_encoder_decoder


#: The index dtypes an embedding looks tokens up with.
_ID_DTYPES = (torch.int64, torch.int32)


def _check_ids(input_ids, vocab_size: int, name: str = "input_ids", dims: int = 2) -> None:
    """``input_ids`` is a non-empty int64/int32 tensor of ``dims`` dims (``(B, P)``, or one ``(P,)``
    prompt of a list) whose every entry is a token id of the model's vocabulary."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != dims or 0 in input_ids.shape:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        expected, fix = (("(B, P) with B, P >= 1, or a list of 1-D prompts", "a single prompt is input_ids[None]")
                         if dims == 2 else ("(P,) with P >= 1", "drop empty prompts"))
        raise ValueError(f"{name}: expected a tensor of token ids {expected}, got {got}. Fix: {fix}.")
    if input_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"{name}: expected token ids of dtype torch.int64 (or torch.int32), got {input_ids.dtype}. "
                        f"Fix: {name}.long() (token ids, not a mask or embeddings).")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        at = tuple((input_ids == bad).nonzero()[0].tolist())
        raise ValueError(
            f"{name}: expected token ids in [0, {vocab_size}) (the model's vocab_size), got {bad} at {at}. "
            "Fix: tokenize with the model's own vocabulary; padding positions are read too, so fill them with a "
            "valid id such as pad_token_id."
        )


def _check_token(name: str, value, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"{name}: expected a token id, an int in [0, {vocab_size}) (the model's vocab_size), "
                         f"got {value!r}. Fix: pass an id of the model's vocabulary.")
    return value


def _check_tokens(model, *, stop_tokens, pad_token_id, generator, decoder_start_token=None) -> list[int]:
    """The token arguments of a call (each an id of the model's vocabulary) and ``generator``;
    returns the stop tokens as a list."""
    V = model.config.vocab_size
    if stop_tokens is None:
        stop = []
    elif isinstance(stop_tokens, (str, bytes, Tensor)) or not isinstance(stop_tokens, Sequence | set | frozenset):
        raise TypeError(f"stop_tokens: expected a list of token ids or None, got {type(stop_tokens).__name__} "
                        f"{stop_tokens!r}. Fix: stop_tokens=[id] for one token (a tensor: .tolist()).")
    else:
        stop = [_check_token(f"stop_tokens[{i}]", t, V) for i, t in enumerate(stop_tokens)]
    _check_token("pad_token_id", pad_token_id, V)
    if decoder_start_token is not None:
        if not model.is_encoder_decoder:
            raise ValueError(f"decoder_start_token={decoder_start_token!r}: a GPT continues its prompt; the start "
                             "token is for an EncoderDecoder. Fix: drop decoder_start_token.")
        _check_token("decoder_start_token", decoder_start_token, V)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__} "
                        f"{generator!r}. Fix: torch.Generator().manual_seed(seed).")
    return stop


def _to_left_padding(input_ids: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Rows reordered so that padding comes first and tokens keep their order (a stable sort
    of each row by its mask): right padding and holes become left padding."""
    order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)
    return input_ids.gather(1, order), valid.gather(1, order)


def _make_cache(model, cache, max_len: int, quantize: str | None) -> KVCache:
    if isinstance(cache, KVCache):
        if cache.seq_len:
            raise ValueError(
                f"cache: expected an empty cache, got one holding {cache.seq_len} tokens. Fix: cache.reset()."
            )
        if quantize is not None:
            raise ValueError("quantize_cache: given with a ready-made cache; build that cache with quantize= instead.")
        return cache
    if cache in ("sliding_window", "recurrent"):
        if quantize is not None:
            raise ValueError(f"quantize_cache: applies to 'static', 'dynamic' and 'paged' caches, not {cache!r}.")
        return model.make_cache(cache)
    if cache in ("static", "dynamic"):
        return model.make_cache(cache, max_len=max_len, quantize=quantize)
    raise ValueError(
        f"cache: expected 'static', 'dynamic', 'sliding_window', 'recurrent', 'paged' or a KVCache, got {cache!r}."
    )


def _next_token(logits: Tensor, seen: Tensor | None, temperature, top_k, top_p, repetition_penalty, generator):
    scores = process_logits(logits, seen=seen, temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=repetition_penalty)
    if temperature > 0:
        return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1)
    return scores.argmax(-1)


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
    quantize_cache: str | None = None,
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
    ``sliding_window``), ``"recurrent"`` (linear-attention models) or an empty :class:`KVCache`;
    ``quantize_cache="int8"`` stores a static or dynamic cache in int8 (paged caches and
    continuous batching: :func:`generate`). ``attention_mask (B, P)``: 1 = token, 0 = padding
    (left or right). For an encoder-decoder, ``input_ids`` is the source and decoding starts from
    ``decoder_start_token``. ``input_ids`` is int64 (or int32); every id it holds (padding included: the
    model reads it), ``stop_tokens``, ``pad_token_id`` (a stopped row's next input) and
    ``decoder_start_token`` must be in ``[0, vocab_size)``: anything else is refused before any work."""
    seq2seq = _check_model(model)
    _check_ids(input_ids, model.config.vocab_size)
    _check_sampling(max_new_tokens, temperature, top_k, top_p, repetition_penalty)
    stop_list = _check_tokens(model, stop_tokens=stop_tokens, pad_token_id=pad_token_id, generator=generator,
                              decoder_start_token=decoder_start_token)
    valid = None if attention_mask is None else padding_mask(attention_mask, *input_ids.shape, "P", need_token=True)
    if cache == "paged" or isinstance(cache, PagedKVCache):
        raise ValueError("cache: a paged cache serves many sequences through generate(), not stream(). "
                         "Fix: generate(model, prompts, cache='paged'), or cache='static' here.")
    stop = torch.tensor(sorted(set(stop_list)), dtype=torch.long, device=input_ids.device)
    B, P = input_ids.shape
    V = model.config.vocab_size
    device = input_ids.device
    if seq2seq:
        if decoder_start_token is None:
            raise ValueError(
                "decoder_start_token: an EncoderDecoder needs the token that starts the target (e.g. BOS)."
            )
        memory = model.encode(input_ids, attention_mask=attention_mask)
        kv = _make_cache(model, cache, 1 + max_new_tokens, quantize_cache)
        ids = torch.full((B, 1), decoder_start_token, dtype=torch.long, device=device)
        history, history_valid = ids, None

        def forward(step_ids: Tensor) -> Tensor:
            return model.decode(step_ids, memory, attention_mask=attention_mask, cache=kv)
    else:
        kv = _make_cache(model, cache, P + max_new_tokens, quantize_cache)
        ids, history_valid = input_ids, valid
        keep = None
        if valid is not None and not bool(valid.all()):
            ids, history_valid = _to_left_padding(input_ids, valid)
            keep = torch.ones(B, P + max_new_tokens, dtype=torch.bool, device=device)  # grows by slicing, no copies
            keep[:, :P] = history_valid
        history = ids

        def forward(step_ids: Tensor) -> Tensor:
            past = kv.seq_len
            mask = None if keep is None else keep[:, : past + step_ids.shape[1]]
            return model(step_ids, cache=kv, attention_mask=mask, logits_to_keep=1)

    seen = None
    if repetition_penalty != 1.0:
        weights = torch.ones_like(history, dtype=torch.float) if history_valid is None else history_valid.float()
        seen = torch.zeros(B, V, device=device).scatter_add_(1, history, weights) > 0  # (B, V)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        logits = forward(ids)[:, -1]  # (B, V)
        token = _next_token(logits, seen, temperature, top_k, top_p, repetition_penalty, generator)
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        yield token
        if stop.numel():
            finished |= torch.isin(token, stop)
        if bool(finished.all()):
            return
        if seen is not None:
            seen[torch.arange(B, device=device), token] |= ~finished
        ids = token[:, None]


def _serve(model, prompts: list[Tensor], max_new_tokens: int, cache: PagedKVCache, max_batch_size: int,
           stop_tokens, sampling: dict, prefill_chunk: int | None = None, on_token=None) -> list[Tensor]:
    """Continuous batching over a paged cache: every prompt plus its new tokens (up to and
    including a stop token). Each iteration admits waiting prompts while rows and blocks are free,
    prefills one chunk of at most ``prefill_chunk`` prompt tokens (None: a whole prompt) of the
    prompt with the fewest tokens left, then runs
    one decode step over every row that has finished its prefill, so a long prompt never stalls
    the running rows for more than one chunk. ``on_token(index, token)`` is called as each token of
    prompt ``index`` is chosen (streaming per sequence)."""
    stop = set(stop_tokens or ())
    V = model.config.vocab_size
    device = prompts[0].device
    waiting = deque(range(len(prompts)))
    running: list[dict] = []  # seq, index, tokens (list), seen row, prefilled (prompt tokens in the cache)
    results: list[Tensor | None] = [None] * len(prompts)

    def budget(i: int) -> int:
        return cache.blocks_needed(len(prompts[i]) + max_new_tokens)

    def finish(row: dict) -> None:
        results[row["index"]] = torch.cat([prompts[row["index"]], torch.tensor(row["tokens"], device=device)])
        cache.free(row["seq"])

    def step(rows: list[dict], logits: Tensor) -> None:
        seen = None
        if sampling["repetition_penalty"] != 1.0:
            seen = torch.stack([row["seen"] for row in rows])
        tokens = _next_token(logits, seen, generator=sampling["generator"], temperature=sampling["temperature"],
                             top_k=sampling["top_k"], top_p=sampling["top_p"],
                             repetition_penalty=sampling["repetition_penalty"]).tolist()
        for row, token in zip(rows, tokens):
            row["tokens"].append(token)
            row["seen"][token] = True
            if on_token is not None:
                on_token(row["index"], token)
            if token in stop or len(row["tokens"]) == max_new_tokens:
                finish(row)
                running.remove(row)

    while waiting or running:
        # Admit waiting prompts while a row is free and the pool can hold their whole budget
        # (blocks still owed to the running sequences included), so no sequence runs out mid-way.
        owed = sum(budget(row["index"]) - len(cache.pool.tables[row["seq"]]) for row in running)
        while waiting and len(running) < max_batch_size:
            i = waiting[0]
            if budget(i) + owed > cache.free_block_count:
                if not running:
                    raise ValueError(
                        f"cache: prompt {i} needs {budget(i)} blocks of {cache.pool.block_size} tokens (prompt + "
                        f"max_new_tokens), the pool has {cache.free_block_count} free. Fix: more num_blocks."
                    )
                break
            waiting.popleft()
            owed += budget(i)
            row = {"seq": cache.add_sequence(), "index": i, "tokens": [], "prefilled": 0,
                   "seen": torch.zeros(V, dtype=torch.bool, device=device)}
            row["seen"][prompts[i]] = True
            running.append(row)
        # Shortest remaining prompt first: short prompts start streaming while a long one prefills.
        pending = [row for row in running if row["prefilled"] < len(prompts[row["index"]])]
        filling = min(pending, key=lambda row: len(prompts[row["index"]]) - row["prefilled"], default=None)
        if filling is not None:  # one prefill chunk
            prompt, start = prompts[filling["index"]], filling["prefilled"]
            end = len(prompt) if prefill_chunk is None else min(len(prompt), start + prefill_chunk)
            cache.select([filling["seq"]])
            logits = model(prompt[None, start:end], cache=cache, logits_to_keep=1)[:, -1]
            filling["prefilled"] = end
            if end == len(prompt):
                step([filling], logits)  # its first token
        rows = [row for row in running if row["tokens"] and row["prefilled"] == len(prompts[row["index"]])
                and row is not filling]
        if rows:
            cache.select([row["seq"] for row in rows])
            ids = torch.tensor([[row["tokens"][-1]] for row in rows], device=device)
            step(rows, model(ids, cache=cache, logits_to_keep=1)[:, -1])  # one decode step, every ready row
    return results


def _prompts_of(input_ids, valid: Tensor | None, vocab_size: int) -> list[Tensor]:
    if isinstance(input_ids, Tensor):
        rows = list(input_ids)
        return rows if valid is None else [row[keep] for row, keep in zip(rows, valid)]
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise TypeError(f"input_ids: expected a tensor (B, P) of token ids or a list of 1-D prompts, got "
                        f"{type(input_ids).__name__}.")
    prompts = list(input_ids)
    for i, p in enumerate(prompts):
        _check_ids(p, vocab_size, f"input_ids[{i}]", dims=1)
    if not prompts:
        raise ValueError("input_ids: expected at least one prompt, got an empty list.")
    return prompts


@torch.no_grad()
def _generate_paged(model, input_ids, max_new_tokens, *, cache, quantize_cache, num_blocks, block_size,
                    max_batch_size, attention_mask, stop_tokens, pad_token_id, prefill_chunk=256, on_token=None,
                    **sampling):
    if model.is_encoder_decoder:
        raise ValueError("cache: paged caches serve decoder-only models; use cache='static' for an EncoderDecoder.")
    _check_sampling(max_new_tokens, sampling["temperature"], sampling["top_k"], sampling["top_p"],
                    sampling["repetition_penalty"])
    positive_int(max_batch_size, "max_batch_size", fix="e.g. max_batch_size=32 sequences decoded together")
    if prefill_chunk is not None:
        positive_int(prefill_chunk, "prefill_chunk", fix="e.g. prefill_chunk=256, or None for whole prompts")
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token: expected a callable on_token(index, token), got {type(on_token).__name__}.")
    positive_int(block_size, "block_size", fix="e.g. block_size=16 tokens per cache page")
    if num_blocks is not None:
        positive_int(num_blocks, "num_blocks", fix="num_blocks=None sizes the pool for the prompts")
    stop_tokens = _check_tokens(model, stop_tokens=stop_tokens, pad_token_id=pad_token_id,
                                generator=sampling["generator"])
    valid = None
    if isinstance(input_ids, Tensor):
        _check_ids(input_ids, model.config.vocab_size)
        valid = None if attention_mask is None else padding_mask(attention_mask, *input_ids.shape, "P", need_token=True)
    elif attention_mask is not None:
        raise ValueError("attention_mask: a list of prompts needs no mask (each prompt is its own length); drop it.")
    prompts = _prompts_of(input_ids, valid, model.config.vocab_size)
    if isinstance(cache, PagedKVCache):
        if quantize_cache is not None or num_blocks is not None:
            raise ValueError("quantize_cache, num_blocks: given with a ready-made PagedKVCache; build it with them.")
        if cache.pool.tables:
            raise ValueError(f"cache: expected an empty PagedKVCache, got one holding {len(cache.pool.tables)} "
                             "sequences. Fix: cache.reset().")
    else:
        per_seq = -(-(max(len(p) for p in prompts) + max_new_tokens) // block_size)
        blocks = num_blocks if num_blocks is not None else per_seq * min(max_batch_size, len(prompts))
        cache = model.make_cache("paged", num_blocks=blocks, block_size=block_size, quantize=quantize_cache)
    results = _serve(model, prompts, max_new_tokens, cache, max_batch_size, stop_tokens, sampling, prefill_chunk,
                     on_token)
    if not isinstance(input_ids, Tensor):
        return results
    new = [r[len(p):] for r, p in zip(results, prompts)]
    n = max(len(t) for t in new)
    out = input_ids.new_full((len(new), n), pad_token_id)
    for i, t in enumerate(new):
        out[i, : len(t)] = t
    return torch.cat([input_ids, out], dim=1)


def generate(model, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int = 32, *,
             cache: str | KVCache = "static", quantize_cache: str | None = None, num_blocks: int | None = None,
             block_size: int = 16, max_batch_size: int = 32, **kwargs):
    """Run :func:`stream` to the end. Returns ``(B, P + n)`` (prompt then new tokens) for a GPT,
    ``(B, 1 + n)`` (start token then new tokens) for an EncoderDecoder; ``n <= max_new_tokens``
    (fewer when every row stopped early; stopped rows are filled with ``pad_token_id``).

    ``cache="paged"`` (or an empty :class:`~attnkit.cache.PagedKVCache`) serves the prompts with
    continuous batching: at most ``max_batch_size`` sequences run at once over a pool of
    ``num_blocks`` blocks of ``block_size`` tokens (default: enough for ``max_batch_size``
    sequences of the longest prompt plus ``max_new_tokens``), ``quantize_cache="int8"`` stores
    the pages in int8. ``input_ids`` may then also be a list of 1-D prompts of any lengths; the
    result is a list of 1-D tensors (each prompt, then its new tokens up to and including a stop
    token). Prompts are prefilled ``prefill_chunk`` tokens at a time (default 256; None: whole),
    one chunk between two decode steps of the running rows; ``on_token(index, token)`` streams
    each sequence's tokens as they are chosen. Other keyword arguments are those of :func:`stream`."""
    if cache == "paged" or isinstance(cache, PagedKVCache):
        return _generate_paged(model, input_ids, max_new_tokens, cache=cache, quantize_cache=quantize_cache,
                               num_blocks=num_blocks, block_size=block_size, max_batch_size=max_batch_size,
                               attention_mask=kwargs.pop("attention_mask", None),
                               stop_tokens=kwargs.pop("stop_tokens", None), pad_token_id=kwargs.pop("pad_token_id", 0),
                               prefill_chunk=kwargs.pop("prefill_chunk", 256), on_token=kwargs.pop("on_token", None),
                               **{k: kwargs.pop(k, d) for k, d in _SAMPLING_DEFAULTS.items()}, **_rest(kwargs))
    if num_blocks is not None:
        raise ValueError("num_blocks: applies to cache='paged' only.")
    if not isinstance(input_ids, Tensor):
        raise ValueError("input_ids: a list of prompts needs cache='paged' (continuous batching); "
                         "or pass a padded (B, P) tensor with an attention_mask.")
    steps = list(stream(model, input_ids, max_new_tokens, cache=cache, quantize_cache=quantize_cache, **kwargs))
    new = torch.stack(steps, dim=1) if steps else input_ids.new_zeros(input_ids.shape[0], 0)
    if model.is_encoder_decoder:
        start = torch.full((input_ids.shape[0], 1), kwargs["decoder_start_token"], dtype=torch.long, device=new.device)
        return torch.cat([start, new], dim=1)
    return torch.cat([input_ids, new], dim=1)


_SAMPLING_DEFAULTS = dict(temperature=0.0, top_k=None, top_p=None, repetition_penalty=1.0, generator=None)


def _rest(kwargs: dict) -> dict:
    """Arguments left after the paged path took its own: only ``decoder_start_token=None`` fits."""
    kwargs.pop("decoder_start_token", None)
    if kwargs:
        raise TypeError(f"generate: unexpected argument(s) {sorted(kwargs)} with cache='paged'.")
    return {}
