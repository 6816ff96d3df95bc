"""attnkit as an attention implementation inside Hugging Face ``transformers``.

After :func:`register_hf_attention` (done on first use by the ``attn_implementation="attnkit"``
helpers below, or call it yourself)::

    model = AutoModel.from_pretrained(path, attn_implementation="attnkit")
    with attnkit.use_backend("tiled"):        # or model.config.attnkit_backend = "tiled"
        out = model(**batch)

HF's model code then calls :func:`attnkit_attention_forward` for every attention layer, which runs
:func:`attnkit.attention` on the backend ``auto`` (or your choice) picks.

Two registrations are needed, because transformers builds masks separately from attention:

* ``AttentionInterface.register("attnkit", attnkit_attention_forward)`` — the attention itself.
* ``AttentionMaskInterface.register("attnkit", attnkit_mask)`` — without a mask function of its own
  transformers passes *no* mask to an unknown implementation. :func:`attnkit_mask` hands over an
  :class:`HFMask`: the pattern HF asked for, recognized as a structured attnkit mask (``Causal()``,
  ``SlidingWindow(left, right)``, nothing) when it is one — so tiled and sliding-window backends can
  skip masked tiles — combined with the padding (``KeyPadding`` for right padding, else a
  ``(B, 1, 1, Tk)`` ``Dense``), plus the absolute offsets of the call (static caches keep keys past
  the current position, so the default bottom-right alignment would be wrong). Packed sequences
  (``DataCollatorWithFlattening``: position ids restarting per sequence, no attention mask) and
  chunked attention are read as ``Document(ids) & Causal()``, so kernels skip the tiles between two
  sequences. A pattern it cannot recognize (blockwise, vmap'ed custom functions) becomes a ``Dense``
  of HF's own boolean mask, which is exact on every backend.

DeepSeek-V3.2 hands the attention function its indexer's top-k key indices (``indices=``, ``(B, Tq,
k)``): they become a :class:`~attnkit.masks.TopK` mask intersected with the model's mask, which the
``topk`` backend runs by gathering the listed keys (never the ``(Tq, Tk)`` mask eager builds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..functional import attention, attention_weights
from ..inputs import split_additive_mask
from ..masks import And, Causal, Dense, Document, KeyPadding, Mask, Padding, SlidingWindow, TopK
from ..score_mods import CustomScoreMod, SoftCap
from ._deps import require
from .hf_cache import vouched

__all__ = ["HFMask", "attnkit_mask", "attnkit_attention_forward", "register_hf_attention", "NAME"]

NAME = "attnkit"
_MASKING: list = [None]  # transformers.masking_utils, imported once by register_hf_attention (not inside a trace)


@dataclass(frozen=True)
class HFMask:
    """What :func:`attnkit_mask` gives HF's model code to pass on to the attention layers.

    ``mask`` is an attnkit mask (None = attend everywhere); queries sit at absolute positions
    ``q_offset ..`` and keys at ``kv_offset ..``. ``shape`` is the ``(B, 1, Tq, Tk)`` HF expects of
    a 4-D mask."""

    mask: Mask | None
    q_offset: int
    kv_offset: int
    shape: tuple[int, int, int, int]

    @property
    def ndim(self) -> int:
        return 4

    def contiguous(self) -> HFMask:  # generate() calls it on the masks it prepares for static caches
        return self

    def keep(self) -> Tensor:
        """The mask as HF's boolean tensor ``(B, 1, Tq, Tk)`` (True = attend), built on demand."""
        B, _, Tq, Tk = self.shape
        if self.mask is None:
            return torch.ones((), dtype=torch.bool).expand(self.shape)
        keep = self.mask.materialize(Tq, Tk, q_offset=self.q_offset, kv_offset=self.kv_offset, batch_size=B,
                                     num_heads=1)
        return keep.expand(self.shape)

    def __getitem__(self, index) -> Tensor:
        """Model code that slices its mask (DeepSeek-V3.2's indexer reads ``attention_mask[:, 0]``)
        gets that slice of :meth:`keep`."""
        return self.keep()[index]


def _offset(value) -> int:
    return int(value.item()) if isinstance(value, Tensor) else int(value)


