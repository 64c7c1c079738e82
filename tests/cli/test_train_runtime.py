"""``armor-train`` at run time: bad input found by the ranks is one line and exit 2, also under the
torchrun relaunch; a lone SLURM task that needs more ranks says how to launch."""

import os
import subprocess
import sys

import pytest

from armor_megatron.cli.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def test_a_single_slurm_task_needing_more_ranks_says_how_to_launch(monkeypatch, capsys, tmp_path):
    for var in ("RANK", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert main(["--config", TINY, "--no-files", f"checkpoint.dir={tmp_path}/ckpt"]) == 2  # tiny_cpu: tp=2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs 2 processes" in err
    assert "srun --ntasks-per-node=2 --cpus-per-task=" in err and "tools/slurm/armor.sbatch" in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_input_found_by_the_ranks_is_one_line_under_the_relaunch(tmp_path):
    def run(*flags):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "armor_megatron.cli.train",
                "--config",
                TINY,
                *flags,
                f"model.path={tmp_path}/nowhere",
                f"checkpoint.dir={tmp_path}/ckpt",
                f"logging.dir={tmp_path}/runs",
            ],
            env=dict(os.environ, PYTHONPATH=ROOT),
            capture_output=True,
            text=True,
            timeout=240,
        )

    # --no-files: nothing is looked at before the relaunch, so the ranks find it
    proc = run("--no-files")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == f"armor-train: error: {tmp_path}/nowhere: not a directory\n"
    # by default the files are checked before any process starts
    proc = run()
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("armor-train: error: config: model.path: ") and "nowhere" in proc.stderr
