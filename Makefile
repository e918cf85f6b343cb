# The two commands of the README. Everything installs into .venv (Python 3.11).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STEPS ?= 300

.PHONY: install test demo lint bench

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

lint: install
	$(VENV)/bin/ruff check .

test: install lint
	$(PY) -m pytest -q

demo: install
	$(PY) -m engine run dapo --set trainer.total_steps=$(STEPS) --progress on

bench: install
	$(PY) bench/logprob_kernel.py
	$(PY) bench/rollout_torch.py
