"""Turn sweep results into a terminal table, crossover tables, JSON and a short Markdown report."""

from __future__ import annotations

import io
import json
import shlex
import statistics
import shutil
from pathlib import Path

from .cases import MASK_SPECS as _KNOWN_MASKS
from .cases import describe_bytes, mask_spec

__all__ = ["command_line", "format_table", "terminal_table", "skip_hint", "crossovers", "crossover_table",
           "write_json", "write_markdown", "auto_ratios", "auto_before", "auto_sweep", "auto_summary",
           "auto_table"]


def command_line(head: str, argv: list[str]) -> str:
    """The command line to store with results, without ``--out``: where the files went is no
    property of the figures, and it would write this machine's paths into shared files."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return f"{head} {shlex.join(kept)}".strip()


def format_table(rows: list[list[str]], header: list[str], markdown: bool = False,
                 right: frozenset[int] = frozenset(), width: int | None = None) -> str:
    """A plain or Markdown table; the columns in ``right`` (numbers) are right-aligned. A plain
    table is laid out by ``rich`` (the ``bench`` extra) to fit ``width`` columns (default: the
    terminal's), its text cells wrapped, never cut; without ``rich``, one line per row."""
    if markdown:
        rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(header)))
        lines = ["| " + " | ".join(header) + " |", rule]
        cell = lambda c: str(c).replace("|", "\\|")  # noqa: E731  (a reason may quote `a | b`)
        return "\n".join(lines + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows])
    width = width or shutil.get_terminal_size((100, 24)).columns
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # the core runs without the bench extra: unwrapped columns
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
        align = lambda r: "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)  # noqa: E731
                                    for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        return "\n".join([align(header), align(["-" * w for w in widths])] + [align(r) for r in rows])
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="")
    # Too wide: narrow the widest text column first (never below 12 characters, its header or its
    # longest word up to 24 characters, so a name such as sliding_window is never cut), so short cells
    # stay on one line and only long text (reasons, lists) wraps at spaces; no column is dropped.
    widths = [max([len(name)] + [len(str(r[i])) for r in rows]) for i, name in enumerate(header)]
    floors = [max([12, len(name)] + [min(len(word), 24) for r in rows for word in str(r[i]).split()])
              for i, name in enumerate(header)]
    while sum(widths) + 3 * (len(widths) - 1) > width:
        text = [i for i in range(len(widths)) if i not in right and widths[i] > floors[i]]
        if not text:
            break
        widths[max(text, key=lambda i: widths[i])] -= 1
    for i, name in enumerate(header):
        table.add_column(name, justify="right" if i in right else "left", no_wrap=i in right, overflow="fold",
                         width=widths[i])
    for r in rows:
        table.add_row(*(str(c) for c in r))
    # numbers and headers are never squeezed: a table of many number columns may run wider
    width = max(width, sum(widths) + 3 * (len(widths) - 1))
    console = Console(width=width, color_system=None, force_terminal=False, record=True, file=io.StringIO())
    console.print(table)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines() if line.strip())


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


# blocked_autorange's interquartile range needs a few timed blocks to mean anything
MIN_RUNS_FOR_IQR = 4


def _spread(r: dict) -> str:
    return _ms(r["iqr_s"]) if r["runs"] >= MIN_RUNS_FOR_IQR else "-"


def terminal_table(results: dict, markdown: bool = False, group_skips: bool = False) -> str:
    """One line per case that ran, then one per skipped case with its reason (``group_skips``: one
    line per backend and reason, with the case count, for the terminal)."""
    rows, skipped = [], []
    for r in results["results"]:
        name = r["backend"] + (f" -> {r['chosen']}" if r["backend"] == "auto" and r["status"] == "ok" else "")
        head = [r["dtype"], r["passes"], r["mask"], str(r["n"]), name]
        if r["status"] == "ok":
            mem = "-" if r["peak_bytes"] is None else describe_bytes(r["peak_bytes"])
            pct = r.get("pct_of_matmul_peak")
            rows.append(head + [_ms(r["median_s"]), _spread(r), str(r["runs"]), mem, f"{r['gflops']:.1f}",
                                "-" if pct is None else f"{pct:.0f}%",
                                f"{r['error']:.1e} {'abs' if r['exact'] else 'rel'}"])
        else:
            skipped.append(head + [r["status"] + ": " + (r["group"] if group_skips else r["reason"])])
    out = format_table(rows, ["dtype", "pass", "mask", "n", "backend", "median ms", "IQR ms", "runs", "peak mem",
                              "GFLOP/s", "% peak", "error"], markdown, right=frozenset({3, 5, 6, 7, 8, 9, 10, 11}))
    if skipped and group_skips:
        groups: dict[tuple[str, str], list[str]] = {}
        for dtype, passes, mask, n, name, why in skipped:
            groups.setdefault((name, why), []).append(f"{dtype}/{passes}/{mask}/{n}")
        rows = [[name, str(len(where)), why] for (name, why), where in groups.items()]
        out += f"\n\n{len(skipped)} cases skipped (every reason in results.json and report.md):\n"
        out += format_table(rows, ["backend", "cases", "skipped because"], markdown, right=frozenset({1}))
    elif skipped:
        out += "\n\n" + format_table(skipped, ["dtype", "pass", "mask", "n", "backend", "skipped because"], markdown,
                                right=frozenset({3}))
    return out


