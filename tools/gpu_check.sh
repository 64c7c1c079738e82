#!/usr/bin/env bash
# The first-GPU acceptance check: proves the GPU path on ONE GPU in under 8 minutes, offline, on
# any single-GPU machine without network (see tools/README.md for what it needs installed).
#
#   tools/gpu_check.sh --logs DIR         # on the GPU machine (wheels from tools/gpu_wheels.sh in .whl)
#   tools/gpu_check.sh --device cpu       # the same checks on the CPU over gloo, small sizes
#   tools/gpu_check.sh --only parity,throughput --seq-len 2048    # see: python tools/gpu_check --help
#
# Prints one line per check (1. bf16 log-prob parity vs fp32 CPU, 2. a 3-step armor-train with
# anchors, a reference reset, a checkpoint and a resume, 3. 0.5B-shaped train throughput and
# MFU, 4. the colocated step's trainer phases with the memory ledger's bytes beside the measured
# peaks; then, when importable, 5. the Transformer Engine spec against the local one and 6. one tiny
# colocated SGLang engine ($SGLANG_PYTHON): release, push by disk and NCCL, resume, generate, log-probs
# against the trainer's at T=0.7; each skipped in one line naming what is missing), a summary of what
# was and was not proven, and last `gpu_ok=<0|1> tokens_per_s=<float> mfu=<float>`. Exit 0 when every
# check passed or was skipped.
# Logs: gpu_check.log and gpu_check.json in --logs DIR, default the work directory (--work,
# default $TMPDIR/armor_gpu_check).
#
# Packages the machine lacks (megatron-core, math-verify and its parser) are installed from the
# wheels in GPU_CHECK_WHEELS (default .whl) with `pip install --no-index --no-deps --target`, into
# GPU_CHECK_SITE (default /tmp/armor_gpu_site), which goes on PYTHONPATH; nothing else is
# installed, and the repository is used in place (PYTHONPATH). Env: PYTHON (default python3),
# GPU_CHECK_BUDGET (seconds for all checks, default 450; a hard stop 30 s later).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/armor_gpu_site}
BUDGET=${GPU_CHECK_BUDGET:-450}
verdict_failed() { echo "gpu_check: $1" >&2; echo "gpu_ok=0 tokens_per_s=nan mfu=nan"; exit 2; }

missing=$("$PY" - <<'PYEOF'
import importlib.util
def absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:
        return True
print(" ".join(n for n in ("megatron.core", "math_verify", "latex2sympy2_extended", "antlr4") if absent(n)))
PYEOF
) || verdict_failed "$PY does not run"
if [[ -n "$missing" ]]; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  ((${#wheels[@]})) || verdict_failed "not importable: $missing; no wheels in $WHEELS (run tools/gpu_wheels.sh where pip reaches the index, then carry $WHEELS)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
    || verdict_failed "pip could not install the wheels in $WHEELS"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout -k 10 $((BUDGET + 30)) "$PY" tools/gpu_check --budget "$BUDGET" "$@"
