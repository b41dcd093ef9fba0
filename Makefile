PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup bench-setup demo test test-soak bench figures figures-stale figures-quick figures-check mutation mutants gpu gpu-real-workers other-torch release-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,workloads,peers]'
	touch $@

demo: setup
	$(BIN)/distsync compare --workload digits --solvers allreduce,ripples,ad-psgd --schedule smart -o ripples.overlap=true --workers 4 --slow 1:3 --device-ms 10 --budget seconds=5 --repeats 3 --out runs/demo --overwrite

test: setup
	@start=$$(date +%s); $(BIN)/python -m pytest -q -n 2 --durations=15; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s"; exit $$rc

# The whole suite SOAK_RUNS times (default 10) beside a busy loop on each core (SOAK_BURNERS),
# each run with fresh property-test draws from a recorded seed (docs/testing.md): hours.
# SOAK_RESUME=1: go on from the runs of the record, made at this commit (a soak longer than a
# machine is kept). SOAK_ARGS: pytest's arguments instead of the whole suite; SOAK_OUT: the record
# (default benchmarks/results/soak.json; docs/benchmarks/raw/soak.json: the published figure).
# Exits 1 if any run failed.
test-soak: setup
	$(BIN)/python tools/soak.py

# Every published figure (docs/benchmarks/raw/*.json, then the docs' rendered blocks); needs
# root for the emulated links; about an hour on 2 cores. figures-quick: a smoke run of each
# (benchmarks/results/quick/, nothing committed changes). figures-check: the docs render from
# the raw files, which carry their provenance and repeats; it lists the stale ones.
# the benchmarks' own extras (simpy, which sim_speed measures the event loop against)
bench-setup: $(VENV)/.bench-installed

$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e '.[bench]'
	touch $@

figures: bench-setup
	$(BIN)/python benchmarks/figures.py run

figures-stale: bench-setup
	$(BIN)/python benchmarks/figures.py run --stale

figures-quick: setup
	$(BIN)/python benchmarks/figures.py run --quick

figures-check: setup
	$(BIN)/python benchmarks/figures.py check

# Each declared mutation of an update rule must make the fast suite fail (docs/testing.md).
mutation: setup
	$(BIN)/python tests/mutation_probe.py --json docs/benchmarks/raw/mutation_probe.json

# Mutants a tool drew (cosmic-ray, a fixed seed), each probed against the fast suite as the
# declared ones are (docs/testing.md): hours; it goes on from the rows already in its progress
# file (benchmarks/progress/mutants-drawn.json, committed as it goes).
mutants: $(VENV)/.mutants-installed
	nice -n 19 $(BIN)/python tests/mutants_drawn.py --resume

$(VENV)/.mutants-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e '.[mutants]'
	touch $@

bench: setup
	$(BIN)/python benchmarks/allreduce_vs_ddp.py
	$(BIN)/python benchmarks/link_efficiency.py

# On a machine with a GPU (docs/gpu.md), from a fresh copy, on the torch already there (nothing
# installed, nothing fetched: the lent GPU machines reach no network): every CUDA test and every
# GPU figure, their raw files in docs/benchmarks/raw/; about 6 minutes. GPU_PYTHON: the Python
# that holds that machine's torch.
GPU_PYTHON ?= python3
gpu:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_kit.py

# The heterogeneity benchmark with 8 and 16 real workers (no emulation) on a many-core machine's
# CPUs (the GPU machine's 16 cores); not part of make gpu (over 10 minutes).
gpu-real-workers:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/heterogeneity.py --link none --device cpu --workers 8 --out benchmarks/results/heterogeneity-real-8
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/heterogeneity.py --link none --device cpu --workers 16 --out benchmarks/results/heterogeneity-real-16

# distsync beside another torch (docs/torch-versions.md): TORCH=2.15.0 makes .venv-torch-2.15.0
# with that torch, installs distsync over it (the check: pip leaves it as it was), runs the fast
# suite and a short train per solver family; the result is docs/benchmarks/raw/torch_versions-2.15.json.
# PyPI's torch for Linux is the CUDA build (about 5 GB): a one-off, not part of make test.
TORCH ?=
other-torch: setup
	@test -n "$(TORCH)" || { echo "make other-torch: say which torch, e.g. make other-torch TORCH=2.15.0" >&2; exit 2; }
	$(BIN)/python benchmarks/torch_versions.py --torch $(TORCH)

# The package as users get it (docs/release.md): the sdist and the wheel built and checked, the
# wheel installed beside torch 2.13.0 and 2.15.0 in fresh venvs (build/release/; PyPI's 2.15 is
# its CUDA build, several GB, downloaded once), the README's commands run from outside the tree;
# fails on a figure not current at this commit but the labelled exceptions.
$(VENV)/.release-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt build twine
	touch $@

release-check: $(VENV)/.release-installed
	$(BIN)/python benchmarks/release_check.py; rc=$$?; $(BIN)/python benchmarks/figures.py render; exit $$rc

clean:
	rm -rf $(VENV) .venv-torch-* runs build src/*.egg-info
