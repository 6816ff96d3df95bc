"""Loading and exporting other libraries' weights, and attnkit inside Hugging Face ``transformers``.

Everything here needs the ``hf`` extra (``pip install 'attnkit[hf]'``: transformers, safetensors,
tokenizers); importing this package does not, the functions raise ``ImportError`` naming the extra.

* :func:`load_bert` — a BERT-family model directory (``config.json`` + ``model.safetensors``) into
  an attnkit :class:`~attnkit.nn.models.Encoder`; :func:`embed_sentences` — mean-pooled, normalized
  sentence embeddings (sentence-transformers' pipeline).
* :func:`gpt2_from_hf` — a ``GPT2LMHeadModel`` (or its state dict + config) into an attnkit ``GPT``.
* :func:`save_pretrained` / :func:`load_pretrained` — attnkit weights as safetensors + config JSON.
* :func:`register_hf_attention` — ``attn_implementation="attnkit"`` in ``transformers``;
  :func:`hf_cache` — attnkit's static and int8 KV caches as a ``transformers`` cache;
  :func:`latent_cache` and :func:`use_latent_decoding` — DeepSeek-V3 decoding over its latents.
* :func:`use_attnkit_linear_attention` — Qwen3-Next / Qwen3.5 gated-delta, Kimi-Linear KDA and Mamba2 SSD
  layers on attnkit's gated linear attention.
"""

from .bert import bert_config_from_hf, embed_sentences, load_bert, load_bert_state_dict
from .export import load_pretrained, save_pretrained
from .gpt2 import gpt2_config_from_hf, gpt2_from_hf, load_gpt2_state_dict
from .hf_attention import HFMask, attnkit_attention_forward, attnkit_mask, register_hf_attention
from .hf_cache import hf_cache
from .hf_deepseek import latent_cache, use_latent_decoding
from .hf_linear_attention import use_attnkit_linear_attention

__all__ = [
    "load_bert",
    "load_bert_state_dict",
    "bert_config_from_hf",
    "embed_sentences",
    "gpt2_from_hf",
    "gpt2_config_from_hf",
    "load_gpt2_state_dict",
    "save_pretrained",
    "load_pretrained",
    "register_hf_attention",
    "attnkit_attention_forward",
    "attnkit_mask",
    "HFMask",
    "hf_cache",
    "latent_cache",
    "use_latent_decoding",
    "use_attnkit_linear_attention",
]
