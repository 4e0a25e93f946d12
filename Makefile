# Two entry points (README): `make run` runs every notebook on the embedded models; `make test` runs the tests.
# Each installs what it needs first (once; .setup-stamp remembers).
PY ?= python3
export PYTHONUNBUFFERED := 1

.PHONY: setup run test lint gpu-test clean

setup: .setup-stamp
.setup-stamp: pyproject.toml
	@# On our CPU machines torch 2.13.0 is a CPU wheel on disk; a GPU box keeps the torch it has.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[dev]"
	$(PY) -m ipykernel install --user --name python3 >/dev/null
	touch .setup-stamp

run: setup
	$(PY) -m moelab.sweep --main

test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check lib tests benchmarks

gpu-test:
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf runs .setup-stamp
