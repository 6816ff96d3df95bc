"""The training loop behind ``python -m attnkit train``.

AdamW with linear warmup and cosine decay, gradient clipping and accumulation, bf16 autocast, DDP
or context parallelism under ``torchrun`` (the strategies of :mod:`attnkit.train.parallel`: a model
wrapper and a batch sharder, the loop the same), periodic evaluation with a sample, exact resume,
profiling, and the deployment reports (int8 dynamic quantization, distillation from a teacher
checkpoint).

Losses are normalised by the number of answer tokens in the *global* batch, so one process, N
processes and any gradient-accumulation split of the same global batch compute the same gradient.

``--resume`` continues a run exactly: the stored training config applies (flags given explicitly
override it and are reported), the schedule is a pure function of the stored config and the step,
and the data of a step is a pure function of ``(seed, step)``. A non-finite loss or gradient stops
the run before the optimizer step, without saving: the checkpoints on disk stay the good ones.
SIGINT and SIGTERM are handled between optimizer steps (:mod:`attnkit.train.interrupt`): the last
finished step is saved and :class:`TrainingInterrupted` raised. A new run that fails before its
first checkpoint removes what it wrote (the ``--out`` it created, or its files in an existing one).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import asdict, fields, replace

import torch
from torch import nn

from ..io.files import remove_stale_temporaries
from .checkpoint import (
    checkpoint_names, checkpoint_order, load_checkpoint, load_model_weights, model_from_header, newest_checkpoint,
    restore_training_state, save_checkpoint,
)
from .config import GPT_TRAIN_DEFAULTS, TrainConfig, lr_at
from .data import IGNORE_INDEX, load_corpus
from .distill import distill_loss, distill_report
from .distributed import DistContext, all_reduce_sum, barrier, setup_distributed, teardown
from .evaluate import autocast, evaluate, loss_sum
from .interrupt import StopSignals, TrainingInterrupted
from .parallel import DataParallel, choose_parallel
from .logs import RunLog, plot_loss_curve
from .lstm import LSTMConfig
from .modeling import build_model, config_dict, default_model_config, load_model, num_params, sample_text
from .profiler import finish_profiler, start_profiler
from .run_dir import (
    LOSS_CURVE, append_metric, check_new_run, discard_failed_start, prepare_new_run, same_directory, write_metrics,
    write_results,
)
from .tasks import SyntheticTask, make_task

__all__ = ["TrainConfig", "TrainingDiverged", "TrainingInterrupted", "train", "build_model", "load_model", "evaluate",
           "lr_at", "load_data", "GPT_TRAIN_DEFAULTS", "num_params"]

# Settings of this invocation, not of the run (where it runs, what it prints, which reports it adds):
# never taken from a stored config. A run trained on a GPU resumes on a CPU-only machine.
_INVOCATION_FIELDS = ("out", "resume", "overwrite", "device", "progress", "log_every", "profile", "profile_steps",
                      "quantize")


class TrainingDiverged(ValueError):
    """The loss or the gradient norm became NaN or infinite; nothing was saved."""


def load_data(spec: str):
    """A :class:`TextCorpus` or a :class:`SyntheticTask`; both have ``vocab_size`` and ``sample()``."""
    return make_task(spec) if spec.startswith("task:") else load_corpus(spec)


def train(cfg: TrainConfig, model_config=None, *, stop_at: int | None = None,
          given: set[str] | frozenset[str] | None = None) -> dict:
    """Train (or continue with ``cfg.resume``) and return the run's results.

    ``model_config`` is a ``TransformerConfig`` (``cfg.model == "gpt"``) or ``LSTMConfig``; its
    vocabulary size is set from the data. ``stop_at`` ends the run early after that step, saving
    a checkpoint as an interruption would (the tests use it to check exact resume).

    With ``cfg.resume`` the stored training config applies, except the fields named in ``given``
    (the flags given explicitly; None means every field whose value differs from the
    ``TrainConfig`` default) and the settings of the invocation itself (``out``, ``device``,
    ``progress``, ``log_every``, ``profile``, ``quantize``), which always come from ``cfg``. Resuming
    a finished run (``steps`` equal to its step) trains nothing and writes nothing: evaluation and
    ``quantize`` are read-only there (it only removes the temporaries a killed writer left)."""
    if not cfg.resume:  # every rank refuses a used --out alike, before the process group starts
        check_new_run(cfg.out, cfg.overwrite)
    ctx = setup_distributed(cfg.device)
    try:
        with StopSignals() as stop:
            result = _train(cfg, model_config, ctx, stop_at, given, stop)
        # every rank done (rank 0 saves and reports last) before any tears the group down: a rank
        # leaving while another still talks to it can abort inside gloo at exit
        barrier(ctx)
        return result
    finally:
        teardown(ctx)


def _train(cfg: TrainConfig, model_config, ctx: DistContext, stop_at: int | None, given, stop: StopSignals) -> dict:
    meta = state = weights = None
    changes: list[str] = []
    if cfg.resume:
        meta, weights, state = load_checkpoint(cfg.resume)
        cfg, changes = _resumed_config(cfg, meta, given)
    elif not cfg.decay_steps:
        cfg = replace(cfg, decay_steps=cfg.steps)  # stored resolved: extending the run keeps this schedule
    start_step = meta["step"] if meta is not None else 0
    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    writes = end > start_step  # a finished run is only analysed: nothing is written
    if meta is not None and ctx.is_main and same_directory(cfg.out, _run_dir_of(cfg.resume)):
        # a writer killed after the run's last save (writing its loss curve, say) left a temporary that no
        # later save would clear: removed, whether or not this resume writes anything
        remove_stale_temporaries(cfg.out)
    data = load_data(cfg.data)  # a bad --data is refused before anything is written
    if isinstance(data, SyntheticTask):
        cfg = replace(cfg, seq_len=data.seq_len)
    parallel = choose_parallel(cfg, ctx)  # DDP (or one process), or context parallelism
    _check_batch_split(cfg, parallel)
    started = None  # (out, created): a new run directory, emptied again when the run fails before its first save
    if writes and ctx.is_main:
        if meta is None or not same_directory(cfg.out, _run_dir_of(cfg.resume)):
            created = not os.path.lexists(cfg.out)
            prepare_new_run(cfg.out, cfg.overwrite)  # before any work: a non-empty --out is refused at once
            started = (cfg.out, created)
        else:
            _check_newest(cfg.out, start_step, cfg.resume)
    try:
        return _run(cfg, ctx, parallel, stop, meta, weights, state, data, model_config, start_step, end, writes,
                    changes)
    except BaseException:
        if started is not None:
            discard_failed_start(*started)
        raise


def _run(cfg, ctx, parallel, stop, meta, weights, state, data, model_config, start_step, end, writes, changes) -> dict:
    device = ctx.device
    torch.manual_seed(cfg.seed)

    # 1. the model: from the checkpoint, or new
    if meta is not None:
        kind, model_cfg = meta["model_kind"], meta["model_config"]
        model = model_from_header(lambda: build_model(kind, model_cfg), weights, cfg.resume, config=model_cfg)
        load_model_weights(model, weights)
        history, evals = list(meta.get("history", [])), list(meta.get("evals", []))
    else:
        kind, model_cfg = _new_model_config(cfg, model_config, data)
        model = build_model(kind, model_cfg)
        history, evals = [], []
    model.to(device).train()
    optimizer = _optimizer(model, cfg)
    if state is not None:
        restore_training_state(optimizer, meta, state, where=cfg.resume)
    teacher = None
    if cfg.distill_from:
        teacher, _ = load_model(cfg.distill_from, device)
        teacher.requires_grad_(False)
    runner = parallel.prepare(model)  # what every process runs on its part of a batch (shares model's weights)
    net = parallel.wrap(runner)  # ... and trains: DDP sums the gradients over the processes

    # 2. what the run says, and its metrics file
    log = RunLog(ctx, cfg.steps, start_step, cfg.progress and writes)
    if meta is None:
        log(f"model {kind}: {num_params(model) / 1e6:.2f}M parameters | data {getattr(data, 'name', cfg.data)} | "
            f"{parallel.describe()} on {device} | {cfg.precision} | global batch {cfg.batch_size}x{cfg.seq_len} | "
            f"{cfg.steps} steps, lr {cfg.lr:g} (warmup {cfg.warmup_steps}) -> {cfg.out}")
    else:
        log(f"resumed from {cfg.resume} at step {start_step}/{cfg.steps}: stored settings apply"
            + (f"; overridden: {', '.join(changes)}" if changes else ""))
        if cfg.steps > cfg.schedule_steps:
            log(f"note: the stored schedule decays until step {cfg.schedule_steps}; later steps train at the "
                f"floor lr {lr_at(cfg.schedule_steps, cfg):.2e} (pass --decay-steps {cfg.steps} to re-plan it)")
        if not writes:
            log("the run is finished: evaluating only, nothing in the run directory is written")
        elif ctx.is_main:
            write_metrics(cfg.out, history)  # lines written after the checkpoint (a crash) are dropped

    # 3. the loop
    profiler = start_profiler(device) if cfg.profile and writes else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    step = saved = start_step
    try:
        for step in range(start_step, end):
            if _stop_requested(stop, ctx):  # between two optimizer steps: the last one is complete
                _interrupted(stop.signum, cfg, ctx, saved, model, optimizer, kind, model_cfg, history, evals, log)
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = data.sample("train", cfg.seed, step, cfg.batch_size, cfg.seq_len)
            count = max(int((y != IGNORE_INDEX).sum()), 1)  # answer tokens in the global batch
            step_loss = 0.0
            for micro in range(cfg.grad_accum):
                rows = parallel.rows(cfg.batch_size, micro, cfg.grad_accum)
                xb, yb = parallel.shard(x[rows]).to(device), parallel.shard(y[rows]).to(device)
                sync = micro == cfg.grad_accum - 1 or not ctx.enabled
                with (contextlib.nullcontext() if sync else net.no_sync()), autocast(device, cfg.precision):
                    logits = net(xb)
                    loss = loss_sum(logits, yb) / count
                    if teacher is not None:
                        with torch.no_grad():
                            teacher_logits = teacher(xb)
                        loss = distill_loss(logits, teacher_logits, yb, loss, count, cfg)
                # DDP averages gradients over processes; scale so the result is the global-batch mean
                (loss * ctx.world).backward()
                step_loss += float(loss.detach())
            step_loss = all_reduce_sum(step_loss, ctx)
            grad_norm = _clip(model, cfg.grad_clip)
            if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
                raise TrainingDiverged(_diverged_message(cfg, step + 1, step_loss, grad_norm, lr))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            record = {"step": step + 1, "loss": step_loss, "lr": lr,
                      "tokens_per_s": tokens_per_step / (time.perf_counter() - t0)}
            history.append(record)
            if ctx.is_main:
                append_metric(cfg.out, record)
            log.step(record, cfg.steps, cfg.log_every)
            if profiler is not None and step + 1 - start_step >= cfg.profile_steps:
                finish_profiler(profiler, cfg.out, log)
                profiler = None
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                evals.append(_eval_and_sample(model, runner, parallel, data, cfg, ctx, step + 1, log))
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < end:
                _save(cfg, ctx, step + 1, model, optimizer, kind, model_cfg, history, evals, log)
                saved = step + 1
        step = end
        if stop.signum is not None:
            log(f"{stop.name(stop.signum)} received during the last step: finishing the run")
    finally:
        if profiler is not None:
            finish_profiler(profiler, cfg.out, log)
        log.close()

    # 4. the end: final evaluation, save, reports
    results = {"model_kind": kind, "params": num_params(model), "steps": step, "world": ctx.world,
               **parallel.results(), "history": history, "evals": evals}
    if step >= cfg.steps:
        final = _eval_and_sample(model, runner, parallel, data, cfg, ctx, step, log)
        if writes:
            evals.append(final)
        results["eval"] = final
    if writes:
        _save(cfg, ctx, step, model, optimizer, kind, model_cfg, history, evals, log)
    if teacher is not None:
        results["distill"] = distill_report(teacher, model, data, cfg, ctx, results, log)
    if cfg.quantize == "int8" and ctx.is_main:
        from .deploy import quantize_report

        results["quantize"] = quantize_report(model, data, cfg, log)
    if writes and ctx.is_main:
        write_results(cfg.out, {k: v for k, v in results.items() if k != "history"})
        curve = plot_loss_curve(history, evals, os.path.join(cfg.out, LOSS_CURVE),
                                title=f"{kind} on {getattr(data, 'name', cfg.data)}")
        if curve:
            log(f"loss curve → {curve}")
    return results


def _resumed_config(cfg: TrainConfig, meta: dict, given) -> tuple[TrainConfig, list[str]]:
    """The stored training config with the explicitly given fields of ``cfg`` on top, and a list of
    ``"name old → new"`` for each stored value that was overridden."""
    defaults = TrainConfig()
    names = [f.name for f in fields(TrainConfig)]
    if given is None:
        given = {n for n in names if getattr(cfg, n) != getattr(defaults, n)}
    stored = {k: v for k, v in meta.get("train_config", {}).items() if k in names}
    if stored.get("decay_steps", 0) == 0 and "steps" in stored:
        stored["decay_steps"] = stored["steps"]  # checkpoints from before decay_steps: keep their schedule
    merged = {**asdict(defaults), **stored}
    changes = []
    for name in names:
        if name in _INVOCATION_FIELDS:
            merged[name] = getattr(cfg, name)
        elif name in given and getattr(cfg, name) != merged[name]:
            changes.append(f"{name} {merged[name]!r} → {getattr(cfg, name)!r}")
            merged[name] = getattr(cfg, name)
    if "out" not in given:  # keep writing into the resumed run
        merged["out"] = _run_dir_of(cfg.resume)
    try:
        resumed = TrainConfig(**merged)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"resume: the training config stored in {cfg.resume} is not valid ({exc}). Fix: resume "
                         f"from another checkpoint, or give the setting explicitly.") from None
    if resumed.steps < meta["step"]:
        raise ValueError(f"steps: {resumed.steps} is below the checkpoint's step {meta['step']} ({cfg.resume}); a "
                         f"resumed run only moves forward. Fix: pass --steps {meta['step']} or more (equal: "
                         f"evaluate only), or start a new run with --out.")
    return resumed, changes


def _check_newest(run_dir: str, step: int, resume: str) -> None:
    """Continuing an older checkpoint inside its run would move ``latest`` backwards: refuse."""
    newer = [n for n in checkpoint_names(run_dir) if checkpoint_order(n)[0] > step]
    if newer:
        raise ValueError(f"resume: {resume} is at step {step} but its run directory {run_dir} holds the newer "
                         f"{newer[-1]}; continuing there would move 'latest' backwards. Fix: --resume {run_dir} "
                         f"to continue the newest, or add --out NEW_DIR to branch from step {step}.")


def _run_dir_of(path: str) -> str:
    """The run directory of a run directory or of one of its step directories."""
    path = os.path.abspath(path)
    return os.path.dirname(path) if os.path.isfile(os.path.join(path, "meta.json")) else path


def _check_batch_split(cfg: TrainConfig, parallel: DataParallel) -> None:
    per_step = parallel.replicas * cfg.grad_accum
    if cfg.batch_size % per_step:
        raise ValueError(f"batch_size: the global batch {cfg.batch_size} must divide evenly into "
                         f"{parallel.replicas} data-parallel replica(s) x {cfg.grad_accum} micro-batches; use a "
                         f"multiple of {per_step}.")


def _new_model_config(cfg: TrainConfig, model_config, data) -> tuple[str, dict]:
    kind = "lstm" if isinstance(model_config, LSTMConfig) else cfg.model
    if model_config is None:
        model_config = default_model_config(kind)
    model_config = replace(model_config, vocab_size=data.vocab_size)
    if getattr(model_config, "position", None) == "learned":  # the position table must cover a sequence
        model_config = replace(model_config, max_len=max(model_config.max_len, cfg.seq_len))
    return kind, config_dict(model_config)


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _clip(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to ``max_norm`` (0 = off) and return it (0.0 when off)."""
    if max_norm <= 0:
        return 0.0
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def _diverged_message(cfg: TrainConfig, step: int, loss: float, grad_norm: float, lr: float) -> str:
    try:
        kept = newest_checkpoint(cfg.out) if os.path.isdir(cfg.out) else None
    except ValueError:  # a 'latest' that was tampered with: say nothing about it here
        kept = None
    where = (f"the last good checkpoint is kept ({os.path.join(cfg.out, kept)}); continue from it with --resume "
             f"{cfg.out}" if kept else "no checkpoint was saved; start again")
    return (f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm} (lr {lr:.2e}); stopped "
            f"without saving. Fix: {where} and a lower --lr (now {cfg.lr:g}), more --warmup-steps or a "
            f"--grad-clip.")


