# NeoPP serving: `make serve` runs tritonserver on the tiny checkpoint, `make test` runs all tests.
SHELL := /bin/bash
PYTHON_BOOTSTRAP ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TINY_DIR ?= build/tiny

.PHONY: setup test lint bench tiny clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PIP) install -qq --upgrade pip
	$(PIP) install -qq -r requirements.txt
	$(PIP) install -qq --no-deps -e .
	touch $(STAMP)

tiny: setup
	test -f $(TINY_DIR)/dense/config.json -a -f $(TINY_DIR)/lora/neopp_8steps_lora.safetensors \
	  || $(PY) -m testing.tiny_checkpoint --out $(TINY_DIR)
	test -f $(TINY_DIR)/demo/tokenizer.json || $(PY) -m testing.demo_checkpoint --out $(TINY_DIR)/demo

# The style check (ruff, settings in pyproject.toml; hadolint for the container recipe) runs first:
# a violation fails `make test` and CI.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint docker/Dockerfile

test: lint
	$(PY) -m pytest -q

bench: setup
	$(PY) -m bench.report --out bench

clean:
	rm -rf build

# ---- Triton serving: `make serve` runs the real tritonserver in the foreground.
# Override: HTTP_PORT GRPC_PORT METRICS_PORT HOST (0.0.0.0 to expose), SERVE_MODELS,
# NEOPP_CHECKPOINT (a real checkpoint; default: the tiny one in $(TINY_DIR)/dense), NEOPP_LORA_DIR (the
# folder of the LoRA file the 8-step mode names; default: $(TINY_DIR)/lora with the tiny checkpoint only).
# CONFIG: a GPU layout, model_repository/*/configs/$(CONFIG).pbtxt (docs/deployment.md); unset: the CPU one.
# Model load/unload, configs and shared memory need the operator key: ADMIN_KEY_FILE (created 0600
# at first start) or NEOPP_ADMIN_KEY; the HTTP port is the launcher's front (docs/security.md).
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
HOST ?= 127.0.0.1
SERVE_MODELS ?= neopp_dense neopp_dense_fp8 neopp_dense_cfg neopp_dense_cfg_seq neopp_dense_8steps \
                neopp_moe neopp_moe_cfg neopp_session neopp_dense_stream neopp_dense_cfg_stream \
                neopp_prompt_encoder neopp_t2i
NEOPP_CHECKPOINT ?= $(abspath $(TINY_DIR)/dense)
NEOPP_MOE_CHECKPOINT ?= $(abspath $(TINY_DIR)/moe)
# The prompt encoder needs a checkpoint with a language tower (tokenizer.json): NEOPP_CHECKPOINT when it has
# one, else the random demo-format one `make tiny` writes (whose geometry the tiny generation models do not
# serve: neopp_t2i then refuses COND_KV; `make serve-demo` serves one checkpoint for all three models).
NEOPP_PROMPT_CHECKPOINT ?= $(if $(wildcard $(NEOPP_CHECKPOINT)/tokenizer.json),$(NEOPP_CHECKPOINT),$(abspath $(TINY_DIR)/demo))
# `make serve-demo`: prompt in, image out from the demo model (trained weights land in demo/checkpoints/dense;
# DEMO_CHECKPOINT=$(TINY_DIR)/demo serves random ones).
DEMO_CHECKPOINT ?= demo/checkpoints/dense
DEMO_MODELS ?= neopp_dense neopp_prompt_encoder neopp_t2i
NEOPP_LORA_DIR ?= $(if $(filter $(abspath $(TINY_DIR)/dense),$(NEOPP_CHECKPOINT)),$(abspath $(TINY_DIR)/lora))
ADMIN_KEY_FILE ?= $(abspath build/admin.key)
BENCH_ARGS ?=

.PHONY: serve serve-demo bench-serve

