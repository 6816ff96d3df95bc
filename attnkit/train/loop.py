"""The training loop behind ``python -m attnkit train``.

AdamW with linear warmup and cosine decay, gradient clipping and accumulation, bf16 autocast, DDP
under ``torchrun``, periodic evaluation with a sample, exact resume, profiling, and the deployment
steps (int8 dynamic quantization, distillation from a teacher checkpoint).

Losses are normalised by the number of answer tokens in the *global* batch, so one process, N
processes and any gradient-accumulation split of the same global batch compute the same gradient.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..generation import process_logits
from .checkpoint import load_checkpoint, load_model_weights, restore_training_state, save_checkpoint
from .data import IGNORE_INDEX, decode, encode, load_corpus
from .distributed import DistContext, all_reduce_sum, barrier, setup_distributed, teardown
from .lstm import LSTMConfig, LSTMLanguageModel
from .tasks import SyntheticTask, make_task

__all__ = ["TrainConfig", "train", "build_model", "load_model", "evaluate", "lr_at", "load_data"]


@dataclass
class TrainConfig:
    data: str = field(default="default", metadata={
        "help": "'default' (Shakespeare, else Python stdlib sources), 'stdlib', a text file, or "
                "'task:assoc_recall|copy|selective_copy[:DISTANCE]'"})
    out: str = field(default="runs/attnkit", metadata={"help": "run directory (checkpoints, metrics, trace)"})
    model: str = field(default="gpt", metadata={"help": "'gpt' or 'lstm' (baseline)"})
    steps: int = field(default=300, metadata={"help": "optimizer steps (the schedule's length)"})
    batch_size: int = field(default=16, metadata={"help": "global batch in sequences (all processes, all micro-batches)"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence (text data)"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final learning rate as a fraction of the peak"})
    warmup_steps: int = field(default=30, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (matrices only)"})
    grad_clip: float = field(default=1.0, metadata={"help": "max global gradient norm (0 = off)"})
    precision: str = field(default="fp32", metadata={"help": "'fp32' or 'bf16' (autocast)"})
    device: str = field(default="auto", metadata={"help": "'auto', 'cpu', 'cuda', 'cuda:1', ..."})
    seed: int = field(default=0, metadata={"help": "seed for weights, data and sampling"})
    eval_every: int = field(default=100, metadata={"help": "evaluate (and sample) every N steps"})
    eval_batches: int = field(default=4, metadata={"help": "validation batches per evaluation"})
    sample_tokens: int = field(default=120, metadata={"help": "tokens sampled at each evaluation (0 = none)"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"})
    resume: str = field(default="", metadata={"help": "run directory or checkpoint to continue from exactly"})
    profile: bool = field(default=False, metadata={"help": "profile the first steps: Chrome trace + top operators"})
    profile_steps: int = field(default=5, metadata={"help": "steps recorded by --profile"})
    quantize: str = field(default="none", metadata={"help": "'int8': after training, report dynamic int8 "
                                                            "quantization (CPU inference speedup, eval-loss change)"})
    distill_from: str = field(default="", metadata={"help": "teacher run directory: train this (smaller) model "
                                                            "on KL to the teacher's logits + the data loss"})
    distill_alpha: float = field(default=0.5, metadata={"help": "weight of the KL term in distillation"})
    distill_temperature: float = field(default=2.0, metadata={"help": "softmax temperature of distillation"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    context_parallel: int = field(default=1, metadata={"help": "split each sequence across this many torchrun "
                                                               "processes (attnkit.distributed; 1 = off)"})

    def __post_init__(self):
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision: expected 'fp32' or 'bf16', got {self.precision!r}.")
        if self.model not in ("gpt", "lstm"):
            raise ValueError(f"model: expected 'gpt' or 'lstm', got {self.model!r}.")
        if self.quantize not in ("none", "int8"):
            raise ValueError(f"quantize: expected 'none' or 'int8', got {self.quantize!r}.")
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}.")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * min(progress, 1.0)))


def load_data(spec: str):
    """A :class:`TextCorpus` or a :class:`SyntheticTask`; both have ``vocab_size`` and ``sample()``."""
    return make_task(spec) if spec.startswith("task:") else load_corpus(spec)


def build_model(kind: str, config: dict) -> nn.Module:
    """A model from its kind and config dict (as stored in a checkpoint's meta.json)."""
    if kind == "lstm":
        return LSTMLanguageModel(LSTMConfig(**config))
    from ..nn.layers import TransformerConfig
    from ..nn.models import GPT

    names = {f.name for f in fields(TransformerConfig)}
    return GPT(TransformerConfig(**{k: v for k, v in config.items() if k in names and k != "backend_options"}))


def config_dict(config) -> dict:
    return {k: v for k, v in asdict(config).items() if k != "backend_options"}


def load_model(path: str, device: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """The model of a checkpoint (run directory or step directory) and its meta."""
    meta, weights, _ = load_checkpoint(path)
    model = build_model(meta["model_kind"], meta["model_config"])
    load_model_weights(model, weights)
    return model.to(device).eval(), meta


def _autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def _loss_sum(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def evaluate(model: nn.Module, data, cfg: TrainConfig, ctx: DistContext | None = None, *,
             device: torch.device | None = None) -> dict:
    """Validation loss (mean per answer token), perplexity and answer accuracy on fixed batches."""
    ctx = ctx or DistContext()
    device = device or ctx.device
    was_training = model.training
    model.eval()
    loss = correct = count = 0.0
    rows = max(cfg.batch_size // ctx.world, 1)
    for i in range(cfg.eval_batches):
        x, y = data.sample("val", cfg.seed, i, rows * ctx.world, cfg.seq_len)
        x, y = x[ctx.rank * rows:(ctx.rank + 1) * rows].to(device), y[ctx.rank * rows:(ctx.rank + 1) * rows].to(device)
        with _autocast(device, cfg.precision):
            logits = model(x)
        loss += float(_loss_sum(logits, y))
        valid = y != IGNORE_INDEX
        correct += float(((logits.argmax(-1) == y) & valid).sum())
        count += float(valid.sum())
    model.train(was_training)
    loss, correct, count = (all_reduce_sum(v, ctx) for v in (loss, correct, count))
    mean = loss / max(count, 1)
    return {"loss": mean, "perplexity": math.exp(min(mean, 50)), "accuracy": correct / max(count, 1)}


@torch.no_grad()
def sample_text(model: nn.Module, prompt: str, max_new_tokens: int, *, temperature: float = 0.8,
                top_k: int | None = 40, device="cpu", seed: int = 0) -> str:
    """A sample from a byte-level model, without touching the global RNG stream (resume stays exact)."""
    ids = encode(prompt)[None].to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = _generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k)
    return decode(out[0, ids.shape[1]:].tolist())


def _generate(model, ids: Tensor, max_new_tokens: int, *, temperature: float, top_k: int | None) -> Tensor:
    max_len = getattr(getattr(model, "config", None), "max_len", None)
    if max_len is not None:  # learned positions end at max_len
        max_new_tokens = min(max_new_tokens, max_len - ids.shape[1])
    if not isinstance(model, LSTMLanguageModel):
        from ..generation import generate

        return generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k)
    for _ in range(max_new_tokens):  # the LSTM baseline: no KV cache, rerun the prefix
        scores = process_logits(model(ids)[:, -1], temperature=temperature, top_k=top_k)
        ids = torch.cat([ids, torch.multinomial(scores.softmax(-1), 1)], dim=1)
    return ids


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts tied weights once


def model_bytes(model: nn.Module) -> int:
    """Bytes of the weights as stored (state dict, tied tensors once, packed int8 counted as such)."""
    seen, total = set(), 0
    for value in model.state_dict().values():
        tensors = value if isinstance(value, tuple) else (value,)
        for t in tensors:
            if isinstance(t, Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


class _Printer:
    def __init__(self, ctx: DistContext, bar):
        self.ctx, self.bar = ctx, bar

    def __call__(self, *msg):
        if not self.ctx.is_main:
            return
        text = " ".join(str(m) for m in msg)
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)


def _progress_bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def train(cfg: TrainConfig, model_config=None, *, stop_at: int | None = None) -> dict:
    """Train (or continue with ``cfg.resume``) and return the run's results.

    ``model_config`` is a ``TransformerConfig`` (``cfg.model == "gpt"``) or ``LSTMConfig``; its
    vocabulary size is set from the data. ``stop_at`` ends the run early after that step, saving
    a checkpoint as an interruption would (the tests use it to check exact resume)."""
    if cfg.context_parallel != 1:  # one sequence split across processes: its own loop
        from ..distributed.training import train_context_parallel

        return train_context_parallel(cfg, model_config)
    ctx = setup_distributed(cfg.device)
    try:
        return _train(cfg, model_config, ctx, stop_at)
    finally:
        teardown(ctx)


def _train(cfg: TrainConfig, model_config, ctx: DistContext, stop_at: int | None) -> dict:
    device = ctx.device
    per_step = ctx.world * cfg.grad_accum
    if cfg.batch_size % per_step:
        raise ValueError(f"batch_size: the global batch {cfg.batch_size} must divide evenly into "
                         f"{ctx.world} processes x {cfg.grad_accum} micro-batches; use a multiple of {per_step}.")
    data = load_data(cfg.data)
    if isinstance(data, SyntheticTask):
        cfg.seq_len = data.seq_len
    torch.manual_seed(cfg.seed)
    start_step, history, evals = 0, [], []
    meta = state = None
    if cfg.resume:
        if cfg.out == TrainConfig.out:  # no --out given: keep writing into the resumed run
            run_dir = os.path.abspath(cfg.resume)
            cfg.out = os.path.dirname(run_dir) if os.path.isfile(os.path.join(run_dir, "meta.json")) else run_dir
        meta, weights, state = load_checkpoint(cfg.resume)
        model = build_model(meta["model_kind"], meta["model_config"])
        load_model_weights(model, weights)
        start_step, history, evals = meta["step"], meta.get("history", []), meta.get("evals", [])
        kind, model_cfg = meta["model_kind"], meta["model_config"]
    else:
        kind = "lstm" if isinstance(model_config, LSTMConfig) else cfg.model
        if model_config is None:
            model_config = LSTMConfig() if kind == "lstm" else _default_gpt_config()
        model_config.vocab_size = data.vocab_size
        if hasattr(model_config, "max_len"):
            model_config.max_len = max(model_config.max_len, cfg.seq_len)
        model = build_model(kind, config_dict(model_config))
        model_cfg = config_dict(model_config)
    model.to(device).train()
    optimizer = _optimizer(model, cfg)
    if state is not None:
        restore_training_state(optimizer, meta, state)
    teacher = None
    if cfg.distill_from:
        teacher, _ = load_model(cfg.distill_from, device)
        teacher.requires_grad_(False)
    net = model
    if ctx.enabled:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    bar = _progress_bar(cfg.steps, start_step, cfg.progress and ctx.is_main)
    log = _Printer(ctx, bar)
    if start_step == 0:
        log(f"model {kind}: {num_params(model) / 1e6:.2f}M parameters | data {getattr(data, 'name', cfg.data)} | "
            f"{ctx.world} process(es) on {device} | {cfg.precision} | global batch {cfg.batch_size}x{cfg.seq_len}")
    else:
        log(f"resumed from {cfg.resume} at step {start_step}")
    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    if ctx.is_main:
        os.makedirs(cfg.out, exist_ok=True)

    profiler = _start_profiler(cfg, device) if cfg.profile else None
    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    step = start_step
    try:
        for step in range(start_step, end):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = data.sample("train", cfg.seed, step, cfg.batch_size, cfg.seq_len)
            count = max(int((y != IGNORE_INDEX).sum()), 1)  # answer tokens in the global batch
            step_loss = 0.0
            for micro in range(cfg.grad_accum):
                rows = _rows(cfg.batch_size, ctx, micro, cfg.grad_accum)
                xb, yb = x[rows].to(device), y[rows].to(device)
                sync = micro == cfg.grad_accum - 1 or not ctx.enabled
                with (contextlib.nullcontext() if sync else net.no_sync()), _autocast(device, cfg.precision):
                    logits = net(xb)
                    loss = _loss_sum(logits, yb) / count
                    if teacher is not None:
                        with torch.no_grad():
                            teacher_logits = teacher(xb)
                        loss = _distill_loss(logits, teacher_logits, yb, loss, count, cfg)
                # DDP averages gradients over processes; scale so the result is the global-batch mean
                (loss * ctx.world).backward()
                step_loss += float(loss.detach())
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_loss = all_reduce_sum(step_loss, ctx)
            dt = time.perf_counter() - t0
            record = {"step": step + 1, "loss": step_loss, "lr": lr, "tokens_per_s": tokens_per_step / dt}
            history.append(record)
            if ctx.is_main:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if bar is not None:
                bar.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
            if profiler is not None and step + 1 - start_step >= cfg.profile_steps:
                _finish_profiler(profiler, cfg, log)
                profiler = None
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                evals.append(_eval_and_sample(model, data, cfg, ctx, step + 1, log))
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < end:
                _save(cfg, ctx, step + 1, model, optimizer, kind, model_cfg, history, evals)
        step = end
    except KeyboardInterrupt:
        step = len(history)
        log(f"interrupted: saving step {step} to {cfg.out}; continue with --resume {cfg.out}")
        _save(cfg, ctx, step, model, optimizer, kind, model_cfg, history, evals)
        raise
    finally:
        if profiler is not None:
            _finish_profiler(profiler, cfg, log)
        if bar is not None:
            bar.close()
    results = {"model_kind": kind, "params": num_params(model), "steps": step, "world": ctx.world,
               "history": history, "evals": evals}
    if step >= cfg.steps:
        final = _eval_and_sample(model, data, cfg, ctx, step, log)
        evals.append(final)
        results["eval"] = final
    _save(cfg, ctx, step, model, optimizer, kind, model_cfg, history, evals)
    if teacher is not None:
        results["distill"] = _distill_report(teacher, model, data, cfg, ctx, results, log)
    if cfg.quantize == "int8" and ctx.is_main:
        from .deploy import quantize_report

        results["quantize"] = quantize_report(model, data, cfg, log)
    if ctx.is_main:
        with open(os.path.join(cfg.out, "results.json"), "w") as f:
            json.dump({k: v for k, v in results.items() if k != "history"}, f, indent=1)
    return results


def _rows(batch_size: int, ctx: DistContext, micro: int, accum: int) -> slice:
    per_micro = batch_size // (ctx.world * accum)
    start = (ctx.rank * accum + micro) * per_micro
    return slice(start, start + per_micro)


def _distill_loss(logits, teacher_logits, targets, data_loss, count, cfg: TrainConfig) -> Tensor:
    """``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * data loss``, over answer tokens."""
    T = cfg.distill_temperature
    valid = (targets != IGNORE_INDEX).flatten()
    s = F.log_softmax(logits.float().flatten(0, 1)[valid] / T, dim=-1)
    t = F.log_softmax(teacher_logits.float().flatten(0, 1)[valid] / T, dim=-1)
    kl = F.kl_div(s, t, log_target=True, reduction="sum") / count
    return cfg.distill_alpha * T * T * kl + (1 - cfg.distill_alpha) * data_loss


def _distill_report(teacher, student, data, cfg, ctx, results, log) -> dict:
    t_eval = evaluate(teacher, data, cfg, ctx)
    s_eval = results.get("eval") or evaluate(student, data, cfg, ctx)
    report = {"teacher_loss": t_eval["loss"], "student_loss": s_eval["loss"],
              "teacher_params": num_params(teacher), "student_params": num_params(student),
              "teacher_bytes": model_bytes(teacher), "student_bytes": model_bytes(student)}
    log(f"distillation: teacher eval loss {report['teacher_loss']:.4f} ({report['teacher_params'] / 1e6:.2f}M params, "
        f"{report['teacher_bytes'] / 2**20:.2f} MiB) | student {report['student_loss']:.4f} "
        f"({report['student_params'] / 1e6:.2f}M params, {report['student_bytes'] / 2**20:.2f} MiB, "
        f"{report['teacher_params'] / report['student_params']:.1f}x smaller)")
    return report


def _eval_and_sample(model, data, cfg, ctx, step, log) -> dict:
    result = {"step": step, **evaluate(model, data, cfg, ctx)}
    if isinstance(data, SyntheticTask):
        log(f"step {step}: eval loss {result['loss']:.4f}, answer accuracy {result['accuracy']:.3f}")
    else:
        log(f"step {step}: eval loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}")
        if cfg.sample_tokens and ctx.is_main:
            text = sample_text(model, "\n", cfg.sample_tokens, device=ctx.device, seed=cfg.seed + step)
            log("  sample: " + repr(text))
    return result


def _save(cfg, ctx, step, model, optimizer, kind, model_cfg, history, evals) -> None:
    if ctx.is_main:
        meta = {"model_kind": kind, "model_config": model_cfg, "train_config": asdict(cfg),
                "history": history, "evals": evals}
        save_checkpoint(cfg.out, step, model, meta, optimizer)
    barrier(ctx)


def _default_gpt_config():
    from ..nn.layers import TransformerConfig

    return TransformerConfig(**GPT_TRAIN_DEFAULTS)


# The small GPT the `train` command starts from: it learns visibly within ~2 minutes on 2 CPU cores.
GPT_TRAIN_DEFAULTS = {"embed_dim": 128, "num_layers": 4, "num_heads": 4, "max_len": 128}


def _start_profiler(cfg: TrainConfig, device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.__enter__()
    return prof


def _finish_profiler(prof, cfg: TrainConfig, log) -> None:
    prof.__exit__(None, None, None)
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(cfg.out, "trace.json" if rank == 0 else f"trace-rank{rank}.json")
    os.makedirs(cfg.out, exist_ok=True)
    prof.export_chrome_trace(path)
    log(f"profile: Chrome/Perfetto trace written to {path} (open in chrome://tracing or ui.perfetto.dev)")
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
