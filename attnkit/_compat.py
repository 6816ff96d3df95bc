"""Bits of torch's API used without their import-time cost."""

from __future__ import annotations

import sys

import torch

__all__ = ["assume_constant_result"]


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` when attnkit is
    imported: that import costs about a second of every command's start, and on an install without
    NumPy it prints torch's "Failed to initialize NumPy" warning. The mark is the attribute the
    decorator itself sets; once ``torch._dynamo`` is loaded, the decorator is called as it is."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn
