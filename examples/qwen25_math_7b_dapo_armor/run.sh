#!/bin/bash
# Qwen2.5-Math-7B, DAPO + ARMOR with the paper's settings, on 1 node x 8 GPUs (see README.md here).
#   HF_DIR=/models/Qwen2.5-Math-7B DATA=/data/dapo-math-17k.parquet examples/qwen25_math_7b_dapo_armor/run.sh [key=value ...]
#   DRY_RUN=1 examples/qwen25_math_7b_dapo_armor/run.sh      # print what would run
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
CONFIG=configs/qwen25_math_7b_dapo_armor.yaml
HF_DIR=${HF_DIR:-/models/Qwen2.5-Math-7B}
MCORE_DIR=${MCORE_DIR:-$HF_DIR-mcore}
# Trainer TP=2 x DP=4 on all 8 GPUs; 3 policy + 1 reference SGLang engines of TP=2 share them (colocated, memory released while training).
# Engines get 40 % of each GPU; the trainer's weights, gradients, optimizer and reference wait in host
# memory while they generate (train.offload_during_rollout, the default when colocated) and come back
# once the engines have released theirs (armor-train --plan prints each phase of a step).
armor_example "$@"
