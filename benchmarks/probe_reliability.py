"""Reliability probes: edge and bad inputs, each classified by what attnkit does with it.

    python benchmarks/probe_reliability.py            # prints a table and the totals
    python benchmarks/probe_reliability.py --json out.json

Every probe is one call a user could make. Valid inputs must give the float64 reference's result
("ok"); nonsense must raise a ``ValueError``/``TypeError`` that names the argument ("clear").
Anything else is counted: "silent" (a wrong result, or nonsense accepted), "crash" (another
exception, or an error that does not name the argument) or "hang" (no answer within the time limit).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import warnings
from collections import Counter

import torch

import attnkit
from attnkit import Causal, Custom, KeyPadding

warnings.filterwarnings("ignore")
LIMIT_S = 90  # generous: a CLI start imports torch, and 2 shared cores can be busy


def reference(q, k, v, keep=None, bias=None, scale=None):
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        s = s + bias.double()
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def close(out, ref, tol=1e-4):
    out = out.double()
    return out.shape == ref.shape and bool(((out - ref).abs() <= tol * (1 + ref.abs())).all())


def qkv(B=2, H=2, T=16, D=8, Hkv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hkv = Hkv or H
    return (torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, Hkv, T, D, generator=g).to(dtype),
            torch.randn(B, Hkv, T, D, generator=g).to(dtype))


# -- valid inputs: the result must be right --------------------------------------------------------
def p_custom_batch(backend):
    q, k, v = qkv()
    L = torch.tensor([5, 16])
    out = attnkit.attention(q, k, v, mask=Custom(lambda b, h, qi, ki: ki < L[b]), backend=backend)
    keep = (torch.arange(16)[None, :] < L[:, None])[:, None, None, :]
    return close(out, reference(q, k, v, keep))


def p_custom_head(backend):
    q, k, v = qkv()
    out = attnkit.attention(q, k, v, mask=Custom(lambda b, h, qi, ki: (ki <= qi) | (h == 1)), backend=backend)
    keep = torch.ones(1, 2, 16, 16, dtype=torch.bool)
    keep[:, 0] = torch.ones(16, 16, dtype=torch.bool).tril()
    return close(out, reference(q, k, v, keep))


def p_causal_scale(scale):
    q, k, v = qkv()
    out = attnkit.attention(q, k, v, mask=Causal(), scale=scale)
    return close(out, reference(q, k, v, torch.ones(16, 16, dtype=torch.bool).tril(), scale=scale))


def p_lsh_double_causal():
    q, _, v = qkv(B=1, T=64)
    a = attnkit.attention(q, q, v, mask=Causal() & Causal(), backend="lsh")
    b = attnkit.attention(q, q, v, mask=Causal(), backend="lsh")
    return torch.allclose(a, b)


def p_longformer_causal():
    mask = attnkit.longformer(2, [5], causal=True)
    keep = mask.materialize(8, 8)[0, 0]
    return not bool(keep.triu(1).any())


def p_nan_later_key(backend):
    q, k, v = qkv(B=1, T=32)
    v = v.clone()
    v[0, 0, 20] = float("nan")
    mask = Causal() if backend not in ("sliding_window",) else attnkit.SlidingWindow(8, 0)
    out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    return bool(torch.isfinite(out[0, 0, :20]).all())


def p_bf16_alibi_sdpa():
    q, k, v = qkv(B=1, H=4, T=512, D=32)
    pos = torch.arange(512)
    bias = 0.5 * (pos[None, :] - pos[:, None]).float()[None, None]  # large magnitudes: bf16 rounds them
    ref = reference(q, k, v, bias=bias)
    out = attnkit.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias=bias, backend="sdpa")
    lp = attnkit.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias=bias, backend="naive")
    return (out.double() - ref).abs().max() <= 2 * (lp.double() - ref).abs().max()


def p_topleft_bias_sdpa():
    q, k, v = qkv(B=1, T=16)
    q = q[:, :, :8]
    bias = torch.randn(1, 2, 8, 16)
    keep = torch.ones(8, 16, dtype=torch.bool).tril()
    out = attnkit.attention(q, k, v, mask=Causal(), q_offset=0, bias=bias, backend="sdpa")
    return close(out, reference(q, k, v, keep, bias=bias))


def p_naive_fp16_overflow():
    q = torch.full((1, 1, 4, 80), 256.0, dtype=torch.float16)
    out = attnkit.attention(q, q, q, backend="naive")
    return bool(torch.isfinite(out).all()) and bool((out.float() - 256).abs().max() < 1)


def p_sliding_compile():
    q, k, v = (t.requires_grad_() for t in qkv(B=1, T=100, D=16))
    mask = attnkit.SlidingWindow(40, 0)

    def f(q, k, v):
        return attnkit.attention(q, k, v, mask=mask, backend="sliding_window").pow(2).sum()

    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(f, backend="aot_eager")(q, k, v), (q, k, v))
    return all(torch.allclose(a, b, atol=1e-5) for a, b in zip(eager, compiled))


def p_block_sparse_noncontig():
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(B=1, T=128, D=8))
    mask = attnkit.BlockSparse.bigbird(4, 32)
    out = attnkit.attention(q, k, v, mask=mask, backend="block_sparse")
    return close(out, reference(q, k, v, mask.materialize(128, 128)))


def p_block_sparse_empty_backward():
    q, k, v = (t.requires_grad_() for t in qkv(B=1, T=64))
    out = attnkit.attention(q, k, v, mask=attnkit.BlockSparse(torch.zeros(2, 2, dtype=torch.bool), 32),
                            backend="block_sparse")
    out.sum().backward()
    return q.grad is not None and bool((q.grad == 0).all())


def p_keypadding_batch1_and():
    q, k, v = qkv()
    mask = KeyPadding([10]) & KeyPadding([12, 16])
    out = attnkit.attention(q, k, v, mask=mask, backend="naive")
    keep = (torch.arange(16)[None, :] < torch.tensor([10, 10])[:, None])[:, None, None, :]  # batch 1 broadcasts
    return close(out, reference(q, k, v, keep))


def p_func_grad_tiled():
    q, k, v = qkv(B=1)
    g = torch.func.grad(lambda x: attnkit.attention(x, k, v, backend="tiled").sum())(q)
    return g.shape == q.shape


def p_generate_right_padded():
    from attnkit.nn import GPT, TransformerConfig

    torch.manual_seed(0)
    model = GPT(TransformerConfig(vocab_size=20, embed_dim=32, num_layers=2, num_heads=2, max_len=64)).eval()
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    am = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    both = attnkit.generate(model, ids, attention_mask=am, max_new_tokens=4)
    alone = attnkit.generate(model, ids[1:, :2], max_new_tokens=4)
    return both[1, -4:].tolist() == alone[0, -4:].tolist()


# -- valid inputs, second round -----------------------------------------------------------------------
class _Lengths:
    """A model that keeps per-batch key lengths on itself and masks through a bound method."""

    def __init__(self, n):
        self.lengths = torch.tensor([n])

    def keep(self, b, h, qi, ki):
        return ki < self.lengths[b]


def p_custom_fresh_plan(backend):
    q = torch.randn(1, 2, 300, 16, generator=torch.Generator().manual_seed(3))
    m = _Lengths(300)
    attnkit.attention(q, q, q, mask=Custom(m.keep), backend=backend)
    m.lengths = torch.tensor([10])
    out = attnkit.attention(q, q, q, mask=Custom(m.keep), backend=backend)
    keep = (torch.arange(300) < 10)[None, None, None, :]
    return close(out, reference(q, q, q, keep))


def p_window_dense_before_keys():
    q, k, v = qkv(B=1, T=7)
    q, k, v = q[:, :, :7], k[:, :, :5], v[:, :, :5]  # Tq=7 > Tk=5: queries start before the keys
    dense = torch.rand(7, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    out = attnkit.attention(q, k, v, mask=attnkit.SlidingWindow(2, 0) & dense, backend="sliding_window")
    qp, kp = torch.arange(-2, 5)[:, None], torch.arange(5)[None, :]
    keep = dense & (kp <= qp) & (kp >= qp - 2)
    return close(out, reference(q, k, v, keep[None, None]))


def p_window_sink_lse():
    q, k, v = qkv(B=1, T=8)
    sinks = torch.tensor([0.3, -1.2])
    _, lse = attnkit.attention(q[:, :, :3], k, v, mask=attnkit.SlidingWindow(2, 0), q_offset=40, sinks=sinks,
                               return_lse=True, backend="sliding_window")
    return torch.allclose(lse, sinks[None, :, None].expand_as(lse))


def p_block_sparse_hidden_nan_mod():
    from attnkit.score_mods import CustomScoreMod

    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 23, 8, generator=g).requires_grad_()
    k = torch.randn(1, 2, 37, 8, generator=g).requires_grad_()
    v = torch.randn(1, 2, 37, 8, generator=g).requires_grad_()
    mask = attnkit.BlockSparse(torch.rand(10, 10, generator=g) > 0.4, 4) & Causal()
    mod = CustomScoreMod(lambda s, b, h, qi, ki: torch.where(ki > qi, float("nan"), s))  # NaN at hidden pairs only
    out = attnkit.attention(q, k, v, mask=mask, score_mod=mod, backend="block_sparse")
    out.sum().backward()
    return all(bool(torch.isfinite(t).all()) for t in (out, q.grad, k.grad, v.grad))


def p_softcap_after_float_mask():
    from attnkit.score_mods import SoftCap

    q, k, v = qkv(B=1, T=12)
    keep = torch.ones(12, 12, dtype=torch.bool).tril()
    float_mask = torch.zeros(12, 12).masked_fill(~keep, float("-inf"))
    out = attnkit.attention(q, k, v, float_mask, score_mod=SoftCap(0.5))
    s = q.double() @ k.double().transpose(-1, -2) * 8 ** -0.5
    s = (0.5 * torch.tanh(s / 0.5)).masked_fill(~keep, float("-inf"))
    return close(out, torch.softmax(s, -1) @ v.double())


def p_tiled_infinite_sink():
    q, k, v = qkv(B=1, T=16)
    out, lse = attnkit.attention(q, k, v, mask=Causal(), sinks=torch.tensor([float("inf"), 0.0]), return_lse=True,
                                 backend="tiled")
    return bool((out[:, 0] == 0).all()) and bool((lse[:, 0] == float("inf")).all()) and bool(torch.isfinite(out).all())


def p_relative_bias_short_distance():
    from attnkit.score_mods import RelativeBias

    q, k, v = qkv(B=1, T=16)
    try:
        mod = RelativeBias(torch.randn(2, 8), max_distance=2)
        out = attnkit.attention(q, k, v, score_mod=mod, backend="naive")
    except ValueError as exc:
        return "max_distance" in str(exc)
    buckets = mod.buckets(torch.arange(16)[:, None], torch.arange(16)[None, :])
    bias = mod.table[:, buckets][None]
    return bool(((buckets >= 0) & (buckets < 8)).all()) and close(out, reference(q, k, v, bias=bias))


def p_batch_zero(backend, mask_kind):
    q = torch.randn(0, 4, 9, 8)
    k = v = torch.randn(0, 2, 9, 8)
    part = (Custom(lambda b, h, qi, ki: ki <= qi) if mask_kind == "Custom"
            else attnkit.Dense(torch.ones(9, 9, dtype=torch.bool).tril()))
    mask = (attnkit.SlidingWindow(3, 0) if backend == "sliding_window"
            else attnkit.BlockSparse(torch.ones(3, 3, dtype=torch.bool), 3)) & part
    out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    return out.shape == (0, 4, 9, 8)


def n_wrong_shape_mod(backend):
    from attnkit.score_mods import CustomScoreMod

    q, k, v = qkv(B=1, T=16)
    mod = CustomScoreMod(lambda s, b, h, qi, ki: s.unsqueeze(0))
    mask = attnkit.SlidingWindow(4, 0) if backend == "sliding_window" else (
        attnkit.BlockSparse(torch.ones(2, 2, dtype=torch.bool), 8) if backend == "block_sparse" else Causal())
    return lambda: attnkit.attention(q, k, v, mask=mask, score_mod=mod, backend=backend)


# -- context parallelism: two gloo processes ------------------------------------------------------
CP_LIMIT_S = 45  # a hang shows as "no answer": far below gloo's 30-minute default timeout


def _cp_rank(rank, port, job, results):
    import datetime
    import os

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(minutes=30))  # the default: the probe must not lean on it
        results.put((rank, "ok", job(rank)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which classifies
        results.put((rank, type(exc).__name__, str(exc)))
    import time

    time.sleep(CP_LIMIT_S)  # a rank stays alive after its error (as a trainer's would); the parent ends it


def _cp_run(job) -> dict:
    """``{rank: (status, value)}`` of ``job(rank)`` on 2 spawned processes; ``_Timeout`` when a rank has
    not answered within CP_LIMIT_S (the survivors are killed)."""
    import multiprocessing as mp
    import queue
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_cp_rank, args=(r, port, job, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + CP_LIMIT_S
    try:
        while len(out) < 2:
            rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            out[rank] = (status, value)
    except queue.Empty:
        raise _Timeout() from None
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def _cp_inputs(T=24):
    q, k, v = qkv(B=2, H=2, T=T)
    return q, k, v


def _cp_job_custom(rank):
    from attnkit.distributed import SequenceLayout, context_parallel_attention

    q, k, v = _cp_inputs()
    L = torch.tensor([7, 24])
    mask = Custom(lambda b, h, qi, ki: (ki <= qi) & (ki < L[b]))
    lay = SequenceLayout.zigzag(24, 2)
    out = context_parallel_attention(*(lay.shard(t, rank) for t in (q, k, v)), mask=mask, layout=lay)
    pos = torch.arange(24)
    keep = (pos[None, :] <= pos[:, None])[None, None] & (pos < L[:, None])[:, None, None]
    return close(out, lay.shard(reference(q, k, v, keep), rank))


def _cp_job_rank_padding(rank):
    from attnkit.distributed import context_parallel_attention

    q, k, v = (t[:, :, 12 * rank:12 * rank + 12] for t in _cp_inputs())
    return context_parallel_attention(q, k, v, mask=KeyPadding([20 - rank, 24]), strategy="ring").shape


def _cp_job_raise(rank):
    import time

    import attnkit.distributed.ring as ring
    from attnkit.distributed import context_parallel_attention

    if rank == 1:  # the first block this rank computes fails (as an out-of-memory would)
        def fail(*args, **kwargs):
            raise RuntimeError("simulated out of memory")
        ring.attention = fail
    q, k, v = (t[:, :, 12 * rank:12 * rank + 12] for t in _cp_inputs())
    t0 = time.monotonic()
    try:
        for _layer in range(2):  # a model goes on to its next layer's call
            context_parallel_attention(q, k, v, mask=Causal(), strategy="ring")
    except Exception as exc:  # noqa: BLE001
        return (time.monotonic() - t0, str(exc))
    return (time.monotonic() - t0, "returned")


def p_cp_custom():
    res = _cp_run(_cp_job_custom)
    bad = [f"rank {r}: {s} {v}"[:110] for r, (s, v) in res.items() if s != "ok"]
    if bad:
        raise RuntimeError(bad[0])
    return all(v for _, v in res.values())


def n_cp_rank_padding():
    res = _cp_run(_cp_job_rank_padding)
    if all(s == "ok" for s, _ in res.values()):
        return "accepted"
    if all(s == "ValueError" for s, _ in res.values()):
        raise ValueError(res[0][1])
    raise RuntimeError(f"{res}"[:200])


def p_cp_raising_rank():
    res = _cp_run(_cp_job_raise)
    if any(s != "ok" for s, _ in res.values()):
        raise RuntimeError(f"{res}"[:200])
    return all(v[1] != "returned" and "rank 1" in v[1] and "simulated out of memory" in v[1] for _, v in res.values())


# -- nonsense: must be refused clearly ---------------------------------------------------------------
def n_attention(**kwargs):
    q, k, v = qkv()
    return lambda: attnkit.attention(q, k, v, **kwargs)


def n_config(**kwargs):
    from attnkit.nn import AttentionConfig

    return lambda: AttentionConfig(embed_dim=32, num_heads=4, **kwargs)


def n_tconfig(**kwargs):
    from attnkit.nn import TransformerConfig

    return lambda: TransformerConfig(vocab_size=20, embed_dim=32, num_layers=1, num_heads=2, **kwargs)


def n_generate(**kwargs):
    def run():
        from attnkit.nn import GPT, TransformerConfig

        model = GPT(TransformerConfig(vocab_size=20, embed_dim=32, num_layers=1, num_heads=2, max_len=32)).eval()
        ids = torch.tensor([[3, 4, 5]])
        return attnkit.generate(model, ids, max_new_tokens=2, **kwargs)

    return run


def n_options(backend, cls_path, **kwargs):
    def run():
        module, name = cls_path.rsplit(".", 1)
        cls = getattr(__import__(module, fromlist=[name]), name)
        opts = cls(**kwargs)
        q, k, v = qkv()
        return attnkit.attention(q, k, v, backend=backend, options=opts)

    return run


def n_options_for_sdpa():
    from attnkit.backends.tiled import TiledOptions

    q, k, v = qkv()
    return lambda: attnkit.attention(q, k, v, backend="sdpa", options=TiledOptions())


def cli(*args):
    if args[0] == "train":  # never train into the working directory
        args = (*args, "--out", tempfile.mkdtemp(prefix="attnkit-probe-"))
    return ("cli", args)


PROBES: list[tuple[str, str, object, str]] = [
    # (name, kind, callable or cli args, argument the error must name)
    *[(f"Custom mask uses b ({b})", "value", (lambda b=b: p_custom_batch(b)), "") for b in ("naive", "sdpa", "tiled")],
    *[(f"Custom mask uses h ({b})", "value", (lambda b=b: p_custom_head(b)), "") for b in ("naive", "sdpa", "tiled")],
    *[(f"Causal with scale={s}", "value", (lambda s=s: p_causal_scale(s)), "") for s in (0.0, -0.5)],
    ("lsh: Causal() & Causal() is causal", "value", p_lsh_double_causal, ""),
    ("longformer(causal=True) is causal", "value", p_longformer_causal, ""),
    *[(f"NaN in a later key ({b})", "value", (lambda b=b: p_nan_later_key(b)), "")
      for b in ("naive", "sdpa", "tiled", "sliding_window")],
    ("sdpa: bf16 + float32 ALiBi bias", "value", p_bf16_alibi_sdpa, ""),
    ("sdpa: top-left Causal, Tq < Tk, bias", "value", p_topleft_bias_sdpa, ""),
    ("naive: fp16 256.0, D=80", "value", p_naive_fp16_overflow, ""),
    ("sliding_window: compiled grads", "value", p_sliding_compile, ""),
    ("block_sparse: non-contiguous q/k/v", "value", p_block_sparse_noncontig, ""),
    ("block_sparse: all-off layout backward", "value", p_block_sparse_empty_backward, ""),
    ("KeyPadding batch 1 & per-batch mask", "value", p_keypadding_batch1_and, ""),
    ("torch.func.grad on tiled", "value", p_func_grad_tiled, ""),
    ("generate: right-padded batch", "value", p_generate_right_padded, ""),
    ("scale=nan", "reject", n_attention(scale=float("nan")), "scale"),
    ("scale=inf", "reject", n_attention(scale=float("inf")), "scale"),
    ("1-D bias", "reject", n_attention(bias=torch.zeros(16)), "bias"),
    ("0-D bias", "reject", n_attention(bias=torch.zeros(())), "bias"),
    ("KeyPadding([1.5, 2.7])", "reject", lambda: KeyPadding([1.5, 2.7]), "KeyPadding"),
    ("KeyPadding([True, False])", "reject", lambda: KeyPadding([True, False]), "KeyPadding"),
    ("longformer(2, [0.5])", "reject", lambda: attnkit.longformer(2, [0.5]), "positions"),
    ("NaiveOptions(return_weights='no')", "reject",
     n_options("naive", "attnkit.backends.naive.NaiveOptions", return_weights="no"), "return_weights"),
    ("TiledOptions(upcast='yes')", "reject",
     n_options("tiled", "attnkit.backends.tiled.TiledOptions", upcast="yes"), "upcast"),
    ("options for a backend without options", "reject", n_options_for_sdpa(), "options"),
    ("AttentionConfig(head_dim=True)", "reject", n_config(head_dim=True), "head_dim"),
    ("AttentionConfig(bias='no')", "reject", n_config(bias="no"), "bias"),
    ("AttentionConfig(kv_dim=0)", "reject", n_config(cross_attention=True, kv_dim=0), "kv_dim"),
    ("TransformerConfig(rope_base=0)", "reject", n_tconfig(position="rope", rope_base=0.0), "rope_base"),
    ("TransformerConfig(layer_norm_eps=0)", "reject", n_tconfig(layer_norm_eps=0.0), "layer_norm_eps"),
    ("generate(temperature=nan)", "reject", n_generate(temperature=float("nan")), "temperature"),
    ("generate(top_p=1.5)", "reject", n_generate(top_p=1.5), "top_p"),
    ("generate(repetition_penalty=inf)", "reject", n_generate(repetition_penalty=float("inf")), "penalty"),
    ("bench --min-run-time nan", "cli", cli("bench", "--min-run-time", "nan"), "min-run-time"),
    ("bench --lengths 1e8", "cli", cli("bench", "--lengths", "100000000"), "lengths"),
    ("train --lr inf", "cli", cli("train", "--lr", "inf", "--steps", "1"), "lr"),
    ("train --grad-clip nan", "cli", cli("train", "--grad-clip", "nan", "--steps", "1"), "grad-clip"),
    ("train --eval-every -1", "cli", cli("train", "--eval-every", "-1", "--steps", "1"), "eval-every"),
    ("train --weight-decay -1", "cli", cli("train", "--weight-decay", "-1", "--steps", "1"), "weight-decay"),
    ("info --shape 1,2", "cli", cli("info", "--shape", "1,2"), "shape"),
    ("info --backend nope", "cli", cli("info", "--shape", "1,8,64,64", "--backend", "nope"), "backend"),
    *[(f"Custom over fresh per-batch state ({b})", "value", (lambda b=b: p_custom_fresh_plan(b)), "")
      for b in ("auto", "native")],
    ("sliding_window & Dense, Tq > Tk", "value", p_window_dense_before_keys, ""),
    ("sliding_window: sink LSE past the keys", "value", p_window_sink_lse, ""),
    ("block_sparse: NaN score mod at hidden pairs", "value", p_block_sparse_hidden_nan_mod, ""),
    ("soft-cap after a float attn_mask", "value", p_softcap_after_float_mask, ""),
    ("tiled: sinks=+inf", "value", p_tiled_infinite_sink, ""),
    ("RelativeBias(max_distance=2)", "value", p_relative_bias_short_distance, ""),
    *[(f"B=0 ({b}, {m})", "value", (lambda b=b, m=m: p_batch_zero(b, m)), "")
      for b in ("sliding_window", "block_sparse") for m in ("Custom", "Dense")],
    *[(f"score_mod of the wrong shape ({b})", "reject", n_wrong_shape_mod(b), "score_mod")
      for b in ("naive", "tiled", "sliding_window", "block_sparse")],
    ("train --initializer-range nan", "cli", cli("train", "--initializer-range", "nan", "--steps", "1"),
     "initializer-range"),
    ("train --initializer-range -1", "cli", cli("train", "--initializer-range", "-1", "--steps", "1"),
     "initializer-range"),
    ("info --shape 1,2,1e9,8", "cli", cli("info", "--shape", "1,2,1000000000,8"), "shape"),
    ("info --mask padding:999999", "cli", cli("info", "--shape", "1,2,64,8", "--mask", "padding:999999"), "mask"),
    ("embed --max-length -1", "cli", cli("embed", "--max-length", "-1", "hello"), "max-length"),
    ("embed --max-length 0", "cli", cli("embed", "--max-length", "0", "hello"), "max-length"),
    ("generate --max-new-tokens 0", "cli", cli("generate", "--max-new-tokens", "0", "no-such-run"), "max-new-tokens"),
    ("context parallel: Custom mask (2 ranks)", "value", p_cp_custom, ""),
    ("context parallel: KeyPadding differs by rank", "reject", n_cp_rank_padding, "mask"),
    ("context parallel: one rank raises in the ring", "value", p_cp_raising_rank, ""),
]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def classify(kind, target, argument) -> tuple[str, str]:
    if kind == "cli":
        try:
            proc = subprocess.run([sys.executable, "-m", "attnkit", *target[1]], capture_output=True, text=True,
                                  timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            return "hang", f"no answer in {LIMIT_S} s"
        err = proc.stderr.strip().splitlines()
        if proc.returncode == 0:
            return "silent", "accepted (exit 0)"
        if "Traceback" in proc.stderr:
            return "crash", (err[-1] if err else "")[:120]
        text = " ".join(err)
        return ("clear" if argument in text else "crash"), (err[-1] if err else "")[:120]
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LIMIT_S)
    try:
        result = target()
    except _Timeout:
        return "hang", f"no answer in {LIMIT_S} s"
    except (ValueError, TypeError) as exc:
        if kind == "reject":
            return ("clear" if argument.lower() in str(exc).lower() else "crash"), str(exc)[:120]
        return "crash", f"{type(exc).__name__}: {str(exc)[:110]}"
    except Exception as exc:  # noqa: BLE001 - classifying is the point
        return "crash", f"{type(exc).__name__}: {str(exc)[:110]}"
    finally:
        signal.alarm(0)
    if kind == "reject":
        return "silent", "accepted"
    return ("ok", "") if result else ("silent", "wrong result")


def _area_probes() -> list:
    """The probes of ``benchmarks/reliability/*.py``: one module per area, each with a ``PROBES`` list of the
    same rows as above (they may import this module's helpers as ``probe_reliability``)."""
    import importlib.util
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.modules.setdefault("probe_reliability", sys.modules[__name__])
    rows = []
    for path in sorted((here / "reliability").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"reliability_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ImportError as exc:  # an area whose API this version lacks (an older attnkit): said, not counted
            print(f"skipped  {path.stem}: {exc}", flush=True)
            continue
        rows += [(f"{path.stem}: {name}", *rest) for name, *rest in module.PROBES]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows and totals here")
    parser.add_argument("--only", help="run only the probes whose name contains this text")
    args = parser.parse_args()
    rows = []
    for name, kind, target, argument in PROBES + _area_probes():
        if args.only and args.only not in name:
            continue
        verdict, detail = classify(kind, target, argument)
        rows.append({"probe": name, "verdict": verdict, "detail": detail})
        print(f"{verdict:<7} {name:<44} {detail}", flush=True)
    totals = Counter(r["verdict"] for r in rows)
    print(f"\n{len(rows)} probes: " + ", ".join(f"{totals[k]} {k}" for k in ("ok", "clear", "silent", "crash", "hang")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"attnkit_version": getattr(attnkit, "__version__", "?"), "totals": totals, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
