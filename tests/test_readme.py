"""The docs are true: every ```python block of README.md and of every page in docs/ runs verbatim (each in a
fresh namespace, in a child interpreter, on CPU), and no shipped text carries a machine path.

A block may opt out only with an explicit marker on the line right before its fence, saying why:
``<!-- no-run: needs a GPU -->``. Shell blocks (```bash) are never executed here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
NO_RUN = re.compile(r"<!--\s*no-run:\s*(\S.*?)\s*-->")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
BLOCK_TIMEOUT_S = 120  # per block, on a loaded 2-core machine
MAX_OPT_OUTS = 3  # the marker must stay rare: a block that cannot run is a doc that cannot be trusted


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(first line number, code, no-run reason or None) for each ```python block of ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(2):
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        if lang == "python":
            before = lines[start - 1] if start > 0 else ""
            marker = NO_RUN.search(before)
            blocks.append((start + 1, "\n".join(body) + "\n", marker.group(1) if marker else None))
    return blocks


CASES = [(path, line, code, why) for path in DOCS for line, code, why in python_blocks(path)]


def test_blocks_found_and_opt_outs_rare():
    assert len(CASES) >= 5, [str(p) for p in DOCS]  # the parser found the README's examples
    skipped = [f"{p.relative_to(ROOT)}:{line} ({why})" for p, line, _, why in CASES if why]
    assert len(skipped) <= MAX_OPT_OUTS, skipped


def test_parser_reads_markers_and_indented_blocks(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n```bash\nrm -rf /\n```\n<!-- no-run: needs a GPU -->\n```python\nprint(1)\n```\n"
                   "* item\n\n  ```python\n  x = 2\n  ```\n")
    assert python_blocks(doc) == [(6, "print(1)\n", "needs a GPU"), (11, "x = 2\n", None)]


# One interpreter runs every block, each exec'd in a fresh namespace (importing torch once instead of
# once per block keeps this test to seconds); it reports per block, as JSON on its last line.
RUNNER = """
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
results = []
for code in blocks:
    try:
        exec(compile(code, "<doc block>", "exec"), {"__name__": "__main__"})
        results.append(None)
    except BaseException:
        results.append(traceback.format_exc()[-3000:])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
    """Run every block that does not opt out; {(path, line): None (ok) or the traceback}."""
    runnable = [(p, line, code) for p, line, code, why in CASES if not why]
    cwd = tmp_path_factory.mktemp("doc-blocks")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg",
           "ATTNKIT_CALIBRATION": str(cwd / "calibration.json")}  # never the user's measured table
    result = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps([c for _, _, c in runnable]), cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S * max(1, len(runnable)))
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    return {(p, line): err for (p, line, _), err in zip(runnable, outcome)}


@pytest.mark.parametrize(
    "path, line, code, why", CASES, ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, _, _ in CASES]
)
def test_python_block_runs_verbatim(path, line, code, why, block_results):
    if why:
        pytest.skip(why)
    error = block_results[(path, line)]
    assert error is None, f"{path.relative_to(ROOT)}:{line} failed:\n{error}"


MACHINE_PATH = re.compile(r"(?<![\w.~])/(tmp|work|root|home)/")


def shipped_text_files() -> list[Path]:
    files = [*DOCS, *(ROOT / "docs").rglob("*.json"), *(ROOT / "attnkit").rglob("*.py"),
             *(ROOT / "benchmarks").glob("*.py"), ROOT / "pyproject.toml", ROOT / "Makefile"]
    return [f for f in files if f.is_file()]


def test_no_machine_paths_in_shipped_text():
    hits = []
    for path in shipped_text_files():
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if MACHINE_PATH.search(text):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {text.strip()[:120]}")
    assert not hits, "\n".join(hits)
