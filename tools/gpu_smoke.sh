#!/usr/bin/env bash
# Run the SGLang client tests against a REAL SGLang server (GPU machine, sglang installed).
#
#   tools/gpu_smoke.sh                      # builds a tiny Qwen2 checkpoint, starts SGLang on it
#   SGLANG_PYTHON=/opt/envs/sglang/bin/python tools/gpu_smoke.sh
#                                           # the server from its own environment (docs/gpu.md, "GPU environments")
#   ARMOR_SGLANG_URL=http://127.0.0.1:30000 ARMOR_SGLANG_MODEL=/path/to/that/model tools/gpu_smoke.sh
#                                           # attaches to a server you started (same model!)
#
# The tests in tests/rollout/sglang/test_client.py then talk to SGLang instead of the test
# double; tests that need the double's fault-injection hooks are skipped. A server you attach to
# must run without SGLANG_RETURN_ORIGINAL_LOGPROB (the log-prob test at T=0.7 fails otherwise). Env knobs:
# PYTHON (the trainer's interpreter: builds the tiny checkpoint, runs pytest; default python3),
# SGLANG_PYTHON (the server's interpreter, as rollout.sglang.python; default $PYTHON),
# SGLANG_PORT (default 30000), SGLANG_ARGS (extra launch_server flags), SMOKE_TIMEOUT (s, default 600).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SERVER_PY=${SGLANG_PYTHON:-$PY}
PORT=${SGLANG_PORT:-30000}
TIMEOUT=${SMOKE_TIMEOUT:-600}
WORK=$(mktemp -d)
SERVER_PID=""

cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

if [[ -z "${ARMOR_SGLANG_URL:-}" ]]; then
  "$SERVER_PY" -c "import sglang" 2>/dev/null || {
    echo "gpu_smoke: sglang is not importable by $SERVER_PY: set SGLANG_PYTHON to the SGLang environment's interpreter (docs/gpu.md, \"GPU environments\")" >&2
    exit 2
  }
  export ARMOR_SGLANG_MODEL="$WORK/tiny-qwen2"
  "$PY" -m armor_megatron.rollout.testing.tiny_models --out "$ARMOR_SGLANG_MODEL" --hidden-size 256 >/dev/null
  FLAGS=(--model-path "$ARMOR_SGLANG_MODEL" --host 127.0.0.1 --port "$PORT" --dtype float32
         --mem-fraction-static 0.2 --disable-cuda-graph)
  if "$SERVER_PY" -c "import torch_memory_saver" 2>/dev/null; then
    FLAGS+=(--enable-memory-saver)
  else
    export ARMOR_SGLANG_NO_MEMORY_SAVER=1
  fi
  # shellcheck disable=SC2206
  FLAGS+=(${SGLANG_ARGS:-})
  # Log-probs at the sampling temperature (SGLang's default, what the trainer recomputes): the
  # variable that turns them into temperature-1 values must not reach the server.
  setsid env -u SGLANG_RETURN_ORIGINAL_LOGPROB "$SERVER_PY" -m sglang.launch_server "${FLAGS[@]}" >"$WORK/server.log" 2>&1 &
  SERVER_PID=$!
  export ARMOR_SGLANG_URL="http://127.0.0.1:$PORT"
  echo "gpu_smoke: waiting for SGLang at $ARMOR_SGLANG_URL (log $WORK/server.log)"
  deadline=$((SECONDS + TIMEOUT))
  until curl -sf "$ARMOR_SGLANG_URL/health_generate" >/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null || (( SECONDS > deadline )); then
      echo "gpu_smoke: SGLang did not come up; log tail:" >&2; tail -n 40 "$WORK/server.log" >&2; exit 1
    fi
    sleep 2
  done
fi
: "${ARMOR_SGLANG_MODEL:?set ARMOR_SGLANG_MODEL to the model directory the server at ARMOR_SGLANG_URL serves}"

echo "gpu_smoke: running client tests against $ARMOR_SGLANG_URL"
"$PY" -m pytest -q -rs tests/rollout/sglang/test_client.py -p no:cacheprovider "$@"
