# Two commands for a fresh machine: `make run` and `make test`. Both install what is missing first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.gemrec-installed
PROTOS := $(wildcard proto/gemrec/v1/*.proto)
APT_PACKAGES := redis-server chromium chromium-driver g++
DATA ?= $(firstword $(wildcard $(GEMREC_DATA_DIR)/movielens-latest-small ../shared/data/movielens-latest-small))

.PHONY: setup run test lint proto system-deps clean

setup: $(STAMP) proto

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps -r requirements-nodeps.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $@

proto: $(STAMP) $(patsubst %.proto,%_pb2.py,$(PROTOS))

proto/gemrec/v1/%_pb2.py: proto/gemrec/v1/%.proto proto/build.py
	$(PY) proto/build.py

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v kubectl >/dev/null || missing="$$missing kubernetes-client"; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

run: setup
	$(VENV)/bin/gemrec pipeline run --recipe movielens $(if $(DATA),--data $(DATA))

# Two workers (the CI machine's cores), each running whole test files: 10 min on 2 cores, 24 min in one process.
PYTEST_WORKERS ?= 2

test: setup system-deps lint
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	@# mypy imports the checkout as `gemrec` through a link (the repository root is the package).
	@mkdir -p $(VENV)/typecheck && ln -sfn $(CURDIR) $(VENV)/typecheck/gemrec
	cd $(VENV)/typecheck && MYPYPATH=. $(abspath $(VENV))/bin/mypy --config-file $(CURDIR)/pyproject.toml \
	  -p gemrec.kernels -p gemrec.model -p gemrec.components.trainer -m gemrec.config

clean:
	rm -rf $(VENV) runs mlruns.db mlartifacts proto/gemrec/v1/*_pb2*.py*
