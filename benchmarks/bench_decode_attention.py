"""Decode attention at long context: the native decode kernel over every cache format vs SDPA and
the PyTorch-op twin, against this machine's copy bandwidth measured in the same run.

Three sections, each interleaved in one process (torch.utils.benchmark, median of ``--rounds``):

1. ``single``: one sequence, one query token, GQA 32/8, D=128, context 16k:
   ``sdpa fp32`` / ``sdpa bf16`` (F.scaled_dot_product_attention(enable_gqa=True) over a contiguous
   cache: the baselines), ``auto fp32|bf16`` (``attention(q, k, v, kv_finite=True)``: what a static
   cache runs, the backend auto picks), ``native fp32|bf16|int8`` over a contiguous cache (int8: values plus
   per-token, per-head scales), ``native paged fp32|bf16|int8`` over a paged cache (block 16,
   blocks shuffled), and ``torch fp32|int8`` (the decode backend's PyTorch-op twin).
2. ``batch``: 8 sequences with contexts spread over 1k..16k in one paged batch (fp32 and int8),
   GB/s over the bytes actually read (each sequence's own keys, no padding).
   ``native bf16 (convert)`` reads the bf16 cache converted to float32 (``bf16_dot=False``) beside
   the default bf16 dot products (where the CPU has AVX512-BF16); ``native [paged ]int8 quantized-q``
   runs ``DecodeOptions(quantized_query=True)`` (integer dot products over a per-row int8 q).
3. ``mods``: ALiBi, soft-cap and relative-bias decode at Tk=512 (B=1, H=8, D=64): the kernel vs SDPA
   with the materialized float bias (soft-cap has no SDPA form: SDPA runs ALiBi's bias as the
   yardstick; the relative bias's own materialized bias is a row too).
4. ``nonfinite``: one sequence, fp32, at contexts 512, 4096 and 16384: ``attention(q, k, v,
   backend="decode")`` on plain tensors (the native kernel keeps the NaN/Inf contract itself: no scan
   of K/V) vs the same call with ``kv_finite=True`` (the baseline: no scan by the caller's word).
5. ``padded``: 4 sequences padded to one length (``KeyPadding``: lengths T, 3T/4, T/2, T/4) at
   contexts 512 and 4096, plain tensors: ``attention(..., mask=KeyPadding(lengths))`` (``auto``) vs
   SDPA with its materialized boolean padding mask (the baseline).
6. ``ort``: ONNX Runtime's CPU ``GroupQueryAttention`` (``com.microsoft``; the ``bench`` extra pins
   onnxruntime and onnx) at the ``--context`` length, fp32: a one-node graph run through IOBinding
   with the past and present K/V bound to one shared buffer (no copy of the cache per step), the
   baseline, vs ``attention(q, k, v, backend="decode")`` on plain tensors. Skipped, with the reason
   printed, when onnxruntime or onnx cannot be imported.

Each row: ms per call (one layer, one token), bytes read, GB/s, % of the triad bandwidth
(``a = b + s * c`` over arrays much larger than the caches), speed vs the section's baseline.
Read the ratios, not the absolute numbers; the load average is printed.

    python benchmarks/bench_decode_attention.py                      # the figures (about 2-3 minutes)
    python benchmarks/bench_decode_attention.py --context 2048 --rounds 1 --min-run-time 0.05   # smoke
    python benchmarks/bench_decode_attention.py --sections single --single-contexts 1024,4096,16384,65536 \
        --heads 8/1 --head-dim 64                                     # one row set per context
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's attnkit

from attnkit import Causal, KeyPadding, attention  # noqa: E402
from attnkit.backends.decode import DecodeOptions  # noqa: E402
from attnkit.backends.decode_native import kernel_reasons  # noqa: E402
from attnkit.cache import quantize_int8  # noqa: E402
from attnkit.dispatch import select  # noqa: E402
from attnkit.inputs import AttentionInputs  # noqa: E402
from attnkit.kv_handle import KVHandle  # noqa: E402
from attnkit.score_mods import ALiBi, RelativeBias, SoftCap  # noqa: E402

BLOCK = 16
NATIVE = DecodeOptions(implementation="native")
CONVERT = DecodeOptions(implementation="native", bf16_dot=False)
QUANTIZED = DecodeOptions(implementation="native", quantized_query=True)
TORCH = DecodeOptions(implementation="torch")


def _pool(x, table, B, Hkv):
    """``x (B, Hkv, T, ...)`` laid out as a pool ``(Hkv, N, BLOCK, ...)`` in ``table``'s pages."""
    T, shape = x.shape[2], x.shape[3:]
    nb = -(-T // BLOCK)
    x = torch.nn.functional.pad(x, (0, 0) * len(shape) + (0, nb * BLOCK - T))
    pool = torch.zeros(Hkv, int(table.max()) + 1, BLOCK, *shape, dtype=x.dtype)
    pages = x.reshape(B, Hkv, nb, BLOCK, *shape).transpose(0, 1)  # (Hkv, B, nb, BLOCK, ...)
    pool[:, table[:, :nb].flatten()] = pages.reshape(Hkv, B * nb, BLOCK, *shape)
    return pool


def cache(fmt: str, dtype: str, k, v, lengths, g):
    """What attention reads for ``fmt`` ("dense", "paged") and ``dtype`` ("fp32", "bf16", "int8"),
    and the bytes a decode step must read (each row's own keys, values and scales)."""
    B, Hkv, T, D = k.shape
    per_elem = {"fp32": 4, "bf16": 2, "int8": 1}[dtype]
    nbytes = sum(2 * Hkv * L * (D * per_elem + (4 if dtype == "int8" else 0)) for L in lengths)
    if dtype == "bf16":
        k, v = k.bfloat16(), v.bfloat16()
    scales = (None, None)
    if dtype == "int8":
        (k, ks), (v, vs) = quantize_int8(k), quantize_int8(v)
        scales = (ks, vs)
    if fmt == "dense" and dtype != "int8":
        return (k, v), nbytes
    if fmt == "dense":
        h = KVHandle("int8", k, v, tuple(lengths), torch.float32, True, *scales)
        return (h, h), nbytes
    nb = -(-T // BLOCK)
    table = torch.randperm(B * nb, generator=g).view(B, nb)
    pools = [_pool(x, table, B, Hkv) for x in (k, v) + (scales if dtype == "int8" else ())]
    kind = "paged-int8" if dtype == "int8" else "paged"
    h = KVHandle(kind, pools[0], pools[1], tuple(lengths), torch.float32 if dtype == "int8" else k.dtype, True,
                 *(pools[2:] if dtype == "int8" else (None, None)), block_table=table)
    return (h, h), nbytes


def _chosen(q, k, v) -> str:
    return select(AttentionInputs.create(q, k, v, kv_finite=True)).name


def single_cases(T: int, Hq: int, Hkv: int, D: int, g):
    """name -> (callable, bytes read, baseline name)."""
    q = torch.randn(1, Hq, 1, D, generator=g)
    k, v = torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    kb, vb, qb = k.bfloat16(), v.bfloat16(), q.bfloat16()
    fns = {
        "sdpa fp32": (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 2 * k.numel() * 4),
        "sdpa bf16": (lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True), 2 * k.numel() * 2),
        # what a model's static cache runs: attention() with kv_finite=True and backend="auto"
        f"auto fp32 ({_chosen(q, k, v)})": (lambda: attention(q, k, v, kv_finite=True), 2 * k.numel() * 4),
        f"auto bf16 ({_chosen(qb, kb, vb)})": (lambda: attention(qb, kb, vb, kv_finite=True), 2 * k.numel() * 2),
    }
    for fmt in ("dense", "paged"):
        for dtype in ("fp32", "bf16", "int8"):
            (hk, hv), nbytes = cache(fmt, dtype, k, v, [T], g)
            qq = qb if dtype == "bf16" else q
            name = f"native {'paged ' if fmt == 'paged' else ''}{dtype}"
            # kv_finite=True: what a cache passes (its handles say so themselves); plain tensors would
            # add the NaN/Inf policy's finiteness sum over K and V to every call
            fns[name] = (lambda qq=qq, hk=hk, hv=hv: attention(qq, hk, hv, backend="decode", options=NATIVE,
                                                               kv_finite=True), nbytes)
            if dtype == "bf16" and fmt == "dense":
                fns[f"{name} (convert)"] = (lambda qq=qq, hk=hk, hv=hv: attention(
                    qq, hk, hv, backend="decode", options=CONVERT, kv_finite=True), nbytes)
            if dtype == "int8":
                fns[f"{name} quantized-q"] = (lambda qq=qq, hk=hk, hv=hv: attention(
                    qq, hk, hv, backend="decode", options=QUANTIZED, kv_finite=True), nbytes)
            if fmt == "dense" and dtype != "bf16":
                fns[f"torch {dtype}"] = (lambda qq=qq, hk=hk, hv=hv: attention(qq, hk, hv, backend="decode",
                                                                               options=TORCH, kv_finite=True), nbytes)
    return fns, "sdpa fp32"


def batch_cases(T: int, Hq: int, Hkv: int, D: int, g, B: int = 8):
    lengths = [int(x) for x in torch.linspace(T // 16, T, B).round().tolist()]
    q = torch.randn(B, Hq, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    fns = {}
    for dtype in ("fp32", "int8"):
        (hk, hv), nbytes = cache("paged", dtype, k, v, lengths, g)
        fns[f"native paged {dtype} x{B}"] = (lambda hk=hk, hv=hv: attention(q, hk, hv, backend="decode",
                                                                              options=NATIVE), nbytes)
    # the one-sequence baseline: the same bytes read by SDPA would need padding to the longest
    fns[f"sdpa fp32 x{B} padded"] = (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                     2 * k.numel() * 4)
    return fns, f"sdpa fp32 x{B} padded", lengths


def mods_cases(g, T: int = 512, H: int = 8, D: int = 64):
    q = torch.randn(1, H, 1, D, generator=g)
    k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g)
    alibi, cap = ALiBi.geometric(H), SoftCap(30.0)
    pos = torch.arange(T)
    bias = -(alibi.slopes.view(H, 1, 1) * (pos[-1] - pos).abs().view(1, 1, T)).unsqueeze(0)  # (1, H, 1, T)
    rel = RelativeBias(torch.randn(H, 32, generator=g), max_distance=128, bidirectional=False)
    rel_bias = rel.table[:, rel.buckets(pos[-1:], pos)].view(1, H, 1, T)  # table[h, bucket(pos(k) - pos(q))]
    nbytes = 2 * k.numel() * 4
    fns = {
        "sdpa + alibi bias": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), nbytes),
        "native alibi": (lambda: attention(q, k, v, mask=Causal(), score_mod=alibi, backend="decode"), nbytes),
        "native soft-cap": (lambda: attention(q, k, v, mask=Causal(), score_mod=cap, backend="decode"), nbytes),
        "tiled alibi": (lambda: attention(q, k, v, mask=Causal(), score_mod=alibi, backend="tiled"), nbytes),
        "sdpa + relative bias": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=rel_bias), nbytes),
        "native relative bias": (lambda: attention(q, k, v, mask=Causal(), score_mod=rel, backend="decode"), nbytes),
    }
    ref_rel = attention(q, k, v, mask=Causal(), score_mod=rel, backend="naive")
    assert (fns["native relative bias"][0]() - ref_rel).abs().max() < 1e-5
    ref = attention(q, k, v, mask=Causal(), score_mod=alibi, backend="naive")
    assert (fns["native alibi"][0]() - ref).abs().max() < 1e-5
    assert (fns["sdpa + alibi bias"][0]() - ref).abs().max() < 1e-5
    return fns, "sdpa + alibi bias"


