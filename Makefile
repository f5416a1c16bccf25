# Everything a fresh machine needs: `make run` starts the daemon on the demo model, `make test`
# runs linters and the whole suite. Both create .venv and install into it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# `make run` installs what serving needs (the daemon extra); `make test` adds the test extras.
DAEMON_STAMP := $(VENV)/.installed-daemon
STAMP := $(VENV)/.installed
# vLLM 0.33 (about 10 GB) lives outside the clone and is reused across runs and clones; its
# version is the one constraints.txt pins (the images' base too).
VLLM_PIN := $(shell sed -n 's/^vllm==//p' constraints.txt)
VLLM_VENV ?= $(HOME)/.cache/weight-cache/vllm-$(VLLM_PIN)
# kubernetes-validate and checkov (the Kubernetes manifests' checks) in an environment of their
# own inside the clone: checkov's pins would fight the project's and vLLM's.
DEPLOY_VENV ?= .venv-deploy
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed

.PHONY: help run demo test test-vllm lint format openapi settings-table bench clean deploy-tools images dist

help:
	@echo "make run     create .venv, install the daemon, start it on the built-in demo model"
	@echo "make demo    a vLLM 0.33 engine on this CPU attached to the demo model, then with"
	@echo "             vLLM's default loader: both tokens and both model loads (DEMO_ARGS=--url URL"
	@echo "             attaches through a running daemon instead of starting one)"
	@echo "make test    create .venv, install test extras, run ruff, mypy and the whole suite"
	@echo "             (vLLM tests run in $(VLLM_VENV), created on first use)"
	@echo "make lint    ruff and mypy only"
	@echo "make openapi regenerate openapi.json from the app"
	@echo "make settings-table  rewrite docs/operating.md's settings table from service/settings.py"
	@echo "make bench   run the benchmarks in bench/"
	@echo "make dist    build the wheel into dist/ (pip install dist/*.whl[daemon])"
	@echo "make images  build and smoke-test both Docker images (where a Docker daemon runs)"

$(PY):
	@# Reuse an interpreter's own torch (a CUDA build, say) when it has one.
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "using the torch of $(PYTHON)"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi

$(DAEMON_STAMP): $(PY) pyproject.toml constraints.txt
	@$(PY) -c "import torch" >/dev/null 2>&1 || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -c constraints.txt -e ".[daemon]"
	@touch $@

$(STAMP): $(DAEMON_STAMP)
	$(PIP) install -q -c constraints.txt -e ".[test]"
	@touch $@

run: $(DAEMON_STAMP)
	$(VENV)/bin/weight-cache serve

lint: $(STAMP)
	$(VENV)/bin/ruff check protocol modelopt_fp8 service engine_client weight_cache_cli harness tests bench
	$(VENV)/bin/ruff format --check protocol modelopt_fp8 service engine_client weight_cache_cli harness tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --python-version 3.12  # pyproject checks 3.10; both ends of what is supported

# Everything installs into .venv, $(DEPLOY_VENV) and $(VLLM_VENV), nothing into the system: the
# compose check uses `docker compose` or `docker-compose` where present and the compose-spec
# schema always.
test: lint deploy-tools
	DEPLOY_VENV=$(DEPLOY_VENV) $(PY) -m pytest
	@if [ -x $(VLLM_VENV)/bin/python ] || [ -n "$(VLLM_PYTHON)" ]; then \
		$(MAKE) --no-print-directory test-vllm; \
	else \
		echo "vLLM 0.33 needs Python 3.11 to 3.14 and there is none (set VLLM_PYTHON):"; \
		echo "its tests were skipped above (could not import 'vllm')"; \
	fi

deploy-tools: $(DEPLOY_STAMP)

$(DEPLOY_STAMP): deploy/kubernetes/tools.txt
	rm -rf $(DEPLOY_VENV)
	$(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/pip install -q -r deploy/kubernetes/tools.txt
	@touch $@

# The loader plugin against the real vLLM 0.33, in its own environment (created once, reused).
# vLLM 0.33 runs on Python 3.11 to 3.14: the environment is made with $(PYTHON) if it is one,
# else with the first python3.11 ... python3.14 found.
VLLM_PYTHON ?= $(shell for p in $(PYTHON) python3.11 python3.12 python3.13 python3.14; do \
	$$p -c 'import sys; sys.exit(not (3, 11) <= sys.version_info < (3, 15))' 2>/dev/null \
	&& command -v $$p && break; done)

$(VLLM_VENV)/bin/python:
	@test -n "$(VLLM_PYTHON)" || { echo "vLLM 0.33 needs Python 3.11 to 3.14 (VLLM_PYTHON)"; exit 1; }
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "vllm==$(VLLM_PIN)"

$(VLLM_VENV)/.weight-cache-deps: $(VLLM_VENV)/bin/python pyproject.toml constraints.txt
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt -e ".[test]"
	@touch $@

# Every process the vLLM tests start sees a plain AVX2 x86-64 host, whatever this machine has
# (tests/vllm/cpu_capabilities.py, run at interpreter start from tests/vllm/startup).
test-vllm: $(VLLM_VENV)/.weight-cache-deps
	@# Point the shared environment at this checkout (its entry point included).
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	PYTHONPATH="$(CURDIR)/tests/vllm/startup$${PYTHONPATH:+:$$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu \
		$(VLLM_VENV)/bin/python -m pytest tests/vllm

# A real vLLM 0.33 engine on this machine's CPU, attached to the demo model, then with vLLM's
# default loader: both token lists and both model loads (harness/engine_demo.py), on vLLM's CPU
# platform as the vLLM tests run it (a plain AVX2 host, whatever this one has). Installs only
# into $(VLLM_VENV), made as for `make test-vllm`.
DEMO_ARGS ?=
demo: $(VLLM_VENV)/.weight-cache-deps
	@$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	@PYTHONPATH="$(CURDIR)/tests/vllm/startup:$(CURDIR)" VLLM_TARGET_DEVICE=cpu \
		$(VLLM_VENV)/bin/python -m harness.engine_demo $(DEMO_ARGS)

format: $(STAMP)
	$(VENV)/bin/ruff format protocol modelopt_fp8 service engine_client weight_cache_cli harness tests bench
	$(VENV)/bin/ruff check --fix protocol modelopt_fp8 service engine_client weight_cache_cli harness tests bench

openapi: $(STAMP)
	$(VENV)/bin/weight-cache openapi > openapi.json

settings-table: $(STAMP)
	$(PY) -m weight_cache_cli.settings_table docs/operating.md

bench: $(STAMP)
	$(PY) -m bench.processing

# The package as a wheel (and its source) in dist/, to install where the checkout is not:
# pip install "dist/weight_cache-VERSION-py3-none-any.whl[daemon]" (the engine side: no extra,
# inside vLLM's environment; [cuda] on a GPU).
dist: $(DAEMON_STAMP)
	rm -rf dist build
	$(PIP) wheel -q --no-deps --no-build-isolation -w dist .
	@ls dist

# Both images, built and smoke-tested where a Docker daemon answers (says so and builds none
# where none does).
images:
	$(PYTHON) docker/images.py

clean:
	rm -rf $(VENV) $(DEPLOY_VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
