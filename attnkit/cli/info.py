"""Show the registered backends and, for an input shape and mask, which one `auto` picks and why.

Examples:
    python -m attnkit info
    python -m attnkit info --shape 1,8,1024,64 --mask causal
    python -m attnkit info --shape 1,8,4096,64 --kv-heads 2 --mask window:256 --dtype bfloat16
"""

from __future__ import annotations

import argparse

import torch

from .. import calibration
from ..dispatch import explain
from ..masks import Causal, KeyPadding, Mask, SlidingWindow
from ..masks import longformer
from ..registry import list_backends

MASK_HELP = (
    "none | causal | window:LEFT[,RIGHT] | padding:LEN (keys at positions >= LEN are padding) | "
    "longformer:WINDOW[,GLOBALS] (two-sided window + the first GLOBALS tokens global)"
)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--shape: expected B,H,T,D as four positive ints, got {text!r}")
    return parts  # type: ignore[return-value]


def parse_mask(text: str) -> Mask | None:
    """Parse a mask spec for the command line (see MASK_HELP)."""
    kind, _, arg = text.partition(":")
    try:
        if kind == "none":
            return None
        if kind == "causal":
            return Causal()
        if kind == "window":
            left, _, right = arg.partition(",")
            return SlidingWindow(int(left), int(right or 0))
        if kind == "padding":
            return KeyPadding([int(arg)])
        if kind == "longformer":
            window, _, globals_ = arg.partition(",")
            return longformer(int(window), list(range(int(globals_ or 1))))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--mask: expected {MASK_HELP}, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", type=parse_shape, help="query shape B,H,T,D: explain the choice for this input")
    parser.add_argument("--kv-len", type=int, default=None, help="key length Tk (default: T)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads Hkv (default: H)")
    parser.add_argument("--mask", type=parse_mask, default=None, help=MASK_HELP)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--grad", action="store_true", help="the inputs require gradients (training)")
    parser.add_argument("--lse", action="store_true", help="the log-sum-exp is requested")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def backend_table() -> str:
    rows = []
    for name, impl in list_backends().items():
        c = impl.capabilities()
        flags = [f for f in ("gqa", "dropout", "bias", "backward", "lse") if c[f]]
        rows.append(
            [name, "yes" if c["available"] else "no", "exact" if c["exact"] else "approx", ",".join(c["devices"]),
             ",".join(d.replace("float", "f").replace("bf16", "bf16") for d in c["dtypes"]),
             c["masks"] if isinstance(c["masks"], str) else ",".join(c["masks"]), ",".join(flags)]
        )
    return _table(rows, ["backend", "avail", "kind", "devices", "dtypes", "masks", "features"])


def policy_line() -> str:
    """Whether ``auto`` follows a measured calibration of this machine or the built-in defaults."""
    data = calibration.load()
    if data is None:
        return (f"auto policy: built-in defaults (no calibration at {calibration.calibration_path()}; "
                "measure this machine with `python -m attnkit bench --calibrate`)")
    return (f"auto policy: measured on this machine ({len(data['entries'])} device/dtype/mask/pass entries "
            f"in {calibration.calibration_path()}, from `{data.get('command', 'attnkit bench --calibrate')}`)")


def run(args: argparse.Namespace) -> int:
    print(f"attnkit on torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"CUDA {'available' if torch.cuda.is_available() else 'not available'}")
    print()
    print(backend_table())
    print()
    print(policy_line())
    if args.shape is None:
        print("\nFor a choice explained: python -m attnkit info --shape B,H,T,D --mask causal")
        return 0
    B, H, T, D = args.shape
    Tk = args.kv_len or T
    Hkv = args.kv_heads or H
    dtype = getattr(torch, args.dtype)
    meta = dict(device=args.device, dtype=dtype)
    # Meta-free but cheap: selection reads only shapes/dtypes, so tiny stand-ins are not enough;
    # empty tensors of the real shape cost no compute (torch.empty does not touch memory).
    q = torch.empty(B, H, T, D, **meta).requires_grad_(args.grad)
    k = torch.empty(B, Hkv, Tk, D, **meta).requires_grad_(args.grad)
    v = torch.empty(B, Hkv, Tk, D, **meta).requires_grad_(args.grad)
    print()
    print(explain(q, k, v, mask=args.mask, return_lse=args.lse))
    return 0
