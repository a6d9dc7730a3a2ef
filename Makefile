# One command each: `make demo` runs the main job, `make test` runs the tests. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-slow demo bench fuzz clean

$(BIN)/marl: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a loose requirement on a machine without torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/marl

setup: $(BIN)/marl

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

demo: setup
	$(BIN)/python examples/learn_format.py

bench: setup
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/engine_throughput.py --model smollm2-135m

# Schema-driven fuzzing of a real tiny-model server: every operation, valid credentials, no 5xx (bench/fuzz.py).
fuzz: setup
	$(BIN)/python bench/fuzz.py

clean:
	rm -rf $(VENV) runs
