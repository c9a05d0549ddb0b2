# The two set-up commands of the README. Each installs what it needs into .venv first.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python

.PHONY: demo test lint bench setup

# The main job on embedded defaults: a small 3D-parallel run (tp=2, pp=2, dp=2, ZeRO-1) with
# telemetry, then where each rank's time went (SQL over the store) and the run's report.
demo: setup
	$(VENV)/bin/ranktrace train --tp 2 --pp 2 --dp 2 --zero 1 --model small --steps 100 \
		--global-batch 16 --micro-batches 4 --seq-len 128 --log-every 10 --run-name demo
	$(VENV)/bin/ranktrace sql "$$(cat docs/demo_breakdown.sql)"
	$(VENV)/bin/ranktrace report demo

# The whole test suite (real multi-process gloo runs) plus lint.
test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) benchmarks/trainer_scaling.py

setup: $(VENV)/.installed

# torch is installed first and pinned, so the project's torch range never pulls a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@