def nonfinite_cases(T: int, Hq: int, Hkv: int, D: int, g):
    """Plain tensors (no scan: the kernel keeps the NaN/Inf contract) vs ``kv_finite=True``, one context."""
    q = torch.randn(1, Hq, 1, D, generator=g)
    k, v = torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    nbytes = 2 * k.numel() * 4
    fns = {
        f"kv_finite=True T={T}": (lambda: attention(q, k, v, backend="decode", kv_finite=True), nbytes),
        f"plain T={T}": (lambda: attention(q, k, v, backend="decode"), nbytes),
    }
    return fns, f"kv_finite=True T={T}"


def padded_cases(T: int, Hq: int, Hkv: int, D: int, g, B: int = 4):
    """Padded decode on plain tensors (``KeyPadding``, backend auto) vs SDPA with the materialized mask."""
    lengths = [T * (B - i) // B for i in range(B)]
    q = torch.randn(B, Hq, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    keep = (torch.arange(T).view(1, T) < torch.tensor(lengths).view(B, 1)).view(B, 1, 1, T)
    nbytes = sum(2 * Hkv * L * D * 4 for L in lengths)
    mask = KeyPadding(lengths)
    fns = {
        f"sdpa bool mask T={T}": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True),
                                  nbytes),
        f"attention KeyPadding T={T}": (lambda: attention(q, k, v, mask=mask), nbytes),
    }
    ref = fns[f"sdpa bool mask T={T}"][0]()
    assert (fns[f"attention KeyPadding T={T}"][0]() - ref).abs().max() < 1e-4
    return fns, f"sdpa bool mask T={T}"


