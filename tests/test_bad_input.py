"""Every invalid call raises ValueError/TypeError naming the argument, what was given and what was
expected — never a silent wrong result or a bare assert."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Custom, Dense, Document, KeyPadding, SlidingWindow
from attnkit.backends.naive import NaiveOptions
from attnkit.nn import AttentionConfig, MultiHeadAttention

q = torch.randn(2, 4, 8, 16)
k = torch.randn(2, 2, 8, 16)
v = torch.randn(2, 2, 8, 16)


def call(**overrides):
    args = dict(q=q, k=k, v=v)
    args.update({name: overrides.pop(name) for name in list(overrides) if name in ("q", "k", "v")})
    return lambda: attnkit.attention(args["q"], args["k"], args["v"], **overrides)


CASES = [
    ("q rank 3", call(q=torch.randn(2, 8, 16)), ValueError, "q"),
    ("k rank 5", call(k=torch.randn(1, 2, 2, 8, 16)), ValueError, "k"),
    ("q not a tensor", call(q=[[1.0]]), TypeError, "q"),
    ("integer q", call(q=torch.ones(2, 4, 8, 16, dtype=torch.long)), TypeError, "q"),
    ("batch mismatch", call(k=torch.randn(3, 2, 8, 16), v=torch.randn(3, 2, 8, 16)), ValueError, "batch"),
    ("head dim mismatch", call(k=torch.randn(2, 2, 8, 15)), ValueError, "head dim"),
    ("v heads", call(v=torch.randn(2, 4, 8, 16)), ValueError, "v"),
    ("v length", call(v=torch.randn(2, 2, 9, 16)), ValueError, "v"),
    ("Hq % Hkv", call(k=torch.randn(2, 3, 8, 16), v=torch.randn(2, 3, 8, 16)), ValueError, "heads"),
    ("mixed dtypes", call(k=k.double()), TypeError, "dtype"),
    ("mixed devices", call(k=torch.empty(2, 2, 8, 16, device="meta")), ValueError, "device"),
    ("empty keys", call(k=torch.randn(2, 2, 0, 16), v=torch.randn(2, 2, 0, 16)), ValueError, "Tk"),
    ("float mask", call(mask=torch.zeros(8, 8)), TypeError, "mask"),
    ("mask shape", call(mask=torch.ones(7, 8, dtype=torch.bool)), ValueError, "mask"),
    ("mask type", call(mask="causal"), TypeError, "mask"),
    ("mask 5 dims", call(mask=torch.ones(1, 1, 1, 8, 8, dtype=torch.bool)), ValueError, "Dense"),
    ("padding batch", call(mask=KeyPadding([8, 8, 8])), ValueError, "batch"),
    ("document too short", call(mask=Document(torch.zeros(2, 5, dtype=torch.long))), ValueError, "Document"),
    ("dropout 1", call(dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout negative", call(dropout_p=-0.1), ValueError, "dropout_p"),
    ("dropout str", call(dropout_p="0.1"), TypeError, "dropout_p"),
    ("scale str", call(scale="0.1"), TypeError, "scale"),
    ("q_offset negative", call(q_offset=-1), ValueError, "q_offset"),
    ("kv_offset negative", call(kv_offset=-3), ValueError, "kv_offset"),
    ("q_offset float", call(q_offset=1.5), TypeError, "q_offset"),
    ("return_lse not bool", call(return_lse="yes"), TypeError, "return_lse"),
    ("unknown backend", call(backend="flash9"), ValueError, "backend"),
    ("backend not str", call(backend=3), TypeError, "backend"),
    ("options wrong backend", call(backend="sdpa", options=NaiveOptions()), TypeError, "options"),
    ("options not dataclass", call(backend="naive", options={"return_weights": True}), TypeError, "options"),
    ("bias int", call(bias=torch.zeros(8, 8, dtype=torch.long)), TypeError, "bias"),
    ("bias shape", call(bias=torch.zeros(3, 8, 8)), ValueError, "bias"),
    ("bias not tensor", call(bias=0.5), TypeError, "bias"),
    ("named backend cannot", call(backend="sdpa", return_lse=True), attnkit.NoBackendError, "log-sum-exp"),
    ("custom returns ints", call(mask=Custom(lambda b, h, qi, ki: qi - ki)), TypeError, "bool"),
    ("mha width", lambda: MultiHeadAttention(AttentionConfig(16, 4))(torch.randn(2, 3, 15)), ValueError, "x"),
    ("mha cross without memory",
     lambda: MultiHeadAttention(AttentionConfig(16, 4, cross_attention=True))(torch.randn(2, 3, 16)), ValueError,
     "memory"),
]

CONSTRUCTION = [
    ("window negative", lambda: SlidingWindow(-1, 0), ValueError, "left"),
    ("window float", lambda: SlidingWindow(2, 1.5), ValueError, "right"),
    ("padding negative", lambda: KeyPadding([3, -1]), ValueError, "lengths"),
    ("padding floats", lambda: KeyPadding(torch.tensor([1.0, 2.0])), TypeError, "lengths"),
    ("padding 2-D", lambda: KeyPadding(torch.ones(2, 2, dtype=torch.long)), ValueError, "lengths"),
    ("document 3-D", lambda: Document(torch.zeros(1, 2, 3, dtype=torch.long)), ValueError, "ids"),
    ("dense not bool", lambda: Dense(torch.zeros(2, 2)), TypeError, "keep"),
    ("custom not callable", lambda: Custom(3), TypeError, "fn"),
    ("config heads divide", lambda: AttentionConfig(10, 3), ValueError, "num_heads"),
    ("config kv heads", lambda: AttentionConfig(16, 4, num_kv_heads=3), ValueError, "num_kv_heads"),
    ("config dropout", lambda: AttentionConfig(16, 4, dropout=1.5), ValueError, "dropout"),
    ("config backend", lambda: AttentionConfig(16, 4, backend="nope"), ValueError, "backend"),
    ("use_backend unknown", lambda: attnkit.use_backend("nope").__enter__(), ValueError, "backend"),
    ("use_backend empty", lambda: attnkit.use_backend().__enter__(), ValueError, "use_backend"),
    ("key_padding_mask float", lambda: attnkit.from_key_padding_mask(torch.zeros(2, 3)), TypeError, "key_padding_mask"),
]


@pytest.mark.parametrize("fn,error,name", [c[1:] for c in CASES + CONSTRUCTION],
                         ids=[c[0] for c in CASES + CONSTRUCTION])
def test_bad_input_raises_clear_error(fn, error, name):
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    assert name.lower() in message.lower(), message
    assert any(word in message for word in ("expected", "Fix", "needs", "cannot", "does not")), message
    assert len(message) > 30

