# The two set-up commands of the README. Each installs what it needs into .venv first.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python

.PHONY: demo test lint bench setup browser

# The main job on embedded defaults: a small 3D-parallel run (tp=2, pp=2, dp=2, ZeRO-1) with
# telemetry, then where each rank's time went (SQL over the store) and the run's report.
demo: setup
	$(VENV)/bin/ranktrace train --tp 2 --pp 2 --dp 2 --zero 1 --model small --steps 100 \
		--global-batch 16 --micro-batches 4 --seq-len 128 --log-every 10 --run-name demo
	$(VENV)/bin/ranktrace sql "$$(cat docs/demo_breakdown.sql)"
	$(VENV)/bin/ranktrace report demo

# The whole test suite (real multi-process gloo runs, a real headless Chromium) plus lint.
test: setup browser lint
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) benchmarks/trainer_scaling.py

setup: $(VENV)/.installed

# Debian's Chromium for the dashboard tests (never a downloaded browser); needs root or sudo.
browser:
	@command -v chromium >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; }

# torch is installed first and pinned, so the project's torch range never pulls a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@
