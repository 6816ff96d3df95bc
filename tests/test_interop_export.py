"""save_pretrained / load_pretrained round trip exactly; optional dependencies stay optional."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("safetensors")

from attnkit.interop import load_pretrained, save_pretrained  # noqa: E402
from attnkit.nn.layers import TransformerConfig  # noqa: E402
from attnkit.nn.models import GPT, Encoder  # noqa: E402


def small(**kw):
    return TransformerConfig(vocab_size=50, max_len=32, embed_dim=32, num_layers=2, num_heads=4, **kw)


@pytest.mark.parametrize("kind", ["gpt", "encoder", "gpt-bf16-untied"])
def test_round_trip_is_exact(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPT(small())
    elif kind == "encoder":
        model = Encoder(small(norm_first=False, type_vocab_size=2, embedding_norm=True, final_norm=False,
                              activation="gelu", layer_norm_eps=1e-12))
    else:
        model = GPT(small(tie_embeddings=False, num_kv_heads=2, position="rope")).to(torch.bfloat16)
    model.eval()
    save_pretrained(model, tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["format"] == "attnkit" and meta["model"] == type(model).__name__
    loaded = load_pretrained(tmp_path)
    assert type(loaded) is type(model) and loaded.config == model.config
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    if isinstance(model, GPT) and model.config.tie_embeddings:
        assert loaded.lm_head.weight is loaded.embed.tokens.weight
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_load_rejects_foreign_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="not an attnkit"):
        load_pretrained(tmp_path)


def test_core_imports_without_hf_packages_and_errors_name_the_extra():
    code = (
        "import sys\n"
        "for name in ('transformers', 'safetensors', 'tokenizers'): sys.modules[name] = None\n"
        "import attnkit, attnkit.interop\n"
        "from attnkit.interop import load_bert, register_hf_attention, save_pretrained\n"
        "for call in (lambda: load_bert('.'), register_hf_attention, lambda: save_pretrained(None, '.')):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as exc:\n"
        "        assert \"pip install 'attnkit[hf]'\" in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('no ImportError')\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
