"""Reformer LSH attention (Kitaev et al. 2020, https://arxiv.org/abs/2001.04451).

Not softmax attention over all keys: each query attends only to keys that share its hash bucket,
found by sorting; used only when named (``backend="lsh"``). Per hash round ``r`` (of ``n_hashes``):

1. bucket every position by its key: ``b_r(j) = argmax([k_j R_r, -k_j R_r])`` (random rotations
   ``R_r (D, n_buckets/2)``; angular LSH, so near keys share buckets);
2. sort all rounds' ``(round, bucket, position)`` and cut the sorted sequence into chunks of
   ``bucket_size``; each chunk attends to itself and the chunk before (one chunk look-back),
   only to entries of the same round and bucket (and, with ``Causal()``, never to later positions);
3. unsort. Query ``i`` sits in the bucket of key ``i`` (self-attention, ``Tq == Tk``); this is
   Reformer's shared-QK attention when ``k = q / |q|`` (:func:`shared_qk`).

Rounds are combined by their log-sum-exp after dividing each pair's weight by the number of
rounds that attend it, so the result is softmax attention over the *union* of the attended pairs.
Self-exclusion rule (``exclude_self=True``, Reformer §2.2): a position attends to itself only when
nothing else is available (then its output is its own value).

Naive twin: exact attention restricted to the union of pairs with the self-exclusion rule —
with ``n_buckets=1`` and ``bucket_size >= Tq`` that is exact (shared-QK) attention with
:func:`self_exclusion` applied to the mask. Memory O(n_hashes · T · bucket_size).
No incremental decoding: buckets and chunks depend on every key, so there is no recurrent state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inputs import AttentionInputs
from .._validate import positive_int
from ..masks import MaskSupport
from ..registry import Backend, register_backend

__all__ = ["LSHOptions", "shared_qk", "self_exclusion", "hash_buckets"]

NO_DECODE = (
    "Reformer LSH cannot decode incrementally: its buckets and chunks are recomputed from every key, "
    "so there is no recurrent state. Fix: decode with backend='linear'/'performer' and RecurrentState, "
    "or with an exact backend and a KV cache."
)


@dataclass(frozen=True, eq=False)
class LSHOptions:
    """``n_hashes``: hash rounds; ``bucket_size``: chunk length of the sorted sequence;
    ``n_buckets``: buckets per round (even, or 1 = no hashing); ``None`` picks
    ``max(2, T / bucket_size)`` rounded up to even. ``rotations (D, n_hashes, n_buckets // 2)``
    (a module's buffer, optional) or ``seed`` to draw them. ``exclude_self``: Reformer's rule."""

    n_hashes: int = 4
    bucket_size: int = 64
    n_buckets: int | None = None
    rotations: Tensor | None = None
    seed: int = 0
    exclude_self: bool = True

    def __post_init__(self):
        positive_int(self.n_hashes, "n_hashes", owner="LSHOptions", fix="pass e.g. n_hashes=4")
        positive_int(self.bucket_size, "bucket_size", owner="LSHOptions", fix="pass e.g. bucket_size=64")
        nb = positive_int(self.n_buckets, "n_buckets", owner="LSHOptions", allow_none=True)
        if nb is not None and nb > 1 and nb % 2:
            raise ValueError(f"LSHOptions(n_buckets={nb!r}): expected 1 or an even int >= 2 (or None = automatic).")

    def buckets_for(self, T: int) -> int:
        if self.n_buckets is not None:
            return self.n_buckets
        nb = max(2, math.ceil(T / self.bucket_size))
        return nb + nb % 2


def shared_qk(x: Tensor) -> tuple[Tensor, Tensor]:
    """Reformer's shared-QK: queries ``x`` and keys ``x / |x|`` from one projection."""
    return x, F.normalize(x, dim=-1)


def self_exclusion(keep: Tensor) -> Tensor:
    """Reformer's rule on a keep-mask ``(…, T, T)``: drop the diagonal, except in rows where
    nothing else is kept (there the position attends to itself only)."""
    eye = torch.eye(keep.shape[-1], dtype=torch.bool, device=keep.device)
    others = keep & ~eye
    return others | (eye & ~others.any(-1, keepdim=True))


def hash_buckets(k: Tensor, options: LSHOptions) -> Tensor:
    """Bucket of each key per round: ``(B, H, n_hashes, T)`` ints in ``[0, n_buckets)``."""
    B, H, T, D = k.shape
    nb = options.buckets_for(T)
    if nb == 1:
        return torch.zeros(B, H, options.n_hashes, T, dtype=torch.long, device=k.device)
    rot = options.rotations
    if rot is None:
        gen = torch.Generator().manual_seed(options.seed)
        rot = torch.randn(D, options.n_hashes, nb // 2, generator=gen)
    elif tuple(rot.shape) != (D, options.n_hashes, nb // 2):
        raise ValueError(
            "LSHOptions(rotations=...): expected shape (D, n_hashes, n_buckets // 2) = "
            f"{(D, options.n_hashes, nb // 2)}, got {tuple(rot.shape)}."
        )
    rotated = torch.einsum("bhtd,drk->bhrtk", k.detach().float(), rot.to(k.device, torch.float32))
    return torch.cat([rotated, -rotated], dim=-1).argmax(dim=-1)  # (B, H, R, T)


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """``x (B, H, T, E)`` rows at ``index (B, H, L)`` -> ``(B, H, L, E)``."""
    return x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1]))


def _look_back(x: Tensor) -> Tensor:
    """``(B, H, N, C, …)`` -> ``(B, H, N, 2C, …)``: each chunk preceded by the chunk before."""
    return torch.cat([torch.roll(x, 1, dims=2), x], dim=3)


def lsh_attention(inp: AttentionInputs, options: LSHOptions) -> Tensor:
    acc = torch.promote_types(inp.dtype, torch.float32)
    k, v = inp.expand_kv()  # (B, H, T, D), (B, H, T, Dv)
    q = inp.q
    B, H, T, _ = q.shape
    R, C = options.n_hashes, options.bucket_size
    nb = options.buckets_for(T)
    causal = inp.mask is not None and inp.mask.is_causal()
    buckets = hash_buckets(k, options) + nb * torch.arange(R, device=q.device)[:, None]  # (B, H, R, T) global ids
    pos = torch.arange(T, device=q.device)
    order = torch.argsort((buckets * T + pos).flatten(2), dim=-1)  # (B, H, R*T): sorted by (round, bucket, pos)
    L = R * T
    N = -(-L // C)
    pad = N * C - L
    src = order % T  # position of each sorted entry
    bid = buckets.flatten(2).gather(2, order)  # bucket id of each sorted entry
    if pad:  # padding entries: position 0, bucket -1 (never matches)
        src = F.pad(src, (0, pad))
        bid = F.pad(bid, (0, pad), value=-1)
    # Where each (round, position) landed in the sorted sequence, to count duplicates and unsort.
    slot = torch.empty_like(order)
    slot.scatter_(2, order, torch.arange(L, device=q.device).expand(B, H, L))
    chunk_of = (slot // C).view(B, H, R, T)  # chunk index of (round, position)

    qs = _gather(q, src).to(acc).view(B, H, N, C, -1)
    ks = _look_back(_gather(k, src).to(acc).view(B, H, N, C, -1))
    vs = _look_back(_gather(v, src).to(acc).view(B, H, N, C, -1))
    qi = src.view(B, H, N, C)
    kj = _look_back(qi)  # (B, H, N, 2C) key positions
    bi = bid.view(B, H, N, C)
    bj = _look_back(bi)
    keep = (bi[..., None] == bj[..., None, :]) & (bi[..., None] >= 0)  # (B, H, N, C, 2C)
    keep[:, :, 0, :, :C] = False  # the first chunk has no chunk before it (no wrap-around)
    if causal:
        keep &= kj[..., None, :] <= qi[..., None]
    if options.exclude_self:
        keep &= kj[..., None, :] != qi[..., None]
    scores = torch.matmul(qs, ks.transpose(-2, -1)) * inp.scale  # (B, H, N, C, 2C)
    if R > 1:  # divide each pair by the number of rounds that attend it: softmax over the union
        # Round r attends (i, j) when they share its bucket and j's chunk is i's or the one before:
        # with code = bucket * (N + 1) + chunk that is code(j) - code(i) in {0, -1}.
        code = (buckets * (N + 1) + chunk_of).int()  # (B, H, R, T); int32 halves the traffic
        count = torch.zeros(scores.shape, dtype=torch.uint8, device=q.device)
        for r in range(R):
            ci = code[:, :, r].gather(2, qi.flatten(2)).view(B, H, N, C)
            d = _look_back(ci)[..., None, :] - ci[..., None]  # (B, H, N, C, 2C)
            count += d.add_(1).bitwise_and_(-2) == 0  # d + 1 in {0, 1}
        scores = scores - torch.log(count.clamp_min(1).to(acc))
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, N, C); -inf where nothing is kept
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0.0)[..., None])
    out = torch.matmul(probs, vs)  # (B, H, N, C, Dv)

    # Unsort back to (round, position) and combine the rounds by their log-sum-exp.
    flat = slot.view(B, H, L)  # sorted index of (round r, position t) at r*T + t
    out = _gather(out.view(B, H, N * C, -1), flat).view(B, H, R, T, -1)
    lse = lse.view(B, H, N * C).gather(2, flat).view(B, H, R, T)
    total = torch.logsumexp(lse, dim=2, keepdim=True)  # (B, H, 1, T)
    seen = torch.isfinite(total)
    w = torch.exp(lse - torch.where(seen, total, 0.0))  # (B, H, R, T)
    out = (w[..., None] * out).sum(2)  # (B, H, T, Dv)
    if options.exclude_self:  # nothing else available: the position attends to itself
        out = torch.where(seen.squeeze(2)[..., None], out, v.to(acc))
    return out.to(inp.dtype)


@register_backend
class LSHBackend(Backend):
    name = "lsh"
    exact = False
    summary = "APPROXIMATE Reformer LSH attention (hash buckets, sorted chunks): O(T * bucket_size * n_hashes)"
    mask_support = MaskSupport("none", "causal")
    Options = LSHOptions
    no_recurrent_reason = NO_DECODE

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs) -> list[str]:
        if inp.Tq != inp.Tk or inp.q_offset != inp.kv_offset:
            return [
                f"is self-attention only (query i joins the bucket of key i): needs Tq == Tk and q_offset == "
                f"kv_offset, got Tq={inp.Tq}, Tk={inp.Tk}, q_offset={inp.q_offset}, kv_offset={inp.kv_offset}; "
                "it cannot decode incrementally (buckets depend on every key)"
            ]
        return []

    @classmethod
    def forward(cls, inp: AttentionInputs, options: LSHOptions | None):
        return lsh_attention(inp, options or LSHOptions())
