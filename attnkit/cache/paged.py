"""A paged KV cache: one block pool shared by many sequences (vLLM's PagedAttention layout).

Keys are stored in fixed-size blocks of ``block_size`` tokens taken from a pool of ``num_blocks``
blocks per layer (``(Hkv, num_blocks, block_size, D)``, int8 plus scales with
``quantize="int8"``). Each sequence owns a *block table*, the list of its blocks in order: token
``p`` of a sequence lives in slot ``p % block_size`` of block ``table[p // block_size]``. A
sequence takes blocks as it grows and returns them when freed, so memory follows the tokens
actually held, not ``batch x max_len``::

    cache = PagedKVCache(num_layers=2, num_blocks=64, block_size=16)
    a = cache.add_sequence()              # an empty sequence id
    cache.select([a])                     # the rows of the next forward
    logits = model(prompt, cache=cache)   # prefill sequence a
    b = cache.fork(a)                     # b shares a's blocks (copy-on-write)
    cache.select([a, b])                  # decode both: the shared last block is copied on write
    cache.free(a)                         # its blocks return to the pool (b keeps what it shares)

**Copy-on-write**: ``fork`` shares every block (reference counts); a write into a block held by
more than one sequence first copies it (in every layer), so branches never see each other's new
tokens (beam search, parallel sampling, shared prompt prefixes). ``reorder`` (beam search) forks
and frees accordingly.

The rows of a batch may hold different lengths (continuous batching in
:func:`attnkit.generation.generate`): positions and masks are per row. Attention reads the pages
through a :class:`~attnkit.kv_handle.KVHandle` (format ``"paged"`` or ``"paged-int8"``): the decode
kernel reads the pages in place, one bounded segment at a time; other backends read a gathered copy
(see :mod:`.direct`). A block is zeroed when a sequence takes it, so no slot holds another
sequence's data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._validate import check_int_at_least
from ..kv_handle import KVHandle, dequantize_int8
from .direct import DirectLayerCache, nbytes
from .kv import KVCache
from .layers import _check_kv, all_finite
from .quantized import check_quantize, quantize_int8

__all__ = ["PagedKVCache", "PagedLayerCache", "BlockPool"]


class BlockPool:
    """Block bookkeeping shared by the layers of one :class:`PagedKVCache`: the free list,
    reference counts, every sequence's block table and the rows of the current batch."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = check_int_at_least("num_blocks", num_blocks)
        self.block_size = check_int_at_least("block_size", block_size)
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest first
        self.refcount = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}
        self.active: list[int] = []
        self.layers: list[PagedLayerCache] = []
        self._next_id = 0
        self._memo: dict = {}  # per-forward results shared by the layers (block table, mask)

    def check_sequence(self, seq: int) -> int:
        if seq not in self.tables:
            raise ValueError(f"seq: unknown sequence id {seq!r}; live ids are {sorted(self.tables)}. "
                             "Fix: use an id from add_sequence() or fork() that was not freed.")
        return seq

    def take(self) -> int:
        if not self.free_blocks:
            raise RuntimeError(
                f"PagedKVCache: all {self.num_blocks} blocks of {self.block_size} tokens are in use. "
                "Fix: free finished sequences, or build the cache with more num_blocks."
            )
        block = self.free_blocks.pop()
        self.refcount[block] = 1
        return block

    def release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free_blocks.append(block)

    def writable(self, seq: int, j: int) -> int:
        """Block ``j`` of ``seq``, allocated if new and copied first if shared (copy-on-write)."""
        table = self.tables[seq]
        while len(table) <= j:
            table.append(self.take())
            for layer in self.layers:  # a fresh block holds zeros, never a freed sequence's keys
                layer.zero_block(table[-1])
        block = table[j]
        if self.refcount[block] > 1:
            fresh = self.take()
            for layer in self.layers:
                layer.copy_block(block, fresh)
            self.release(block)
            table[j] = fresh
            block = fresh
        return block

    def memo(self, key, compute):
        """``compute()`` once per ``key`` (the layers of one forward share it); old keys are dropped."""
        if key not in self._memo:
            if len(self._memo) >= 8:
                self._memo.clear()
            self._memo[key] = compute()
        return self._memo[key]


