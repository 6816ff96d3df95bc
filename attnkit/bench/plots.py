"""PNG plots of a sweep (matplotlib, from the ``bench`` extra; Agg backend, no display needed)."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

from .cases import mask_spec

__all__ = ["write_plots", "missing_extra", "style", "STYLES"]


def missing_extra() -> str | None:
    """None when matplotlib is importable, else the message naming the extra to install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "plots need matplotlib: pip install 'attnkit[bench]'"
    return None


# One colour and marker per backend in every plot and every run (a sweep measuring fewer backends
# keeps the others' colours), with markers no two of which look alike. In every plot a dashed line means
# one thing, an approximate backend: exact backends are drawn solid, approximate ones dashed, auto dotted.
STYLES = {
    "naive": ("#1f77b4", "o"),
    "sdpa": ("#d62728", "s"),
    "tiled": ("#2ca02c", "^"),
    "sliding_window": ("#9467bd", "v"),
    "block_sparse": ("#8c564b", "D"),
    "linear": ("#ff7f0e", "P"),
    "performer": ("#e377c2", "X"),
    "lsh": ("#17becf", "*"),
    "native": ("#bcbd22", ">"),
    "flex": ("#7f7f7f", "h"),
    "decode": ("#aec7e8", "<"),
    "auto": ("#000000", "+"),
}
_SPARE = ["#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d"]
_SPARE_MARKERS = ["8", "d", "H", "1", "2", "|"]
APPROXIMATE = frozenset({"linear", "performer", "lsh"})


def style(backend: str, exact: bool | None = None) -> dict:
    """Matplotlib keyword arguments for ``backend``'s line: the same for a name in every plot and
    run (names outside the table get a colour from a checksum of the name, not from the order)."""
    family = backend.split("-")[0].split("->")[0]
    if family in STYLES:
        color, marker = STYLES[family]
    else:
        i = zlib.crc32(family.encode())
        color, marker = _SPARE[i % len(_SPARE)], _SPARE_MARKERS[i % len(_SPARE_MARKERS)]
    if exact is None:
        exact = family not in APPROXIMATE
    linestyle = ":" if family == "auto" else ("-" if exact else "--")
    return {"color": color, "marker": marker, "linestyle": linestyle}


def _series(results: dict, passes: str, dtype: str, mask: str, key: str) -> dict[str, tuple[list, list, bool]]:
    out: dict[str, tuple[list, list, bool]] = {}
    for r in results["results"]:
        # log axes: drop None and 0
        if r["status"] == "ok" and (r["passes"], r["dtype"], r["mask"]) == (passes, dtype, mask) and r[key]:
            xs, ys, _ = out.setdefault(r["backend"], ([], [], r["exact"]))
            xs.append(r["n"])
            ys.append(r[key])
    return out


MAX_PANELS = 6  # per PNG: more panels are too small to read


