"""SLURM launch: run config + allocation -> the job's srun/torchrun commands; sweeps as job arrays.

Never imports megatron or an engine: it only plans commands and waits for engines over HTTP.
"""

from armor_megatron.launch.nodelist import NodeListError, expand_nodelist
from armor_megatron.launch.plan import EngineStep, JobPlan, LaunchOptions, LaunchPlanError, plan_job
from armor_megatron.launch.slurm_env import SlurmEnv, SlurmEnvError

__all__ = [
    "EngineStep",
    "JobPlan",
    "LaunchOptions",
    "LaunchPlanError",
    "NodeListError",
    "SlurmEnv",
    "SlurmEnvError",
    "expand_nodelist",
    "plan_job",
]
