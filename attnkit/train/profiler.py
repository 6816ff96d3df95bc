"""``--profile``: a Chrome/Perfetto trace of the first steps and a table of the top operators."""

from __future__ import annotations

import os

import torch

from ..io.files import atomic_write

__all__ = ["start_profiler", "finish_profiler"]


def start_profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.__enter__()
    return prof


def finish_profiler(prof, out_dir: str, log) -> None:
    prof.__exit__(None, None, None)
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(out_dir, "trace.json" if rank == 0 else f"trace-rank{rank}.json")
    os.makedirs(out_dir, exist_ok=True)
    atomic_write(path, prof.export_chrome_trace)
    log(f"profile: Chrome/Perfetto trace written to {path} (open in chrome://tracing or ui.perfetto.dev)")
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
