"""The ``sbatch`` command line that asks SLURM for exactly the resources a run config describes.

    sbatch --job-name=NAME --nodes=N --gpus-per-node=G --exclusive --time=T [--partition=P] [--account=A]
           --requeue --signal=B:USR1@GRACE --open-mode=append --output=LOG_DIR/%x-%j.out
           [--array=0-K%M] [extra ...] tools/slurm/armor.sbatch [--launcher L] --config FILE [overrides ...]

``--signal=B:USR1@GRACE`` delivers SIGUSR1 to the batch shell GRACE seconds before the time limit;
the template forwards it to the trainer, which checkpoints and exits with
``launch.requeue_exit_code``, and the template then runs ``scontrol requeue``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from armor_megatron.config.schema import RunConfig

TEMPLATE = os.path.join("tools", "slurm", "armor.sbatch")
DEFAULT_LOG_DIR = os.path.join("runs", "slurm")


def sbatch_command(
    cfg: RunConfig,
    template_args: Sequence[str],
    *,
    launcher: str = "srun",
    template: str = TEMPLATE,
    log_dir: str = DEFAULT_LOG_DIR,
    signal_grace_s: int = 120,
    array: str | None = None,
    job_name: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``template_args`` are what the template passes to the trainer: ``--config FILE`` and overrides."""
    launch = cfg.launch
    log_name = "%x-%A_%a.out" if array else "%x-%j.out"
    cmd = ["sbatch", f"--job-name={job_name or cfg.name}", f"--nodes={launch.nodes}"]
    if launch.gpus_per_node:
        cmd.append(f"--gpus-per-node={launch.gpus_per_node}")
    cmd += ["--exclusive", f"--time={launch.time}"]
    if launch.partition:
        cmd.append(f"--partition={launch.partition}")
    if launch.account:
        cmd.append(f"--account={launch.account}")
    cmd += [
        "--requeue",
        f"--signal=B:USR1@{signal_grace_s}",
        # the same grace inside the job: torchrun's agent waits that long for ranks that are saving
        f"--export=ALL,ARMOR_SIGNAL_GRACE={signal_grace_s}",
        "--open-mode=append",  # a requeued run appends to the same log
        f"--output={os.path.join(log_dir, log_name)}",
    ]
    if array:
        cmd.append(f"--array={array}")
    cmd += list(extra)
    cmd.append(template)
    if launcher != "srun":
        cmd.append(f"--launcher={launcher}")
    return cmd + list(template_args)
