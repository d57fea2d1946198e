# The single entry point. A newcomer runs `make demo` and `make test`; each installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-8)
DEMO_STAMP := $(VENV)/.demo-installed-$(shell cat pyproject.toml | md5sum | cut -c1-8)

.PHONY: install install-demo redis-server test unit lint demo bench soak clean mutation

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Installs the package with the dev extras (every runtime extra included).
$(STAMP): $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

# What the demo needs (the sim and cli extras), installed once per pyproject.toml version.
$(DEMO_STAMP): $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install --quiet -e '.[sim,cli]'
	rm -f $(VENV)/.demo-installed-*
	touch $(DEMO_STAMP)

install-demo: $(DEMO_STAMP)

# Debian's redis-server (and redis-sentinel, for the Sentinel failover tests) for the
# real-Redis fixtures, tmux, the real terminal the screen tests run the CLI in, and valgrind,
# whose callgrind counts the scripts' instructions (bench.script_instructions); installed
# only when missing.
redis-server:
	@command -v redis-server >/dev/null 2>&1 && command -v redis-sentinel >/dev/null 2>&1 \
	  && command -v tmux >/dev/null 2>&1 && command -v valgrind >/dev/null 2>&1 || { \
	  echo "installing redis-server, redis-sentinel, tmux and valgrind (Debian)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server redis-sentinel tmux valgrind >/dev/null; }

lint: install
	$(VENV)/bin/ruff format --check src tests bench tools
	$(VENV)/bin/ruff check src tests bench tools
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict tests/typing
	$(VENV)/bin/lint-imports

unit: install
	$(PY) -m pytest tests/unit -q

# Lint, then the whole suite on two workers, a test file per worker at a time (each worker
# starts its own redis-server). pytest exits 5 when it collected nothing: that fails too.
test: install redis-server lint
	$(PY) -m pytest -q -n 2 --dist loadfile

# The long-running variants alone (the `soak` marker, which addopts deselects everywhere
# else): about 13 minutes on two cores, each test's wall time listed at the end to read
# beside the machine's load. pytest exits 5 when it collected nothing: that fails too.
soak: install redis-server
	$(PY) -m pytest -q -m soak --durations=0

demo: install-demo
	$(PY) -m polygateway demo

# Benchmarks run from their own venv: openai and litellm (the `bench` extra) never enter the
# dev venv or the runtime dependencies. BENCH_N (chat calls, default 1000) and BENCH_ROUNDS
# (default 3) size the run; the page goes to research-wiki/BENCHMARKS.md.
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-8)

$(BENCH_STAMP): pyproject.toml
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	echo '*' > $(BENCH_VENV)/.gitignore
	$(BENCH_PY) -m pip install --quiet -e '.[dev,bench]'
	rm -f $(BENCH_VENV)/.installed-*
	touch $(BENCH_STAMP)

bench: redis-server $(BENCH_STAMP)
	BENCH_N='$(BENCH_N)' BENCH_ROUNDS='$(BENCH_ROUNDS)' $(BENCH_PY) -m bench

# The telemetry-cost table alone (the governance loop with each emitter, side by side), without
# rewriting BENCHMARKS.md: the results go to bench/results/telemetry.json, the table to stdout.
TELEMETRY_CONFIGS := pgw_memory_instant,pgw_instant_null,pgw_instant_bare,pgw_instant_logging,
TELEMETRY_CONFIGS := $(TELEMETRY_CONFIGS)pgw_instant_prometheus,pgw_instant_otel_noop,pgw_instant_otel_sdk
.PHONY: bench-telemetry
bench-telemetry: $(BENCH_STAMP)
	BENCH_N='$(BENCH_N)' BENCH_ROUNDS='$(BENCH_ROUNDS)' $(BENCH_PY) -m bench --scenarios telemetry \
	  --configs $(TELEMETRY_CONFIGS) --results bench/results/telemetry.json \
	  --out bench/results/telemetry-page.md
	rm -f bench/results/telemetry-page.md
	$(BENCH_PY) -m bench.report bench/results/telemetry.json --telemetry

