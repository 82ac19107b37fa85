#!/usr/bin/env bash
# Dense CFG-parallel 1024x1024 (2 ranks: cond on rank 0, uncond on rank 1) under torchrun; same turns as dense_t2i_1k.sh, so the images must match it.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CKPT=${CKPT:-checkpoints/neopp}
MODE=${MODE:-configs/neopp/neopp_dense_parallel_cfg.json}
NPROC=${NPROC:-2}  # must equal cfg_p_size x seq_p_size of the mode file; anything else is refused
KV_DIR=${KV_DIR:-replay_kv/dense_t2i_1k}
OUT_DIR=${OUT_DIR:-outputs/replay}
PREFIX=${PREFIX:-dense_cfg_parallel_1k}
TASK=${TASK:-t2i}
SIZE=${SIZE:-1024 1024}
CFG_SCALE=${CFG_SCALE:-4.0}
CFG_INTERVAL=${CFG_INTERVAL:--1 2}
CFG_NORM=${CFG_NORM:-none}
SHIFT=${SHIFT:-3.0}
TURNS=("298 9 200" "366 12 201" "441 15 202")
source "$HERE/_common.sh"
replay_turns
