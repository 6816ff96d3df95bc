"""Modules built on :func:`attnkit.attention`."""

from .attention import AttentionConfig, MultiHeadAttention
from .indexer import indexer_scores, lightning_indexer, varlen_lightning_indexer
from .latent_attention import LatentAttentionConfig, MultiHeadLatentAttention
from .layers import DecoderLayer, EncoderLayer, FeedForward, TransformerConfig
from .models import GPT, Decoder, Embeddings, Encoder, EncoderDecoder, ViT, ViTConfig
from .positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
    sinusoidal,
    sinusoidal_2d,
)

__all__ = [
    "AttentionConfig",
    "MultiHeadAttention",
    "LatentAttentionConfig",
    "indexer_scores",
    "lightning_indexer",
    "varlen_lightning_indexer",
    "MultiHeadLatentAttention",
    "TransformerConfig",
    "FeedForward",
    "EncoderLayer",
    "DecoderLayer",
    "Embeddings",
    "Encoder",
    "Decoder",
    "GPT",
    "EncoderDecoder",
    "ViTConfig",
    "ViT",
    "sinusoidal",
    "SinusoidalPositionalEmbedding",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "sinusoidal_2d",
]