# The fleet benchmark (issue #18): N = 1, 8 and 50 worker processes contending for one scope on a
# private redis-server, 20 s each, a few minutes in all. Too heavy for `make bench`'s default run
# (50 interpreters at once), so a target of its own; `make bench` keeps the page section it writes.
# BENCH_FLEET_N (fleet sizes), BENCH_FLEET_SECONDS and BENCH_FLEET_CALLERS (in all) size it;
# BENCH_FLEET_NOTE in the environment adds a note to the page. Results: bench/results/fleet.json.
.PHONY: bench-fleet
bench-fleet: redis-server $(BENCH_STAMP)
	BENCH_FLEET_N='$(BENCH_FLEET_N)' BENCH_FLEET_SECONDS='$(BENCH_FLEET_SECONDS)' \
	  BENCH_FLEET_CALLERS='$(BENCH_FLEET_CALLERS)' $(BENCH_PY) -m bench.fleet

# Priority classes across a fleet (issue 19): interactive calls under a batch flood, with and
# without classes, and shares 3:1 across four processes. BENCH_CLASSES_SECONDS (60) sizes
# each scenario. Results: bench/results/fleet_classes.json and a section of BENCHMARKS.md.
.PHONY: bench-classes
bench-classes: redis-server $(BENCH_STAMP)
	BENCH_CLASSES_SECONDS='$(BENCH_CLASSES_SECONDS)' $(BENCH_PY) -m bench.fleet_classes

# The harness end to end with tiny sizes (also part of `make test`).
.PHONY: bench-smoke
bench-smoke: install redis-server
	$(PY) -m pytest -q tests/integration/test_bench_smoke.py tests/integration/test_bench_fleet_smoke.py

# Mutation testing of the governance core, never part of `make test` (about an hour on two
# cores): mutmut on the Python policy code against the fast tests ([tool.mutmut] in
# pyproject.toml), then our own runner on the Lua twin against the Redis contract and
# differential tests; the page goes to research-wiki/MUTATION.md. Its own venv, like bench.
MUT_VENV := .venv-mutation
MUT_PY := $(MUT_VENV)/bin/python
MUT_STAMP := $(MUT_VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-8)

$(MUT_STAMP): pyproject.toml
	test -x $(MUT_PY) || $(PYTHON) -m venv $(MUT_VENV)
	echo '*' > $(MUT_VENV)/.gitignore
	$(MUT_PY) -m pip install --quiet --upgrade pip
	$(MUT_PY) -m pip install --quiet -e '.[dev,mutation]'
	rm -f $(MUT_VENV)/.installed-*
	touch $(MUT_STAMP)

.PHONY: mutation-python mutation-lua
# MUTATION_NOTE="..." adds a line to the page (what else the machine was doing, say).
mutation: mutation-python mutation-lua
	$(MUT_PY) tools/mutation/report.py

# A fresh run every time: mutmut's cache would carry results over from older code.
mutation-python: $(MUT_STAMP)
	rm -rf mutants && mkdir mutants
	git rev-parse --short=12 HEAD > mutants/run-commit.txt
	date -u '+%Y-%m-%d %H:%M UTC' > mutants/run-started.txt
	start=$$(date +%s); \
	$(MUT_VENV)/bin/mutmut run --max-children 2 > mutants/mutmut-run.log 2>&1 \
	  || { tail -c 4000 mutants/mutmut-run.log; exit 1; }; \
	echo $$(( $$(date +%s) - start )) > mutants/python-seconds.txt
	tail -c 300 mutants/mutmut-run.log | tr '\r' '\n' | tail -3

mutation-lua: redis-server $(MUT_STAMP)
	$(MUT_PY) tools/mutation/lua.py

# polygateway.example.toml from the settings model (tests/unit/test_example_config.py fails
# when the committed file is stale).
.PHONY: example-config
example-config: install
	$(PY) tools/example_config.py polygateway.example.toml

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build dist
