"""Show the registered backends and, for an input shape and mask, which one `auto` picks and why.

Examples:
    python -m attnkit info
    python -m attnkit info --shape 1,8,1024,64 --mask causal
    python -m attnkit info --shape 1,8,4096,64 --num-kv-heads 2 --mask window:256 --dtype bfloat16
    python -m attnkit info --shape 1,8,4096,64 --mask bigbird
"""

from __future__ import annotations

import argparse
import os
import shutil
import textwrap
from collections import Counter
from dataclasses import dataclass, replace

import torch

from .. import __version__
from ..dispatch import table as measured_table
from ..bench.cases import MASK_SPECS, BenchConfig
from ..bench.report import format_table
from ..dispatch import explain
from ..masks import Causal, Custom, Dense, Document, KeyPadding, Mask, SlidingWindow, TopK
from ..inputs import FLOAT_DTYPES
from ..registry import ALL_DEVICES, list_backends
from .options import add_deprecated_alias, device, positive_int

MASK_HELP = (
    "one of the masks `bench` measures: none | causal | window[:LEFT[,RIGHT]] (default 256,0) | "
    "padding[:LEN] (keys at positions >= LEN are padding; default 3/4 of the keys) | "
    "bigbird[:WINDOW[,BLOCK]] | longformer[:WINDOW[,BLOCK]] (BlockSparse layouts, default 256,64)"
)

# The input the capability table probes each backend with (cheap: torch.empty, explain runs nothing).
PROBE_LENGTH = 256


@dataclass(frozen=True)
class MaskChoice:
    """A parsed ``--mask``: a bench mask spec and its parameters; ``build(B, Tk)`` gives the mask."""

    kind: str
    config: BenchConfig
    padding_length: int | None = None  # padding:LEN
    right: int = 0  # window:LEFT,RIGHT (bench's window is one-sided)

    def build(self, batch: int, kv_len: int) -> Mask | None:
        if self.padding_length is not None:
            return KeyPadding([self.padding_length] * batch)
        if self.right:
            return SlidingWindow(self.config.window, self.right)
        return MASK_SPECS[self.kind].build(kv_len, replace(self.config, batch=batch))


def parse_mask(text: str) -> MaskChoice:
    """Parse a mask spec for the command line (see MASK_HELP)."""
    kind, _, arg = text.partition(":")
    args = arg.split(",") if arg else []
    default = BenchConfig()
    try:
        numbers = [int(a) for a in args]
    except ValueError:
        numbers = None
    limits = {"none": 0, "causal": 0, "window": 2, "padding": 1, "bigbird": 2, "longformer": 2}
    if kind in limits and numbers is not None and len(numbers) <= limits[kind] and all(x >= 0 for x in numbers):
        if kind == "window":
            left, right = (numbers + [default.window, 0][len(numbers):])[:2]
            if left >= 1:
                return MaskChoice(kind, replace(default, window=left), right=right)
        elif kind == "padding":
            if not numbers or numbers[0] >= 1:
                return MaskChoice(kind, default, numbers[0] if numbers else None)
        elif kind in ("bigbird", "longformer"):
            window, block = (numbers + [default.window, default.block][len(numbers):])[:2]
            if window >= 1 and block >= 1:
                return MaskChoice(kind, replace(default, window=window, block=block))
        else:
            return MaskChoice(kind, default)
    raise argparse.ArgumentTypeError(f"expected {MASK_HELP}; got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", type=parse_shape, help="query shape B,H,T,D: explain the choice for this input")
    parser.add_argument("--kv-len", type=positive_int, default=None, help="key length Tk (default: T)")
    parser.add_argument("--num-kv-heads", type=positive_int, default=None,
                        help="key/value heads Hkv, a divisor of H (default: H)")
    add_deprecated_alias(parser, "--kv-heads", "--num-kv-heads")
    parser.add_argument("--mask", type=parse_mask, default=None, help=MASK_HELP)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--device", type=device, default="cpu", help="a device this machine has (default cpu)")
    parser.add_argument("--grad", action="store_true", help="the inputs require gradients (training)")
    parser.add_argument("--lse", action="store_true", help="the log-sum-exp is requested")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected B,H,T,D as four positive ints, e.g. 1,8,1024,64; got {text!r}")
    return parts  # type: ignore[return-value]


