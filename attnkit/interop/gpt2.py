"""GPT-2 (Hugging Face ``GPT2LMHeadModel`` layout) in attnkit's :class:`~attnkit.nn.models.GPT`.

GPT-2 is Pre-LN with a final LayerNorm (``ln_f``), learned positions, ``gelu_new`` (tanh GELU) and
the LM head tied to the token embedding. Its projections are ``Conv1D`` modules whose weight is
stored ``(in, out)``, the transpose of ``nn.Linear``'s ``(out, in)``. The names map::

    transformer.wte / wpe / ln_f        -> embed.tokens / embed.positions / final_norm
    transformer.h.i.ln_1 / ln_2         -> layers.i.norm1 / layers.i.norm2
    transformer.h.i.attn.c_attn         -> layers.i.self_attn.qkv_proj   (columns [q | k | v], transposed)
    transformer.h.i.attn.c_proj         -> layers.i.self_attn.out_proj   (transposed)
    transformer.h.i.mlp.c_fc / c_proj   -> layers.i.ffn.fc1 / layers.i.ffn.fc2 (transposed)

Example (random weights from a config, no download)::

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2))
    model = gpt2_from_hf(hf)            # attnkit GPT with the same logits
"""

from __future__ import annotations

import re

from torch import Tensor

from ._convert import activation, copy_state

__all__ = ["gpt2_config_from_hf", "convert_gpt2_state_dict", "load_gpt2_state_dict", "gpt2_from_hf"]


def gpt2_config_from_hf(hf_config, **overrides):
    """A :class:`~attnkit.nn.layers.TransformerConfig` equal to a HF ``GPT2Config`` (object or dict)."""
    from ..nn.layers import TransformerConfig

    get = hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    if not get("scale_attn_weights", True) or get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError(
            "GPT2Config: scale_attn_weights=False or scale_attn_by_inverse_layer_idx=True is not supported; "
            "expected the standard 1/sqrt(head_dim) scale. Fix: use the default GPT-2 attention scaling."
        )
    embed_dim = get("n_embd")
    fields = dict(
        vocab_size=get("vocab_size"),
        max_len=get("n_positions"),
        embed_dim=embed_dim,
        num_layers=get("n_layer"),
        num_heads=get("n_head"),
        ffn_dim=get("n_inner") or 4 * embed_dim,
        activation=activation(get("activation_function", "gelu_new")),
        norm_first=True,
        layer_norm_eps=get("layer_norm_epsilon", 1e-5),
        position="learned",
        final_norm=True,
        tie_embeddings=get("tie_word_embeddings", True),
        bias=True,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


_LAYER = re.compile(r"^h\.(\d+)\.(.+)$")
_NAMES = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_attn": "self_attn.qkv_proj", "attn.c_proj": "self_attn.out_proj",
          "mlp.c_fc": "ffn.fc1", "mlp.c_proj": "ffn.fc2"}
_TOP = {"wte": "embed.tokens", "wpe": "embed.positions", "ln_f": "final_norm"}
_CONV1D = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}


def convert_gpt2_state_dict(hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF GPT-2 parameter names -> attnkit ``GPT`` names, Conv1D weights transposed to Linear."""
    out: dict[str, Tensor] = {}
    for key, value in hf_state.items():
        if key == "lm_head.weight":
            out["lm_head.weight"] = value
            continue
        module, _, param = key.removeprefix("transformer.").rpartition(".")
        if module in _TOP:
            out[f"{_TOP[module]}.{param}"] = value
            continue
        match = _LAYER.match(module)
        if match is None or match.group(2) not in _NAMES:
            continue  # attn.bias / attn.masked_bias buffers of older checkpoints
        name = match.group(2)
        if name in _CONV1D and param == "weight":
            value = value.t()  # Conv1D (in, out) -> Linear (out, in)
        out[f"layers.{match.group(1)}.{_NAMES[name]}.{param}"] = value
    return out


def load_gpt2_state_dict(model, hf_state: dict[str, Tensor]):
    """Copy a HF ``GPT2LMHeadModel`` state dict into an attnkit ``GPT`` (strict)."""
    converted = convert_gpt2_state_dict(hf_state)
    if getattr(model.config, "tie_embeddings", True):
        converted.pop("lm_head.weight", None)  # the same tensor as embed.tokens.weight
        optional = ("lm_head.weight",)
    else:
        optional = ()
    return copy_state(model, converted, what="GPT-2 state dict", optional=optional,
                      fix="build the GPT with gpt2_config_from_hf(hf_model.config).")


def gpt2_from_hf(hf_model, **overrides):
    """An attnkit ``GPT`` with the weights of a HF ``GPT2LMHeadModel`` (in eval mode)."""
    from ..nn.models import GPT

    model = GPT(gpt2_config_from_hf(hf_model.config, **overrides))
    load_gpt2_state_dict(model, hf_model.state_dict())
    return model.to(next(hf_model.parameters()).dtype).eval()