def skip_hint(results: dict) -> str | None:
    """When most cases were skipped for a budget, say which flag to raise (None otherwise)."""
    rows = results["results"]
    over_time = sum(r["status"] == "skipped" and r.get("group") == "predicted time over budget" for r in rows)
    over_memory = sum(r["status"] == "skipped" and r.get("group") == "predicted memory over budget" for r in rows)
    skipped = sum(r["status"] != "ok" for r in rows)
    if not rows or skipped * 2 <= len(rows) or not (over_time or over_memory):
        return None
    config = results["config"]
    parts = []
    if over_time:
        longest = max(r.get("predicted_s", 0) for r in rows)
        parts.append(f"{over_time} were predicted to take over --time-budget {config['time_budget_s']:g} s per call "
                     f"(the slowest {longest:.2g} s): raise it, e.g. --time-budget {max(1, min(60, round(longest)))}")
    if over_memory:
        parts.append(f"{over_memory} were predicted to need over --memory-budget "
                     f"{config['memory_budget_bytes'] / 2**30:g} GiB: raise it or drop the longest lengths")
    return (f"hint: {skipped} of {len(rows)} cases were skipped; " + "; ".join(parts) +
            ". Or measure fewer backends (--backends) and masks (--masks).")


def crossovers(results: dict, exact_only: bool = True) -> dict[tuple[str, str, str], list[tuple[int, str, float, str]]]:
    """Per (dtype, pass, mask): for each length the fastest backend, its speed-up over the second
    fastest, and that second backend's name."""
    points: dict[tuple[str, str, str, int], dict[str, float]] = {}
    for r in results["results"]:
        if r["status"] != "ok" or r["backend"] == "auto" or (exact_only and not r["exact"]):
            continue
        points.setdefault((r["dtype"], r["passes"], r["mask"], r["n"]), {})[r["backend"]] = r["median_s"]
    out: dict[tuple[str, str, str], list] = {}
    for (dtype, passes, mask, n), times in sorted(points.items()):
        order = sorted(times, key=times.get)
        second = order[1] if len(order) > 1 else order[0]
        out.setdefault((dtype, passes, mask), []).append((n, order[0], times[second] / times[order[0]], second))
    return out


def crossover_table(results: dict, markdown: bool = False) -> str:
    """Fastest exact backend per length (x = its speed-up over the runner-up), and where it changes."""
    rows = []
    for (dtype, passes, mask), pts in crossovers(results).items():
        cells = [f"{n}: {best} {x:.2f}x vs {second}" if second != best else f"{n}: {best} (alone)"
                 for n, best, x, second in pts]
        changes = [f"{a[1]}->{b[1]} in ({a[0]}, {b[0]}]" for a, b in zip(pts, pts[1:]) if a[1] != b[1]]
        rows.append([dtype, passes, mask_spec(mask).label, "; ".join(cells), ", ".join(changes) or "none"])
    return format_table(rows, ["dtype", "pass", "mask", "fastest exact backend per n", "crossovers"], markdown)


def _best_and_auto(results: dict) -> tuple[dict[tuple, dict], dict[tuple, dict]]:
    best: dict[tuple, dict] = {}
    auto: dict[tuple, dict] = {}
    for r in results["results"]:
        if r["status"] != "ok":
            continue
        key = (r["n"], r["mask"], r["dtype"], r["passes"])
        if r["backend"] == "auto":
            auto[key] = r
        elif r["exact"] and (key not in best or r["median_s"] < best[key]["median_s"]):
            best[key] = r
    return best, auto


