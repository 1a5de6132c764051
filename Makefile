# featurehouse — `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WAREHOUSE ?= warehouse
SAMPLES ?= samples

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-10s %s\n", $$1, $$2}'

# uv installs the pinned set in ~30 s where pip took 64-100 s (a fresh clone here, 2026-12-02, byte-compiling
# included); pip installs the same pins if uv cannot be had. --compile-bytecode, as pip does: this machine
# sets PYTHONDONTWRITEBYTECODE, so without .pyc files every process compiles what it imports, each time
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	if $(BIN)/python -m pip install -q -c constraints.txt uv; then \
	  $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -c constraints.txt -e '.[dev,airflow]'; \
	else \
	  $(BIN)/python -m pip install -q --upgrade pip && $(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,airflow]'; \
	fi
	touch $@

setup: $(BIN)/.installed ## Create .venv and install featurehouse with its test and Airflow extras

run: setup ## Ingest the bundled sample pages into $(WAREHOUSE), print the summary and the report's path
	$(BIN)/featurehouse ingest $(SAMPLES) --warehouse $(WAREHOUSE)
	$(BIN)/featurehouse index --warehouse $(WAREHOUSE)
	$(BIN)/featurehouse status --warehouse $(WAREHOUSE) -n 3
	@echo "(the samples' first run is WARN, as expected: one of the two sample files is not a feature page and the page holds one bad record, to show how each is reported; run again, it is PASS: nothing new to load)"
	@# the run's report again, with Great Expectations' Data Docs (an ingest leaves them to it: docs/report.md)
	$(BIN)/featurehouse report --warehouse $(WAREHOUSE)

# three processes on this 2-core machine: with two, the CPU sat ~13 % idle while a worker waited on
# Airflow's, PostgreSQL's or a subprocess's clock (measured 2026-12-02: 2 workers 1,282 s at 87 %
# busy; 3 workers 1,068 s at 99.6 %)
JOBS ?= 3
PYTEST_ARGS ?= -n $(JOBS) --dist loadgroup --no-loadscope-reorder --durations=30

test: setup ## Run the whole test suite in $(JOBS) processes (fails if no test is collected); prints its wall time
	@# byte-compile our own modules once: where PYTHONDONTWRITEBYTECODE is set (it is on this machine) each CLI and
	@# Airflow process of the suite would compile pipeline/ from source again
	@$(BIN)/python -m compileall -q pipeline dags tests bench || true  # a syntax error: pytest names it
	@start=$$(date +%s); set +e; $(BIN)/pytest $(PYTEST_ARGS); rc=$$?; \
	echo "make test: the suite took $$(( $$(date +%s) - start )) s of wall time (pytest exit $$rc)"; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here"; exit 1; fi; exit $$rc

test-cpu: setup ## Run the whole suite as `make test` does, recording each test's CPU seconds; prints where the suite's CPU goes (by module, heaviest tests)
	@rm -f test-output/suite-cpu.tsv; mkdir -p test-output
	-FEATUREHOUSE_TEST_CPU=$(CURDIR)/test-output/suite-cpu.tsv $(MAKE) --no-print-directory test
	$(BIN)/python bench/suite_cpu.py test-output/suite-cpu.tsv

constraints: setup ## Pin what .venv holds now into constraints.txt (after a change to pyproject.toml's dependencies and a passing suite)
	{ sed -n '/^#/p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable; } > constraints.txt.new && mv constraints.txt.new constraints.txt

lint: setup ## Lint and check formatting with ruff
	$(BIN)/ruff check pipeline dags tests bench

bench: setup ## Benchmark ingest against DuckDB read_json, wall and CPU (full N=250/1000 on two page generators, re-run, one new page, 1 GiB export batch, a whole generated source through ingest and fetch exports), then finding features and browsing them (featurehouse serve)
	@$(BIN)/python -m compileall -q pipeline  # as `make test`: no process of the bench compiles our modules again
	$(BIN)/python bench/run_bench.py $(BENCH_ARGS)
	$(BIN)/python bench/find_bench.py $(FIND_BENCH_ARGS)
	$(BIN)/python bench/serve_bench.py $(SERVE_BENCH_ARGS)

bench-scale: setup ## Scale-out figures on PostgreSQL + S3 (moto): lock share, 1 vs 2 writers, S3 export throughput vs local disk (needs PostgreSQL's binaries, as `make test`)
	@$(BIN)/python -m compileall -q pipeline
	$(BIN)/python bench/scale_bench.py --n 200 --workers 1 --workers 2 $(SCALE_BENCH_ARGS)
	$(BIN)/python bench/scale_bench.py --n 800 --batch-features 800 --exports --no-pages --workers 1 --vs-local 2

bench-find: setup ## Benchmark search, similar and by-token on one generated 262,144-feature source (CLI and Python), index build and refresh
	$(BIN)/python bench/find_bench.py $(FIND_BENCH_ARGS)

up: ## Start Airflow with docker compose, as .env records it (one machine unless `make up-scale` chose scale-out; DEPLOYMENT=single goes back); writes .env's secrets once
	@PYTHON=$(PYTHON) bash deploy/dotenv.sh secrets
	@case "$(DEPLOYMENT)" in "") ;; single) bash deploy/dotenv.sh set FEATUREHOUSE_DEPLOYMENT=single COMPOSE_PROFILES= \
	  FEATUREHOUSE_WRITER_SLOTS=2 ;; *) echo "DEPLOYMENT=single, or make up-scale"; exit 2 ;; esac
	@if [ "$$(bash deploy/dotenv.sh get FEATUREHOUSE_DEPLOYMENT)" = scale ]; then PYTHON=$(PYTHON) bash deploy/dotenv.sh scale-secrets; fi
	@mkdir -p inbox
	docker compose up -d --build
	@echo "Airflow ($$(bash deploy/dotenv.sh get FEATUREHOUSE_DEPLOYMENT | grep . || echo single) deployment): http://localhost:8080 (user admin, password AIRFLOW_ADMIN_PASSWORD in .env); drop pages into ./inbox"

up-scale: ## Start the scale-out deployment (CeleryExecutor, Redis, MinIO, N=2 Celery workers) and record it in .env, so a later `make up` or `docker compose up -d` keeps it
	@PYTHON=$(PYTHON) bash deploy/dotenv.sh secrets
	@PYTHON=$(PYTHON) bash deploy/dotenv.sh scale-secrets
	@bash deploy/dotenv.sh set FEATUREHOUSE_DEPLOYMENT=scale COMPOSE_PROFILES=scale \
	  FEATUREHOUSE_WORKERS=$${N:-2} FEATUREHOUSE_WRITER_SLOTS=$$(( $${N:-2} * 2 ))
	@mkdir -p inbox
	docker compose --profile scale up -d --build --scale airflow-worker=$${N:-2}
	@echo "Airflow: http://localhost:8080; MinIO console: http://localhost:9001 (AWS_* in .env)"

down: ## Stop the docker compose deployment (volumes, and so the warehouse, are kept)
	docker compose --profile scale down

clean: ## Remove the virtualenv, the local warehouse and test output
	rm -rf $(VENV) warehouse reports test-output bench/out

.PHONY: help setup run test constraints lint bench bench-find clean up up-scale down
