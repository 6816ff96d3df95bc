"""Reliability probes of generation with bad input: ``attnkit.generate`` (static and paged caches) and
``python -m attnkit generate``.

Every probe is a mistake a user can make: token ids outside the model's vocabulary (in the prompt, the
stop tokens, the pad or start token), prompts of the wrong dtype or with nothing in them, and nonsense
sizes. Each must be refused with a ``ValueError``/``TypeError`` naming the argument (the CLI: one line,
no traceback, naming the flag). The CLI probes run on a checkpoint trained for one step on a synthetic
task (a vocabulary smaller than the 256 bytes a prompt can hold), made once, on first use.
"""

from __future__ import annotations

import contextlib
import io
import tempfile

import probe_reliability as pr
import torch

import attnkit
from attnkit.nn import GPT, EncoderDecoder, TransformerConfig


def _gpt():
    torch.manual_seed(0)
    return GPT(TransformerConfig(vocab_size=20, embed_dim=32, num_layers=1, num_heads=2, max_len=64)).eval()


def n_gen(ids=None, **kwargs):
    def run():
        prompt = torch.tensor([[3, 4, 5]]) if ids is None else ids
        return attnkit.generate(_gpt(), prompt, **{"max_new_tokens": 2, **kwargs})

    return run


def n_seq2seq(ids, **kwargs):
    def run():
        model = EncoderDecoder(TransformerConfig(vocab_size=20, embed_dim=32, num_layers=1, num_heads=2)).eval()
        return attnkit.generate(model, ids, 2, **kwargs)

    return run


def n_padded_with(fill):
    """A right-padded batch whose padding holds ``fill`` (padding positions are read by the model too)."""
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, fill, fill]])
    return n_gen(ids, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))


class _TaskCheckpoint:
    """CLI arguments ``generate <run> *args`` whose run directory (a GPT trained one step on a synthetic
    task) is made when the harness first reads them."""

    run_dir: str | None = None

    def __init__(self, *args):
        self.args = args

    def __iter__(self):
        if _TaskCheckpoint.run_dir is None:
            from attnkit.cli.main import main

            out = tempfile.mkdtemp(prefix="attnkit-probe-") + "/task"
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                main(["train", "--data", "task:copy:16", "--out", out, "--steps", "1", "--batch-size", "2",
                      "--seq-len", "32", "--eval-every", "1", "--eval-batches", "1", "--sample-tokens", "2",
                      "--no-progress", "--device", "cpu", "--warmup-steps", "1", "--embed-dim", "32",
                      "--num-layers", "1", "--num-heads", "2"])
            _TaskCheckpoint.run_dir = out
        args = (_prompts_file(a.text) if isinstance(a, _FileText) else a for a in self.args)
        return iter(("generate", _TaskCheckpoint.run_dir, "--max-new-tokens", "2", *args))


def cli_task(*args):
    return ("cli", _TaskCheckpoint(*args))


class _FileText:
    """A CLI argument written to a temporary file (its path) when the probe runs."""

    def __init__(self, text):
        self.text = text


def _prompts_file(text):
    path = tempfile.mkstemp(prefix="attnkit-probe-", suffix=".txt")[1]
    with open(path, "w") as f:
        f.write(text)
    return path


PROBES = [
    # defect classes of the fix
    ("token id >= vocab", "reject", n_gen(torch.tensor([[3, 20, 5]])), "input_ids"),
    ("negative token id", "reject", n_gen(torch.tensor([[3, -1, 5]])), "input_ids"),
    ("token id >= vocab, paged", "reject", n_gen(torch.tensor([[3, 25]]), cache="paged"), "input_ids"),
    ("block_size=0, paged", "reject", n_gen(cache="paged", block_size=0), "block_size"),
    ("bool prompt", "reject", n_gen(torch.tensor([[True, False]])), "input_ids"),
    ("batch of 0 prompts", "reject", n_gen(torch.zeros(0, 3, dtype=torch.long)), "input_ids"),
    ("pad_token_id=-1 fed after a stop", "reject", n_gen(torch.tensor([[3, 4], [5, 6]]), pad_token_id=-1,
                                                        stop_tokens=list(range(10)), max_new_tokens=4), "pad_token_id"),
    ("stop_tokens=7 (not a list)", "reject", n_gen(stop_tokens=7), "stop_tokens"),
    ("generator=0", "reject", n_gen(generator=0, temperature=1.0), "generator"),
    ("decoder_start_token >= vocab", "reject", n_seq2seq(torch.tensor([[1, 2]]), decoder_start_token=20),
     "decoder_start_token"),
    ("cli: --prompt byte outside the vocabulary", "cli", cli_task("--prompt", "hello"), "--prompt"),
    ("cli: --prompt ''", "cli", cli_task("--prompt", ""), "--prompt"),
    # other shapes and arguments, not the ones the fix was made at
    ("third list prompt has id 99, paged", "reject",
     n_gen([torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 99, 5])], cache="paged"), "input_ids[2]"),
    ("source id >= vocab, EncoderDecoder", "reject", n_seq2seq(torch.tensor([[1, 21, 2]]), decoder_start_token=1),
     "input_ids"),
    ("right padding filled with -100", "reject", n_padded_with(-100), "input_ids"),
    ("int16 prompt, paged", "reject", n_gen(torch.tensor([[3, 4]], dtype=torch.int16), cache="paged"), "input_ids"),
    ("block_size=-4, paged", "reject", n_gen(cache="paged", block_size=-4), "block_size"),
    ("num_blocks=0, paged", "reject", n_gen(cache="paged", num_blocks=0), "num_blocks"),
    ("stop_tokens=[3, 1000]", "reject", n_gen(stop_tokens=[3, 1000]), "stop_tokens"),
    ("float prompt (1, 3)", "reject", n_gen(torch.tensor([[3.0, 4.0, 5.0]])), "input_ids"),
    ("cli: --prompts-file line with a byte outside", "cli", cli_task("--prompts-file", _FileText("\x01\nabc\n")),
     "--prompts-file"),
    ("cli: --prompts-file of empty lines", "cli", cli_task("--prompts-file", _FileText("\n\n")), "--prompts-file"),
    ("cli: --top-k -1", "cli", pr.cli("generate", "no-such-run", "--top-k", "-1"), "top-k"),
]