def _grid(results: dict, key: str, scale: float, ylabel: str, title: str, path: Path) -> list[Path]:
    """Time (or memory) against length: one panel per (pass, dtype, mask) where a backend was measured
    at two or more lengths (a single point is no curve, and is not drawn); one PNG per pass and dtype,
    of at most ``MAX_PANELS`` panels (more masks: more PNGs). ``path`` itself when one PNG holds
    everything, else ``<stem>-<pass>-<dtype>[-<page>].png`` beside it; [] when no panel qualifies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results["results"] if r["status"] == "ok"]
    panels: dict[tuple[str, str], list] = {}  # (pass, dtype) -> [(mask, {backend: (xs, ys, exact)})]
    for passes, dtype, mask in sorted(dict.fromkeys((r["passes"], r["dtype"], r["mask"]) for r in ok),
                                      key=lambda c: (c[0], c[1])):
        curves = {b: c for b, c in _series(results, passes, dtype, mask, key).items() if len(c[0]) >= 2}
        if curves:
            panels.setdefault((passes, dtype), []).append((mask, curves))
    pages = [(group, page, cells[i:i + MAX_PANELS]) for group, cells in panels.items()
             for page, i in enumerate(range(0, len(cells), MAX_PANELS), 1)]
    made = []
    for (passes, dtype), page, cells in pages:
        several = len(cells) < len(panels[passes, dtype])  # this pass and dtype take more than one page
        name = path.name if len(pages) == 1 else (
            f"{path.stem}-{passes}-{dtype}{f'-{page}' if several else ''}{path.suffix}")
        made.append(_grid_page(plt, f"{passes}, {dtype}", cells, scale, ylabel, title, path.with_name(name)))
    return made


def _grid_page(plt, what: str, cells: list, scale: float, ylabel: str, title: str, path: Path) -> Path:
    cols = min(3, len(cells))
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1.6, 3.0 * rows), squeeze=False)
    handles: dict[str, object] = {}
    for n, ax in enumerate(ax for row in axes for ax in row):
        if n >= len(cells):
            ax.set_visible(False)
            continue
        mask, curves = cells[n]
        for backend, (xs, ys, exact) in sorted(curves.items()):
            (line,) = ax.plot(xs, [y * scale for y in ys], markersize=4, label=backend, **style(backend, exact))
            handles.setdefault(backend, line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(mask_spec(mask).label, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(True, which="major", alpha=0.3)
        if n + cols >= len(cells):
            ax.set_xlabel("sequence length n", fontsize=9)
        if n % cols == 0:
            ax.set_ylabel(ylabel, fontsize=9)
    order = [b for b in STYLES if b in handles] + sorted(b for b in handles if b not in STYLES)
    fig.legend([handles[b] for b in order], order, loc="center right", fontsize=8,
               title="solid: exact\ndashed: approximate\ndotted: auto", title_fontsize=7)
    fig.suptitle(f"{title} ({what})", fontsize=11)
    fig.subplots_adjust(left=0.07, right=1 - 1.5 / fig.get_figwidth(), bottom=0.12, top=0.86, wspace=0.3,
                        hspace=0.5)  # tight_layout is slow
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _error_vs_speed(results: dict, path: Path) -> Path | None:
    """Approximate backends: error against time, one colour per backend, one marker per mask."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = [r for r in results["results"] if r["status"] == "ok" and not r["exact"]]
    if len(rows) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mask_markers = dict(zip(dict.fromkeys(r["mask"] for r in rows), "osD^vP*X"))
    for r in rows:
        ax.scatter(r["median_s"] * 1e3, max(r["error"], 1e-12), s=16 + 10 * math.log2(max(r["n"], 1)) / 4,
                   color=style(r["backend"], False)["color"], marker=mask_markers[r["mask"]], alpha=0.85)
    backends = sorted({r["backend"] for r in rows})
    legend = [Line2D([], [], color=style(b, False)["color"], marker="o", linestyle="", label=b) for b in backends]
    legend += [Line2D([], [], color="gray", marker=m, linestyle="", label=mask_spec(k).label)
               for k, m in mask_markers.items()]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("median time per call (ms)")
    ax.set_ylabel("relative error vs exact attention (float64)")
    lengths = sorted({r["n"] for r in rows})
    ax.set_title(f"Approximate backends: error vs time (n = {', '.join(map(str, lengths))}; larger marker = longer n)",
                 fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(handles=legend, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def _auto_over_best(results: dict, path: Path) -> Path | None:
    """Is ``auto`` the fastest? auto's time over the best measured backend's against length, one
    panel per pass, one line per mask and dtype (a colour per mask, a marker per dtype: dashed lines
    mean approximate backends in every plot), 1.0 and 1.05 marked."""
    from .report import AUTO_GOOD_ENOUGH, auto_ratios

    rows = auto_ratios(results)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = sorted({r["passes"] for r in rows})
    fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 4), squeeze=False, sharey=True)
    colours = dict(zip(dict.fromkeys(r["mask"] for r in rows), plt.get_cmap("tab10").colors))
    markers = dict(zip(dict.fromkeys(r["dtype"] for r in rows), "os^vD"))
    for ax, passes_name in zip(axes[0], passes):
        for (mask, dtype) in dict.fromkeys((r["mask"], r["dtype"]) for r in rows if r["passes"] == passes_name):
            pts = sorted((r["n"], r["auto_over_best"]) for r in rows
                         if (r["mask"], r["dtype"], r["passes"]) == (mask, dtype, passes_name))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[dtype], color=colours[mask],
                    linestyle="-", label=f"{mask_spec(mask).label} {dtype}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.axhline(AUTO_GOOD_ENOUGH, color="gray", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n")
        ax.set_title(passes_name, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("auto time / best backend time")
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    when = "after this run's calibration" if results.get("auto_verification") else "as auto stood during the sweep"
    fig.suptitle(f"Does auto pick the fastest backend, {when}? (1.0 = yes; dotted line: 5% slower)", fontsize=10)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """Time vs length (log-log) per backend and mask, peak memory vs length, error vs speed, and
    auto over the best backend."""
    method = results["memory_method"].split(" (")[0]
    made = [
        *_grid(results, "median_s", 1e3, "median time per call (ms)", "Time per call vs sequence length",
               out_dir / "time_vs_length.png"),
        *_grid(results, "peak_bytes", 2**-20, "peak memory (MiB)", f"Peak memory vs sequence length ({method})",
               out_dir / "memory_vs_length.png"),
        _error_vs_speed(results, out_dir / "error_vs_speed.png"),
        _auto_over_best(results, out_dir / "auto_vs_best.png"),
    ]
    return [p for p in made if p is not None]