def auto_sweep(results: dict) -> list[dict]:
    """From the sweep itself: auto's row over the best exact backend's at each point (two single
    timings back to back, as auto stood when the sweep ran; at long lengths their noise can exceed
    the difference between backends, so the report measures this column with
    :func:`attnkit.bench.runner.verify_auto_before`)."""
    best, auto = _best_and_auto(results)
    return [
        {"n": k[0], "mask": k[1], "dtype": k[2], "passes": k[3], "best": best[k]["backend"],
         "auto_chose": auto[k]["chosen"], "auto_over_best": auto[k]["median_s"] / best[k]["median_s"]}
        for k in sorted(auto) if k in best
    ]


def auto_before(results: dict) -> list[dict]:
    """auto over the best backend as auto stood when the sweep ran (before this run's calibration):
    the run's verification of those picks (:func:`attnkit.bench.runner.verify_auto_before`), else
    (results without one) the sweep's own figures (:func:`auto_sweep`)."""
    return results.get("auto_before_verification") or auto_sweep(results)


def auto_ratios(results: dict) -> list[dict]:
    """auto over the best backend as it stands after the run: after a calibration the verification
    (:func:`attnkit.bench.runner.verify_auto`), else :func:`auto_before`."""
    return results.get("auto_verification") or auto_before(results)


def auto_summary(rows: list[dict], limit: float = 1.10) -> str:
    """``median 1.02, max 1.31 over 80 cells (3 over 1.10)``."""
    if not rows:
        return "no cells"
    ratios = [r["auto_over_best"] for r in rows]
    over = sum(x > limit for x in ratios)
    return (f"median {statistics.median(ratios):.2f}, max {max(ratios):.2f} over {len(ratios)} cells "
            f"({over} over {limit:.2f})")


def _measured(rows: list[dict], pick: str) -> str:
    """How a verified column's cells were measured, with their counts."""
    timed = sum(bool(r["timed"]) for r in rows)
    shared = sum(bool(r.get("from_known")) for r in rows)
    same = sum(not r["timed"] and r["auto_chose"] == r["best"] for r in rows)
    swept = len(rows) - timed - same
    return (f"{pick}: {timed} cells timed interleaved against the best (median ratio over alternating rounds"
            + (f"; {shared} of them as timed for the other column, the same pick" if shared else "")
            + f"), {same} at 1.00 by construction (the pick is the best)"
            + (f", {swept} from the sweep's back-to-back times (past the time budget)" if swept else ""))


def auto_table(results: dict, markdown: bool = False) -> str:
    """Per point: the best measured exact backend, auto's pick and auto/best before this run's
    calibration (:func:`auto_before`) and after it (the verification), with a line per column saying
    how it was measured and summarizing it, and one for the sweep's own back-to-back figures."""
    verified = bool(results.get("auto_before_verification"))
    before = {(r["n"], r["mask"], r["dtype"], r["passes"]): r for r in auto_before(results)}
    after = {(r["n"], r["mask"], r["dtype"], r["passes"]): r for r in results.get("auto_verification") or []}
    header = ["dtype", "pass", "mask", "n", "best"]
    if before:
        header += ["auto before" if after else "auto", "auto/best"]
    if after:
        header += ["auto after", "auto/best "]
    rows = []
    for key in sorted(set(before) | set(after), key=lambda k: (k[2], k[3], k[1], k[0])):
        ref = after.get(key) or before[key]
        row = [key[2], key[3], mask_spec(key[1]).label, str(key[0]), ref["best"]]
        for found, present in ((before.get(key), before), (after.get(key), after)):
            if present:
                row += [found["auto_chose"], f"{found['auto_over_best']:.2f}"] if found else ["-", "-"]
        rows.append(row)
    right = frozenset({3} | {i for i, h in enumerate(header) if h.startswith("auto/best")})
    table = format_table(rows, header, markdown, right=right)
    lines = []
    if before:
        when = "before calibration" if after else "(no calibration in this run)"
        how = (_measured(list(before.values()), "auto's picks in the sweep, called by name") if verified
               else "the sweep, back to back")
        lines.append(f"auto/best {when}: {auto_summary(list(before.values()))}; {how}")
    if after:
        lines.append(f"auto/best after calibration: {auto_summary(list(after.values()))}; "
                     f"{_measured(list(after.values()), 'auto as it picks now')}")
    if verified:
        swept = [{"auto_over_best": r["auto_over_best_sweep"]} for r in before.values() if "auto_over_best_sweep" in r]
        lines.append(f"auto/best in the sweep itself: {auto_summary(swept)}; auto's row over the best's, "
                     "single timings back to back (auto_over_best_sweep in results.json)")
    sep = "\n\n" if markdown else "\n"
    return table + sep + sep.join(lines) if lines else table


