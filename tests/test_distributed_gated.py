"""Context-parallel gated linear attention on CPU with gloo: 2 and 4 processes against one process.

Every rule (gated delta, KDA, SSD, GLA), contiguous, uneven and zigzag layouts, initial and final
states: each rank's output slice, its inputs' gradients, the final state and the initial state's
gradient (summed over the ranks) equal ``gated_linear_attention`` on the whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit import gated_linear_attention
from attnkit.distributed import ContextParallelError, SequenceLayout, context_parallel_gated_linear_attention

from .test_distributed import _readme_job, run_group

pytestmark = pytest.mark.xdist_group("distributed")  # one worker, one forkserver

_TENSORS = ("q", "k", "v", "g", "beta")


def _inputs(seed, *, B, Hk, Hv, T, Dk, Dv, per_channel, delta, dtype, init):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    x = {"q": r(B, Hk, T, Dk), "k": r(B, Hk, T, Dk), "v": r(B, Hv, T, Dv),
         "g": -0.3 * F.softplus(r(B, Hv, T, *([Dk] if per_channel else []))),
         "beta": torch.sigmoid(r(B, Hv, T)) if delta else None}
    extra = {"init": r(B, Hv, Dk, Dv) * 0.5 if init else None, "w": r(B, Hv, T, Dv), "wf": r(B, Hv, Dk, Dv)}
    return {n: None if t is None else t.to(dtype) for n, t in {**x, **extra}.items()}


def _cases(world):
    T = 24 if world == 2 else 40
    uneven = [5, T - 5] if world == 2 else [3, 11, T - 20, 6]
    zig = SequenceLayout.zigzag(T, world)
    f64, f32 = torch.float64, torch.float32
    return T, {
        "delta-gqa-init": dict(Hk=1, Hv=2, Dk=5, Dv=3, delta=True, dtype=f64, init=True, chunk_size=4),
        "delta-zigzag-f32": dict(Dk=8, Dv=8, delta=True, dtype=f32, init=True, layout=zig, chunk_size=4),
        # no state returned: on a contiguous split rank 0's output reads no summary, yet its backward
        # must still take part in the exchange
        "delta-uneven-implicit": dict(Dk=4, Dv=6, delta=True, dtype=f64, lengths=uneven, state=False),
        "kda-zigzag": dict(Dk=4, Dv=3, delta=True, per_channel=True, dtype=f64, init=True, layout=zig,
                           chunk_size=4),
        "kda-f32": dict(Hk=1, Hv=2, Dk=6, Dv=4, delta=True, per_channel=True, dtype=f32, chunk_size=8, state=False),
        "ssd-uneven": dict(Dk=4, Dv=5, dtype=f64, layout=SequenceLayout.contiguous(uneven), init=True),
        "gla-zigzag-f32": dict(Dk=4, Dv=4, per_channel=True, dtype=f32, layout=zig, chunk_size=4),
        # computed in fp32 from the same bf16 values: one rounding of the output apart
        "delta-bf16": dict(Dk=8, Dv=8, delta=True, dtype=torch.bfloat16, init=True, chunk_size=4),
    }


def _equality_job(rank, world):
    torch.set_num_threads(1)
    T, cases = _cases(world)
    report = {}
    for seed, (name, c) in enumerate(cases.items()):
        x = _inputs(seed, B=c.get("B", 2), Hk=c.get("Hk", 2), Hv=c.get("Hv", 2), T=T, Dk=c["Dk"], Dv=c["Dv"],
                    per_channel=c.get("per_channel", False), delta=c.get("delta", False), dtype=c["dtype"],
                    init=c.get("init", False))
        opts = dict(qk_l2norm=c.get("delta", False), chunk_size=c.get("chunk_size"))
        with_state = c.get("state", True)
        names = [n for n in _TENSORS if x[n] is not None] + (["init"] if x["init"] is not None else [])
        ref_in = {n: x[n].clone().requires_grad_() for n in names}
        o, final = gated_linear_attention(*(ref_in.get(n) for n in _TENSORS), initial_state=ref_in.get("init"),
                                          return_state=True, **opts)
        final = final if with_state else final.detach()
        ref_grads = dict(zip(names, torch.autograd.grad((o * x["w"]).sum() + (final * x["wf"]).sum(),
                                                        list(ref_in.values()))))
        layout = c.get("layout")
        shards = layout or SequenceLayout.contiguous(c.get("lengths", [T // world] * world))
        local = {n: (shards.shard(x[n], rank) if n != "init" else x[n]).clone().requires_grad_() for n in names}
        out = context_parallel_gated_linear_attention(*(local.get(n) for n in _TENSORS), layout=layout,
                                                      initial_state=local.get("init"), return_state=with_state,
                                                      **opts)
        out, state = out if with_state else (out, final)
        loss = (out * shards.shard(x["w"], rank)).sum() + (rank == 0 and with_state) * (state * x["wf"]).sum()
        grads = dict(zip(names, torch.autograd.grad(loss, list(local.values()))))

        def rel(a, b):
            return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))

        report[name] = {
            "dtype": str(out.dtype),
            "out": rel(out, shards.shard(o, rank)),
            "state": rel(state, final),
            "state_bits": state.detach(),
            "grads": {n: rel(grads[n], shards.shard(ref_grads[n], rank)) for n in names if n != "init"},
            "init_grad": (grads["init"], ref_grads["init"]) if "init" in names else None,
        }
    return report


def _check_equality(world):
    results = run_group(world, _equality_job, join_timeout=150)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    reports = {rank: value for rank, (_, value) in results.items()}
    _, cases = _cases(world)
    for name, c in cases.items():
        tol = {torch.float32: 1e-5, torch.float64: 1e-11, torch.bfloat16: 2e-2}[c["dtype"]]
        for rank, report in reports.items():
            r = report[name]
            where = f"{name} on rank {rank} of {world}: {r}"
            assert r["dtype"] == str(c["dtype"]), where
            assert r["out"] <= tol and r["state"] <= tol and max(r["grads"].values()) <= tol, where
            assert set(r["grads"]) == {n for n in _TENSORS if n != "beta" or c.get("delta")}, where
            # every rank ran the same prefix on the same summaries: the same bits
            assert torch.equal(r["state_bits"], reports[0][name]["state_bits"]), where
        if c.get("init"):  # each rank holds its own tokens' share of the initial state's gradient
            total = sum(reports[rank][name]["init_grad"][0] for rank in reports)
            ref = reports[0][name]["init_grad"][1]
            assert float((total - ref).abs().max() / ref.abs().max()) <= tol, name
            assert not torch.allclose(reports[0][name]["init_grad"][0], ref), name  # a share, not the whole


def test_two_ranks_equal_one_process():
    _check_equality(2)


def test_four_ranks_equal_one_process():
    _check_equality(4)


def _failure_job(rank, world):
    q = k = torch.randn(1, 2, 6, 4)
    v = torch.randn(1, 2, 6, 4)
    g = -torch.rand(1, 2, 6)
    if rank == 1:
        g = g.abs() + 1  # a growing state: rank 1 alone rejects its gates
    try:
        context_parallel_gated_linear_attention(q, k, v, g, torch.rand(1, 2, 6))
    except (ValueError, ContextParallelError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_rank_with_bad_inputs_stops_every_rank():
    results = run_group(2, _failure_job)
    assert results[1] == ("ok", results[1][1]) and "g: expected finite log-decays" in results[1][1], results
    assert "rank(s) [1] rejected their inputs" in results[0][1], results


def _local_failure_job(rank, world):
    from attnkit.distributed import gated

    if rank == 1:  # this rank's local run fails after every check passed
        def broken(*args, **kwargs):
            raise RuntimeError("out of memory (simulated)")

        gated.gated_linear_attention = broken
    q = k = v = torch.randn(1, 2, 6, 4)
    try:
        context_parallel_gated_linear_attention(q, k, v, -torch.rand(1, 2, 6), torch.rand(1, 2, 6))
    except ContextParallelError as exc:
        return f"{exc} {exc.ranks}"
    return "no error"


def test_a_rank_whose_local_run_fails_stops_every_rank_with_its_error():
    results = run_group(2, _local_failure_job)
    for rank, (status, value) in results.items():
        assert status == "ok" and "rank(s) [1]" in value and "out of memory (simulated)" in value, (rank, value)


def _nonfinite_job(rank, world):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 4, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 2, 16, generator=gen), torch.rand(1, 2, 16, generator=gen)
    v[0, 1, 3] = float("nan")  # rank 0's token 3, value head 1: later outputs of that head, on every rank
    q[0, 0, 12] = float("inf")  # rank 1's query 12: its own output only
    layout = SequenceLayout.even(16, world)
    report = {}
    for name, b in (("delta", beta), ("ssd", None)):  # extra state columns, and the diagonal transition
        want = layout.shard(gated_linear_attention(q, k, v, g, b, qk_l2norm=True), rank)
        got = context_parallel_gated_linear_attention(*(layout.shard(t, rank) for t in (q, k, v, g)),
                                                      None if b is None else layout.shard(b, rank), qk_l2norm=True)
        finite = ~want.isnan()
        report[name] = {"same_nan": torch.equal(got.isnan(), want.isnan()), "nan": int(want.isnan().sum()),
                        "close": bool(torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6))}
    return report


def test_nonfinite_tokens_reach_what_they_reach_in_one_process():
    results = run_group(2, _nonfinite_job)
    for rank, (status, value) in results.items():
        assert status == "ok", (rank, value)
        for name, r in value.items():
            assert r["same_nan"] and r["close"] and r["nan"], (rank, name, r)  # both ranks hold poisoned outputs


def test_one_rank_is_the_plain_function():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=gen) for _ in range(3))
    g, beta = -torch.rand(2, 2, 9, generator=gen), torch.rand(2, 2, 9, generator=gen)
    got = context_parallel_gated_linear_attention(q, k, v, g, beta, qk_l2norm=True, return_state=True)
    want = gated_linear_attention(q, k, v, g, beta, qk_l2norm=True, return_state=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bad_arguments_name_the_argument():
    q = k = v = torch.randn(1, 2, 8, 4)
    g = -torch.rand(1, 2, 8)
    with pytest.raises(ValueError, match="layout: built for 2 ranks"):
        context_parallel_gated_linear_attention(q, k, v, g, layout=SequenceLayout.even(8, 2))
    with pytest.raises(TypeError, match="layout: expected a SequenceLayout"):
        context_parallel_gated_linear_attention(q, k, v, g, layout=[(0, 8)])
    with pytest.raises(ValueError, match="g: expected"):
        context_parallel_gated_linear_attention(q, k, v, g[..., :5])
    with pytest.raises(ValueError, match="timeout"):
        context_parallel_gated_linear_attention(q, k, v, g, timeout=-1)
    with pytest.raises(ValueError, match="scale: expected a finite number"):
        context_parallel_gated_linear_attention(q, k, v, g, scale=float("nan"))


# ---------------------------------------------------------------------------------------------
# A hybrid model (gated-delta and softmax layers) trained by `attnkit train --context-parallel 2`.

_TRAIN_FLAGS = ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--lr", "1e-2", "--warmup-steps", "1",
                "--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--device", "cpu", "--embed-dim", "32",
                "--num-layers", "2", "--num-heads", "2", "--max-len", "64", "--layer-pattern", "ga"]


def _cli_train_job(rank, world, text, out):
    import os

    from attnkit.cli.main import main

    from .train_helpers import read_losses

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    code = main(["train", "--data", text, "--out", out, "--context-parallel", "2", *_TRAIN_FLAGS])
    return {"code": code, "losses": read_losses(out) if rank == 0 else None}


def test_hybrid_model_trains_context_parallel_like_one_process(tmp_path, capsys):
    from attnkit.cli.main import main

    from .train_helpers import read_losses

    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200)))
    assert main(["train", "--data", str(text), "--out", str(tmp_path / "one"), *_TRAIN_FLAGS]) == 0
    one = read_losses(tmp_path / "one")
    results = run_group(2, _cli_train_job, str(text), str(tmp_path / "cp"), join_timeout=150)
    for rank, (status, value) in results.items():
        assert status == "ok" and value["code"] == 0, f"rank {rank}: {value}"
    assert len(one) == 3 and one[-1] < one[0]  # it learns: the comparison is about training
    assert results[0][1]["losses"] == pytest.approx(one, rel=1e-5)


def test_guide_example_runs_on_two_ranks():
    results = run_group(2, _readme_job, "## Gated linear attention")
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert f"rank {rank}: matches one process: True" in value


def test_make_context_parallel_swaps_gated_layers_and_keeps_the_weights():
    from attnkit.cache import StateCache
    from attnkit.distributed.training import (
        ContextParallelGatedDeltaNet, ContextParallelSelfAttention, make_context_parallel,
    )
    from attnkit.nn import GPT

    from .train_helpers import tiny_gpt_config

    model = GPT(tiny_gpt_config(layer_pattern="ga"))
    before = {n: p.data_ptr() for n, p in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    want = model(ids)
    make_context_parallel(model, None, SequenceLayout.even(8, 1))
    kinds = [type(m) for m in model.modules()]
    assert ContextParallelGatedDeltaNet in kinds and ContextParallelSelfAttention in kinds
    assert {n: p.data_ptr() for n, p in model.state_dict().items()} == before  # the same tensors, the same keys
    assert torch.allclose(model(ids), want, atol=1e-6)  # one rank: the model as it was
    layer = next(m for m in model.modules() if isinstance(m, ContextParallelGatedDeltaNet))
    with pytest.raises(ValueError, match="cache: a context-parallel gated-delta layer"):
        layer(torch.randn(1, 8, 32), cache=StateCache(layer.make_state))
