"""The floor plan holds: imports point down the layers (tools/import_graph.py, the README's
"Architecture" section), every public module's ``__all__`` names what exists, and every capability
a backend declares is read by something."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
import sys
from pathlib import Path

import pytest

import attnkit
from attnkit.registry import Backend

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
import_graph = sys.modules.setdefault("import_graph", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(import_graph)

# Known exceptions, each with the change that removes it. Keep this empty: a new entry is a design decision.
PENDING_UPWARD: set[tuple[str, str]] = set()
PENDING_CIRCLES: list = []


def test_imports_point_down_the_layers_and_form_no_circle():
    graph = import_graph.build(ROOT / "attnkit")
    up = [e for e in import_graph.upward(graph) if e not in PENDING_UPWARD]
    assert up == [], "imports from a lower layer to a higher one (see tools/import_graph.py for the rows)"
    circles = [c for c in import_graph.circles(graph) if not any(pending(c) for pending in PENDING_CIRCLES)]
    assert circles == []


def test_the_import_graph_check_can_fail(tmp_path):
    pkg = tmp_path / "attnkit"
    (pkg / "io").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "__init__.py").write_text("from ..nn import layers\n")  # io is below nn: upward
    (pkg / "nn").mkdir()
    (pkg / "nn" / "__init__.py").write_text("")
    (pkg / "nn" / "layers.py").write_text("from . import models\n")
    (pkg / "nn" / "models.py").write_text("def f():\n    from .layers import x\n")  # a lazy import closes a circle
    graph = import_graph.build(pkg)
    assert import_graph.upward(graph) == [("attnkit.io", "attnkit.nn.layers")]
    assert import_graph.circles(graph) == [["attnkit.nn.layers", "attnkit.nn.models"]]
    assert import_graph.main(["--root", str(pkg), "--check"]) == 1


def _public_modules():
    for info in pkgutil.walk_packages(attnkit.__path__, "attnkit."):
        if info.name.endswith("__main__") or any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        yield info.name


@pytest.mark.parametrize("name", sorted(_public_modules()))
def test_every_public_all_names_what_exists(name):
    module = importlib.import_module(name)
    missing = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert missing == [], f"`from {name} import *` raises: {missing} are in __all__ but not defined"


def test_every_declared_capability_is_read():
    """A ``supports_*`` flag that no check reads (``not cls.supports_x`` refusing an input) is a
    promise nothing keeps; listing it in ``capabilities()`` does not count."""
    flags = sorted(n for n in vars(Backend) if n.startswith("supports_"))
    source = "\n".join(p.read_text() for p in (ROOT / "attnkit").rglob("*.py"))
    unread = [f for f in flags if not re.search(rf"\bnot \w+\.{f}\b", source)]
    assert flags and unread == []