#: auto within this factor of the best measured backend counts as "use auto".
AUTO_GOOD_ENOUGH = 1.05


def recommendation(row: dict) -> str:
    """One line for one (mask, length, dtype, pass) point of :func:`auto_ratios`: what to use."""
    where = f"{row['mask']} n={row['n']} {row['dtype']} {row['passes']}"
    return f"{where}: {_advice(row)}"


def _advice(row: dict) -> str:
    if row["auto_over_best"] <= AUTO_GOOD_ENOUGH or row["auto_chose"] == row["best"]:
        return f"use backend='auto' (it picks {row['auto_chose']}, within {AUTO_GOOD_ENOUGH:.2f}x of the best)"
    return (f"backend='{row['best']}' was {row['auto_over_best']:.2f}x faster than auto's {row['auto_chose']}; "
            "name it, or calibrate (`python -m attnkit bench`) if this machine is not calibrated")


def grouped_recommendations(rows: list[dict]) -> list[str]:
    """One line per mask and length: ``use backend='auto'`` when it is within
    :data:`AUTO_GOOD_ENOUGH` of the best for every dtype and pass measured, else what to use where."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mask"], r["n"]), []).append(r)
    lines = []
    for (mask, n), points in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1])):
        label = mask_spec(mask).label if mask in _KNOWN_MASKS else mask
        bad = [r for r in points if not (r["auto_over_best"] <= AUTO_GOOD_ENOUGH or r["auto_chose"] == r["best"])]
        if not bad:
            picks = ", ".join(sorted({r["auto_chose"] for r in points}))
            lines.append(f"{label} n={n}: use backend='auto' (it picks {picks}; within {AUTO_GOOD_ENOUGH:.2f}x of the "
                         "best measured everywhere)")
        else:
            where = "; ".join(f"{r['dtype']} {r['passes']}: {_advice(r)}" for r in bad)
            lines.append(f"{label} n={n}: backend='auto' elsewhere; {where}")
    return lines


def calibration_status() -> str:
    """Which table ``auto`` on this machine follows, in one line."""
    from ..dispatch import table

    return f"auto: {table.status()}; elsewhere the static rule decides (`python -m attnkit bench` measures)"


def recommendations(results: dict) -> str:
    return "\n".join([calibration_status(), *grouped_recommendations(auto_ratios(results))])


def write_json(results: dict, path: Path) -> Path:
    path.write_text(json.dumps(results, indent=1, default=str))
    return path


def write_markdown(results: dict, out_dir: Path, plots: list[Path], claims: str | None = None) -> Path:
    machine = results["machine"]
    peaks = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in results["matmul_peak_gflops"].items())
    lines = [
        "# attnkit bench",
        "",
        f"Command: `{results.get('command', 'python -m attnkit bench')}`  ",
        f"Machine: {machine['processor']}, {machine['cpu_count']} CPUs ({machine['torch_threads']} torch threads), "
        f"device {machine['device']}{', ' + machine['gpu'] if 'gpu' in machine else ''}; torch {machine['torch']}, "
        f"Python {machine['python']}  ",
        f"Measured matmul peak: {peaks}. Run took {results['elapsed_s']:.0f} s.",
        "",
        f"* Time: median of `torch.utils.benchmark` blocked_autorange (min_run_time "
        f"{results['config']['min_run_time']} s) after one warm-up call; `runs` is the number of timed blocks, "
        f"and the interquartile range is shown from {MIN_RUNS_FOR_IQR} runs. A shared or busy machine makes "
        "these noisy: compare ratios within one run, and repeat.",
        f"* Peak memory: {results['memory_method']}.",
        f"* GFLOP/s: {results['flops_convention']}; "
        f"% peak: {results.get('pct_of_peak_convention', 'of the matmul peak')}.",
        f"* Error: {results['error_convention']}.",
        "* All figures: [results.json](results.json).",
        "",
        "## Fastest exact backend per length (crossovers)",
        "",
        crossover_table(results, markdown=True),
        "",
        "## auto vs the best backend",
        "",
        auto_table(results, markdown=True) if auto_ratios(results) else "(auto was not measured in this run)",
        "",
        "## What to use",
        "",
        *(f"* {line}" for line in recommendations(results).split("\n")),
        "",
    ]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    if claims:
        lines += ["## The textbook rules of thumb, measured", "", claims, ""]
    lines += ["## Every case", "", terminal_table(results, markdown=True), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
