# Daybreak developer entry points. `make test` and `make demo` work on a fresh
# machine with Python 3.11+, Go 1.26+ and gcc: everything else is installed here.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Two pytest workers, each test file whole on one of them (pytest-xdist --dist loadfile): most of an
# e2e test's time is waiting for pods, loads and windows. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
# The repository root holds `operator/` (imported as daybreak.operator). Never
# let `python -m ...` put the root on sys.path, or it shadows the stdlib module.
export PYTHONSAFEPATH := 1

.PHONY: all venv vllm-env tools rdma-deps lint typecheck test demo dashboards prometheus-deps bench bench-deps crds image image-deps clean help

all: test

help:
	@echo "make test   - install into .venv, build the local control plane, lint, typecheck, run the tests"
	@echo "make demo   - the local cluster with fake accelerator nodes, the chart, a stepped load and a live view (DEMO_SECONDS=N DEMO_JSON=FILE for scripts)"
	@echo "make dashboards - a short demo with Prometheus, then docs/dashboards/*.png from the chart's dashboard queries"
	@echo "make bench  - run the benchmarks against their anchors"
	@echo "make crds   - regenerate crds/ from the API models"
	@echo "make tools  - build (or find cached) kube-apiserver, etcd, kwok, helm, ..."
	@echo "make image  - build the container image (OCI layout in ~/.cache/daybreak/image/oci) from Debian packages"
	@echo "make vllm-env - install (or find cached) vLLM on CPU; prints the interpreter's path last"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

tools: venv
	$(BIN)/daybreak dev tools

# vLLM on CPU for the connector tests and `daybreak bench vllm`: a base venv cached by version
# outside the repo plus .venv-vllm for this checkout (daybreak/devenv/vllmenv.py). Seconds when warm.
vllm-env: venv
	@$(BIN)/python -m daybreak.devenv.vllmenv

# Optional RDMA bindings from the distribution (see hack/pyverbs.sh).
rdma-deps: venv
	@hack/pyverbs.sh $(BIN)/python

lint: venv
	$(BIN)/ruff check .

typecheck: venv
	$(BIN)/python hack/linktree.py
	$(BIN)/mypy

test: venv tools rdma-deps vllm-env prometheus-deps lint typecheck
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: venv tools prometheus-deps
	$(BIN)/python -m daybreak.devenv.demo

# docs/dashboards/*.png from a short demo run: the chart's dashboard queries against its Prometheus.
DASHBOARD_SECONDS ?= 90
dashboards: venv tools prometheus-deps
	@$(BIN)/python -c 'import matplotlib' 2>/dev/null || $(BIN)/python -m pip install --quiet -e '.[test,dashboards]'
	DEMO_SECONDS=$(DASHBOARD_SECONDS) $(BIN)/python -m daybreak.devenv.dashboards

# Debian's Prometheus server, which the demo runs when it is installed (about 11 s of apt-get here). apt-get
# needs root; without it a note: the demo runs without Prometheus, tests/devenv/test_dashboards.py fails asking for
# its promtool.
prometheus-deps:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] || { echo "note: prometheus is not installed and \
	installing it needs root (apt-get install prometheus): the demo runs without it, the dashboard test fails"; \
	exit 0; }; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

bench: venv tools bench-deps vllm-env
	$(BIN)/daybreak bench all

# Mooncake's wheel (the transfer bench anchor) links libibverbs.so.1 even for tcp; the store
# bench also runs Debian's redis-server and the bench extra (redis client, Mooncake Store).
bench-deps:
	@ldconfig -p | grep -q 'libibverbs.so.1 ' || { apt-get update -qq && apt-get install -y -qq libibverbs1; }
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
	@$(BIN)/python -c 'import redis, mooncake.store' 2>/dev/null || $(BIN)/python -m pip install --quiet -e '.[test,bench]'

# The container image (docs/image.md): Debian root filesystem by mmdebstrap, OCI layers by umoci,
# cached per layer under ~/.cache/daybreak/image (DAYBREAK_IMAGE_DIR). The build needs root (chroot, file ownership).
image: venv image-deps
	$(BIN)/python -m daybreak.devenv.image

image-deps:
	@command -v mmdebstrap >/dev/null && command -v umoci >/dev/null || { apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap umoci >/dev/null; }

crds: venv
	$(BIN)/daybreak crds --out crds --docs docs/api.md
	cp crds/*.yaml charts/daybreak/crds/

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm.lock .typecheck .pytest_cache .mypy_cache .ruff_cache build *.egg-info .daybreak
