"""Reliability probes of a newcomer's first hour: the command line's usage errors and hints, the
kernel's build command, training data and run directories, a KV cache after a dtype change, the gated
rule given the (B, T, H, D) layout, the bench's plots and table, and what the base classes declare.

A "value" probe returns True when attnkit does the right thing (a command's mistake is one line on
stderr with exit status 2, a refusal names what is wrong and the fix); "reject" and "cli" probes are
classified by the harness (a ValueError/TypeError, or one error line, naming the argument).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import probe_reliability as pr
import torch

import attnkit


def _run(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "attnkit", *argv], capture_output=True, text=True,
                          timeout=pr.LIMIT_S, env=env)


def one_line_usage_error(*argv, flag):
    """The command's mistake: exit 2, one stderr line naming ``flag``, no usage dump."""
    def run():
        proc = _run(*argv)
        lines = proc.stderr.strip().splitlines()
        return proc.returncode == 2 and len(lines) == 1 and flag in lines[0] and "usage:" not in proc.stderr

    return run


def hints_name_this_interpreter():
    env = dict(os.environ, PATH=os.defpath)  # no console script on PATH: bare `python` may be another one
    proc = _run("info", "--shape", "x", env=env)
    return proc.returncode == 2 and not proc.stderr.startswith("python -m attnkit") and sys.executable in proc.stderr


def build_command_exists():
    return _run("build", "--help").returncode == 0


def info_says_where_it_looked():
    out = _run("info").stdout
    return "native kernel:" in out and os.path.join("csrc", "_build") in out


def _file(content: bytes, suffix: str) -> str:
    fd, path = tempfile.mkstemp(suffix=suffix, prefix="attnkit-probe-")
    os.write(fd, content)
    os.close(fd)
    return path


PNG = _file(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8, ".png")
LATIN1 = _file("na\u00efve caf\u00e9 r\u00e9sum\u00e9 ".encode("latin-1") * 40, ".txt")


def cache_after_cast(kind, dtype, layers=1):
    """A cache filled in float32, then the model cast: the refusal names the dtype and the fix, not the batch."""
    def run():
        from attnkit.nn import GPT, TransformerConfig

        torch.manual_seed(0)
        model = GPT(TransformerConfig(vocab_size=40, embed_dim=24, num_layers=layers, num_heads=3, max_len=32)).eval()
        cache = attnkit.cache.KVCache.create(kind, layers, max_len=32 if kind == "static" else None)
        x = torch.randint(0, 40, (3, 5))
        with torch.no_grad():
            model(x, cache=cache)
            model.to(dtype)
            try:
                model(x[:, :1], cache=cache)
            except ValueError as exc:
                text = str(exc)
                return "dtype" in text and str(dtype) in text and "reset()" in text and "batch size" not in text
        return False

    return run


def gated_btHD(B, T, H, D, per_channel=False, beta=False):
    def run():
        q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
        g = -torch.rand(B, H, T, *((D,) if per_channel else ()))
        return attnkit.gated_linear_attention(q, k, v, g, torch.rand(B, H, T) if beta else None)

    return run


def torchrun_rank_refuses_before_the_group(rank):
    """Rank ``rank`` of 4 given a used --out: the same one-line refusal as rank 0, before any process group."""
    def run():
        import torch.distributed as dist

        from attnkit.nn import TransformerConfig
        from attnkit.train import TrainConfig, train

        out = tempfile.mkdtemp(prefix="attnkit-probe-")
        with open(os.path.join(out, "notes.txt"), "w") as f:
            f.write("a user's file")
        saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        real = dist.init_process_group
        os.environ.update(WORLD_SIZE="4", RANK=str(rank), LOCAL_RANK=str(rank))

        def started(*args, **kwargs):
            raise RuntimeError("the process group started before the run directory was checked")

        dist.init_process_group = started
        try:
            train(TrainConfig(data="stdlib", out=out, steps=1, progress=False, device="cpu"),
                  TransformerConfig(embed_dim=16, num_layers=1, num_heads=2, max_len=32))
        except ValueError as exc:
            return str(exc).startswith("out:") and "not empty" in str(exc)
        finally:
            dist.init_process_group = real
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        return False

    return run


def _bench_rows(masks, dtypes, passes=("forward", "train"), lengths=(128, 512, 2048)):
    base = {"status": "ok", "iqr_s": 0.0, "runs": 1, "peak_bytes": 2**20, "gflops": 1.0, "pct_of_matmul_peak": None,
            "error": 1e-7}
    return {"memory_method": "none", "results": [
        {**base, "backend": b, "chosen": "sdpa" if b == "auto" else b, "exact": b != "performer", "mask": m,
         "dtype": d, "passes": p, "n": n, "median_s": n * 1e-6}
        for b in ("sdpa", "performer", "auto") for m in masks for d in dtypes for p in passes for n in lengths]}


