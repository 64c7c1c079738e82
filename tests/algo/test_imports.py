"""algo/ and data/ are pure torch: importing them pulls in no megatron, engine or GPU-only module."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.timeout(60)
def test_algo_and_data_import_nothing_heavy():
    code = (
        "import sys, armor_megatron.algo, armor_megatron.data\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('megatron', 'sglang', 'transformer_engine', 'apex', 'transformers'))\n"
        "bad += [m for m in sys.modules if m.startswith(('armor_megatron.megatron', 'armor_megatron.rollout'))]\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