def _eval_and_sample(model, runner, parallel, data, cfg, ctx, step, log) -> dict:
    result = {"step": step, **evaluate(runner, data, cfg, ctx, parallel=parallel)}
    if isinstance(data, SyntheticTask):
        log(f"step {step}: eval loss {result['loss']:.4f}, answer accuracy {result['accuracy']:.3f}")
    else:
        log(f"step {step}: eval loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}")
        if cfg.sample_tokens and ctx.is_main and parallel.samples():
            text = sample_text(model, "\n", cfg.sample_tokens, device=ctx.device, seed=cfg.seed + step)
            log("sample:\n  " + text.rstrip().replace("\n", "\n  "))
    return result


def _save(cfg, ctx, step, model, optimizer, kind, model_cfg, history, evals, log, quiet=False) -> str:
    path = os.path.join(cfg.out, f"step-{step:06d}")
    if ctx.is_main:
        meta = {"model_kind": kind, "model_config": model_cfg, "train_config": asdict(cfg),
                "history": history, "evals": evals}
        path = save_checkpoint(cfg.out, step, model, meta, optimizer)
        if not quiet:
            log(f"saved step {step} → {path}")
    barrier(ctx)
    return path


def _stop_requested(stop: StopSignals, ctx: DistContext) -> bool:
    """Whether a stop signal arrived (on any process: they all stop at the same step)."""
    flag = float(stop.signum is not None)
    return (all_reduce_sum(flag, ctx) if ctx.enabled else flag) > 0


def _interrupted(signum, cfg, ctx, saved, model, optimizer, kind, model_cfg, history, evals, log):
    """Save the last finished step (unless it is saved already), print one line, raise TrainingInterrupted."""
    signum = signum if signum is not None else signal.SIGTERM  # another process received it
    done, name = len(history), StopSignals.name(signum)
    if done > saved:
        path = _save(cfg, ctx, done, model, optimizer, kind, model_cfg, history, evals, log, quiet=True)
        message = f"{name}: stopped after step {done}, saved {path}; continue with --resume {cfg.out}"
    elif done > 0:
        message = f"{name}: stopped after step {done}, which is saved; continue with --resume {cfg.out}"
    else:
        message = f"{name}: stopped before the first step finished; nothing was saved"
    log(message)
    raise TrainingInterrupted(signum, done, path if done > saved else None, message)
