#!/usr/bin/env bash
# Dense 8-step LoRA 2048x2048: one turn, offset 298, seed 200, CFG off (no uncond prefix).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CKPT=${CKPT:-checkpoints/neopp}
MODE=${MODE:-configs/neopp/neopp_dense_8steps.json}
KV_DIR=${KV_DIR:-replay_kv/dense_8steps_2k}
OUT_DIR=${OUT_DIR:-outputs/replay}
PREFIX=${PREFIX:-dense_8steps_lora_2k}
TASK=${TASK:-t2i}
SIZE=${SIZE:-2048 2048}
CFG=off
CFG_SCALE=${CFG_SCALE:-1.0}
CFG_INTERVAL=${CFG_INTERVAL:--1 2}
CFG_NORM=${CFG_NORM:-none}
SHIFT=${SHIFT:-3.0}
TURNS=("298 none 200")
source "$HERE/_common.sh"
replay_turns
