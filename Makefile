# Two entry points (README): `make run` runs every notebook on the embedded models; `make test` runs the tests.
# Each installs what it needs first (once; .setup-stamp remembers).
PY ?= python3
export PYTHONUNBUFFERED := 1
# This checkout's lib first, whatever the editable install points at (another clone or worktree would otherwise
# run, test and record its own code here); papermill's kernels inherit it.
export PYTHONPATH := $(CURDIR)/lib$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: setup run test lint gpu-test bench clean

setup: .setup-stamp
.setup-stamp: pyproject.toml
	@# On our CPU machines torch 2.13.0 is a CPU wheel on disk; a GPU box keeps the torch it has.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[dev]"
	$(PY) -m ipykernel install --user --name python3 >/dev/null
	@# the browser test drives Debian's Chromium (playwright's own browser download is not possible here)
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi
	-git config filter.nbstripout.clean >/dev/null || nbstripout --install
	touch .setup-stamp

run: setup
	$(PY) -m moelab.sweep --main

test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check lib tests benchmarks

gpu-test:
	$(PY) -m pytest -q -m gpu

bench:  # the GPU benchmarks as the README's results were run; each writes data/results/<topic>-<date>.json
	$(PY) benchmarks/moe_kernels.py --parts routing,host,layer
	$(PY) benchmarks/graph_pool.py --models synthetic,tiny-mixtral,tiny-qwen-moe,tiny-olmoe --rounds 5 --decode-steps 40 --adaptive --adaptive-models synthetic
	$(PY) benchmarks/paper_tables.py --targets 0.1,0.25,0.4 --budget-steps 5
	$(PY) benchmarks/first_call.py --models tiny-olmoe,tiny-qwen-moe,tiny-mixtral

clean:
	rm -rf runs .setup-stamp
