"""The package's import graph against its layers: circles, upward arrows, file sizes.

    python tools/import_graph.py            # counts, then every circle and upward arrow
    python tools/import_graph.py --check    # exit 1 if there is a circle or an upward arrow

Layers, top to bottom (an import may only point down or sideways within a row); the README's
"Architecture" section draws the same rows::

    cli  __main__
    interop
    train  bench
    distributed
    nn  generation  mla
    cache
    functional  varlen  approximation        the entry points
    dispatch
    calibration
    backends  hardware
    registry
    inputs  kv_handle
    masks  score_mods
    io  _validate  _compat  _version
    csrc                                     below everything (the C++ sources, their build and loader)

Every import counts, also one inside a function (a lazy import is still a dependency), except
those under ``if TYPE_CHECKING:``. ``attnkit/__init__.py`` only re-exports and is left out as a
source; importing the root package (``from attnkit import __version__``) points at the top row.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Rows, top to bottom. A module belongs to the row of its first dotted part below `attnkit`.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli", "__main__"),
    ("interop",),
    ("train", "bench"),
    ("distributed",),
    ("nn", "generation", "mla"),
    ("cache",),
    ("functional", "varlen", "approximation"),
    ("dispatch",),
    ("calibration",),
    ("backends", "hardware"),
    ("registry",),
    ("inputs", "kv_handle"),
    ("masks", "score_mods"),
    ("io", "_validate", "_compat", "_version"),
    ("csrc",),
)
RANK = {name: i for i, row in enumerate(LAYERS) for name in row}
ROOT = "attnkit"
BIG = 400  # lines: a file past this is listed (DESIGN.md: a backend near 300, any file under ~600)


@dataclass
class Graph:
    files: dict[str, Path] = field(default_factory=dict)  # module name -> file
    edges: dict[str, set[str]] = field(default_factory=dict)  # module -> modules it imports

    def group(self, module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else ROOT

    def rank(self, module: str) -> int:
        group = self.group(module)
        if group == ROOT:
            return 0  # the package facade sits with cli at the top
        if group not in RANK:
            raise SystemExit(f"import_graph: {module} is in no layer; add {group!r} to LAYERS")
        return RANK[group]


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def build(root: Path) -> Graph:
    graph = Graph()
    for path in sorted(root.rglob("*.py")):
        graph.files[_module_name(path, root)] = path
    for name, path in graph.files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                bases = [a.name for a in node.names]
                names: list[str] = []
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = name.split(".") if is_pkg else name.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join(package + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                bases = [base]
                names = [a.name for a in node.names]
            else:
                continue
            for base in bases:
                if base != ROOT and not base.startswith(ROOT + "."):
                    continue
                subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in graph.files]
                targets.update(subs or [m for m in (base,) if m in graph.files] or [_owner(base, graph)])
        targets.discard(name)
        graph.edges[name] = targets
    return graph


def _owner(module: str, graph: Graph) -> str:
    while module not in graph.files and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


def circles(graph: Graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), root package left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    nodes = [m for m in graph.edges if m != ROOT]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.edges.get(v, ()):
            if w == ROOT:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in nodes:
        if v not in index:
            visit(v)
    return sorted(found)


def upward(graph: Graph) -> list[tuple[str, str]]:
    """Imports from a lower row to a higher one (the root package's own re-exports left out)."""
    return sorted(
        (src, dst)
        for src, dsts in graph.edges.items()
        if src != ROOT
        for dst in dsts
        if graph.rank(dst) < graph.rank(src)
    )


def sizes(graph: Graph) -> list[tuple[int, str]]:
    return sorted(((len(p.read_text().splitlines()), str(p)) for p in graph.files.values()), reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "attnkit")
    parser.add_argument("--check", action="store_true", help="exit 1 on a circle or an upward arrow")
    args = parser.parse_args(argv)
    graph = build(args.root)
    found, up, by_size = circles(graph), upward(graph), sizes(graph)
    big = [(n, p) for n, p in by_size if n > BIG]
    rel = args.root.parent
    print(f"modules {len(graph.files)}  imports {sum(len(d) for d in graph.edges.values())}")
    print(f"circles {len(found)}  upward arrows {len(up)}")
    print(f"largest file {by_size[0][0]} lines ({Path(by_size[0][1]).relative_to(rel)})")
    print(f"files over {BIG} lines {len(big)}")
    for comp in found:
        print("  circle: " + " <-> ".join(comp))
    for src, dst in up:
        print(f"  upward: {src} ({graph.group(src)}) -> {dst} ({graph.group(dst)})")
    for n, p in big:
        print(f"  {n:5d} {Path(p).relative_to(rel)}")
    return 1 if args.check and (found or up) else 0


if __name__ == "__main__":
    raise SystemExit(main())
