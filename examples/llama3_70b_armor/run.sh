#!/bin/bash
# Llama-3.1-70B, DAPO + ARMOR on 8 nodes x 8 GPUs: 4 trainer nodes (TP=8 x PP=4, VPP=5) and
# 4 engine nodes (3 policy + 1 reference SGLang engines of TP=8, disaggregated). See README.md here.
#   HF_DIR=/models/Llama-3.1-70B-Instruct DATA=/data/dapo-math-17k.parquet examples/llama3_70b_armor/run.sh [key=value ...]
#   DRY_RUN=1 examples/llama3_70b_armor/run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
CONFIG=configs/llama3_70b_armor.yaml
HF_DIR=${HF_DIR:-/models/Llama-3.1-70B-Instruct}
MCORE_DIR=${MCORE_DIR:-$HF_DIR-mcore}
# 140 GB of bf16 weights stream through the converter: run it on a CPU node, not the login node.
export ARMOR_CONVERT_LAUNCH=${ARMOR_CONVERT_LAUNCH:-srun --nodes=1 --ntasks=1 --cpus-per-task=8 --mem=32G --time=06:00:00}
armor_example "$@"
