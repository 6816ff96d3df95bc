"""The README is a front page and the manual in docs/ holds together: the README stays short and
never tells a user to run a bare ``python``, every relative link resolves, every page is reachable
from the manual's table of contents, and every figure carries the record of how it was made.

(``tests/test_readme.py`` runs the ```python blocks of both; ``make docs`` builds the site with
warnings as errors.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
FIGURE_RECORD = ("command", "cpu", "threads", "torch")


def code_lines(text: str) -> list[str]:
    """The lines inside fenced blocks of a Markdown text."""
    inside, out = False, []
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
        elif inside:
            out.append(line)
    return out


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the details to a page in docs/"
    long = [f"{n}: {len(line)}" for n, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters: {long}"


def test_readme_commands_name_the_venv():
    """A command in the README runs the project's environment: ``.venv/bin/python``, or bare ``python``
    only after the README has said to ``source .venv/bin/activate``."""
    text = README.read_text(encoding="utf-8")
    activated = text.find("source .venv/bin/activate")
    bare = []
    for line in code_lines(text):
        command = line.strip()
        if re.match(r"(python3?|pip)\b", command):
            where = text.find(line)
            if activated < 0 or where < activated:
                bare.append(command)
    assert not bare, f"README.md runs a bare python/pip before saying which: {bare}"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def toctree_entries() -> set[Path]:
    """Every page named in a ``{toctree}`` block of the manual."""
    entries = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```\{toctree\}\n(.*?)```", text, re.S):
            for line in block.splitlines():
                line = line.strip()
                if line and not line.startswith(":"):
                    entries.add((page.parent / f"{line}.md").resolve())
    return entries


def test_every_page_is_in_the_manual():
    assert (DOCS / "index.md").is_file() and (DOCS / "conf.py").is_file()
    reachable = toctree_entries() | {(DOCS / "index.md").resolve()}
    orphans = [str(p.relative_to(ROOT)) for p in PAGES if p.resolve() not in reachable]
    assert not orphans, f"pages in no toctree: {orphans}"
    linked = set(LINK.findall(README.read_text(encoding="utf-8")))
    guides = [p for p in PAGES if p.parent.name == "guide"]
    assert guides, "docs/guide/ holds no page"
    unlinked = [str(p.relative_to(ROOT)) for p in guides if str(p.relative_to(ROOT)) not in linked]
    assert not unlinked, f"guide pages the README does not link: {unlinked}"


def test_every_figure_has_its_record():
    """A figure in the manual names the command, CPU, thread count and torch version that made it, and
    the figures page shows that record; no image or data file in docs/ lacks one."""
    records = sorted((DOCS / "figures").glob("*.json"))
    figures_page = (DOCS / "figures.md").read_text(encoding="utf-8")
    for record in records:
        data = json.loads(record.read_text(encoding="utf-8"))
        missing = [key for key in FIGURE_RECORD if not data.get(key)]
        assert not missing, f"{record.relative_to(ROOT)} lacks {missing}"
        assert record.name in figures_page, f"docs/figures.md does not show {record.name}"
        assert str(data["command"]) in figures_page, f"docs/figures.md does not show the command of {record.name}"
        # how the figures were made, never where one run wrote its files
        assert not re.search(r"--out\b|--record\b|(^|\s)/", str(data["command"])), data["command"]  # an absolute path
    stems = {r.stem for r in records}
    unrecorded = [str(p.relative_to(ROOT)) for p in DOCS.rglob("*")
                  if p.suffix in (".png", ".svg", ".jpg", ".json") and "_build" not in p.relative_to(DOCS).parts
                  and p.parent != DOCS / "figures" and p.stem not in stems]
    assert not unrecorded, f"figures without a record in docs/figures/: {unrecorded}"
