# Two commands a newcomer needs: `make demo` (stack + worker + simulated agents) and `make test`.
# Both install what they need into .venv; pip downloads are cached in .cache/pip (ignored).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PIP_CACHE_DIR ?= $(CURDIR)/.cache/pip
# cargo builds treadle_native (native/: the Avro record codec); rustup puts it in ~/.cargo/bin.
CARGO ?= $(shell command -v cargo 2>/dev/null || ls $(HOME)/.cargo/bin/cargo 2>/dev/null)
NATIVE_SOURCES := native/Cargo.toml native/Cargo.lock native/pyproject.toml $(wildcard native/src/*.rs)

.PHONY: install native demo test test-unit test-integration test-gpu lint bench bench-smoke bench-weaving bench-plans chaos up down clean

install: $(VENV)/.installed $(VENV)/.native

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all,test]'
	touch $@

# Without cargo treadle still runs, on its generated Python codec (slower); tests/test_avro_native.py then fails.
$(VENV)/.native: $(VENV)/.installed $(NATIVE_SOURCES)
	@if [ -z "$(CARGO)" ]; then \
		echo "cargo not found: treadle_native is not built (install Rust from https://rustup.rs, then make install)"; \
	else \
		PATH="$(dir $(CARGO)):$$PATH" $(BIN)/pip install -q ./native && touch $@; \
	fi

native: $(VENV)/.native

demo: install
	$(BIN)/treadle up
	$(BIN)/treadle demo

# Everything: lint, the layers contract, then every test (unit and integration: a real Kafka, chDB, Valkey).
test: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest -q

# The fast inner loop: no servers, under a minute.
test-unit: install
	$(BIN)/pytest -q tests/unit

test-integration: install
	$(BIN)/pytest -q tests/integration

# On a machine with an NVIDIA GPU: the GPU telemetry path (skipped elsewhere), then the whole suite.
test-gpu: install
	$(BIN)/pytest -q -rs tests/unit/test_gpu.py
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.plans_latency_bench

# Every bench and section with small N (CI runs it): each must run to the end and its row checks hold; no timings
# are asserted.
bench-smoke: install
	$(BIN)/python -m bench.run --quick --strict
	$(BIN)/python -m bench.weaving_bench --quick --only throughput --only latency --duration 10
	$(BIN)/python -m bench.state_bench --nodes 2000 --deltas 1000 --steps 200 --sessions 4 --runs 3
	$(BIN)/python -m bench.state_soak --minutes 0.25 --rate 100 --sessions 10 --strict
	$(BIN)/python -m bench.cache_read_bench --nodes 1000 --runs 3
	$(BIN)/python -m bench.plans_bench --plans 60 --repeats 1 --codec
	$(BIN)/python -m bench.plans_recovery_bench --plans 50
	$(BIN)/python -m bench.contracts_bench --quick

# Issue #25: kills of the worker, the sink, a broker (3-broker cluster) and Valkey under load; every table checked.
chaos: install
	$(BIN)/python -m bench.chaos --events 50000 --faults 12

# Issue #3: reward weaving throughput on one core, latency at 5,000 events/s, a 10-minute RSS soak (~15 min).
bench-weaving: install
	$(BIN)/python -m bench.weaving_bench

# Issue #27: the plans scheduler's fold (releases/s on one core), its recovery refold, and release latency on a stack.
bench-plans: install
	$(BIN)/python -m bench.plans_bench --codec
	$(BIN)/python -m bench.plans_recovery_bench
	$(BIN)/python -m bench.plans_latency_bench

up: install
	$(BIN)/treadle up

down: install
	$(BIN)/treadle down

clean:
	rm -rf $(VENV) .treadle .pytest_cache .ruff_cache native/target
