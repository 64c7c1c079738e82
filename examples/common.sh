# Shared steps of the example recipes (sourced by examples/*/run.sh):
#   1. convert the HF checkpoint once to Megatron torch_dist (loads at any TP/PP/EP);
#   2. submit the SLURM job with the resources of the recipe's config.
# The caller sets CONFIG, HF_DIR, MCORE_DIR (and optionally DATA), then calls armor_example with
# the recipe's overrides followed by the user's; later overrides win.
# DRY_RUN=1 prints the conversion command, the sbatch command and the job's plan; nothing runs.
# A layout whose device-memory plan (armor-train --plan) exceeds launch.gpu_memory_gib is refused
# in one line before anything else; pass --no-plan among the overrides to accept it.
# ARMOR_CONVERT_LAUNCH prefixes the conversion, e.g. "srun -p cpu --mem=64G -t 6:00:00".

set -euo pipefail
ARMOR_HOME=${ARMOR_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export ARMOR_HOME
export PYTHONPATH="$ARMOR_HOME${PYTHONPATH:+:$PYTHONPATH}"
PY=${ARMOR_PYTHON:-python}
cd "$ARMOR_HOME"

armor_example() {
  local overrides=("model.path=$HF_DIR" "model.mcore_path=$MCORE_DIR")
  [[ -n ${DATA:-} ]] && overrides+=("data.train_path=$DATA")
  overrides+=("$@")
  local convert=(${ARMOR_CONVERT_LAUNCH:-} "${ARMOR_CONVERT:-armor-convert}" hf-to-mcore "$HF_DIR" "$MCORE_DIR")

  # config errors and a layout that does not fit its GPUs, before converting (the checkpoint does
  # not exist yet; the job checks the files on the compute nodes before any model is built)
  "$PY" -m armor_megatron.cli.train --check --no-files --config "$CONFIG" "${overrides[@]}" >/dev/null
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    if [[ -d $MCORE_DIR ]]; then echo "# $MCORE_DIR exists: conversion skipped"; else printf '%q ' "${convert[@]}"; echo; fi
    "$PY" -m armor_megatron.cli.slurm submit --dry-run --config "$CONFIG" "${overrides[@]}"
    "$PY" -m armor_megatron.cli.slurm plan --dry-run --config "$CONFIG" "${overrides[@]}"
    return
  fi
  if [[ ! -d $MCORE_DIR ]]; then  # the converter writes to a temporary directory and renames it: present = complete
    echo "converting $HF_DIR -> $MCORE_DIR" >&2
    "${convert[@]}"
  fi
  "$PY" -m armor_megatron.cli.slurm submit --config "$CONFIG" "${overrides[@]}"
}
