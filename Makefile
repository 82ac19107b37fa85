# NeoPP serving: `make serve` runs tritonserver on the trained demo model, `make test` runs all tests.
SHELL := /bin/bash
PYTHON_BOOTSTRAP ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TINY_DIR ?= build/tiny
# The checkout this Makefile belongs to (through symlinks): the editable install always points here.
REPO_DIR := $(realpath $(dir $(realpath $(firstword $(MAKEFILE_LIST)))))

.PHONY: setup test test-quick lint bench tiny clean contract-configs router-config serve-replicas

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PIP) install -qq --upgrade pip
	$(PIP) install -qq -r requirements.txt
	$(PIP) install -qq --no-deps -e $(REPO_DIR)
	touch $(STAMP)

tiny: setup
	test -f $(TINY_DIR)/dense/config.json -a -f $(TINY_DIR)/lora/neopp_8steps_lora.safetensors \
	  || $(PY) -m testing.tiny_checkpoint --out $(TINY_DIR)

# The style check (ruff, settings in pyproject.toml; hadolint for the container recipe) and the
# package's storeys (import-linter's contracts in pyproject.toml, docs/architecture.md) run first:
# a violation fails `make test` and CI.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint docker/Dockerfile
	$(VENV)/bin/lint-imports --no-cache

test: lint
	$(PY) -m pytest -q

# A smoke subset in about a minute: the request rules, parsing, schedule and noise, the contract
# tables, KV and image files, the float64 reference, the neopp command, and one picture drawn through
# a real tritonserver behind the door (the demo model). One file: $(PY) -m pytest -q tests/test_cli.py
QUICK_TESTS ?= tests/test_cli.py tests/test_request_limits.py tests/test_front_parsing.py tests/test_schedule.py \
               tests/test_rng.py tests/test_contract_configs.py tests/test_stream_parsing.py \
               tests/test_kv_and_images.py tests/test_reference_equivalence.py tests/test_security.py \
               tests/e2e/test_cli_e2e.py::test_generate_streams_progress_and_writes_the_picture_neopp_t2i_draws
test-quick: setup
	$(PY) -m pytest -q $(QUICK_TESTS)

# The input/output blocks of every config.pbtxt, written from the code's tables (a test fails when
# a file differs from them).
contract-configs: setup
	$(PY) -m neopp.tools.contract_configs

# The cluster router's configuration (deploy/kubernetes/base/router/haproxy.cfg), written from
# deploy/router.py's rules (a test fails when the file differs).
router-config: setup
	$(PY) -m deploy.router --kubernetes > deploy/kubernetes/base/router/haproxy.cfg

# N replicas of the demo server behind HAProxy (Debian's, `make deps`) on HTTP_PORT/GRPC_PORT.
N ?= 2
serve-replicas: setup
	$(PY) -m deploy.replicas --replicas $(N) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT)

bench: setup
	$(PY) -m bench.report --out bench

clean:
	rm -rf build

# ---- Triton serving: `make serve` runs the real tritonserver in the foreground, on the trained demo model.
# Override: HTTP_PORT GRPC_PORT METRICS_PORT HOST (0.0.0.0 to expose), SERVE_MODELS,
# NEOPP_CHECKPOINT (a real checkpoint; default: the demo one in $(DEMO_DIR)/dense), NEOPP_MOE_CHECKPOINT,
# NEOPP_LORA_DIR (the folder of the LoRA file the 8-step mode names; default: the demo's or the tiny one's,
# matching NEOPP_CHECKPOINT). $(TINY_DIR) holds the random tiny checkpoints the tests use.
# CONFIG: a GPU layout, model_repository/*/configs/$(CONFIG).pbtxt (docs/deployment.md); unset: the CPU one.
# GPUS (1, 2, 4 or 8) instead: writes the layout gpus$(GPUS) for this machine and these checkpoints
# (python -m neopp.tools.gpu_layout, docs/deployment.md), then serves it, loading only the models it places;
# GPU_MEMORY_GB: the memory per GPU (default: what nvidia-smi reports).
# Model load/unload, configs and shared memory need the operator key: ADMIN_KEY_FILE (created 0600
# at first start) or NEOPP_ADMIN_KEY; the HTTP port is the launcher's front (docs/security.md).
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
HOST ?= 127.0.0.1
# PROFILE picks the models: full (every mode), or small (one mode, its streamed twin and the prompt
# side: what the playground, /v1 and the neopp command need; README "Serve less"). SERVE_MODELS overrides it.
PROFILE ?= full
PROFILE_full = neopp_dense neopp_dense_fp8 neopp_dense_cfg neopp_dense_cfg_seq neopp_dense_8steps \
               neopp_moe neopp_moe_cfg neopp_session neopp_dense_stream neopp_dense_cfg_stream \
               neopp_prompt_encoder neopp_t2i
