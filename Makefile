PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,workloads]'
	touch $@

demo: setup
	$(BIN)/distsync compare --workload digits --solvers allreduce,ripples,ad-psgd --schedule smart --workers 4 --slow 1:3 --device-ms 10 --budget seconds=5 --out runs/demo --overwrite

test: setup
	@start=$$(date +%s); $(BIN)/python -m pytest -q --durations=15; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s"; exit $$rc

bench: setup
	$(BIN)/python benchmarks/allreduce_vs_ddp.py
	$(BIN)/python benchmarks/link_efficiency.py

clean:
	rm -rf $(VENV) runs build src/*.egg-info
