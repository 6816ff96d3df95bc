"""Context parallelism on CPU with gloo: 2 and 4 processes against single-process ``attention()``.

Processes start from a forkserver, join over a free port with a process-group timeout, and are
killed after a join timeout, so a hang fails a test instead of blocking the suite."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import pytest


pytestmark = pytest.mark.xdist_group("distributed")  # one worker, one forkserver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, pg_timeout, outbox):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # No measured table, as in the parent: every rank follows the static rule, never the user's table.
    os.environ["ATTNKIT_CALIBRATION"] = os.path.join(outbox, "no-calibration.json")
    from attnkit.dispatch import table

    table.reload()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            report = ("ok", fn(rank, world, *args))
        finally:
            if dist.is_initialized():  # the training loop tears its group down itself
                dist.destroy_process_group()
    except BaseException as exc:  # report every failure to the parent, which decides
        report = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    _post(outbox, rank, report)


def _post(outbox: str, rank: int, report: tuple) -> None:
    """A rank's report as a file, written whole then renamed: no pipe or lock is shared with the
    parent (a rank killed mid-write leaves no half message the parent could block on)."""
    path = os.path.join(outbox, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(report, f)
    os.replace(path + ".tmp", path)


def _context():
    # forkserver: children start clean like spawn (no threads or state inherited from pytest), but
    # are forked from one server that imported torch and attnkit once, instead of each child
    # importing them again (seconds per process on a busy machine).
    ctx = mp.get_context("forkserver")
    # torch._dynamo: the optimizers import it on construction (seconds per process otherwise)
    ctx.set_forkserver_preload([__name__, "attnkit.train", "attnkit.distributed.training", "torch._dynamo"])
    return ctx


def run_group(world: int, fn, *args, pg_timeout: float = 30.0, join_timeout: float = 90.0) -> dict[int, tuple]:
    """``{rank: ("ok", result) | ("error", text)}`` from ``fn(rank, world, *args)`` on ``world``
    spawned processes; processes still alive after ``join_timeout`` seconds are killed and
    reported as errors, so a hang fails the test instead of blocking the suite."""
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="attnkit-ranks-") as outbox:
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, pg_timeout, outbox), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, tuple] = {}
        deadline = time.monotonic() + join_timeout
        while len(out) < world and time.monotonic() < deadline:
            for r in range(world):
                path = os.path.join(outbox, f"rank{r}.pkl")
                if r not in out and os.path.exists(path):
                    with open(path, "rb") as f:
                        out[r] = pickle.load(f)
            if len(out) < world:
                time.sleep(0.05)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    for r in range(world):
        out.setdefault(r, ("error", f"rank {r} did not report within {join_timeout} s"))
    return out


# ---------------------------------------------------------------------------------------------
# Equality with single-process attention(): every case runs inside one spawned group per world
# size, so the processes start once; each rank checks its own slice and reports the errors.

from attnkit import Causal, Custom, Document, KeyPadding, Padding, SlidingWindow, attention  # noqa: E402
from attnkit.distributed import (  # noqa: E402
    ContextParallelError, SequenceLayout, context_parallel_attention, explain_context_parallel,
)


def _case_inputs(seed, B, Hq, Hkv, T, D, dtype):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=dtype) for h in (Hq, Hkv, Hkv))
    w = torch.randn(B, Hq, T, D, generator=g, dtype=dtype)  # loss weights on out
    u = torch.randn(B, Hq, T, generator=g, dtype=torch.float64)  # loss weights on the (finite) lse
    return q, k, v, w, u


def _loss(out, lse, w, u):
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return (out * w).sum() + (finite.double() * u).sum()


def _cases(world):
    T = 24 if world == 2 else 40
    ids = torch.tensor([0] * 7 + [1] * (T - 12) + [2] * 5)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, : T // 2] = False  # left padding
    keep = torch.rand(T, T, generator=torch.Generator().manual_seed(3)) > 0.6
    uneven = [5, T - 5] if world == 2 else [3, 11, T - 20, 6]
    zig = SequenceLayout.zigzag(T, world)
    lens = torch.tensor([T - 9, T])
    cases = {
        "dense": dict(mask=None),
        "causal": dict(mask=Causal()),
        "causal-zigzag": dict(mask=Causal(), layout=zig),
        "causal-zigzag-gqa-f32": dict(mask=Causal(), layout=zig, Hq=4, Hkv=2, dtype=torch.float32),
        "window": dict(mask=SlidingWindow(3, 0)),
        "window-zigzag": dict(mask=SlidingWindow(2, 1), layout=zig),
        "document-causal": dict(mask=Document(ids) & Causal()),
        "padding-causal-fully-masked": dict(mask=Causal() & Padding(valid), B=2),
        "keypadding-empty-row": dict(mask=KeyPadding([T, 0]), B=2),
        "keypadding-nan-in-padding": dict(mask=KeyPadding([T - 5, T]), B=2, nan_from=T - 5),
        "bool-tensor": dict(mask=keep),
        "uneven": dict(mask=Causal(), layout=SequenceLayout.contiguous(uneven)),
        "uneven-implicit": dict(mask=SlidingWindow(4, 0), lengths=uneven),
        "gqa-mqa": dict(mask=Causal(), Hq=4, Hkv=1),
        "ulysses": dict(mask=Causal(), Hq=4, Hkv=4 if world == 4 else 2, strategy="ulysses"),
        "ulysses-zigzag-document": dict(mask=Document(ids) & Causal(), layout=zig, Hq=4, Hkv=world,
                                        strategy="ulysses"),
        "ulysses-uneven-window": dict(mask=SlidingWindow(5, 0), Hq=4, Hkv=world, lengths=uneven, strategy="ulysses"),
        "auto-falls-back-to-ring": dict(mask=Causal(), Hq=3, Hkv=3, strategy="auto"),
        # Custom masks reading b and h (FlexAttention's contract): every batch row and head evaluated
        "custom-batch-head": dict(mask=Custom(lambda b, h, qi, ki: (ki <= qi) & ((ki < lens[b]) | (h == 1))), B=2,
                                  Hq=4, Hkv=2),
        "custom-zigzag-auto": dict(mask=Custom(lambda b, h, qi, ki: (qi - ki).abs() <= 3 + b), layout=zig, B=2,
                                   strategy="auto"),
    }
    if world == 4:  # the cases where more ranks change the plan (layouts, skipped steps, exchanges)
        keep = ("causal-zigzag", "causal-zigzag-gqa-f32", "window", "window-zigzag", "document-causal",
                "padding-causal-fully-masked", "keypadding-nan-in-padding", "uneven", "uneven-implicit", "ulysses",
                "ulysses-zigzag-document", "ulysses-uneven-window", "custom-batch-head")
        cases = {name: cases[name] for name in keep}
    return cases


def _equality_job(rank, world):
    torch.set_num_threads(1)
    report = {}
    for seed, (name, case) in enumerate(_cases(world).items()):
        B, Hq, Hkv = case.get("B", 1), case.get("Hq", 2), case.get("Hkv", 2)
        dtype = case.get("dtype", torch.float64)
        T = 24 if world == 2 else 40
        q, k, v, w, u = _case_inputs(seed, B, Hq, Hkv, T, 8, dtype)
        if "nan_from" in case:  # keys no query may see hold NaN: nothing may change
            k[0, :, case["nan_from"]:] = float("nan")
            v[0, :, case["nan_from"]:] = float("nan")
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = attention(*ref_in, mask=case["mask"], backend="naive", return_lse=True)
        ref_grads = torch.autograd.grad(_loss(ref_out, ref_lse, w, u), ref_in)
        layout = case.get("layout")
        shard_layout = layout or SequenceLayout.contiguous(case.get("lengths", [T // world] * world))
        local = [shard_layout.shard(t, rank).clone().requires_grad_() for t in (q, k, v)]
        kwargs = dict(mask=case["mask"], layout=layout, strategy=case.get("strategy", "ring"))
        out, lse = context_parallel_attention(*local, return_lse=True, **kwargs)
        grads = torch.autograd.grad(_loss(out, lse, shard_layout.shard(w, rank), shard_layout.shard(u, rank)), local)
        out, lse, ref_out, ref_lse = (t.detach() for t in (out, lse, ref_out, ref_lse))
        lse_ref = shard_layout.shard(ref_lse, rank)
        report[name] = {
            "out": float((out - shard_layout.shard(ref_out, rank)).abs().max()),
            "lse_inf_match": bool(torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))),
            "lse": float((torch.where(torch.isfinite(lse), lse, 0) - torch.where(torch.isfinite(lse_ref), lse_ref, 0))
                         .abs().max()),
            "grads": [float((g - shard_layout.shard(r, rank)).abs().max()) for g, r in zip(grads, ref_grads)],
            "finite": all(bool(torch.isfinite(g).all()) for g in grads) and bool(torch.isfinite(out).all()),
            "dtype": str(out.dtype),
            "plan": explain_context_parallel(*local, mask=case["mask"], layout=layout,
                                             strategy=case.get("strategy", "ring")),
        }
    return report


def _check_equality(world):
    results = run_group(world, _equality_job, join_timeout=150)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    for rank, (_, report) in results.items():
        assert set(report) == set(_cases(world))
        for name, r in report.items():
            tol = 2e-5 if "f32" in name else 1e-10
            where = f"{name} on rank {rank} of {world}: {r}"
            assert r["out"] <= tol and r["lse"] <= tol and max(r["grads"]) <= 10 * tol, where
            assert r["lse_inf_match"] and r["finite"], where
    return {rank: report for rank, (_, report) in results.items()}


def test_two_ranks_equal_single_process():
    reports = _check_equality(2)
    plan = reports[0]["auto-falls-back-to-ring"]["plan"]
    assert "ring" in plan and "Hq=3" in plan  # the fallback says why
    assert "ulysses" in reports[0]["ulysses"]["plan"]
    assert "ring" in reports[0]["custom-zigzag-auto"]["plan"] and "per head" in reports[0]["custom-zigzag-auto"]["plan"]


def test_four_ranks_equal_single_process_and_skip_empty_pairs():
    reports = _check_equality(4)
    # a causal window of 3 over contiguous slices of 10 needs only the neighbour's block: 2 of 4 ring steps
    plan = reports[2]["window"]["plan"]
    assert "2 of 4 ring step(s)" in plan and "skips 2 empty" in plan, plan
    # zigzag balances causal work: every rank computes the same number of non-empty shard pairs
    counts = {r: reports[r]["causal-zigzag"]["plan"].split("computes ")[1].split(" ")[0] for r in reports}
    assert len(set(counts.values())) == 1, counts


def _failure_job(rank, world):
    torch.set_num_threads(1)
    seen = {}
    q = k = v = torch.randn(1, 2, 6, 8)
    bad_k = torch.randn(1, 2, 6, 5) if rank == 1 else k  # rank 1 alone gets a wrong head dim
    try:
        context_parallel_attention(q, bad_k, v, mask=Causal())
        seen["bad_input"] = "returned"
    except ValueError as exc:
        seen["bad_input"] = str(exc)
    try:  # a strategy that cannot run is refused on every rank, with the reason
        context_parallel_attention(torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8), v[:, :1].expand(1, 3, 6, 8),
                                   strategy="ulysses")
        seen["ulysses"] = "returned"
    except ValueError as exc:
        seen["ulysses"] = str(exc)
    # Masks and layouts that differ between ranks are refused on every rank (they would be silently wrong).
    ids = torch.tensor([0] * 5 + [1] * 7)
    differing = {
        "rank_keypadding": dict(mask=KeyPadding([10 - rank])),  # a rank's own padding instead of the row's
        "document_ids": dict(mask=Document(ids if rank == 0 else ids.flip(0)) & Causal()),
        "mask_or_none": dict(mask=Causal() if rank == 0 else None),
        "dense_content": dict(mask=torch.ones(12, 12, dtype=torch.bool).tril(-rank)),
        "layout": dict(mask=Causal(), layout=SequenceLayout.zigzag(12, 2) if rank == 0
                       else SequenceLayout.contiguous([6, 6])),
        "custom_reads_rank": dict(mask=Custom(lambda b, h, qi, ki: ki <= qi + rank)),
    }
    for name, kwargs in differing.items():
        try:
            context_parallel_attention(q, k, v, strategy="ring", **kwargs)
            seen[name] = "returned"
        except ValueError as exc:
            seen[name] = str(exc)
    try:  # a Custom mask that raises on one rank while planning: both ranks stop
        fail = rank == 1
        context_parallel_attention(q, k, v, mask=Custom(lambda b, h, qi, ki: 1 / 0 if fail else ki <= qi))
        seen["planning_error"] = "returned"
    except (ValueError, ZeroDivisionError) as exc:
        seen["planning_error"] = f"{type(exc).__name__}: {exc}"
    if rank == 1:  # rank 1 stays alive but stops taking part: rank 0's next call must fail, not hang
        import time

        time.sleep(8)
        return seen
    os.environ["ATTNKIT_CP_TIMEOUT"] = "1.5"  # far below the process group's 60 s
    t0 = datetime.datetime.now()
    try:
        context_parallel_attention(q, k, v, mask=Causal())
        seen["missing_rank"] = "returned"
    except ContextParallelError as exc:
        seen["missing_rank"] = str(exc)
    seen["waited_s"] = (datetime.datetime.now() - t0).total_seconds()
    return seen


def test_a_failing_rank_raises_on_every_rank():
    results = run_group(2, _failure_job, pg_timeout=60.0, join_timeout=50)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    assert "head dim" in results[1][1]["bad_input"]  # the rank with the bad input names the problem
    assert "rank(s) [1] rejected" in results[0][1]["bad_input"]  # the others say which rank failed
    for rank in (0, 1):
        seen = results[rank][1]
        assert "Hq=3" in seen["ulysses"] and "strategy='ring'" in seen["ulysses"]
        for name in ("rank_keypadding", "document_ids", "mask_or_none", "dense_content", "custom_reads_rank"):
            assert seen[name].startswith("mask: the ranks of the group pass different values: rank(s) [1]"), name
        assert seen["layout"].startswith("layout: the ranks of the group pass different values"), seen
    assert results[1][1]["planning_error"].startswith("ZeroDivisionError")
    assert "rank(s) [1] rejected" in results[0][1]["planning_error"]
    assert "1.5 s" in results[0][1]["missing_rank"] and "ATTNKIT_CP_TIMEOUT" in results[0][1]["missing_rank"]
    assert results[0][1]["waited_s"] < 6  # the timeout, not the process group's 60 s (rank 1 sleeps 8 s)


def _raising_job(rank, world):
    """Rank 1 fails inside the exchange (its attention blocks, or its backward tiles); every rank
    must end each call with the error, without waiting for the process group's timeout."""
    import time

    from attnkit.distributed import ring

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    real_attention, real_backward = ring.attention, ring._pair_backward

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    seen = {}
    for name, strategy, layout, where in (("ring-forward", "ring", None, "attention"),
                                          ("zigzag-forward", "ring", SequenceLayout.zigzag(16, 2), "attention"),
                                          ("ring-backward", "ring", None, "_pair_backward"),
                                          ("ulysses-forward", "ulysses", None, "attention"),
                                          ("ulysses-backward", "ulysses", None, "_pair_backward")):
        lay = layout or SequenceLayout.contiguous([8, 8])
        local = [lay.shard(t, rank).clone().requires_grad_() for t in full]
        if rank == 1:
            setattr(ring, where, broken)
        t0 = time.monotonic()
        try:
            for _layer in range(2):  # a model calls again for its next layer, then runs its backward
                out = context_parallel_attention(*local, mask=Causal(), layout=layout, strategy=strategy)
            out.sum().backward()
            seen[name] = ("returned", time.monotonic() - t0)
        except ContextParallelError as exc:
            seen[name] = (str(exc), time.monotonic() - t0, exc.ranks)
        finally:
            ring.attention, ring._pair_backward = real_attention, real_backward
    out = context_parallel_attention(*local, mask=Causal(), strategy="ring")  # the group still works
    seen["after"] = float((out - lay.shard(attention(*full, mask=Causal()), rank)).abs().max())
    return seen