PROFILE_small = neopp_dense neopp_dense_stream neopp_prompt_encoder neopp_t2i
SERVE_MODELS ?= $(PROFILE_$(PROFILE))
DEMO_DIR ?= demo/checkpoints
NEOPP_CHECKPOINT ?= $(abspath $(DEMO_DIR)/dense)
NEOPP_MOE_CHECKPOINT ?= $(abspath $(DEMO_DIR)/moe)
# The prompt encoder and neopp_t2i need a checkpoint with a language tower and its tokenizer.json (the
# demo's words, or a SenseNova-U1 checkpoint's own); on one without (LightLLM sends its KV) they are left out.
has_tokenizer = $(shell test -f $(1)/tokenizer.json && echo yes)
NEOPP_PROMPT_CHECKPOINT ?= $(if $(call has_tokenizer,$(NEOPP_CHECKPOINT)),$(NEOPP_CHECKPOINT))
SERVED_MODELS = $(if $(NEOPP_PROMPT_CHECKPOINT),$(SERVE_MODELS),$(filter-out neopp_prompt_encoder neopp_t2i,$(SERVE_MODELS)))
NEOPP_LORA_DIR ?= $(if $(filter $(abspath $(DEMO_DIR)/dense),$(NEOPP_CHECKPOINT)),$(abspath $(DEMO_DIR)/lora),\
                  $(if $(filter $(abspath $(TINY_DIR)/dense),$(NEOPP_CHECKPOINT)),$(abspath $(TINY_DIR)/lora)))
ADMIN_KEY_FILE ?= $(abspath build/admin.key)
GPUS ?=
GPU_MEMORY_GB ?=
GPU_LAYOUT_ARGS = --gpus $(GPUS) $(if $(GPU_MEMORY_GB),--gpu-memory-gb $(GPU_MEMORY_GB)) --repository model_repository \
  --checkpoint $(NEOPP_CHECKPOINT) --moe-checkpoint $(NEOPP_MOE_CHECKPOINT) \
  $(if $(NEOPP_PROMPT_CHECKPOINT),--prompt-checkpoint $(NEOPP_PROMPT_CHECKPOINT)) --models "$(SERVED_MODELS)"
# With GPUS, the models the written layout serves (it writes nothing when asked only that).
LOADED_MODELS = $(if $(GPUS),$(shell $(PY) -m neopp.tools.gpu_layout $(GPU_LAYOUT_ARGS) --served 2>/dev/null),$(SERVED_MODELS))
SERVE_CONFIG = $(if $(GPUS),gpus$(GPUS),$(CONFIG))
# A comma inside $(if ...) text.
comma := ,
BENCH_ARGS ?=

# What serve and bench-serve check before they start anything (a canned recipe: one line each).
define check_serve_inputs
@test -n "$(SERVE_MODELS)" || { echo "error: PROFILE=$(PROFILE): expected full or small" >&2; exit 2; }
@test -f $(NEOPP_CHECKPOINT)/config.json || { echo "error: no checkpoint in $(NEOPP_CHECKPOINT)" \
  "(make train-demo writes the demo one, make tiny the tiny test ones in $(TINY_DIR);" \
  "or NEOPP_CHECKPOINT=/path/to/checkpoint)" >&2; exit 2; }
@$(if $(NEOPP_PROMPT_CHECKPOINT),true,echo "note: $(NEOPP_CHECKPOINT) has no tokenizer.json:" \
  "neopp_prompt_encoder and neopp_t2i are not loaded")