def ort_cases(T: int, Hq: int, Hkv: int, D: int, g, threads: int):
    """ONNX Runtime's CPU GroupQueryAttention (one node, IOBinding, past and present K/V in one shared
    buffer of T slots: the step writes its key into the last slot and reads all T) vs the decode
    kernel on plain tensors. Returns None and a reason when onnxruntime or onnx is not importable."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError as exc:
        return None, f"onnxruntime/onnx not importable ({exc}); pip install attnkit[bench]"
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    node = helper.make_node(
        "GroupQueryAttention", inputs, ["output", "present_key", "present_value"], domain="com.microsoft",
        num_heads=Hq, kv_num_heads=Hkv, scale=D**-0.5)
    io = [helper.make_tensor_value_info("query", f32, [1, 1, Hq * D]),
          helper.make_tensor_value_info("key", f32, [1, 1, Hkv * D]),
          helper.make_tensor_value_info("value", f32, [1, 1, Hkv * D]),
          helper.make_tensor_value_info("past_key", f32, [1, Hkv, T, D]),
          helper.make_tensor_value_info("past_value", f32, [1, Hkv, T, D]),
          helper.make_tensor_value_info("seqlens_k", i32, [1]),
          helper.make_tensor_value_info("total_sequence_length", i32, [])]
    outs = [helper.make_tensor_value_info("output", f32, [1, 1, Hq * D]),
            helper.make_tensor_value_info("present_key", f32, [1, Hkv, T, D]),
            helper.make_tensor_value_info("present_value", f32, [1, Hkv, T, D])]
    model = helper.make_model(helper.make_graph([node], "gqa", io, outs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    q = torch.randn(1, Hq, 1, D, generator=g)
    k, v = torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    # the shared buffers hold the T - 1 past keys; the step's own key and value go to slot T - 1
    past_k, past_v = (ort.OrtValue.ortvalue_from_numpy(x.numpy().copy()) for x in (k, v))
    feeds = {"query": q.transpose(1, 2).reshape(1, 1, Hq * D).numpy(),
             "key": k[:, :, -1:].transpose(1, 2).reshape(1, 1, Hkv * D).numpy(),
             "value": v[:, :, -1:].transpose(1, 2).reshape(1, 1, Hkv * D).numpy(),
             "seqlens_k": np.array([T - 1], dtype=np.int32), "total_sequence_length": np.array(T, dtype=np.int32)}
    out = ort.OrtValue.ortvalue_from_shape_and_type([1, 1, Hq * D], np.float32)
    binding = sess.io_binding()
    for name, x in feeds.items():
        binding.bind_cpu_input(name, x)
    binding.bind_ortvalue_input("past_key", past_k)
    binding.bind_ortvalue_input("past_value", past_v)
    binding.bind_ortvalue_output("output", out)
    binding.bind_ortvalue_output("present_key", past_k)  # the same buffer: no copy of the cache
    binding.bind_ortvalue_output("present_value", past_v)

    def run_ort():
        sess.run_with_iobinding(binding)

    run_ort()
    got = torch.from_numpy(out.numpy()).view(1, 1, Hq, D).transpose(1, 2)
    ref = attention(q, k, v, backend="naive")
    assert (got - ref).abs().max() < 1e-4, (got - ref).abs().max()
    nbytes = 2 * k.numel() * 4
    name = f"ort GQA fp32 T={T} ({ort.__version__})"
    fns = {name: (run_ort, nbytes),
           f"decode fp32 T={T}": (lambda: attention(q, k, v, backend="decode"), nbytes)}
    return fns, name


def triad(n: int):
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    return (lambda: torch.add(b, c, alpha=1.5, out=a)), 3 * n * 4


def run_section(title: str, fns: dict, baseline: str, args, bandwidth_fn) -> tuple[list[dict], float]:
    fns = dict(fns, triad=bandwidth_fn)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):  # interleaved: load on the machine hits every case alike
        for name, (fn, _) in fns.items():
            t = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=args.threads)
            times[name].append(t.blocked_autorange(min_run_time=args.min_run_time).median)
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    bandwidth = fns["triad"][1] / med["triad"] / 1e9
    print(f"\n== {title} (copy bandwidth, triad: {bandwidth:.1f} GB/s)")
    print(f"{'case':<34} {'ms/token':>9} {'MB read':>8} {'GB/s':>7} {'% bw':>6} {'vs base':>8}")
    rows = []
    for name, (_, nbytes) in fns.items():
        if name == "triad":
            continue
        gbs = nbytes / med[name] / 1e9
        row = dict(case=name, ms=med[name] * 1e3, bytes=nbytes, gb_per_s=gbs, pct_bandwidth=100 * gbs / bandwidth,
                   speedup_vs_baseline=med[baseline] / med[name])
        rows.append(row)
        print(f"{name:<34} {row['ms']:9.3f} {nbytes / 1e6:8.1f} {gbs:7.1f} {row['pct_bandwidth']:6.1f} "
              f"{row['speedup_vs_baseline']:7.2f}x")
    return rows, bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--single-contexts", type=lambda x: [int(c) for c in x.split(",")], default=None,
                        help="run the `single` section at each of these contexts (e.g. 1024,4096,16384,65536) "
                             "instead of --context alone")
    parser.add_argument("--heads", default="32/8", help="query/key-value heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per case per round")
    parser.add_argument("--triad-mib", type=int, default=512, help="size of each triad array")
    parser.add_argument("--sections", default="single,batch,mods,nonfinite,padded,ort")
    parser.add_argument("--out", default="bench-results/decode_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    Hq, Hkv = (int(x) for x in args.heads.split("/"))
    D, T = args.head_dim, args.context
    probe = torch.zeros(1, Hq, 1, D)
    reasons = kernel_reasons(AttentionInputs.create(probe, probe, probe))
    if reasons:
        sys.exit("the native decode kernel cannot run: " + "; ".join(reasons))
    print(f"threads={args.threads} load average={os.getloadavg()} heads={Hq}/{Hkv} T={T} D={D}")
    g = torch.Generator().manual_seed(0)
    tri = triad(args.triad_mib * 2**20 // 4)
    result = dict(threads=args.threads, load_average=os.getloadavg(), heads=[Hq, Hkv], context=T, head_dim=D,
                  rounds=args.rounds, sections={})
    sections = args.sections.split(",")
    for ctx in (args.single_contexts or [T]) if "single" in sections else ():
        fns, base = single_cases(ctx, Hq, Hkv, D, g)
        ref = fns["sdpa fp32"][0]()
        for name, (fn, _) in fns.items():  # a benchmark of wrong results is worth nothing
            err = (fn().float() - ref).abs().max().item()
            assert err < (0.05 if "int8" in name or "bf16" in name else 1e-4), (name, err)
        rows, bw = run_section(f"one sequence, context {ctx}", fns, base, args, tri)
        single = dict(rows=rows, triad_gb_per_s=bw, context=ctx)
        if args.single_contexts:  # one entry per context
            result["sections"].setdefault("single_contexts", {})[ctx] = single
        else:
            result["sections"]["single"] = single
    if "batch" in sections:
        fns, base, lengths = batch_cases(T, Hq, Hkv, D, g)
        rows, bw = run_section(f"paged batch of {len(lengths)}, contexts {lengths}", fns, base, args, tri)
        result["sections"]["batch"] = dict(rows=rows, triad_gb_per_s=bw, lengths=lengths)
    if "mods" in sections:
        fns, base = mods_cases(g)
        rows, bw = run_section("score modifiers at Tk=512, B=1, H=8, D=64", fns, base, args, tri)
        result["sections"]["mods"] = dict(rows=rows, triad_gb_per_s=bw)
    for section, contexts, make in (("nonfinite", (512, 4096, 16384), nonfinite_cases),
                                    ("padded", (512, 4096), padded_cases)):
        if section not in sections:
            continue
        result["sections"][section] = {}
        for ctx in contexts:
            fns, base = make(ctx, Hq, Hkv, D, g)
            rows, bw = run_section(f"{section}, context {ctx}", fns, base, args, tri)
            result["sections"][section][ctx] = dict(rows=rows, triad_gb_per_s=bw)
    if "ort" in sections:
        fns, base = ort_cases(T, Hq, Hkv, D, g, args.threads)
        if fns is None:
            print(f"\n== ort: skipped: {base}")
            result["sections"]["ort"] = dict(skipped=base)
        else:
            rows, bw = run_section(f"ONNX Runtime GroupQueryAttention, context {T}", fns, base, args, tri)
            result["sections"]["ort"] = dict(rows=rows, triad_gb_per_s=bw)
    result["load_average_after"] = os.getloadavg()
    print(f"load average after: {os.getloadavg()}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