def probe_masks(batch: int = 2, n: int = PROBE_LENGTH) -> dict[str, Mask | None]:
    """The masks the capability table asks each backend about: every ``bench`` mask, plus the
    kinds ``bench`` does not sweep (a dense bool tensor, ``Document``, ``Custom``, ``TopK`` lists)."""
    config = replace(BenchConfig(), batch=batch, window=n // 4, block=n // 8)
    masks: dict[str, Mask | None] = {name: spec.build(n, config) for name, spec in MASK_SPECS.items()}
    masks["dense-bool"] = Dense(torch.ones(n, n, dtype=torch.bool).tril())
    masks["document"] = Document(torch.arange(n).div(n // 2, rounding_mode="floor").expand(batch, n))
    masks["custom"] = Custom(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
    masks["topk"] = TopK(torch.arange(n // 8).expand(1, 1, n, n // 8)) & Causal()  # the first n/8 keys
    return masks


def backend_rows() -> list[dict]:
    """Per backend: availability and the probe masks it accepts, both from the backend's own
    ``not_supported_reasons`` (what ``explain`` reports), on a float32 CPU input of length 256."""
    masks = probe_masks()
    q = torch.empty(2, 4, PROBE_LENGTH, 16)
    rows = []
    for name, impl in list_backends().items():
        reasons = {label: impl.not_supported_reasons(_inputs(q, mask)) for label, mask in masks.items()}
        accepted = [label for label, why in reasons.items() if not why]
        c = impl.capabilities()
        if not c["available"]:
            avail = "no: " + next(iter(r for why in reasons.values() for r in why), "a required package is missing")
        elif not accepted:
            common = Counter(r for why in reasons.values() for r in why).most_common(1)
            avail = "no: " + (common[0][0] if common else "unknown")
        else:
            avail = "yes"
        rows.append({"name": name, "avail": avail, "capabilities": c,
                     "masks": "any" if len(accepted) == len(masks) else ",".join(accepted) or "-"})
    return rows


def _inputs(q, mask):
    from ..inputs import AttentionInputs

    return AttentionInputs.create(q, q, q, mask=mask)


def backend_table() -> str:
    rows, missing = [], []
    for row in backend_rows():
        c = row["capabilities"]
        flags = [f for f in ("dropout", "bias", "backward", "lse") if c[f]]
        avail = row["avail"]
        if avail != "yes":  # the reason goes under the table: a table cell would wrap it into a column
            missing.append(f"  {row['name']}: {avail.removeprefix('no: ')}")
            avail = "no*"
        devices = "all" if set(c["devices"]) == ALL_DEVICES else ",".join(c["devices"])
        dtypes = ("all" if len(c["dtypes"]) == len(FLOAT_DTYPES)
                  else ",".join(d.replace("float", "f") for d in c["dtypes"]))
        rows.append([row["name"], avail, "exact" if c["exact"] else "approx", devices, dtypes,
                     row["masks"].replace(",", ", "), ", ".join(flags)])
    legend = (f"masks: those each backend accepts (its own reasons, as explain() reports them, at T={PROBE_LENGTH})"
              f" among {', '.join(probe_masks())}; 'any' = all of them")
    notes = [legend, f"devices, dtypes: 'all' = {', '.join(sorted(ALL_DEVICES))}; "
                     f"{', '.join(sorted(str(d).removeprefix('torch.') for d in FLOAT_DTYPES))}"]
    notes += ["* not available here:"] + missing if missing else []
    table = format_table(rows, ["backend", "avail", "kind", "devices", "dtypes", "masks", "features"])
    return table + "\n" + "\n".join(wrap(line) for line in notes)


def wrap(text: str) -> str:
    """``text`` wrapped to the terminal, continuation lines indented under its first word."""
    width = shutil.get_terminal_size((100, 24)).columns
    indent = " " * min(len(text) - len(text.lstrip()) + 4, 12)
    return textwrap.fill(text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def native_precision_line() -> str | None:
    """Which path bfloat16/float16 inputs take in the native kernel here, and why (None: not built)."""
    from ..backends import native

    if not native.NativeBackend.available():
        return None
    return "native kernel precision: " + "; ".join(native.half_tiles_note(d) for d in (torch.bfloat16, torch.float16))


def native_kernel_line(prog: str = "attnkit") -> str:
    """Where each native kernel family was looked for, and whether it loaded there (or why not): one
    line per family (prefill, decode, fastpath, gated, sparse; each its own library)."""
    from ..backends import decode_native, native, topk
    from ..backends.kernelized.gated import kernel as gated_kernel
    from ..csrc import build, loader
    from ..inputs import AttentionInputs

    cpu = torch.zeros(1, 1, 1, 1)
    reasons = {"prefill": native.load_extension()[1], "decode": decode_native._extension()[1],
               "fastpath": None if loader.fastpath() is not None else loader.load_library("fastpath"),
               "gated": gated_kernel.extension_reason(),
               "sparse": topk.kernel_reason(AttentionInputs.create(cpu, cpu, cpu))}
    lines = []
    for family, reason in reasons.items():
        where = build.library_path(family)
        if reason is None:
            lines.append(f"native kernel: {family} loaded from {where}")
        else:
            lines.append(f"native kernel: {family} unavailable, looked for {where}: {reason}. "
                         f"`{prog} build` builds it there")
    return "\n".join(lines)


def policy_line(prog: str = "attnkit") -> str:
    """Which table ``auto`` follows here, or that the static rule decides alone."""
    return (f"auto policy: the static rule, refined by this machine's measured table where it has a row "
            f"({measured_table.status()}; `{prog} bench` measures one)")


def _memory_bytes() -> int | None:
    """This machine's physical memory (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def run(args: argparse.Namespace) -> int:
    explanation = None
    if args.shape is not None:  # build and check the input first: a mistake is reported before any output
        B, H, T, D = args.shape
        Tk = args.kv_len or T
        Hkv = args.num_kv_heads or H
        if H % Hkv:
            raise ValueError(f"--num-kv-heads {Hkv}: must divide the {H} query heads of --shape "
                             f"(grouped-query attention); e.g. --num-kv-heads {H} or 1")
        dtype = getattr(torch, args.dtype)
        need = (B * H * T * D + 2 * B * Hkv * Tk * D) * dtype.itemsize
        have = _memory_bytes()
        if have is not None and need > have:
            raise ValueError(f"--shape {B},{H},{T},{D}: q, k and v would take {need / 2**30:.1f} GiB, more than this "
                             f"machine's {have / 2**30:.1f} GiB of memory, so no backend could run the call here. "
                             f"Fix: a smaller B, H, T or D (or --kv-len).")
        if args.mask is not None and args.mask.padding_length is not None and args.mask.padding_length > Tk:
            raise ValueError(f"--mask padding:{args.mask.padding_length}: more valid keys than the {Tk} keys of the "
                             f"input. Fix: padding:LEN with LEN <= {Tk} (--kv-len, else T of --shape).")
        meta = dict(device=args.device, dtype=dtype)
        # selection reads only shapes/dtypes: empty tensors of the real shape cost no compute
        q = torch.empty(B, H, T, D, **meta).requires_grad_(args.grad)
        k = torch.empty(B, Hkv, Tk, D, **meta).requires_grad_(args.grad)
        v = torch.empty(B, Hkv, Tk, D, **meta).requires_grad_(args.grad)
        mask = None if args.mask is None else args.mask.build(B, Tk)
        explanation = explain(q, k, v, mask=mask, return_lse=args.lse)
    print(f"attnkit {__version__} on torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"CUDA {'available' if torch.cuda.is_available() else 'not available'}")
    print()
    print(backend_table())
    print()
    prog = getattr(args, "_prog", "attnkit")
    print("\n".join(wrap(line) for line in native_kernel_line(prog).splitlines()))
    precision = native_precision_line()
    if precision:
        print(wrap(precision) + "\n")
    if explanation is None:
        print(wrap(policy_line(prog)))
        print(f"\nFor a choice explained: {prog} info --shape B,H,T,D --mask causal")
        return 0
    print("\n".join(wrap(line) for line in str(explanation).splitlines()))  # it ends with the policy line
    return 0