def plots_readable(masks, dtypes):
    """At most six panels per PNG, no panel of single points, dashed lines only for approximate backends."""
    def run():
        import matplotlib.figure

        from attnkit.bench import plots

        seen, real = [], matplotlib.figure.Figure.savefig

        def spy(fig, *args, **kwargs):
            drawn = [ax for ax in fig.axes if ax.get_visible() and (ax.lines or ax.collections)]
            lines = [line for ax in drawn for line in ax.lines if not line.get_label().startswith("_")]
            seen.append(len(drawn) <= 6 and all(len(line.get_xdata()) >= 2 for line in lines)
                        and all(line.get_label() in ("performer", "linear", "lsh")
                                for line in lines if line.get_linestyle() == "--"))
            return real(fig, *args, **kwargs)

        matplotlib.figure.Figure.savefig = spy
        try:
            made = plots.write_plots(_bench_rows(masks, dtypes), __import__("pathlib").Path(tempfile.mkdtemp()))
        finally:
            matplotlib.figure.Figure.savefig = real
        return bool(made) and all(seen)

    return run


def table_keeps_names_whole(width):
    def run():
        from attnkit.bench.report import terminal_table

        before = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = str(width)
        try:
            rows = _bench_rows(["bigbird", "window"], ["bfloat16"], lengths=(16384,))["results"]
            names = ("auto", "sliding_window")
            rows = [{**r, "backend": name, "chosen": "sliding_window"} for r, name in zip(rows, names)]
            text = terminal_table({"results": rows})
        finally:
            os.environ.pop("COLUMNS") if before is None else os.environ.__setitem__("COLUMNS", before)
        return text.count("sliding_window") == 2

    return run


def state_cache_is_no_kv_cache():
    state = attnkit.cache.StateCache.recurrent("linear", 8)
    return not isinstance(state, attnkit.cache.LayerCache)


def backend_declares_compiles():
    from attnkit.registry import Backend

    return "compiles" in vars(Backend) and Backend.compiles is False


PROBES = [
    # argparse mistakes: one line, exit 2, the flag named (the shape used for the fix: train --steps abc)
    ("train --steps abc is one line", "value", one_line_usage_error("train", "--steps", "abc", flag="--steps"), ""),
    ("bench --lengths x is one line", "value", one_line_usage_error("bench", "--lengths", "x", flag="--lengths"), ""),
    ("info --shape (no value) is one line", "value", one_line_usage_error("info", "--shape", flag="--shape"), ""),
    ("generate --top-k 1.5 is one line", "value",
     one_line_usage_error("generate", "runs/x", "--top-k", "1.5", flag="--top-k"), ""),
    ("demo --no-such-flag is one line", "value", one_line_usage_error("demo", "--no-such-flag", flag="--no-such-flag"),
     ""),
    # hints and the build command
    ("python -m attnkit hints name this interpreter", "value", hints_name_this_interpreter, ""),
    ("attnkit build is a command", "value", build_command_exists, ""),
    ("info says where it looked for the kernel", "value", info_says_where_it_looked, ""),
    # training data that is not text
    ("train --data file.png", "cli", pr.cli("train", "--data", PNG, "--steps", "1", "--no-progress"), "data"),
    ("train --data latin-1 text", "cli", pr.cli("train", "--data", LATIN1, "--steps", "1", "--no-progress"), "data"),
    # every torchrun rank refuses a used --out before the process group starts
    ("torchrun rank 1 of 4, used --out", "value", torchrun_rank_refuses_before_the_group(1), ""),
    ("torchrun rank 3 of 4, used --out", "value", torchrun_rank_refuses_before_the_group(3), ""),
    # a KV cache reused after model.to(dtype)
    ("dynamic cache after model.to(bfloat16)", "value", cache_after_cast("dynamic", torch.bfloat16), ""),
    ("static cache after model.to(float16), 2 layers", "value", cache_after_cast("static", torch.float16, 2), ""),
    ("dynamic cache after model.to(float64)", "value", cache_after_cast("dynamic", torch.float64), ""),
    # gated_linear_attention given (B, T, H, D)
    ("gated (B,T,H,D) 2x7x3x8", "reject", gated_btHD(2, 7, 3, 8), "(B, T, H, D)"),
    ("gated (B,T,H,D) 1x33x4x16 per-channel gate", "reject", gated_btHD(1, 33, 4, 16, per_channel=True),
     "(B, T, H, D)"),
    ("gated (B,T,H,D) 3x20x2x5 with beta", "reject", gated_btHD(3, 20, 2, 5, beta=True), "(B, T, H, D)"),
    # the bench's plots and table
    ("plots: 5 masks x 2 dtypes x 2 passes", "value", plots_readable(["none", "causal", "window", "bigbird", "padding"],
                                                                    ["float32", "bfloat16"]), ""),
    ("plots: 3 masks x 3 dtypes", "value", plots_readable(["none", "causal", "window"],
                                                         ["float32", "bfloat16", "float16"]), ""),
    ("table at 100 columns keeps sliding_window whole", "value", table_keeps_names_whole(100), ""),
    ("table at 80 columns keeps sliding_window whole", "value", table_keeps_names_whole(80), ""),
    # declarations on the base classes
    ("StateCache is no LayerCache", "value", state_cache_is_no_kv_cache, ""),
    ("Backend declares compiles", "value", backend_declares_compiles, ""),
]
