#!/usr/bin/env bash
# MoE t2i 1024x1024: one turn, offsets 325/9, seed 200, cfg_interval (0, 1), cfg_norm none.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CKPT=${CKPT:-checkpoints/neopp_moe}
MODE=${MODE:-configs/neopp/neopp_moe.json}
NPROC=${NPROC:-1}
KV_DIR=${KV_DIR:-replay_kv/moe_t2i_1k}
OUT_DIR=${OUT_DIR:-outputs/replay}
PREFIX=${PREFIX:-moe_t2i_1k}
TASK=${TASK:-t2i}
SIZE=${SIZE:-1024 1024}
CFG_SCALE=${CFG_SCALE:-4.0}
CFG_INTERVAL=${CFG_INTERVAL:-0 1}
CFG_NORM=${CFG_NORM:-none}
SHIFT=${SHIFT:-3.0}
TURNS=("325 9 200")
source "$HERE/_common.sh"
replay_turns
