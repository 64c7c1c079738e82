#!/bin/bash
# DeepSeek-V2-Lite (MLA + MoE: 64 routed experts, 6 active, 2 shared), DAPO + ARMOR on 1 node x 8 GPUs:
# trainer EP=8, 3 policy + 1 reference colocated SGLang engines of TP=2. See README.md here.
#   HF_DIR=/models/DeepSeek-V2-Lite DATA=/data/dapo-math-17k.parquet examples/deepseek_v2_lite_armor/run.sh [key=value ...]
#   DRY_RUN=1 examples/deepseek_v2_lite_armor/run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
CONFIG=configs/deepseek_v2_lite_armor.yaml
HF_DIR=${HF_DIR:-/models/DeepSeek-V2-Lite}
MCORE_DIR=${MCORE_DIR:-$HF_DIR-mcore}
armor_example "$@"
