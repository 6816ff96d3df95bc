"""Modules built on :func:`attnkit.attention`."""

from .attention import AttentionConfig, MultiHeadAttention

__all__ = ["AttentionConfig", "MultiHeadAttention"]
