"""PyTorch's FlexAttention (``torch.nn.attention.flex_attention``), compiled, for every attnkit mask.

Equals ``naive``: the mask enters as a ``mask_mod`` that calls the attnkit mask's own ``mask_mod``
at absolute positions (``index + offset``), and the ``BlockMask`` that tells Flex which blocks to
skip (EMPTY), run unmasked (FULL) or run through the ``mask_mod`` (PARTIAL) is built from attnkit's
own structure (:func:`attnkit.masks.tile_grid`: a few tensor operations per mask class
masks, no Tq x Tk evaluation), cached per (mask, Tq, Tk, offsets, device). A ``bias`` and attnkit's
score modifiers (ALiBi, soft-cap, relative biases, custom) become one Flex ``score_mod``, applied
before the mask; sinks are not taken; GQA is native (``enable_gqa``). The NaN/Inf contract is kept
by :mod:`attnkit.backends.nonfinite` (Flex runs on finite q, K, V). Flex marks fully masked rows
with output 0 and LSE -inf, attnkit's contract too.

``flex_attention`` is compiled once per device with dynamic shapes: the first call compiles (tens
of seconds on a CPU, see ``describe``), and a new length reuses the compiled kernel. Where torch
runs it: forward and backward on CUDA; forward on CPU (no LSE there) inside ``allow_cpu()``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from .._compat import scope_reader
from ..inputs import AttentionInputs
from ..masks import Mask, mask_params
from ..registry import Backend, Work, register_backend
from ..score_mods import ScoreMod, score_mod_spec
from ._tiles import FULL, PARTIAL, empty_batch, tile_grid

_CPU_ALLOWED: ContextVar[bool] = ContextVar("attnkit_flex_cpu", default=False)
_cpu_allowed = scope_reader(_CPU_ALLOWED)


@contextlib.contextmanager
def allow_cpu() -> Iterator[None]:
    """Within the block, ``flex`` may run on the CPU (forward only). Opt-in because torch 2.13's
    CPU Flex template compiles each mask kind for tens of seconds and fails to compile some mask_mods;
    without it the backend declines on CPU with that reason. A ContextVar, restored on exit."""
    token = _CPU_ALLOWED.set(True)
    try:
        yield
    finally:
        _CPU_ALLOWED.reset(token)


#: Flex's block size (its default sparse block): the BlockMask has one entry per BLOCK x BLOCK tile.
BLOCK = 128
_STATE: dict = {"compiled": {}, "compile_seconds": {}, "block_masks": {}}
_MAX_BLOCK_MASKS = 64


@dataclass(frozen=True)
class FlexOptions:
    """``compile=False`` runs Flex eagerly (its reference path, which materializes the scores):
    no compile time, for checking and debugging only."""

    compile: bool = True


def _flex_api():
    from torch.nn.attention import flex_attention as fa

    return fa


def _compiled(device_type: str, compile: bool):
    fa = _flex_api()
    if not compile:
        return fa.flex_attention
    fn = _STATE["compiled"].get(device_type)
    if fn is None:
        fn = _STATE["compiled"][device_type] = torch.compile(fa.flex_attention, dynamic=True)
    return fn


def _loud_recompile_limit(compile: bool):
    """Make dynamo raise when a compiled call hits its recompile limit (it would otherwise fall
    back to eager silently); a no-op for eager calls."""
    if not compile:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def _mask_mod(mask: Mask, B: int, H: int, q_offset: int, kv_offset: int, Tq: int, Tk: int, device):
    """Flex's ``mask_mod(b, h, q_idx, kv_idx)`` for ``mask``: indices made absolute, batch and head
    indices kept inside the mask's own sizes, out-of-range indices of a ragged last block clamped
    (Flex may evaluate them; they are masked out of the result anyway). The offsets travel as a
    tensor, so a new offset (a cache that grew) reuses the compiled kernel."""
    per_batch = mask.depends_on_batch and mask.batch_size != 1  # Custom masks see every b and h
    per_head = mask.depends_on_head and mask.num_heads != 1
    # Band conjuncts (Causal, SlidingWindow) as index arithmetic on their bounds, and every integer
    # as a captured tensor: inductor's CPU Flex template (torch 2.13) fails to compile index
    # arithmetic with Python constants (and SlidingWindow.mask_mod's boolean constant).
    params = mask_params(mask, B)
    band, others = params.band, params.beyond_band
    ints = torch.tensor([q_offset, kv_offset, -(band.left or 0), band.right or 0, Tq - 1, Tk - 1], device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = torch.minimum(q_idx, ints[4]) + ints[0]
        kv_pos = torch.minimum(kv_idx, ints[5]) + ints[1]
        keep = q_pos == q_pos  # all True, in the shape of the indices
        if band.left is not None:
            keep = keep & (kv_pos - q_pos >= ints[2])
        if band.right is not None:
            keep = keep & (kv_pos - q_pos <= ints[3])
        for part in others:
            keep = keep & part.mask_mod(b if per_batch else b * 0, h if per_head else h * 0, q_pos, kv_pos,
                                        q_offset=ints[0], kv_offset=ints[1])
        return keep

    return mask_mod


def block_mask(mask: Mask | None, inp: AttentionInputs):
    """The Flex ``BlockMask`` for ``inp`` (None without a mask), built from ``tile_grid`` and cached
    per (mask, Tq, Tk, offsets, device); returns ``(block_mask, build_seconds)`` (0.0 when cached)."""
    if mask is None:
        return None, 0.0
    key = (mask, inp.B, inp.Hq, inp.Tq, inp.Tk, inp.q_offset, inp.kv_offset, str(inp.device))
    cached = _STATE["block_masks"].get(key)
    if cached is not None:
        return cached, 0.0
    start = time.perf_counter()
    bm = build_block_mask(mask, inp.B, inp.Hq, inp.Tq, inp.Tk, inp.q_offset, inp.kv_offset, inp.device)
    seconds = time.perf_counter() - start
    if len(_STATE["block_masks"]) >= _MAX_BLOCK_MASKS:
        _STATE["block_masks"].pop(next(iter(_STATE["block_masks"])))
    _STATE["block_masks"][key] = bm
    return bm, seconds


def build_block_mask(mask: Mask, B: int, H: int, Tq: int, Tk: int, q_offset: int, kv_offset: int, device):
    """A Flex ``BlockMask`` from attnkit's tile statuses: PARTIAL blocks in ``kv_indices`` (run with
    the ``mask_mod``), FULL blocks in ``full_kv_indices`` (run unmasked), EMPTY blocks left out."""
    grid = tile_grid(mask, Tq, Tk, q_offset, kv_offset, BLOCK, BLOCK, B, H)  # (nQ, nK) uint8
    partial, full = grid == PARTIAL, grid == FULL

    def ordered(sel):  # selected block indices first in each row, as Flex expects
        num = sel.sum(-1, dtype=torch.int32)
        idx = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None].to(device), idx[None, None].to(device)

    # Build the BlockMask directly: from_kv_blocks would derive the transposed (per key block)
    # indices for the backward pass with vmap, ~100x slower than ordering the transposed grid.
    return _flex_api().BlockMask(
        (Tq, Tk), *ordered(partial), *ordered(full), *ordered(partial.T), *ordered(full.T),
        BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=_mask_mod(mask, B, H, q_offset, kv_offset, Tq, Tk, device),
    )


def _flex_term(term, device):
    """One modifier as Flex calls it: the primitive's own ``apply``, except soft-capping, whose cap
    travels as a tensor (torch 2.13's CPU Flex template fails to compile a Python float constant)."""
    if term.kind != "softcap":
        return term.mod.apply
    cap = torch.tensor([term.cap], device=device)
    return lambda score, b, h, q_idx, kv_idx: torch.tanh(score / cap[0].to(score.dtype)) * cap[0].to(score.dtype)


def _score_mod(bias: torch.Tensor | None, mod: ScoreMod | None, q_offset: int, kv_offset: int, device):
    """Flex's ``score_mod``: ``score + bias[b, h, q, k]`` (broadcast dims of ``bias (B|1, H|1, Tq|1,
    Tk|1)`` indexed at 0), then attnkit's modifier at absolute positions (``ScoreMod.apply`` has
    Flex's signature; the offsets travel as a tensor, so a new offset reuses the compiled kernel)."""
    dims = ()
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        dims = [s > 1 for s in bias.shape]
    offsets = torch.tensor([q_offset, kv_offset], device=device)
    terms = [] if mod is None else [_flex_term(t, device) for t in score_mod_spec(mod).terms]

    def score_mod(score, b, h, q_idx, kv_idx):
        if bias is not None:
            idx = [i if keep else i * 0 for i, keep in zip((b, h, q_idx, kv_idx), dims)]
            score = score + bias[idx[0], idx[1], idx[2], idx[3]].to(score.dtype)
        for term in terms:
            score = term(score, b, h, q_idx + offsets[0], kv_idx + offsets[1])
        return score

    return score_mod


@register_backend
class FlexBackend(Backend):
    name = "flex"
    work = Work(fused=True)
    reason_contexts = (_CPU_ALLOWED,)
    summary = ("torch FlexAttention, compiled (dynamic shapes): any mask via mask_mod + a BlockMask from attnkit's "
               "structure")
    devices = frozenset({"cpu", "cuda"})
    supports_bias = True
    supports_lse = True
    supports_score_mod = True  # every kind: attnkit modifiers are Flex score_mods (custom ones included)
    Options = FlexOptions
    compiles = True  # the first call per device compiles (tens of seconds on a CPU)

    @classmethod
    def available(cls) -> bool:
        try:
            _flex_api()
        except ImportError:
            return False
        return True

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs):
        if not cls.available():
            yield "torch.nn.attention.flex_attention is missing from this torch build"
        if inp.device.type == "cpu":
            if not _cpu_allowed():
                yield ("on CPU only inside `with attnkit.backends.flex.allow_cpu():` (each mask kind compiles for tens "
                       "of seconds, and torch's CPU Flex template fails to compile some mask_mods)")
            if inp.requires_grad:
                yield "FlexAttention has no backward on CPU (inputs require grad)"
            if inp.return_lse:
                yield "FlexAttention returns no log-sum-exp on CPU (return_lse=True)"

    @classmethod
    def describe(cls, inp: AttentionInputs) -> str:
        dev = inp.device.type
        took = _STATE["compile_seconds"].get(dev)
        if dev in _STATE["compiled"] and took is not None:
            compiled = f"compiled for {dev} already (the first call took {took:.1f} s)"
        else:
            compiled = f"the first call compiles flex_attention for {dev} (tens of seconds on a CPU, once per process)"
        mask = "no mask" if inp.mask is None else f"a BlockMask of {BLOCK}x{BLOCK} blocks from the mask's structure"
        return f"compiled FlexAttention with {mask}; {compiled}"

    @classmethod
    def forward(cls, inp: AttentionInputs, options: FlexOptions | None):
        options = options or FlexOptions()
        if inp.B == 0:  # Flex traces mask_mods on sample indices, which an empty batch cannot index
            return empty_batch(inp)
        dev = inp.device.type
        first = options.compile and dev not in _STATE["compiled"]
        fn = _compiled(dev, options.compile)
        bm, _ = block_mask(inp.mask, inp)
        # Dynamo specializes on strides even with dynamic shapes, and on whether q, k and v are one
        # object: transposed or sliced inputs, or attention(x, x, x) after attention(q, k, v), would
        # each compile anew (and past its recompile limit run eager). Contiguous strides are
        # expressions of the sizes, and a fresh view per argument keeps the objects distinct
        # (no copy), so one compiled kernel serves every layout and length.
        q, k, v = (t.contiguous().view(t.shape) for t in (inp.q, inp.k, inp.v))
        kwargs = dict(block_mask=bm, scale=inp.scale, enable_gqa=inp.groups > 1)
        if inp.bias is not None or inp.score_mod is not None:
            kwargs["score_mod"] = _score_mod(inp.bias, inp.score_mod, inp.q_offset, inp.kv_offset, inp.device)
        if inp.return_lse:
            kwargs["return_aux"] = _flex_api().AuxRequest(lse=True)
        start = time.perf_counter()
        try:
            with _loud_recompile_limit(options.compile):
                result = fn(q, k, v, **kwargs)
        except Exception as exc:
            if options.compile and type(exc).__name__ == "FailOnRecompileLimitHit":
                # Past dynamo's limit torch would run flex_attention eagerly (the unfused path that
                # materializes every score) without a word: refuse instead.
                raise RuntimeError(
                    f"flex: flex_attention was recompiled {torch._dynamo.config.recompile_limit} times on {dev} "
                    f"(q {tuple(inp.q.shape)}, k {tuple(inp.k.shape)}), dynamo's recompile_limit, and would run "
                    "eagerly from now on. Each mask kind (its structure, e.g. a band or none) compiles once; so "
                    "does each new Custom function. Fix: reuse mask values across calls, raise "
                    "torch._dynamo.config.recompile_limit, or use backend='native' or 'tiled'."
                ) from exc
            if not options.compile or "Inductor" not in type(exc).__name__:
                raise
            # torch 2.13's CPU Flex template fails to compile some mask_mods (C++ codegen errors):
            # say so plainly instead of a page of generated C++.
            raise RuntimeError(
                f"flex: torch.compile of flex_attention failed on {dev} for q {tuple(inp.q.shape)}, "
                f"k {tuple(inp.k.shape)} ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}). "
                "Fix: use backend='native' or 'tiled', or options=FlexOptions(compile=False) (eager, slow)."
            ) from exc
        if first:
            _STATE["compile_seconds"][dev] = time.perf_counter() - start
        if not inp.return_lse:
            return result
        out, aux = result
        lse = aux.lse.float()
        return out, lse.masked_fill(torch.isnan(lse), float("-inf"))