serve: tiny
	NEOPP_CHECKPOINT=$(NEOPP_CHECKPOINT) NEOPP_CHECKPOINT_NEOPP_MOE=$(NEOPP_MOE_CHECKPOINT) \
	NEOPP_CHECKPOINT_NEOPP_MOE_CFG=$(NEOPP_MOE_CHECKPOINT) NEOPP_LORA_DIR=$(NEOPP_LORA_DIR) \
	NEOPP_CHECKPOINT_NEOPP_PROMPT_ENCODER=$(NEOPP_PROMPT_CHECKPOINT) \
	$(PY) -m neopp.serving.tritonserver serve \
	  --model-repository model_repository --host $(HOST) --http-port $(HTTP_PORT) \
	  --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --admin-key-file $(ADMIN_KEY_FILE) \
	  -- --model-control-mode=explicit $(foreach m,$(SERVE_MODELS),--load-model=$(m)) \
	  $(if $(CONFIG),--model-config-name=$(CONFIG))

serve-demo: tiny
	@test -f $(DEMO_CHECKPOINT)/tokenizer.json || { echo "error: no demo checkpoint in $(DEMO_CHECKPOINT)" \
	  "(DEMO_CHECKPOINT=$(TINY_DIR)/demo serves random weights)" >&2; exit 2; }
	$(MAKE) serve NEOPP_CHECKPOINT=$(abspath $(DEMO_CHECKPOINT)) SERVE_MODELS="$(DEMO_MODELS)"

# perf_analyzer against the server `make serve` runs (same GRPC_PORT); BENCH_ARGS="--own-server" starts one.
bench-serve: tiny
	NEOPP_CHECKPOINT=$(NEOPP_CHECKPOINT) $(PY) -m bench.perf_analyzer --model neopp_dense \
	  --grpc-url 127.0.0.1:$(GRPC_PORT) $(BENCH_ARGS)

# System libraries, installed only here (as root, Debian/Ubuntu): libb64-0d, which perf_analyzer links.
.PHONY: deps
deps:
	apt-get update -qq && apt-get install -y -qq libb64-0d

# ---- GPU check (needs a CUDA device): every mode the GPU count allows on the 8B geometry, 1024px, 50 steps.
# GPU_CHECK_ARGS: e.g. --checkpoint /models/SenseNova-U1-8B; smoke run without GPU: --device cpu --layers 2 ...
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check: setup
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

# ---- 8B geometry on this machine (not in `make test`): writes a ~14 GB sharded random checkpoint to
# build/8b, generates in bf16 and FP8 (a child process each), deletes the checkpoint, updates bench/RESULTS.md.
.PHONY: bench-8b
bench-8b: setup
	$(PY) -m bench.report --out bench --only 8b

# ---- Reliability: bad input, 8-client load for SOAK_SECONDS, stub kills, SIGTERM; prints the figures.
SOAK_SECONDS ?= 600
.PHONY: soak
soak: setup
	$(PY) -m testing.soak --seconds $(SOAK_SECONDS)

# ---- Replays of saved KV (docs/replay.md), no venv to activate. CASE: a case of `make replay-list`,
# either a replay case (scripts/replay) or a LightX2V launcher name (scripts/lightx2v, `.sh` optional);
# ARGS go to the tool (e.g. --device cpu); KV_DIR, CKPT, SIZE, STEPS... pass through the environment.
CASE ?=
ARGS ?=
.PHONY: replay replay-list
replay: setup
	@name="$(CASE:.sh=)"; test -n "$$name" || { echo "usage: make replay CASE=<name> [ARGS=...]" \
	  "(make replay-list shows the names)" >&2; exit 2; }; \
	for dir in scripts/replay scripts/lightx2v; do \
	  test -f "$$dir/$$name.sh" && exec bash "$$dir/$$name.sh" $(ARGS); done; \
	echo "error: CASE=$(CASE): no scripts/replay/$$name.sh or scripts/lightx2v/$$name.sh" \
	  "(make replay-list shows the names)" >&2; exit 2

replay-list: setup
	@$(PY) -m neopp.tools.replay_cases --list
	@$(PY) -m neopp.tools.lightx2v_launchers --list
