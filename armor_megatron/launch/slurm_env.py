"""What a SLURM allocation looks like from inside its batch script, read from the environment.

Only the variables the launcher needs are read; a missing or malformed one raises
``SlurmEnvError`` naming it. ``ARMOR_NODES`` (hosts separated by white space, as printed by
``scontrol show hostnames``) wins over expanding ``SLURM_JOB_NODELIST`` here, so the batch
script can use SLURM's own expansion when ``scontrol`` is installed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from armor_megatron.errors import UserInputError
from armor_megatron.launch.nodelist import NodeListError, expand_nodelist


class SlurmEnvError(UserInputError):
    """The environment does not describe a usable SLURM allocation."""


@dataclasses.dataclass(frozen=True)
class SlurmEnv:
    """The SLURM allocation this process runs in: job id, nodes, GPUs per node, job name."""

    job_id: str
    nodes: tuple[str, ...]
    gpus_per_node: int | None = None  # None when SLURM did not say (no GPUs requested)
    job_name: str = ""
    array_task_id: int | None = None
    restart_count: int = 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> SlurmEnv:
        """Read the allocation from SLURM's environment variables; outside an allocation raises SlurmEnvError."""
        job_id = env.get("SLURM_JOB_ID", "")
        if not job_id:
            raise SlurmEnvError(
                "SLURM_JOB_ID is not set: run inside an sbatch/salloc allocation (or set fake SLURM_* variables)"
            )
        if not job_id.isdigit():
            raise SlurmEnvError(f"SLURM_JOB_ID={job_id!r} is not a number")
        nodes = _nodes(env)
        count_var = next((v for v in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES") if v in env), None)
        if count_var and _int(env, count_var) != len(nodes):
            raise SlurmEnvError(
                f"{count_var}={env[count_var]} but the node list names {len(nodes)} hosts: {' '.join(nodes)}"
            )
        array = env.get("SLURM_ARRAY_TASK_ID")
        return cls(
            job_id=job_id,
            nodes=tuple(nodes),
            gpus_per_node=_gpus_per_node(env),
            job_name=env.get("SLURM_JOB_NAME", ""),
            array_task_id=None if array is None else _int(env, "SLURM_ARRAY_TASK_ID"),
            restart_count=_int(env, "SLURM_RESTART_COUNT") if "SLURM_RESTART_COUNT" in env else 0,
        )


def _nodes(env: Mapping[str, str]) -> list[str]:
    listed = env.get("ARMOR_NODES", "").split()
    if listed:
        return listed
    compressed = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not compressed:
        raise SlurmEnvError("SLURM_JOB_NODELIST is not set: cannot tell which nodes the job holds")
    try:
        return expand_nodelist(compressed)
    except NodeListError as err:
        raise SlurmEnvError(f"SLURM_JOB_NODELIST: {err}") from None


def _gpus_per_node(env: Mapping[str, str]) -> int | None:
    """``SLURM_GPUS_ON_NODE`` ("8"), else ``SLURM_GPUS_PER_NODE`` ("8" or "h100:8")."""
    if "SLURM_GPUS_ON_NODE" in env:
        return _int(env, "SLURM_GPUS_ON_NODE")
    raw = env.get("SLURM_GPUS_PER_NODE")
    if raw is None:
        return None
    match = re.fullmatch(r"(?:[\w-]+:)?(\d+)", raw.strip())
    if not match:
        raise SlurmEnvError(f"SLURM_GPUS_PER_NODE={raw!r} is not a GPU count such as '8' or 'h100:8'")
    return int(match.group(1))


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise SlurmEnvError(f"{name}={raw!r} is not an integer") from None
