"""Suite-wide settings and fixtures."""

import pytest
import torch

from attnkit.dispatch import table

# Several test processes share 2 CPU cores: one intra-op thread each avoids oversubscription,
# which makes small matmuls ~50x slower under load.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_user_calibration(tmp_path_factory, monkeypatch):
    """Tests see the static dispatch rule, never a table the user measured with `attnkit bench` and
    never the user's cache folder (tests that need a table point ATTNKIT_CALIBRATION at a temp file)."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(base / "no-calibration.json"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(base / "xdg-cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(base / "xdg-config"))  # matplotlib's config folder, among others
    table.reload()
    yield
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(base / "no-calibration.json"))  # a test may have pointed it elsewhere
    table.reload()


def pytest_report_header(config):
    """Print the rotating hypothesis seed, so a failure can be replayed."""
    from .reference import DEVICE, HYPOTHESIS_CI, ROTATING_SEED

    return (f"attnkit tests on {DEVICE}; hypothesis {'ci' if HYPOTHESIS_CI else 'dev'} profile "
            f"(ATTNKIT_HYPOTHESIS_PROFILE), rotating seed: ATTNKIT_HYPOTHESIS_SEED={ROTATING_SEED}")


# The tiers. `make test` runs everything; `make test-fast` deselects these markers (see pyproject.toml).
# They are applied here, from what a test does, so no test file has to remember them.
_FILE_MARKS = {
    "test_packaging.py": "packaging",  # builds a wheel, imports attnkit afresh
    "test_distributed.py": "distributed",  # gloo process groups
    "test_distributed_gated.py": "distributed",
    "test_train_ddp.py": "distributed",  # torchrun
    "test_compile.py": "compile",
}
# A test (or a module-level helper or fixture it uses) whose source contains one of these is marked.
_SOURCE_MARKS = (("subprocess.", "subprocess"), ("os.fork(", "subprocess"), ("torch.compile(", "compile"),
                 ("torch._dynamo.", "compile"), ("init_process_group", "distributed"))
# The costliest tests of the suite (each several seconds on 2 shared cores): they run whole benchmarks and
# calibrations, load Hugging Face models, search with hypothesis, or repeat decode sweeps on two threads.
# `make test` runs them; the fast tier keeps the one-thread decode sweeps, the table-file tests and test_properties.
_SLOW_TESTS = {
    "test_bench.py": ("test_json_schema", "test_outputs_written"),
    "test_bench_calibrate.py": ("*",),
    "test_properties_fuzz.py": ("*",),
    "test_interop_bert.py": ("test_every_layer_matches_hf_on_every_exact_backend",),
    "test_cli.py": ("test_embed_with_an_approximate_backend_says_so",),
}
_SLOW_IDS = (("test_decode_batch_invariance.py", "threads2"),)  # (file, a part of the test id)


def _sources(item) -> str:
    """The test function's source, and that of the module-level functions and fixtures it names."""
    import inspect

    fn = getattr(item, "function", None)
    if fn is None:
        return ""
    texts, seen = [], set()
    todo = [fn] + [d.func for name in item.fixturenames
                   for d in (item._fixtureinfo.name2fixturedefs.get(name) or ())
                   if getattr(d.func, "__module__", "").startswith("tests")]
    while todo:
        f = inspect.unwrap(todo.pop())
        if f in seen or not inspect.isfunction(f):
            continue
        seen.add(f)
        try:
            texts.append(inspect.getsource(f))
        except (OSError, TypeError):
            continue
        module_globals = f.__globals__
        todo += [module_globals[n] for n in f.__code__.co_names if inspect.isfunction(module_globals.get(n))
                 and module_globals[n].__module__ == f.__module__]
    return "\n".join(texts)


def pytest_collection_modifyitems(config, items):
    for item in items:
        marks = set()
        if item.path.name in _FILE_MARKS:
            marks.add(_FILE_MARKS[item.path.name])
        slow = _SLOW_TESTS.get(item.path.name, ())
        if "*" in slow or getattr(item, "originalname", item.name) in slow or any(
                item.path.name == name and part in item.name for name, part in _SLOW_IDS):
            marks.add("slow")
        source = _sources(item)
        marks.update(mark for needle, mark in _SOURCE_MARKS if needle in source)
        for mark in sorted(marks):
            item.add_marker(getattr(pytest.mark, mark))