endef

.PHONY: serve bench-serve train-demo

serve: setup
	$(check_serve_inputs)
	$(if $(and $(GPUS),$(CONFIG)),@echo "error: give GPUS (writes and serves gpus$(GPUS)) or CONFIG (a written layout)$(comma) not both" >&2; exit 2)
	$(if $(GPUS),$(PY) -m neopp.tools.gpu_layout $(GPU_LAYOUT_ARGS))
	NEOPP_CHECKPOINT=$(NEOPP_CHECKPOINT) NEOPP_CHECKPOINT_NEOPP_MOE=$(NEOPP_MOE_CHECKPOINT) \
	NEOPP_CHECKPOINT_NEOPP_MOE_CFG=$(NEOPP_MOE_CHECKPOINT) NEOPP_LORA_DIR=$(NEOPP_LORA_DIR) \
	$(if $(NEOPP_PROMPT_CHECKPOINT),NEOPP_CHECKPOINT_NEOPP_PROMPT_ENCODER=$(NEOPP_PROMPT_CHECKPOINT)) \
	$(PY) -m neopp.launcher serve \
	  --model-repository model_repository --host $(HOST) --http-port $(HTTP_PORT) \
	  --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --admin-key-file $(ADMIN_KEY_FILE) \
	  -- --model-control-mode=explicit $(foreach m,$(LOADED_MODELS),--load-model=$(m)) \
	  $(if $(SERVE_CONFIG),--model-config-name=$(SERVE_CONFIG))

# The demo model from its seeds (demo/README.md): both towers, the upcycled MoE, the distilled 8-step LoRA,
# then the loss curves. DEMO_DIR=build/demo keeps the committed weights untouched.
train-demo: setup
	PYTHONPATH=. $(PY) -m demo.train --out $(DEMO_DIR)/dense
	PYTHONPATH=. $(PY) -m demo.upcycle --dense $(DEMO_DIR)/dense --out $(DEMO_DIR)/moe
	PYTHONPATH=. $(PY) -m demo.distill --dense $(DEMO_DIR)/dense --out $(DEMO_DIR)/lora
	PYTHONPATH=. $(PY) -m demo.sample_kv --checkpoint $(DEMO_DIR)/dense
	PYTHONPATH=. $(PY) -m demo.card --dir $(DEMO_DIR)

# perf_analyzer against the server `make serve` runs (same GRPC_PORT); BENCH_ARGS="--own-server" starts one.
# It measures exactly 30 requests (a stability wait may never end on a busy machine); BENCH_ARGS="-- FLAGS"
# passes perf_analyzer flags that override it (docs/local-triton.md).
bench-serve: setup
	$(check_serve_inputs)
	NEOPP_CHECKPOINT=$(NEOPP_CHECKPOINT) $(PY) -m bench.perf_analyzer --model neopp_dense \
	  $(if $(NEOPP_URL),,--grpc-url 127.0.0.1:$(GRPC_PORT)) $(BENCH_ARGS)

# System packages, installed only here (as root, Debian/Ubuntu): libb64-0d, which perf_analyzer links;
# chromium and its driver for the playground's browser test.
.PHONY: deps
deps:
	apt-get update -qq && apt-get install -y -qq libb64-0d chromium chromium-driver haproxy