def test_a_rank_that_raises_inside_the_exchange_ends_every_rank_with_its_error():
    results = run_group(2, _raising_job, pg_timeout=120.0, join_timeout=90)  # a hang: no report in time
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    for rank, (_, seen) in results.items():
        for name in ("ring-forward", "zigzag-forward", "ring-backward", "ulysses-forward", "ulysses-backward"):
            message, _, ranks = seen[name]  # (no bound on the time taken: run_group's join timeout, under the
            # process group's, already tells a raised error from a hang that only the group's timeout ends)
            assert "failed on rank(s) [1]" in message and "simulated failure" in message, (rank, name, message)
            assert ranks == (1,), (rank, name, ranks)
        assert seen["after"] < 1e-12


# ---------------------------------------------------------------------------------------------
# One process (no process group): layouts, the plain-attention limit, bad input.


def test_layouts_cover_the_sequence_and_round_trip():
    zig = SequenceLayout.zigzag(10, 2)
    assert zig.segments == (((0, 3), (8, 10)), ((3, 6), (6, 8)))  # chunks of 3, 3, 2, 2 (larger first)
    assert zig.positions(0).tolist() == [0, 1, 2, 8, 9]
    x = torch.arange(2 * 10).view(1, 2, 10, 1)
    parts = [zig.shard(x, r) for r in range(2)]
    assert parts[1][0, 0, :, 0].tolist() == [3, 4, 5, 6, 7]
    assert torch.equal(zig.unshard(parts), x)
    assert SequenceLayout.even(7, 3).segments == (((0, 3),), ((3, 5),), ((5, 7),))
    assert SequenceLayout.build("zigzag", 8, 2) == SequenceLayout.zigzag(8, 2)
    with pytest.raises(ValueError, match="tile 0 .. T-1 exactly once"):
        SequenceLayout((((0, 3),), ((2, 5),)))
    with pytest.raises(ValueError, match="total_len"):
        SequenceLayout.zigzag(3, 2)
    with pytest.raises(ValueError, match="layout: expected 'contiguous' or 'zigzag'"):
        SequenceLayout.build("striped", 8, 2)
    with pytest.raises(ValueError, match="covers 10 positions"):
        zig.shard(torch.zeros(1, 1, 9, 1), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_is_plain_attention(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 33, 16, generator=g).to(dtype).requires_grad_() for h in (4, 2, 2))
    mask = Causal() & KeyPadding([33, 20])
    out, lse = context_parallel_attention(q, k, v, mask=mask, return_lse=True)
    ref, ref_lse = attention(*(t.detach().double() for t in (q, k, v)), mask=mask, return_lse=True)
    low, _ = attention(*(t.detach() for t in (q, k, v)), mask=mask, return_lse=True, backend="naive")
    assert out.dtype == dtype and lse.dtype == torch.float32
    bound = 2 * (low.double() - ref).abs().max() + 1e-6  # flash-attn's rule: no worse than the naive backend
    assert (out.double() - ref).abs().max() <= bound
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4 if dtype == torch.float32 else 2e-2)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert "one rank" in explain_context_parallel(q, k, v, mask=mask)


