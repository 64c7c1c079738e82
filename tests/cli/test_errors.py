"""Exit codes of the commands: only a ``UserInputError`` is bad input (exit 2, one line); every other
exception is a bug and keeps its traceback and a non-2 exit code."""

import os
import subprocess
import sys
import textwrap

import pytest

from armor_megatron.errors import UserInputError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")

# armor-train with its training replaced by a body that raises what the trainer's code raises
# (the same exception types, from the package's own checks); exit code and stderr are what a user sees
RUN = textwrap.dedent(
    """
    import sys
    import armor_megatron.trainer.run as run
    from armor_megatron.cli.train import main

    def train(cfg, resume):
        exec(sys.argv[1])

    run.train = train
    sys.exit(main(["--config", sys.argv[2], "--no-files", "parallelism.tp=1", "checkpoint.dir=" + sys.argv[3]]))
    """
)


def _train_raising(body: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", RUN, body, TINY, str(tmp_path / "ckpt")],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # armor-train processes (each starts an interpreter importing torch)
@pytest.mark.timeout(150)
def test_a_config_error_is_one_line_and_an_internal_value_error_keeps_its_traceback(tmp_path):
    # bad input found while training: a checkpoint of another model layout, a dataset row
    proc = _train_raising(
        "from armor_megatron.config import ConfigError; raise ConfigError('checkpoint.resume', 'x: not a checkpoint')",
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == "armor-train: error: checkpoint.resume: x: not a checkpoint\n"
    # a bug: an internal shape check of the rollout batch (a ValueError, not a UserInputError)
    proc = _train_raising(
        "import torch; from armor_megatron.data.batch import RolloutBatch; "
        "b = RolloutBatch(); b['a'] = torch.zeros(2); b['b'] = torch.zeros(3)",
        tmp_path,
    )
    assert proc.returncode not in (0, 2), proc.stderr[-2000:]
    assert "Traceback (most recent call last)" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.rstrip().splitlines()[-1] == "ValueError: field 'b' has 3 rows, the batch has 2"


def test_the_input_error_types_of_the_package_are_user_input_errors():
    from armor_megatron.config import ConfigError
    from armor_megatron.convert.errors import CheckpointError
    from armor_megatron.launch.nodelist import NodeListError
    from armor_megatron.launch.plan import LaunchPlanError
    from armor_megatron.launch.slurm_env import SlurmEnvError
    from armor_megatron.launch.sweep import SweepError
    from armor_megatron.megatron.checkpoint_manifest import DamagedCheckpointError
    from armor_megatron.models.arch import ParallelismError, UnsupportedModelError
    from armor_megatron.rewards.spec import VerifierSpecError
    from armor_megatron.trainer.overlap import LaggingBatchError

    for kind in (ConfigError, CheckpointError, NodeListError, LaunchPlanError, SlurmEnvError, SweepError):
        assert issubclass(kind, UserInputError), kind
    for kind in (DamagedCheckpointError, ParallelismError, UnsupportedModelError, VerifierSpecError):
        assert issubclass(kind, UserInputError), kind
    # the overlap's lag check guards the trainer's own bookkeeping: a bug, never bad input
    assert not issubclass(LaggingBatchError, UserInputError)


def test_a_missing_dataset_is_bad_input_and_still_a_file_not_found_error(tmp_path):
    from armor_megatron.data.prompts import read_rows

    with pytest.raises(UserInputError) as err:
        read_rows(str(tmp_path / "nope.jsonl"))
    assert isinstance(err.value, FileNotFoundError) and str(err.value) == f"dataset not found: {tmp_path}/nope.jsonl"
