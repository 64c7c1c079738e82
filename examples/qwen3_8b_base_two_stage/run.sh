#!/bin/bash
# Qwen3-8B-Base, DAPO + ARMOR with the two-stage reference reset (tau=1 for 180 steps, then frozen),
# on 2 nodes x 8 GPUs (see README.md here).
#   HF_DIR=/models/Qwen3-8B-Base DATA=/data/dapo-math-17k.parquet examples/qwen3_8b_base_two_stage/run.sh [key=value ...]
#   DRY_RUN=1 examples/qwen3_8b_base_two_stage/run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
CONFIG=configs/qwen3_8b_base_two_stage.yaml
HF_DIR=${HF_DIR:-/models/Qwen3-8B-Base}
MCORE_DIR=${MCORE_DIR:-$HF_DIR-mcore}
# Trainer TP=2 x DP=8 on 16 GPUs; 7 policy + 1 reference colocated engines of TP=2 (set in the config).
armor_example "$@"