@pytest.mark.parametrize("mask", [Causal(), SlidingWindow(4, 2), Document(torch.tensor([0] * 9 + [1] * 28)) & Causal(),
                                  "per-head", Custom(lambda b, h, qi, ki: (ki <= qi) & ((ki % 3 != b) | (h == 2)))],
                         ids=["causal", "window", "document-causal", "per-head-bool", "custom-batch-head"])
def test_backward_tiles_skip_empty_parts_and_stay_exact(monkeypatch, mask):
    from attnkit.distributed import ring

    monkeypatch.setattr(ring, "_KEY_TILE", 5)  # many (query chunk x key tile) tiles: EMPTY, FULL, PARTIAL
    monkeypatch.setattr(ring, "_BACKWARD_TILE", 4 * 2 * 5 * 3)
    g = torch.Generator().manual_seed(1)
    if mask == "per-head":
        mask = torch.rand(1, 4, 37, 37, generator=g) > 0.5  # a different mask per query head, GQA below
    q, k, v = (torch.randn(2, h, 37, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out, lse = context_parallel_attention(q, k, v, mask=mask, return_lse=True)
    ref, ref_lse = attention(q, k, v, mask=mask, return_lse=True, backend="naive")
    grads = torch.autograd.grad((out * out).sum() + lse.clamp(min=-30).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * ref).sum() + ref_lse.clamp(min=-30).sum(), (q, k, v))
    assert (out - ref).abs().max() < 1e-12
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() < 1e-11


def test_mask_digests_compare_content_not_identity():
    T, sizes = 12, dict(batch_size=2, num_heads=2)
    same = [(KeyPadding([5, 12]), KeyPadding(torch.tensor([5, 12]))),
            (Document(torch.arange(T) // 4) & Causal(), Document(torch.arange(T) // 4) & Causal()),
            (Custom(lambda b, h, qi, ki: ki <= qi), Custom(lambda b, h, qi, ki: qi >= ki))]
    for a, b in same:
        assert a.content_digest(T, T, **sizes) == b.content_digest(T, T, **sizes), (a, b)
    differ = [(KeyPadding([5, 12]), KeyPadding([6, 12])), (Causal(), SlidingWindow(None, 1)),
              (Causal() & KeyPadding([5, 12]), KeyPadding([5, 12]) | Causal()),
              (Document(torch.arange(T) // 4), Document(torch.arange(T) // 3)),
              (Custom(lambda b, h, qi, ki: ki <= qi), Custom(lambda b, h, qi, ki: (ki <= qi) & (ki < T - 1 - b)))]
    for a, b in differ:
        assert a.content_digest(T, T, **sizes) != b.content_digest(T, T, **sizes), (a, b)


def test_bad_arguments_name_the_argument():
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="strategy: expected one of"):
        context_parallel_attention(q, k, v, strategy="tree")
    with pytest.raises(ValueError, match="dropout_p"):
        context_parallel_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="same positions of q and k/v"):
        context_parallel_attention(q, k[:, :, :5], v[:, :, :5])
    with pytest.raises(TypeError, match="layout: expected a SequenceLayout"):
        context_parallel_attention(q, k, v, layout="zigzag")
    with pytest.raises(ValueError, match="layout: built for 2 ranks"):
        context_parallel_attention(q, k, v, layout=SequenceLayout.zigzag(8, 2))
    with pytest.raises(ValueError, match="head dim"):
        context_parallel_attention(q, torch.randn(1, 2, 8, 3), v)
    for bad in (0, -1, float("nan"), "soon"):
        with pytest.raises(ValueError, match="timeout: expected a positive number of seconds"):
            context_parallel_attention(q, k, v, timeout=bad)


# ---------------------------------------------------------------------------------------------
# Training: the same losses as one process on the whole batch.


def _train_job(rank, world, out, text, model_overrides, port):
    import copy
    from dataclasses import replace

    from attnkit.train import train

    from .train_helpers import read_losses, tiny_gpt_config, tiny_train_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cfg = tiny_train_config(out, data=text, steps=3, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1,
                            context_parallel=2, eval_every=2)
    model_cfg = tiny_gpt_config(**model_overrides)
    given = (copy.deepcopy(cfg), copy.deepcopy(model_cfg))
    first = train(cfg, model_cfg, stop_at=2)  # the one loop: saved as an interruption would
    unchanged = (cfg, model_cfg) == given  # the caller's configs are never mutated
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # the loop tore its group down
    resumed = train(replace(cfg, resume=out))
    return {"losses": [r["loss"] for r in resumed["history"]], "first": [r["loss"] for r in first["history"]],
            "dp": resumed["data_parallel"], "peak": resumed["peak_rss_mb_per_rank"], "evals": resumed["evals"],
            "unchanged": unchanged, "metrics": read_losses(out) if rank == 0 else None,
            "steps": sorted(d for d in os.listdir(out) if d.startswith("step-")) if rank == 0 else None}


def test_context_parallel_training_matches_one_process_and_resumes(tmp_path):
    """4 processes: 2 data-parallel replicas x 2 context-parallel ranks, grouped-query attention,
    stopped after step 2 and resumed through the same loop as one process."""
    pytest.importorskip("safetensors")
    world, model = 4, {"num_kv_heads": 1}
    from attnkit.train import train

    from .train_helpers import tiny_gpt_config, tiny_train_config

    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200)))
    single = train(tiny_train_config(tmp_path / "one", data=str(text), steps=3, batch_size=4, seq_len=32, lr=1e-2,
                                     warmup_steps=1, eval_every=2), tiny_gpt_config(**model))
    one = [r["loss"] for r in single["history"]]
    results = run_group(world, _train_job, str(tmp_path / "cp"), str(text), model, free_port(), join_timeout=150)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    for rank, (_, r) in results.items():
        assert r["dp"] == world // 2 and len(r["peak"]) == world and r["unchanged"], (rank, r)
        assert r["first"] == pytest.approx(one[:2], rel=1e-5), rank
        assert r["losses"] == pytest.approx(one, rel=1e-5), rank
        assert [e["loss"] for e in r["evals"]] == pytest.approx([e["loss"] for e in single["evals"]], rel=1e-5)
    assert one[-1] < one[0]  # it learns: the comparison is about training, not initialisation
    assert results[0][1]["metrics"] == pytest.approx(one, rel=1e-5)  # rank 0 wrote the metrics, once per step
    assert results[0][1]["steps"] == ["step-000002", "step-000003"]


def test_context_parallel_flag_needs_torchrun(tmp_path, monkeypatch, capsys):
    from attnkit.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["train", "--context-parallel", "2", "--out", str(tmp_path / "run"), "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "torchrun --nproc_per_node=2" in err, err  # one line, exit status 2


def _readme_job(rank, world, heading="# Context parallelism"):
    """The first ```python block after ``heading`` of the context-parallel guide, run on this rank."""
    import contextlib
    import io
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "context-parallel.md").read_text()
    section = readme.split(heading, 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "context-parallel.md", "exec"), {})
    return printed.getvalue()


def test_readme_example_runs_on_two_ranks():
    results = run_group(2, _readme_job)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert f"rank {rank}: matches one process: True" in value
    assert "ring (requested)" in results[0][1]