class PagedLayerCache(DirectLayerCache):
    """One layer's pages. Built by :class:`PagedKVCache`; ``seq_len`` is the common length of the
    selected rows (an error when they differ: pass per-row positions instead)."""

    def __init__(self, pool: BlockPool, quantize: str | None) -> None:
        super().__init__()  # cross_kv, finite (every token written since the pool was last emptied), siblings
        self.pool = pool
        self.quantize = quantize
        self.kind = f"paged{' ' + quantize if quantize else ''} (block size {pool.block_size})"
        self.lengths: dict[int, int] = {}
        self.k = self.v = self.k_scale = self.v_scale = None  # (Hkv, N, bs, ·) pools
        self.dtype: torch.dtype | None = None

    def rollback_siblings(self) -> None:
        """The layers that appended this step go back to this layer's lengths (the pages they wrote
        past them are never read)."""
        for layer in self.pool.layers:
            for seq in self.pool.active:
                if layer.lengths.get(seq, 0) > self.lengths.get(seq, 0):
                    layer.lengths[seq] = self.lengths.get(seq, 0)

    @property
    def seq_len(self) -> int:
        lengths = set(self.row_lengths())
        if len(lengths) > 1:
            raise ValueError(
                f"seq_len: the selected sequences hold different lengths {self.row_lengths()}. "
                "Fix: pass per-row positions=cache.positions(T) to the model (generate() does)."
            )
        return lengths.pop() if lengths else 0

    def row_lengths(self) -> list[int]:
        return [self.lengths.get(seq, 0) for seq in self.pool.active]

    def _allocate(self, k: Tensor, v: Tensor) -> None:
        H, N, bs = k.shape[1], self.pool.num_blocks, self.pool.block_size
        dtype = torch.int8 if self.quantize else k.dtype
        self.k = torch.zeros(H, N, bs, k.shape[3], dtype=dtype, device=k.device)
        self.v = torch.zeros(H, N, bs, v.shape[3], dtype=dtype, device=k.device)
        if self.quantize:
            self.k_scale = torch.ones(H, N, bs, device=k.device)
            self.v_scale = torch.ones(H, N, bs, device=k.device)
        self.dtype = k.dtype

    def zero_block(self, block: int) -> None:
        for pool in (self.k, self.v):
            if pool is not None:
                pool[:, block].zero_()
        for pool in (self.k_scale, self.v_scale):
            if pool is not None:
                pool[:, block].fill_(1.0)

    def copy_block(self, src: int, dst: int) -> None:
        for pool in (self.k, self.v, self.k_scale, self.v_scale):
            if pool is not None:
                pool[:, dst].copy_(pool[:, src])

    def _store(self, k, v):
        _check_kv(k, v)
        active = self.pool.active
        if k.shape[0] != len(active):
            raise ValueError(
                f"k: batch size {k.shape[0]} but {len(active)} sequences are selected ({active}). "
                "Fix: cache.select(seq_ids) with one id per batch row before the forward."
            )
        self._check_held(k, v)
        T = k.shape[2]
        if T == 0:
            raise ValueError("k: expected at least one new token (Tnew >= 1), got 0.")
        before = self.row_lengths()
        B, H = k.shape[:2]
        k_rows = k.transpose(0, 1).reshape(H, B * T, k.shape[3])  # (Hkv, B*T, D), row-major tokens
        v_rows = v.transpose(0, 1).reshape(H, B * T, v.shape[3])  # (Dv = 0: a latent cache's values)
        self._write(k_rows, v_rows, [T] * len(active))
        return before

    def _check_held(self, k: Tensor, v: Tensor) -> None:
        """Allocate the pools for ``(B, Hkv, T, ·)`` keys and values, or check that they match them."""
        if self.k is None:
            self._allocate(k, v)
        held = (self.k.shape[0], self.k.shape[3], self.v.shape[3])
        if (k.shape[1], k.shape[3], v.shape[3]) != held or k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(
                f"k, v: this paged cache holds (Hkv, D, Dv) = {held} from {self.dtype} keys, got "
                f"{(k.shape[1], k.shape[3], v.shape[3])} in {k.dtype}/{v.dtype}. Fix: one cache per model."
            )

    def _slots(self, spans: list[tuple[int, int, int]], writable: bool) -> tuple[Tensor, Tensor]:
        """Block and slot ids ``(N,)`` of the positions ``start .. stop-1`` of each ``(seq, start, stop)``,
        in order; ``writable`` allocates (and copies shared blocks on write) first."""
        bs = self.pool.block_size
        blocks, slots = [], []
        for seq, start, stop in spans:
            if writable:  # one call per block
                ids = {j: self.pool.writable(seq, j) for j in range(start // bs, (stop - 1) // bs + 1)}
            else:
                ids = self.pool.tables[seq]
            blocks += [ids[p // bs] for p in range(start, stop)]
            slots += [p % bs for p in range(start, stop)]
        return torch.tensor(blocks, device=self.k.device), torch.tensor(slots, device=self.k.device)

    def _write(self, k_rows: Tensor, v_rows: Tensor, counts: list[int]) -> None:
        """Append ``counts[i]`` tokens to the i-th selected sequence from ``k_rows (Hkv, sum(counts), D)``
        (token-major, sequence after sequence) and ``v_rows``."""
        before = self.row_lengths()
        blocks_t, slots_t = self._slots([(seq, L, L + n) for seq, L, n in zip(self.pool.active, before, counts)],
                                        writable=True)
        finite = all_finite(k_rows, v_rows)
        self.finite = self.finite and finite
        if self.quantize:
            (k_rows, ks), (v_rows, vs) = quantize_int8(k_rows, finite), quantize_int8(v_rows, finite)
            self.k_scale[:, blocks_t, slots_t] = ks
            self.v_scale[:, blocks_t, slots_t] = vs
        self.k[:, blocks_t, slots_t] = k_rows
        self.v[:, blocks_t, slots_t] = v_rows
        for seq, L, n in zip(self.pool.active, before, counts):
            self.lengths[seq] = L + n

    def update_packed(self, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Append a packed batch in one call: ``k (total_new, Hkv, D)``, ``v (total_new, Hkv, Dv)`` hold
        the new tokens of the selected sequences one after another (flash-attn's varlen layout), the
        i-th selected sequence's at rows ``cu_seqlens[i] .. cu_seqlens[i+1]-1``. Returns
        ``(k_all, v_all, cu_seqlens_k)``: every token each selected sequence now holds, packed the
        same way, for :func:`attnkit.varlen_attention` with ``causal=True`` (each prompt attends only
        its own tokens, bottom-right aligned, so a prompt appended to a held prefix continues it)::

            cache.select(seqs)
            k_all, v_all, cu_k = layer.update_packed(k, v, cu)
            out = attnkit.varlen_attention(q, k_all, v_all, cu, cu_k, causal=True)

        Over empty sequences ``k_all, v_all, cu_seqlens_k`` are ``k, v, cu_seqlens`` themselves (full
        precision, and the same offsets tensor: varlen's fast packed self-attention). Decoding then
        continues per sequence with :meth:`update` on ``(B, Hkv, 1, D)`` rows."""
        from ..varlen import check_packed_offsets

        for x, name in ((k, "k"), (v, "v")):
            if not isinstance(x, Tensor) or x.dim() != 3:
                raise ValueError(f"{name}: expected packed (total_tokens, Hkv, D) keys/values, got "
                                 f"{tuple(getattr(x, 'shape', ()))}. Fix: (B, Hkv, T, D) batches go to update().")
        counts = check_packed_offsets(cu_seqlens, k.shape[0], "cu_seqlens")
        active = self.pool.active
        if len(counts) != len(active):
            raise ValueError(f"cu_seqlens: {len(counts)} packed sequences but {len(active)} are selected ({active}). "
                             "Fix: cache.select(seq_ids) with one id per packed sequence, in order.")
        if v.shape[0] != k.shape[0] or any(n == 0 for n in counts):
            raise ValueError(f"k, v, cu_seqlens: expected >= 1 new token per sequence and as many values as keys, "
                             f"got lengths {counts}, {k.shape[0]} keys, {v.shape[0]} values.")
        rows_k, rows_v = k.detach().transpose(0, 1), v.detach().transpose(0, 1)  # (Hkv, total, D)
        self._check_held(rows_k[None], rows_v[None])
        before = self.row_lengths()
        try:
            self._write(rows_k, rows_v, counts)
        except Exception:  # all or nothing across the model's layers, as update()
            self.rollback_siblings()
            raise
        if not any(before):  # a prefill over empty sequences: the new keys are all there is
            return k, v, cu_seqlens
        held = [L + n for L, n in zip(before, counts)]
        blocks_t, slots_t = self._slots([(seq, 0, n) for seq, n in zip(active, held)], writable=False)
        pages = []
        for pool, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = pool[:, blocks_t, slots_t]  # (Hkv, total_held, D)
            x = x if scales is None else dequantize_int8(x, scales[:, blocks_t, slots_t], self.dtype)
            pages.append(x.transpose(0, 1))  # (total_held, Hkv, D)
        cu_k = torch.tensor([0] + held, device=cu_seqlens.device).cumsum(0).to(cu_seqlens.dtype)
        return pages[0], pages[1], cu_k

    def block_table(self) -> Tensor:
        """``(B, nb)`` block ids of the selected rows (padded with block 0, hidden by the mask)."""
        tables = [self.pool.tables[seq] for seq in self.pool.active]
        width = max(1, -(-max(self.row_lengths()) // self.pool.block_size))
        key = ("table", tuple(self.pool.active), tuple(tuple(t[:width]) for t in tables))
        rows = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
        return self.pool.memo(key, lambda: torch.tensor(rows, dtype=torch.long, device=self.k.device))

    def handle(self) -> KVHandle:
        return KVHandle("paged-int8" if self.quantize else "paged", self.k, self.v, tuple(self.row_lengths()),
                        self.dtype, self.finite, self.k_scale, self.v_scale, self.block_table(), self.pool.memo)

    def memory_bytes(self) -> int:
        """Bytes of this layer's pools (all blocks, used or free)."""
        return nbytes(self.k, self.v, self.k_scale, self.v_scale)

    def reset(self):
        raise TypeError("PagedLayerCache: reset the whole PagedKVCache (cache.reset()), not one layer.")

    def crop(self, length):
        raise TypeError("PagedLayerCache: crop the whole PagedKVCache (cache.crop(length)), not one layer.")

    def reorder(self, index):
        raise TypeError("PagedLayerCache: reorder the whole PagedKVCache (cache.reorder(index)), not one layer.")


class PagedKVCache(KVCache):
    """Paged cache for many sequences: ``num_blocks`` blocks of ``block_size`` tokens per layer,
    shared by every sequence; ``quantize="int8"`` stores the pages in int8 (see
    :mod:`attnkit.cache.quantized`). See the module docstring for the life cycle of a sequence."""

    def __init__(self, num_layers: int, *, num_blocks: int, block_size: int = 16, quantize: str | None = None):
        check_int_at_least("num_layers", num_layers)
        self.pool = BlockPool(num_blocks, block_size)
        self.quantize = check_quantize(quantize)
        super().__init__([PagedLayerCache(self.pool, self.quantize) for _ in range(num_layers)])
        self.pool.layers = list(self.layers)

    # -- sequences ------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        seq = self.pool._next_id
        self.pool._next_id += 1
        self.pool.tables[seq] = []
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of ``seq`` (copy-on-write); returns its id."""
        table = self.pool.tables[self.pool.check_sequence(seq)]
        child = self.add_sequence()
        self.pool.tables[child] = list(table)
        for block in table:
            self.pool.refcount[block] += 1
        for layer in self.layers:
            layer.lengths[child] = layer.lengths.get(seq, 0)
        return child

    def free(self, seq: int) -> None:
        """Forget ``seq``; blocks no other sequence shares return to the pool."""
        for block in self.pool.tables.pop(self.pool.check_sequence(seq)):
            self.pool.release(block)
        for layer in self.layers:
            layer.lengths.pop(seq, None)
        self.pool.active = [s for s in self.pool.active if s != seq]

    def select(self, seqs: Sequence[int]) -> None:
        """The sequences of the next forward's batch rows, in order (each at most once)."""
        seqs = [self.pool.check_sequence(s) for s in seqs]
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seqs: each sequence may appear once per batch, got {seqs}. Fix: fork() a copy.")
        self.pool.active = seqs

    @property
    def active(self) -> list[int]:
        return list(self.pool.active)

    def lengths(self, seqs: Sequence[int] | None = None) -> list[int]:
        """Tokens held by ``seqs`` (default: the selected ones)."""
        layer = self.layers[0]
        return [layer.lengths.get(self.pool.check_sequence(s), 0) for s in (self.pool.active if seqs is None else seqs)]

    def positions(self, length: int, device=None) -> Tensor:
        """Absolute positions ``(B, length)`` of the next tokens of the selected rows."""
        return self.layers[0].positions(length, device)

    @property
    def free_block_count(self) -> int:
        return len(self.pool.free_blocks)

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def memory_bytes(self) -> int:
        """Bytes of every layer's pools."""
        return sum(layer.memory_bytes() for layer in self.layers)

    # -- KVCache operations over the selected rows ------------------------------------------------
    def reset(self) -> None:
        for seq in list(self.pool.tables):
            self.free(seq)
        for layer in self.layers:  # every block is free again (and zeroed when taken)
            layer.finite = True

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens of every selected sequence (blocks past them are released)."""
        for seq in self.pool.active:
            held = self.lengths([seq])[0]
            if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= held:
                raise ValueError(f"length: expected an int in [0, {held}] (tokens of sequence {seq}), got {length!r}.")
            table = self.pool.tables[seq]
            keep = self.blocks_needed(length)
            for block in table[keep:]:
                self.pool.release(block)
            del table[keep:]
            for layer in self.layers:
                layer.lengths[seq] = length

    def reorder(self, index: Tensor) -> None:
        """Beam search: row ``i`` becomes old row ``index[i]``; repeated rows are forked
        (copy-on-write), rows no longer used are freed."""
        rows = [int(i) for i in index.tolist()]
        active = self.pool.active
        if any(not 0 <= i < len(active) for i in rows):
            raise ValueError(f"index: rows must lie in [0, {len(active)}), got {rows}.")
        new, used = [], set()
        for i in rows:
            seq = active[i]
            new.append(self.fork(seq) if seq in used else seq)
            used.add(seq)
        for seq in active:
            if seq not in used:
                self.free(seq)
        self.pool.active = new

    def __repr__(self) -> str:
        return (f"PagedKVCache({len(self.layers)} layers, {self.pool.num_blocks} blocks x {self.pool.block_size} "
                f"tokens{', int8' if self.quantize else ''}, {len(self.pool.tables)} sequences, "
                f"{self.free_block_count} free blocks)")
