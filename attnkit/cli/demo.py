"""Run a tiny demo of attention(): every backend on one causal input, checked against naive."""

from __future__ import annotations

import argparse

import torch

from ..dispatch import explain
from ..functional import attention
from ..inputs import AttentionInputs
from ..masks import Causal
from ..registry import list_backends
from .options import bounded_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=bounded_int(1, 4096), default=256,
                        help="sequence length (1..4096; naive is the reference)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    q = torch.randn(2, 8, args.length, 64)
    k, v = torch.randn(2, 2, args.length, 64), torch.randn(2, 2, args.length, 64)  # GQA: 8 query, 2 kv heads
    print(f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, mask=Causal()")
    print(explain(q, k, v, mask=Causal()))
    ref = attention(q, k, v, mask=Causal(), backend="naive")
    inp = AttentionInputs.create(q, k, v, mask=Causal())
    print("\nbackend      max |out - naive|")
    for name, impl in list_backends().items():
        if not impl.exact or impl.not_supported_reasons(inp):
            continue
        out = attention(q, k, v, mask=Causal(), backend=name)
        print(f"{name:12s} {float((out - ref).abs().max()):.2e}")
    return 0
