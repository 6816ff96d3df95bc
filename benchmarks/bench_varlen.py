"""Packed variable-length attention, forward + backward: varlen vs padding vs one call per sequence;
recompiles under ``torch.compile(dynamic=True)``; Hugging Face packed vs padded training steps.

    python benchmarks/bench_varlen.py                       # 16 sequences of 64..2048 tokens, fp32 and bf16
    python benchmarks/bench_varlen.py --sequences 4 --max-length 256 --repeats 1   # a quick look
    python benchmarks/bench_varlen.py --sections recompiles,hf                     # the other two figures

Three ways to run the same causal attention over a batch of sequences of different lengths, timed in
one process with the cases interleaved (``torch.utils.benchmark``, the median of ``--repeats`` rounds):

* ``varlen``: :func:`attnkit.varlen_attention` on the packed ``(total, H, D)`` tokens (``auto``);
* ``padded sdpa``: the batch padded to its longest sequence, ``F.scaled_dot_product_attention`` with
  the bool mask ``causal & key padding`` (what a padded training step does);
* ``per sequence``: one ``F.scaled_dot_product_attention(is_causal=True)`` call per sequence.

Prints times and the ratios against varlen, and the load average.

``recompiles``: ``varlen_attention`` (causal, forward + backward) compiled once with
``torch.compile(dynamic=True)`` (``fullgraph=True`` on ``native`` when it is built), then called on
``--batches`` random packed batches (2..8 sequences, 1000..1100 tokens in all); prints how many graphs
were compiled and how many recompiles that took (the aim: at most 1), checking each output against eager.
``--compile-backend aot_eager`` (default) traces what inductor would without generating code.

``hf``: a tiny random Llama (transformers, ``attn_implementation="attnkit"``) trained one step at a time
on the same sequences as a padded batch and as a ``DataCollatorWithFlattening`` packed batch: the time
ratio padded / packed (interleaved, median of ``--repeats``) and the loss difference.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attnkit


def cases(lengths, H, D, dtype):
    g = torch.Generator().manual_seed(0)
    total, T, B = sum(lengths), max(lengths), len(lengths)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    q, k, v = (torch.randn(total, H, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(total, H, D, generator=g).to(dtype)
    pos = torch.arange(T)
    valid = pos[None, None, None, :] < torch.tensor(lengths)[:, None, None, None]  # (B, 1, 1, T)
    keep = (pos[None, :] <= pos[:, None])[None, None] & valid
    index = torch.cat([b * T + torch.arange(n) for b, n in enumerate(lengths)])  # packed row -> padded row

    def pad(x):  # (total, H, D) -> (B, H, T, D)
        out = x.new_zeros(B * T, H, D)
        out = out.index_copy(0, index, x)
        return out.view(B, T, H, D).transpose(1, 2)

    def run_varlen():
        out = attnkit.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    def run_padded():
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=keep)
        out = out.transpose(1, 2).reshape(B * T, H, D)[index]
        torch.autograd.grad(out, (q, k, v), dout)

    def run_loop():
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qi, ki, vi = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)[0].transpose(0, 1))
        torch.autograd.grad(torch.cat(outs), (q, k, v), dout)

    return {"varlen": run_varlen, "padded sdpa": run_padded, "per sequence": run_loop}


def recompiles(args):
    from torch._dynamo.utils import counters

    backend = "native" if attnkit.get_backend("native").available() else "auto"
    H, D = args.heads, args.head_dim

    def step(q, k, v, cu, longest):
        return attnkit.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True, backend=backend)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, dynamic=True, fullgraph=backend == "native", backend=args.compile_backend)
    g = torch.Generator().manual_seed(2)
    worst = 0.0
    for _ in range(args.batches):
        n = int(torch.randint(2, 9, (), generator=g))
        total = int(torch.randint(1000, 1101, (), generator=g))
        cuts = torch.randperm(total - 1, generator=g)[: n - 1].sort().values + 1
        cu = F.pad(torch.cat([cuts, torch.tensor([total])]), (1, 0)).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        q, k, v = (torch.randn(total, H, D, generator=g).requires_grad_() for _ in range(3))
        out = compiled(q, k, v, cu, longest)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        ref = step(q, k, v, cu, longest)
        ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
        worst = max([worst, float((out - ref).abs().max())]
                    + [float((a - b).abs().max()) for a, b in zip(grads, ref_grads)])
    graphs = counters["stats"]["unique_graphs"]
    print(f"\nrecompiles: {args.batches} random batches (1000..1100 tokens, 2..8 sequences), backend={backend}, "
          f"torch.compile(dynamic=True, backend={args.compile_backend!r}): {graphs} graph(s) compiled, "
          f"{max(0, graphs - 1)} recompile(s); max |compiled - eager| over outputs and grads {worst:.2e}")


def hf_packed(args):
    try:
        import transformers
        from transformers import DataCollatorWithFlattening
    except ImportError:
        print("\nhf: skipped (pip install transformers)")
        return
    from attnkit.interop import register_hf_attention

    register_hf_attention()
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation("attnkit")
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(args.min_length, args.max_length + 1, (args.sequences,), generator=g).tolist()
    seqs = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in lengths]
    T = max(lengths)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    am = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], am[i, : len(s)] = torch.tensor(s), 1
    padded = dict(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    flat = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s} for s in seqs])
    packed = dict(input_ids=flat["input_ids"], position_ids=flat["position_ids"], labels=flat["labels"],
                  use_cache=False)

    def train_step(batch):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach()

    losses = {"padded": train_step(padded), "packed": train_step(packed)}  # warm-up, and the losses
    times = {"padded": [], "packed": []}
    for _ in range(args.repeats):  # interleaved rounds
        for name, batch in (("padded", padded), ("packed", packed)):
            times[name].append(benchmark.Timer("fn()", globals={"fn": lambda: train_step(batch)},
                                               num_threads=args.threads).timeit(1).median)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nhf: tiny Llama (2 layers, hidden 128), {len(seqs)} sequences, {sum(lengths)} tokens (padded to "
          f"{len(seqs)} x {T}), one training step (fwd+bwd):")
    print(f"  padded {med['padded'] * 1e3:9.1f} ms   packed {med['packed'] * 1e3:9.1f} ms   "
          f"padded/packed {med['padded'] / med['packed']:5.2f}x   |loss difference| "
          f"{abs(float(losses['padded'] - losses['packed'])):.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--min-length", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--sections", default="attention,recompiles,hf",
                        help="comma-separated: attention (the timings), recompiles, hf")
    parser.add_argument("--batches", type=int, default=20, help="random batches of the recompiles section")
    parser.add_argument("--compile-backend", default="aot_eager",
                        help="torch.compile backend of the recompiles section")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    if "attention" in sections:
        attention_times(args)
    if "recompiles" in sections:
        recompiles(args)
    if "hf" in sections:
        hf_packed(args)


def attention_times(args):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_length, args.max_length + 1, (args.sequences,), generator=g).tolist()
    print(f"{args.sequences} sequences, {sum(lengths)} tokens (longest {max(lengths)}), H={args.heads}, "
          f"D={args.head_dim}, causal, fwd+bwd, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        fns = cases(lengths, args.heads, args.head_dim, dtype)
        for fn in fns.values():  # warm-up: plans, caches, first-call costs
            fn()
        times = {name: [] for name in fns}
        for _ in range(args.repeats):  # interleaved rounds
            for name, fn in fns.items():
                timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=args.threads)
                times[name].append(timer.timeit(1).median)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"\n{dtype_name}:")
        for name, t in med.items():
            print(f"  {name:<13} {t * 1e3:9.1f} ms   {t / med['varlen']:5.2f}x varlen's time")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
