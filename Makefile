.PHONY: install run test test-asan bench clean
VENV := .venv
PY := $(VENV)/bin/python

# KVCALIB_CONVERT=gemma3 make install: also convert Gemma 3 270M now (otherwise the first model=gemma3 run does, once)
install:
	@bash scripts/install.sh

run: install
	$(PY) -m pipeline run $(ARGS)

# the suite, then the C kernel's tests once more under AddressSanitizer (ASAN=0 skips that step)
ASAN ?= 1
test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)
	@if [ "$(ASAN)" != 0 ]; then bash scripts/test-asan.sh; fi

# the C kernel's tests with the library built with -fsanitize=address (scripts/test-asan.sh)
test-asan: install
	bash scripts/test-asan.sh

bench: install
	$(PY) -m bench.traces --model smollm2 --n-samples 16 --seq-len 1024 --json bench-results/traces-16.json
	$(PY) -m bench.traces --model smollm2 --n-samples 64 --seq-len 1024 --json bench-results/traces-64.json

clean:
	rm -rf .kvcalib_cache outputs multirun mlruns mlruns.db mlartifacts
