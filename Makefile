# Two entry points: `make run` (set up, run the embedded default workflow) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2

.PHONY: run test lint report clean-results

$(BIN)/.installed: pyproject.toml requirements/cpu.txt requirements/test-extra-nodeps.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/cpu.txt
	$(BIN)/pip install -q -e ".[model,workflow,data,dev,cluster]"
	# speculators 0.4.0, only so the tests can load our exports with its own dataset class
	$(BIN)/pip install -q --no-deps -r requirements/test-extra-nodeps.txt
	touch $@

run: $(BIN)/.installed
	$(BIN)/snakemake --cores $(CORES)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

lint: $(BIN)/.installed
	$(BIN)/snakemake --lint
	$(BIN)/snakefmt --check Snakefile workflow/rules

report: $(BIN)/.installed
	$(BIN)/snakemake --report report.html

clean-results:
	rm -rf results logs benchmarks .snakemake report.html
