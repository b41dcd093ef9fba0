PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup bench-setup demo test bench figures figures-stale figures-quick figures-check mutation gpu clean

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

# Every published figure (docs/benchmarks/raw/*.json, then the docs' rendered blocks); needs
# root for the emulated links; about an hour on 2 cores. figures-quick: a smoke run of each
# (benchmarks/results/quick/, nothing committed changes). figures-check: the docs render from
# the raw files, which carry their provenance and repeats and are not stale.
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

bench: setup
	$(BIN)/python benchmarks/allreduce_vs_ddp.py
	$(BIN)/python benchmarks/link_efficiency.py

# On a machine with a GPU (docs/gpu.md): the CUDA tests, allreduce against DDP on the GPU,
# the cnn and mnist rows of the emulated-device heterogeneity benchmark (each worker's math on the
# GPU), and the heterogeneity benchmark with 8 and 16 real workers (no emulation) on its cores.
gpu: setup
	$(BIN)/python -m pytest -q -rs -m cuda tests/test_cuda.py
	$(BIN)/python benchmarks/figures.py run allreduce_vs_ddp-gpu
	$(BIN)/python benchmarks/figures.py run heterogeneity_devices_cnn-gpu
	$(BIN)/python benchmarks/figures.py run heterogeneity_devices_mnist-gpu
	$(BIN)/python benchmarks/heterogeneity.py --link none --device cpu --workers 8 --out benchmarks/results/heterogeneity-real-8
	$(BIN)/python benchmarks/heterogeneity.py --link none --device cpu --workers 16 --out benchmarks/results/heterogeneity-real-16

clean:
	rm -rf $(VENV) runs build src/*.egg-info
