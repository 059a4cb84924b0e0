.PHONY: install run test bench clean
VENV := .venv
PY := $(VENV)/bin/python

# KVCALIB_CONVERT=gemma3 make install: also convert Gemma 3 270M now (otherwise the first model=gemma3 run does, once)
install:
	@bash scripts/install.sh

run: install
	$(PY) -m pipeline run $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: install
	$(PY) -m bench.traces --model smollm2 --n-samples 16 --seq-len 1024 --json bench-results/traces-16.json
	$(PY) -m bench.traces --model smollm2 --n-samples 64 --seq-len 1024 --json bench-results/traces-64.json

clean:
	rm -rf .kvcalib_cache outputs multirun mlruns mlruns.db mlartifacts