# ---- GPU check (needs a CUDA device): the CUDA tests (GPU against CPU, CUDA graphs against eager,
# FP8 kernel, step batching), every mode the GPU count allows on the 8B geometry (1024px, 50 steps;
# each one-GPU mode eager, through graphs and on the default path, side by side; guided 256/512
# steps; the step goals), then continuous batching on the 8B tower against one and two plain
# instances (bench/continuous_batching_gpu.md).
# GPU_CHECK_ARGS: e.g. --checkpoint /models/SenseNova-U1-8B; smoke run without GPU: --device cpu --layers 2 ...
# The GPU targets run with the machine's own Python and CUDA torch (GPU_PY; this checkout's venv where
# there is one) and install nothing: a GPU machine may have no network. Each part of gpu-check runs
# even if the one before failed, so one run brings back every figure it can.
GPU_CHECK_ARGS ?=
GPU_BATCHING_ARGS ?=
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_ENV = PYTHONPATH=$(REPO_DIR)/backend_src:$(REPO_DIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
.PHONY: gpu-check
gpu-check:
	-$(GPU_ENV) $(GPU_PY) -m pytest -q -rA tests/test_cuda_paths.py tests/test_cuda_graphs.py tests/test_fp8.py \
	  tests/test_layer_offload.py
	-$(GPU_ENV) $(GPU_PY) -m bench.gpu_check $(GPU_CHECK_ARGS)
	-$(GPU_ENV) $(GPU_PY) -m bench.offload_check
	$(GPU_ENV) $(GPU_PY) -m bench.continuous_batching --device cuda --dtype bfloat16 --geometries 8b \
	  --two-instances --report continuous_batching_gpu.md $(GPU_BATCHING_ARGS)

# ---- The server for a GPU machine without network or container (docs/local-triton.md): tritonserver,
# the libraries it links, the Python backend with the stub for GPU_PYTHON, perf_analyzer and the
# client packages, in one archive (about 48 MiB) that `make gpu-serve-check` unpacks there.
GPU_PYTHON ?= 3.12
GPU_BUNDLE ?= build/gpu-bundle.tar.xz
.PHONY: gpu-bundle gpu-serve-check
gpu-bundle: setup
	$(PY) -m deploy.gpu_bundle --out $(GPU_BUNDLE) --python $(GPU_PYTHON)

# ---- Triton on one GPU (bench/gpu_serve_check.py): the bundle GPU_BUNDLE unpacked into build/gpu-bundle
# (where it exists; else the tritonserver this environment has), `neopp_dense` and its streamed twin
# in the layout GPU_SERVE_CONFIG on a random 8B-geometry checkpoint, Triton against in-process, then
# throughput through Triton. GPU_SERVE_ARGS: e.g. --checkpoint /models/SenseNova-U1-8B.
GPU_SERVE_ARGS ?=
GPU_SERVE_CONFIG ?= h200x1
BUNDLE_TOP = $(REPO_DIR)/build/gpu-bundle/neopp-gpu-bundle
gpu-serve-check:
	@if test -f $(GPU_BUNDLE); then $(GPU_ENV) $(GPU_PY) -m deploy.gpu_bundle --unpack $(GPU_BUNDLE) \
	  --out build/gpu-bundle; fi
	$(GPU_ENV)$(if $(wildcard $(GPU_BUNDLE)),:$(BUNDLE_TOP)/site NEOPP_TRITONSERVER_ROOT=$(BUNDLE_TOP)/tritonserver) \
	  $(GPU_PY) -m bench.gpu_serve_check --config "$(GPU_SERVE_CONFIG)" $(GPU_SERVE_ARGS)

# ---- 8B geometry on this machine (not in `make test`): writes a ~14 GB sharded random checkpoint to
# build/8b, generates in bf16 and FP8 (a child process each), deletes the checkpoint, updates bench/RESULTS.md.
.PHONY: bench-8b
bench-8b: setup
	$(PY) -m bench.report --out bench --only 8b

# ---- Reliability: bad input, 8-client load for SOAK_SECONDS, stub kills, SIGTERM; prints the figures.
SOAK_SECONDS ?= 600
.PHONY: soak soak-attack
soak: setup
	$(PY) -m testing.soak --seconds $(SOAK_SECONDS)

# ---- Under attack (docs/reliability.md): legitimate mixed traffic at twice what the server completes, a CPU
# burner per core, ATTACK_SECONDS alone and ATTACK_SECONDS under attack (idle connections, trickled uploads,
# large JSON, planted "not healthy" texts, a session flood, another client's /v1 flood, a SIGKILLed stub); about
# 5 minutes plus twice ATTACK_SECONDS. Prints the figures and PASS/FAIL per goal, writes them to
# build/attack_soak.json. SERVER_NICE: the launcher's --server-nice.
ATTACK_SECONDS ?= 120
SERVER_NICE ?= 0
soak-attack: setup
	$(PY) -m testing.attack_soak --seconds $(ATTACK_SECONDS) --server-nice $(SERVER_NICE) --json build/attack_soak.json

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
