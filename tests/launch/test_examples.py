"""The example recipes: dry runs print valid plans; a real run converts once, then calls sbatch."""

import os
import shlex
import subprocess
import sys

import pytest

from tests.launch.conftest import ROOT

EXAMPLES = {
    # folder: (nodes in the sbatch line, trainer srun prefix of the plan)
    "qwen25_math_7b_dapo_armor": (
        1,
        "srun --nodes=1 --ntasks=8 --ntasks-per-node=8 --nodelist=node01 --kill-on-bad-exit=1 --overlap",
    ),
    "qwen3_8b_base_two_stage": (
        2,
        "srun --nodes=2 --ntasks=16 --ntasks-per-node=8 --nodelist=node01,node02 --kill-on-bad-exit=1 --overlap",
    ),
    "llama3_70b_armor": (
        8,
        "srun --nodes=4 --ntasks=32 --ntasks-per-node=8 --nodelist=node01,node02,node03,node04 --kill-on-bad-exit=1 /",
    ),
    "qwen3_30b_a3b_moe_armor": (
        2,
        "srun --nodes=2 --ntasks=16 --ntasks-per-node=8 --nodelist=node01,node02 --kill-on-bad-exit=1 --overlap",
    ),
}
STUB = """#!/bin/bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
if [[ $(basename "$0") == armor-convert ]]; then mkdir -p "$3"; fi
"""


def _env(tmp_path, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("armor-convert", "sbatch"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), "/usr/bin", "/bin"]),
        "HOME": str(tmp_path),
        "ARMOR_PYTHON": sys.executable,
        "STUB_LOG": str(tmp_path / "stub.log"),
        "HF_DIR": "/models/hf",
        "MCORE_DIR": str(tmp_path / "mcore"),
    }
    env.update(extra)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_dry_run_prints_conversion_sbatch_and_plan(tmp_path, name):
    nodes, trainer_prefix = EXAMPLES[name]
    script = os.path.join(ROOT, "examples", name, "run.sh")
    out = subprocess.run(
        ["bash", script],
        env=_env(tmp_path, DRY_RUN="1"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[-3:] == ["hf-to-mcore", "/models/hf", str(tmp_path / "mcore")]
    sbatch = shlex.split(lines[1])
    assert sbatch[0] == "sbatch" and f"--nodes={nodes}" in sbatch and "tools/slurm/armor.sbatch" in sbatch
    assert sbatch[sbatch.index("--config") + 1] == f"configs/{name}.yaml"
    assert "model.path=/models/hf" in sbatch and f"model.mcore_path={tmp_path / 'mcore'}" in sbatch
    assert lines[-1].startswith(trainer_prefix)
    assert not (tmp_path / "stub.log").exists()  # nothing ran


@pytest.mark.slow
def test_example_run_converts_once_then_submits(tmp_path):
    script = os.path.join(ROOT, "examples", "qwen25_math_7b_dapo_armor", "run.sh")
    env = _env(tmp_path)
    for _ in range(2):
        out = subprocess.run(
            ["bash", script, "algorithm.alpha=0.875"], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
    calls = (tmp_path / "stub.log").read_text().splitlines()
    assert calls[0] == f"armor-convert hf-to-mcore /models/hf {tmp_path / 'mcore'}"
    assert [c.split()[0] for c in calls] == ["armor-convert", "sbatch", "sbatch"]  # the second run skips conversion
    assert calls[1].endswith(f"model.mcore_path={tmp_path / 'mcore'} algorithm.alpha=0.875")


@pytest.mark.slow
def test_example_refuses_a_bad_override_before_converting(tmp_path):
    script = os.path.join(ROOT, "examples", "qwen25_math_7b_dapo_armor", "run.sh")
    out = subprocess.run(
        ["bash", script, "algorithm.alpha=7"], env=_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "algorithm.alpha: 7.0 is out of range" in out.stderr
    assert not (tmp_path / "stub.log").exists()


@pytest.mark.slow
@pytest.mark.parametrize("dry_run", ["0", "1"])
def test_example_refuses_a_layout_over_the_gpu_memory_in_one_line(tmp_path, dry_run):
    script = os.path.join(ROOT, "examples", "qwen25_math_7b_dapo_armor", "run.sh")
    env = _env(tmp_path, DRY_RUN=dry_run)
    out = subprocess.run(["bash", script, "train.recompute=none"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1
    assert "needs 86.7 GiB per GPU in phase 'update'" in out.stderr and "pass --no-plan" in out.stderr
    assert not (tmp_path / "stub.log").exists()  # neither converted nor submitted
    accepted = subprocess.run(
        ["bash", script, "train.recompute=none", "--no-plan"], env=env, capture_output=True, text=True, timeout=120
    )
    assert accepted.returncode == 0, accepted.stderr
