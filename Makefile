# The two set-up commands of the README. Each installs what it needs into .venv first.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
# Where a local CPU build of torch lies (this machine kind's /opt/wheels): found there, it is
# taken before the index's CUDA build of the same version; absent, the index alone is asked.
TORCH_WHEELS ?= /opt/wheels
PY      = $(VENV)/bin/python
# uv installs (pip's resolver and one-core unpacking took 75 s of a clean set-up, uv 17 s with
# a cold cache); itself from the index, into .uv/, once.
UV_VERSION = 0.13.10
UV      = .uv/bin/uv
UV_PIP  = $(UV) pip install -q --python $(PY) $(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS))

.PHONY: demo test test-serial test-fast lint bench setup browser ray prerequisites

# The main job on embedded defaults (`ranktrace demo`): a one-axis sweep (tp 1 -> 2 at pp=2,
# dp=2) and a tp=2 pp=2 dp=2 ZeRO-1 run with an injected straggler, with telemetry; the sweep
# table and the straggler run's report; then the dashboard on http://127.0.0.1:8050/.
demo: setup
	$(VENV)/bin/ranktrace demo

# The whole test suite (real multi-process gloo runs, a real headless Chromium) plus lint, on
# two pytest workers, each a module (or the modules reading one session run) at a time
# (tests/conftest.py `worker_groups`); the 15 slowest tests at the end. Every `ranktrace train`
# of a worker runs in one launcher process (tests/launcher_service.py).
test: prerequisites
	$(PY) -m pytest -q -n 2 --durations=15

# The same on one worker (slower by ~30% here: docs/testing.md).
test-serial: prerequisites
	$(PY) -m pytest -q --durations=15

# What the suite needs, the browser's download and unpacking (I/O) beside the Python set-up and
# its compiling (CPU): a clean set-up's ~35 s of apt overlap the rest.
prerequisites:
	@$(MAKE) --no-print-directory -j 3 --output-sync=target setup browser ray lint

# The edit loop: unit and single-process tests only (no rank processes, browser or network
# namespaces), about a minute. Not a substitute for `make test`.
test-fast: setup
	$(PY) -m pytest -q -m "not multiprocess" --durations=10

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

# The optional Ray extra (`ranktrace ingest --ray`), for the tests' real two-node cluster; its
# package compiled like the rest (no process here caches bytecode: PYTHONDONTWRITEBYTECODE).
ray: $(VENV)/.ray

$(VENV)/.ray: $(VENV)/.installed
	$(UV_PIP) "$(TORCH)" -e ".[ray]"
	$(PY) -m compileall -q -j 0 -x '/tests/' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ray" >/dev/null 2>&1 || true
	touch $@

# torch is pinned in each install, so the project's torch range never pulls a CUDA build. uv
# does not byte-compile; compileall on every core does it after. Like pip's, it skips what does
# not compile on this Python (torch ships a 3.12-only test file), so its exit status is not the
# set-up's. The packages' own test suites (`/tests/` folders: pandas', sympy's, numpy's...) are
# never imported here: not compiled (21.4 -> 15.3 s, 38 -> 28 cpu-s, forced over the same venv).
# The venv keeps pip (`--seed`) for its users.
$(VENV)/.installed: pyproject.toml $(UV)
	$(UV) venv -q --seed --allow-existing --python $(PYTHON) $(VENV)
	$(UV_PIP) "$(TORCH)" -e ".[dev]"
	$(PY) -m compileall -q -j 0 -x '/tests/' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
	touch $@

$(UV):
	$(PYTHON) -m pip install -q --no-compile --target .uv "uv==$(UV_VERSION)"
