#!/usr/bin/env bash
# Fetch the wheels that tools/gpu_check.sh installs on a GPU machine that has no package index.
#
#   tools/gpu_wheels.sh [DIR]        # default .whl (at the repository root)
#
# Run it where pip reaches the index, then copy DIR to the GPU machine beside the repository. It
# downloads, for CPython 3.12 on x86-64 manylinux (a CUDA image with Python 3.12, torch and
# transformers), the pinned wheels below WITHOUT their dependencies: the packages such an image
# usually lacks. The rest of setup.py's install_requires (torch, numpy, psutil, pyyaml, pyarrow,
# safetensors, xxhash, transformers; sympy for latex2sympy2_extended; packaging for
# megatron-core) must already be installed there. About 3 MB in all.
# A DIR inside the repository is added to its info/exclude, so git ignores it.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY=${PYTHON:-python3}
WHEELS=(
  megatron-core==0.16.1           # the version the CPU tests use; a 2.6 MB cp312 manylinux wheel
  math-verify==0.9.0              # the math verifier (rewards/math_equivalence.py)
  latex2sympy2_extended==1.11.0   # math-verify's pin
  antlr4-python3-runtime==4.13.2  # latex2sympy2_extended's parser runtime (<=4.13.2)
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
mkdir -p "$DEST"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]/#/--platform=}" -d "$DEST" "${WHEELS[@]}"
if [[ "$DEST" != /* ]] && exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then
  entry="/${DEST#./}"; entry="${entry%/}/"
  mkdir -p "$(dirname "$exclude")"
  grep -qxF "$entry" "$exclude" 2>/dev/null || echo "$entry" >>"$exclude"
fi
ls -l "$DEST"
du -sh "$DEST"
