"""PNG plots of a sweep (matplotlib, from the ``bench`` extra; Agg backend, no display needed)."""

from __future__ import annotations

from pathlib import Path

from .cases import mask_spec

__all__ = ["write_plots", "missing_extra"]


def missing_extra() -> str | None:
    """None when matplotlib is importable, else the message naming the extra to install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "plots need matplotlib: pip install 'attnkit[bench]'"
    return None


def _series(results: dict, passes: str, dtype: str, mask: str, key: str) -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = {}
    for r in results["results"]:
        if r["status"] == "ok" and (r["passes"], r["dtype"], r["mask"]) == (passes, dtype, mask) and r[key]:  # log axes: drop None and 0
            xs, ys = out.setdefault(r["backend"], ([], []))
            xs.append(r["n"])
            ys.append(r[key])
    return out


def _colors(results: dict) -> dict[str, object]:
    """One color per backend across every panel (so the shared legend is right)."""
    import matplotlib.pyplot as plt

    names = sorted({r["backend"] for r in results["results"]})
    cycle = plt.get_cmap("tab10")
    return {name: cycle(i % 10) for i, name in enumerate(names)}


def _grid(results: dict, key: str, ylabel: str, title: str, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["passes"], r["dtype"]) for r in results["results"] if r["status"] == "ok"})
    masks = list(dict.fromkeys(r["mask"] for r in results["results"] if r["status"] == "ok"))
    if not combos or not masks:
        return None
    fig, axes = plt.subplots(len(combos), len(masks), figsize=(3.2 * len(masks), 2.8 * len(combos)), squeeze=False)
    colors = _colors(results)
    for i, (passes, dtype) in enumerate(combos):
        for j, mask in enumerate(masks):
            ax = axes[i][j]
            for backend, (xs, ys) in sorted(_series(results, passes, dtype, mask, key).items()):
                ax.plot(xs, ys, marker="o", markersize=3, label=backend, color=colors[backend],
                        linestyle="--" if backend == "auto" else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{mask_spec(mask).label}, {dtype}, {passes}", fontsize=8)
            ax.tick_params(labelsize=7)
            if i == len(combos) - 1:
                ax.set_xlabel("sequence length n", fontsize=8)
            if j == 0:
                ax.set_ylabel(ylabel, fontsize=8)
    handles, labels = {}, {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="upper right", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.08, right=0.88, bottom=0.1, top=0.9, wspace=0.35, hspace=0.45)  # tight_layout is slow
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _error_vs_speed(results: dict, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["results"] if r["status"] == "ok" and not r["exact"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = _colors(results)
    for backend in sorted({r["backend"] for r in rows}):
        mine = [r for r in rows if r["backend"] == backend]
        ax.scatter([r["median_s"] * 1e3 for r in mine], [max(r["error"], 1e-12) for r in mine], label=backend, s=14,
                   color=colors[backend])
        for r in mine:
            ax.annotate(f"{r['mask']} {r['n']}", (r["median_s"] * 1e3, max(r["error"], 1e-12)), fontsize=5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("median time per call (ms)")
    ax.set_ylabel("relative error vs exact (float64)")
    ax.set_title("approximate backends: error vs speed")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """Time vs length (log-log) per backend and mask, peak memory vs length, error vs speed."""
    made = [
        _grid(results, "median_s", "median time (s)", "time vs length", out_dir / "time_vs_length.png"),
        _grid(results, "peak_bytes", "peak memory (bytes)", f"peak memory vs length ({results['memory_method']})",
              out_dir / "memory_vs_length.png"),
        _error_vs_speed(results, out_dir / "error_vs_speed.png"),
    ]
    return [p for p in made if p is not None]
