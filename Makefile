# `make run` runs every notebook on the embedded models; `make test` runs ruff and the tests. Both install first.
PY ?= python3
export PYTHONUNBUFFERED := 1
# This checkout's lib first, whatever the editable install points at; papermill's kernels inherit it.
export PYTHONPATH := $(CURDIR)/lib$(if $(PYTHONPATH),:$(PYTHONPATH))
# JupyterLab refuses to start as root unless told to (a fresh container is root).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: setup run test lint lab report gpu-test bench clean

setup: .setup-stamp  ## install moelab and its dev extras once (torch too if absent)
.setup-stamp: pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[dev]"
	$(PY) -m ipykernel install --user --name python3 >/dev/null
	@# the browser test drives Debian's Chromium
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi
	-git config filter.nbstripout.clean >/dev/null || nbstripout --install
	touch .setup-stamp

run: setup  ## every notebook through papermill into runs/main/, figures into figures/
	$(PY) -m moelab.sweep --main

# two workers, one thread each (the 2-core CI machine); the tests of one papermill run share a worker (loadgroup)
test: setup lint  ## ruff, then the test suite
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

lint: setup  ## ruff over the code
	$(PY) -m ruff check lib tests benchmarks tools

lab: setup  ## JupyterLab on the notebooks, at http://127.0.0.1:8888
	$(PY) -m jupyter lab --no-browser --ip=127.0.0.1 $(ROOT_FLAG)

report:  ## the docs' tables and figures again from data/results
	$(PY) tools/report.py

gpu-test:  ## the CUDA tests (on a GPU machine)
	$(PY) -m pytest -q -m gpu

bench:  ## the headline GPU benchmarks; each writes data/results/<topic>.json
	$(PY) benchmarks/moe_kernels.py --parts routing,host,layer
	$(PY) benchmarks/graph_pool.py --models synthetic,tiny-mixtral,tiny-qwen-moe,tiny-olmoe --rounds 5 --decode-steps 40 --adaptive --adaptive-models synthetic
	$(PY) benchmarks/paper_tables.py --targets 0.1,0.25,0.4 --budget-steps 5 --domains all --domain-tokens 131072
	$(PY) benchmarks/seeds.py --workers 9 --out runs/seeds
	$(PY) benchmarks/first_call.py --models tiny-olmoe,tiny-qwen-moe,tiny-mixtral
	$(PY) benchmarks/serving.py --models olmoe-1b-7b,qwen1.5-moe-a2.7b --reps 3 --steps 16 --rounds 2 --stress 1000
	$(PY) benchmarks/serving.py --models mixtral-8x7b --parts prefill,decode --reps 3 --steps 16 --topic serving-mixtral

clean:  ## remove the runs and the install stamp
	rm -rf runs .setup-stamp
