#!/usr/bin/env bash
# Dense i2i (image editing) 1024x1024: one turn, seed 200; the input image is inside both KV prefixes. Set the offsets LightLLM logged with the KV.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CKPT=${CKPT:-checkpoints/neopp}
MODE=${MODE:-configs/neopp/neopp_dense.json}
KV_DIR=${KV_DIR:-replay_kv/dense_i2i_1k}
OUT_DIR=${OUT_DIR:-outputs/replay}
PREFIX=${PREFIX:-dense_i2i_1k}
TASK=${TASK:-i2i}
SIZE=${SIZE:-1024 1024}
CFG_SCALE=${CFG_SCALE:-4.0}
CFG_INTERVAL=${CFG_INTERVAL:--1 2}
CFG_NORM=${CFG_NORM:-none}
SHIFT=${SHIFT:-3.0}
TURNS=("${OFFSET_COND:-298} ${OFFSET_UNCOND:-9} 200")
source "$HERE/_common.sh"
replay_turns
