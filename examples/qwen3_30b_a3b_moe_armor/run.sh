#!/bin/bash
# Qwen3-30B-A3B (MoE: 128 experts, 8 active), DAPO + ARMOR on 2 nodes x 8 GPUs:
# trainer TP=2 (+SP) x EP=8, 3 policy + 1 reference colocated SGLang engines of TP=4. See README.md here.
#   HF_DIR=/models/Qwen3-30B-A3B-Base DATA=/data/dapo-math-17k.parquet examples/qwen3_30b_a3b_moe_armor/run.sh [key=value ...]
#   DRY_RUN=1 examples/qwen3_30b_a3b_moe_armor/run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
CONFIG=configs/qwen3_30b_a3b_moe_armor.yaml
HF_DIR=${HF_DIR:-/models/Qwen3-30B-A3B-Base}
MCORE_DIR=${MCORE_DIR:-$HF_DIR-mcore}
# Engines listen on all interfaces (trainer ranks on both nodes reach them) and share the GPUs: 40 % each.
armor_example "$@"