def _cells(fn) -> dict:
    """The free variables a closure captured, by name."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or closure is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure)}
    except ValueError:  # an empty cell
        return {}


_UNKNOWN = object()


def _from_function(fn, masking) -> Mask | None | object:
    """The attnkit mask that transformers' ``mask_function`` computes, read from how it was built
    (``causal_mask_function``, ``and_masks`` of overlays, packed sequences) with no (Tq, Tk) grid
    evaluated; :data:`_UNKNOWN` for anything else (a custom function: the caller evaluates it)."""
    if fn is masking.causal_mask_function:
        return Causal()
    if fn is masking.bidirectional_mask_function:
        return None
    name, cells = getattr(fn, "__qualname__", ""), _cells(fn)
    if name == "sliding_window_overlay.<locals>.inner_mask" and type(cells.get("sliding_window")) is int:
        return SlidingWindow(cells["sliding_window"] - 1, None)  # kv > q - w: at most w - 1 keys back
    if name == "sliding_window_bidirectional_overlay.<locals>.inner_mask" and type(cells.get("sliding_window")) is int:
        return SlidingWindow(cells["sliding_window"], cells["sliding_window"])  # |q - kv| <= w
    if name != "and_masks.<locals>.and_mask" or not isinstance(cells.get("mask_functions"), tuple):
        return _UNKNOWN
    parts = list(cells["mask_functions"])
    # packed sequences (position ids restarting): and_masks(same document, remapped mask)
    names = [getattr(f, "__qualname__", "") for f in parts]
    packed = [f for f, n in zip(parts, names) if n == "packed_sequence_mask_function.<locals>.inner_mask"]
    remapped = [f for f, n in zip(parts, names) if n == "remap_positions_for_packed_sequence.<locals>.inner_mask"]
    if packed or remapped:
        if len(packed) != 1 or len(remapped) != 1 or len(parts) != 2:
            return _UNKNOWN
        ids, inner = _cells(packed[0]).get("packed_sequence_mask"), _cells(remapped[0]).get("mask_function")
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            return _UNKNOWN
        # Within a document the position ids step by one (that is how transformers found the documents), so
        # the inner mask over positions is the same mask over indices.
        inner = _from_function(inner, masking)
        if inner is not None and not isinstance(inner, Causal):
            return _UNKNOWN
        return Document(ids) if inner is None else And(Document(ids), inner)
    masks = [_from_function(f, masking) for f in parts]
    if any(m is _UNKNOWN for m in masks):
        return _UNKNOWN
    masks = [m for m in masks if m is not None]
    windows = [m for m in masks if isinstance(m, SlidingWindow)]
    if len(windows) == 1 and len(masks) == 2 and any(isinstance(m, Causal) for m in masks):  # one band
        right = windows[0].right
        return SlidingWindow(windows[0].left, 0 if right is None else min(right, 0))
    return None if not masks else masks[0] if len(masks) == 1 else And(*masks)


def _recognize(pattern: Tensor, q_pos: Tensor, kv_pos: Tensor) -> tuple[bool, Mask | None]:
    """``(True, mask)`` when the ``(Tq, Tk)`` boolean ``pattern`` equals a structured mask over the
    absolute positions ``q_pos`` (Tq,) and ``kv_pos`` (Tk,, consecutive): nothing (``None``),
    ``Causal()`` or ``SlidingWindow(left, right)``; ``(False, None)`` otherwise.

    Works row by row (first kept key, count of kept keys), so it needs no (Tq, Tk) tensor beyond
    the pattern itself: a band is one contiguous run per row at the bounds the window predicts."""
    Tk = pattern.shape[1]
    counts = pattern.sum(-1)  # (Tq,) kept keys per query
    rows = counts > 0
    if not bool(rows.any()):
        return False, None
    as_bytes = pattern.to(torch.uint8)
    first = as_bytes.argmax(-1)  # index of the first kept key (0 for empty rows)
    kv0 = int(kv_pos[0])
    left = int((q_pos - kv0 - first)[rows].max())  # farthest kept key before its query
    right = int((kv0 + first + counts - 1 - q_pos)[rows].max())  # farthest kept key after it
    if left < 0 or right < 0:
        return False, None
    lo = (q_pos - left - kv0).clamp(0, Tk)  # the band's first key index per row
    hi = (q_pos + right - kv0).clamp(-1, Tk - 1)  # and its last
    expected = (hi - lo + 1).clamp(min=0)
    last = Tk - 1 - as_bytes.flip(-1).argmax(-1)  # index of the last kept key
    contiguous = torch.equal((last - first + 1)[rows], counts[rows])  # one run per row, no holes
    if not (contiguous and torch.equal(expected, counts) and torch.equal(first[rows], lo[rows])):
        return False, None
    left_open = left >= int(q_pos.max()) - kv0  # every key before each query is kept
    right_open = right >= int(kv_pos[-1] - q_pos.min())  # and every key after it
    if left_open and right_open:
        return True, None
    if left_open and right == 0:
        return True, Causal()
    # The measured bounds are exact for this call (checked above), so a side that is only bounded by
    # the call's key range keeps its finite value: a decode step of a sliding-window model is then
    # SlidingWindow(w, 0), which banded backends run, not SlidingWindow(w, None), which they cannot.
    return True, SlidingWindow(None if left_open else left, right)


def _recognize_packed(pattern: Tensor, offset: int) -> tuple[bool, Mask | None]:
    """``(True, Document(ids) [& Causal()])`` when the ``(B, T, T)`` pattern is packed sequences
    (position ids restarting per sequence, as transformers' ``DataCollatorWithFlattening`` makes):
    blocks on the diagonal, each causal or full. The blocks are read off the entries just below
    and above the diagonal, then the whole pattern is checked, so the answer is exact."""
    B, T, _ = pattern.shape
    if T < 2:
        return False, None
    below = pattern.diagonal(-1, -2, -1)  # (B, T-1): query i+1 sees key i
    above = pattern.diagonal(1, -2, -1)  # (B, T-1): query i sees key i+1
    starts = ~(below | above)  # a new sequence begins at i+1
    ids = torch.nn.functional.pad(starts.long().cumsum(-1), (1, 0))  # (B, T) sequence index per position
    if not bool(starts.any()):
        return False, None
    same = ids[:, :, None] == ids[:, None, :]
    for structure in (Causal(), None):
        expected = same if structure is None else same & torch.ones(T, T, dtype=torch.bool, device=same.device).tril()
        if torch.equal(expected, pattern):
            ids = torch.nn.functional.pad(ids, (offset, 0))  # Document ids cover absolute positions 0..offset+T-1
            doc = Document(ids)
            return True, doc if structure is None else And(doc, structure)
    return False, None


def _padding_mask(padding: Tensor | None, kv_offset: int, kv_length: int) -> Mask | None:
    """HF's 2-D padding mask ``(B, >= kv_offset + Tk)`` over absolute key positions as an attnkit
    mask: ``KeyPadding(lengths)`` when each row is ones then zeros (right padding), else ``Padding``."""
    if padding is None:
        return None
    padding = padding[:, : kv_offset + kv_length].bool()
    if bool(padding[:, kv_offset:].all()):
        return None
    lengths = padding.sum(-1)
    positions = torch.arange(padding.shape[1], device=padding.device)
    if torch.equal(positions[None, :] < lengths[:, None], padding):
        return KeyPadding(lengths)
    return Padding(padding)  # left padding or holes


def attnkit_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> HFMask:
    """The mask function for ``AttentionMaskInterface`` (same arguments as transformers' ``sdpa_mask``)."""
    if isinstance(attention_mask, HFMask):  # generate() builds static-cache masks once and passes them back in
        return attention_mask
    masking = _MASKING[0] or require("transformers.masking_utils", "attn_implementation='attnkit'")
    if mask_function is None:
        mask_function = masking.causal_mask_function
    q_offset, kv_offset = _offset(q_offset), _offset(kv_offset)
    shape = (batch_size, 1, q_length, kv_length)
    padding = masking.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if torch.compiler.is_compiling():
        return _traced_mask(masking, mask_function, padding, shape, q_offset, kv_offset, use_vmap, device)
    structure = _from_function(mask_function, masking)
    documents = [] if structure is _UNKNOWN or structure is None else [
        leaf for leaf in structure.leaves() if isinstance(leaf, Document)]
    # document ids (B, T) cover the positions 0..T-1 of a call without a cache
    recognized = structure is not _UNKNOWN and all(
        q_length == kv_length == d.ids.shape[-1] and q_offset == kv_offset == 0 for d in documents)
    if not recognized:
        structure = None
    elif isinstance(structure, Causal) and q_offset >= kv_offset + kv_length - 1:
        structure = None  # every query sits at or past the last key (a decode step): causality hides nothing
    q_pos = torch.arange(q_length, device=device) + q_offset
    kv_pos = torch.arange(kv_length, device=device) + kv_offset
    if not recognized and not use_vmap:  # vmap'ed functions are not index-based: only sdpa_mask can evaluate them
        b = torch.arange(batch_size, device=device).view(-1, 1, 1, 1)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
        pattern = mask_function(b, h, q_pos.view(1, 1, -1, 1), kv_pos.view(1, 1, 1, -1))
        pattern = torch.as_tensor(pattern, device=device).expand(batch_size, 1, q_length, kv_length)
        if bool((pattern == pattern[:1]).all()):  # the same for every batch element
            recognized, structure = _recognize(pattern[0, 0], q_pos, kv_pos)
        if not recognized and q_length == kv_length and q_offset == kv_offset:
            recognized, structure = _recognize_packed(pattern[:, 0], q_offset)
    if not recognized:
        keep = masking.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device,
        )
        return HFMask(Dense(keep), q_offset, kv_offset, shape)
    pad = _padding_mask(padding, kv_offset, kv_length)
    parts = [m for m in (structure, pad) if m is not None]
    mask = None if not parts else parts[0] if len(parts) == 1 else And(*parts)
    return HFMask(mask, q_offset, kv_offset, shape)


def _traced_mask(masking, mask_function, padding, shape, q_offset, kv_offset, use_vmap, device) -> HFMask:
    """:func:`attnkit_mask` inside a ``torch.compile`` trace: nothing read on the host. Causal and
    bidirectional masks are known by identity and padding is a :class:`Padding` (no check of its
    form); any other pattern is transformers' own boolean mask, as a ``Dense`` (exact everywhere)."""
    B, _, Tq, Tk = shape
    if mask_function is masking.causal_mask_function or mask_function is masking.bidirectional_mask_function:
        structure = Causal() if mask_function is masking.causal_mask_function else None
        pad = None if padding is None else Padding(padding[:, : kv_offset + Tk].bool())
        parts = [m for m in (structure, pad) if m is not None]
        mask = None if not parts else parts[0] if len(parts) == 1 else And(*parts)
        return HFMask(mask, q_offset, kv_offset, shape)
    keep = masking.sdpa_mask(batch_size=B, q_length=Tq, kv_length=Tk, q_offset=q_offset, kv_offset=kv_offset,
                             mask_function=mask_function, attention_mask=padding, allow_is_causal_skip=False,
                             allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)
    return HFMask(Dense(keep), q_offset, kv_offset, shape)


def _added(scores: Tensor, q_offset: int, kv_offset: int) -> CustomScoreMod:
    """A score modifier adding ``scores (B|1, H|1, Tq, Tk)``, indexed relative to the call."""
    Tq, Tk = scores.shape[-2:]

    def add(score, b, h, q_idx, kv_idx):
        b = b if scores.shape[0] > 1 else b * 0
        h = h if scores.shape[1] > 1 else h * 0
        i, j = (q_idx - q_offset).clamp(0, Tq - 1), (kv_idx - kv_offset).clamp(0, Tk - 1)
        return score + scores[b, h, i, j].to(score.dtype)

    return CustomScoreMod(add, name="float attention_mask")


def attnkit_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: HFMask | Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """HF's attention-function signature on top of :func:`attnkit.attention`.

    ``query (B, Hq, Tq, D)``, ``key``/``value (B, Hkv, Tk, D)`` (GQA heads unrepeated, attnkit is
    native); returns ``((B, Tq, Hq, Dv), None)`` as HF expects, or ``(out, weights (B, Hq, Tq, Tk))``
    when the model asks for ``output_attentions=True`` (the weights from
    :func:`attnkit.attention_weights`, before dropout).
    The backend is ``module.config.attnkit_backend`` when set, else ``"auto"`` (which honours
    :func:`attnkit.use_backend`)."""
    # Gemma-2/3 soft-cap the scaled logits before the mask; gpt-oss passes its per-head sinks.
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    score_mod = None if softcap is None else SoftCap(float(softcap))
    sinks = None if sinks is None else sinks.to(query.dtype)
    Tq, Tk = query.shape[2], key.shape[2]
    mask, bias, q_offset, kv_offset = None, position_bias, None, 0
    if isinstance(attention_mask, HFMask):
        if attention_mask.shape[2:] != (Tq, Tk):
            raise ValueError(
                f"attention_mask: an attnkit HFMask built for (Tq, Tk) = {attention_mask.shape[2:]}, but the layer "
                f"got query length {Tq} and key length {Tk}. Fix: build masks with the model's own "
                "create_*_mask helpers for this call."
            )
        mask, q_offset, kv_offset = attention_mask.mask, attention_mask.q_offset, attention_mask.kv_offset
    elif isinstance(attention_mask, Tensor):
        if attention_mask.dtype == torch.bool:
            mask = Dense(attention_mask[..., :Tk])
        elif score_mod is None:  # an additive float mask (HF's eager convention): a bias
            bias = attention_mask[..., :Tk] if bias is None else bias + attention_mask[..., :Tk]
        else:
            # Eager soft-caps the scores, then adds the float mask: its -inf part is a mask (after
            # the cap), and its finite part is added after the cap too.
            keep, added = split_additive_mask(attention_mask[..., :Tk])
            mask = None if keep is None else Dense(keep)
            if added is not None:
                q_offset = Tk - Tq
                score_mod = score_mod >> _added(added, q_offset, kv_offset)
    elif attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and Tq > 1:
            # As transformers' sdpa: without a mask, causal means top-left aligned (an empty static
            # cache's prefill), so keys past the last query are never seen.
            if kwargs.get("indices") is None:  # (key lists index the keys as given: keep them whole)
                key, value = key[:, :, :Tq], value[:, :, :Tq]
            mask, q_offset = Causal(), 0
    else:
        raise TypeError(
            f"attention_mask: expected an attnkit HFMask, a tensor or None, got {type(attention_mask).__name__}. "
            "Fix: load the model with attn_implementation='attnkit' after register_hf_attention()."
        )
    indices = kwargs.get("indices")
    if indices is not None:  # DeepSeek-V3.2: each query's top-k keys (B, Tq, k), indices into this call's keys
        lists = TopK(torch.where(indices >= 0, indices.long() + kv_offset, -1)[:, None])
        mask = lists if mask is None else mask & lists
    if Tq > 1 and isinstance(mask, Causal) and not _WARNED_PACKED[0]:
        _warn_if_packed(kwargs.get("position_ids"))
    config = getattr(module, "config", None)
    backend = getattr(config, "attnkit_backend", None) or "auto"
    out = attention(
        query, key, value, mask=mask, bias=bias, scale=scaling, dropout_p=dropout,
        q_offset=q_offset, kv_offset=kv_offset, backend=backend, score_mod=score_mod,
        sinks=sinks, kv_finite=True if vouched(key, value) else None,
    )
    weights = None
    if kwargs.get("output_attentions"):
        weights = attention_weights(query, key, mask=mask, bias=bias, scale=scaling, q_offset=q_offset,
                                    kv_offset=kv_offset, score_mod=score_mod, sinks=sinks)
    return out.transpose(1, 2).contiguous(), weights  # (B, Tq, Hq, Dv)


_WARNED_PACKED: list = [False]
_CHECKED_POSITIONS: list = [None]  # the last position_ids checked (a forward's layers share one tensor)


def _warn_if_packed(position_ids) -> None:
    """Once per process: position ids that restart inside a row under a plain causal mask are packed
    sequences that transformers did not separate (it detects packing only without a cache), so every
    implementation attends across them. Checked once per position_ids tensor, never inside a trace."""
    if (not isinstance(position_ids, Tensor) or position_ids.shape[-1] < 2 or torch.compiler.is_compiling()
            or position_ids is _CHECKED_POSITIONS[0]):
        return
    _CHECKED_POSITIONS[0] = position_ids
    if bool((position_ids[..., 1:] - position_ids[..., :-1] != 1).any()):
        _WARNED_PACKED[0] = True
        import warnings

        warnings.warn("attnkit: position_ids restart inside a row, but the mask is plain causal: these packed "
                      "sequences attend to each other (transformers detects packing only when the forward runs "
                      "without a cache). Fix: call the model with use_cache=False (or past_key_values=None) for "
                      "packed batches, so each sequence attends to itself only.", UserWarning, stacklevel=3)


def register_hf_attention(name: str = NAME) -> str:
    """Register attnkit with transformers' attention and mask interfaces under ``name``; returns it.

    Idempotent. Afterwards ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` run HF's model code on attnkit backends."""
    modeling = require("transformers.modeling_utils", "register_hf_attention")
    masking = _MASKING[0] = require("transformers.masking_utils", "register_hf_attention")
    modeling.AttentionInterface.register(name, attnkit_attention_forward)
    masking.AttentionMaskInterface.register(name, attnkit_mask)
    return name
