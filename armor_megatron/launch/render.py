"""Print a JobPlan: as shell assignments for the batch script to ``eval``, or as a readable dry run.

Every command is rendered with ``shlex.join``, so the string the batch script evaluates and the
line a dry run prints are the same text.
"""

from __future__ import annotations

import shlex

from armor_megatron.launch.plan import API_KEY_ENV, JobPlan


def render_shell(plan: JobPlan) -> str:
    """Bash assignments (``eval "$(...)"`` in tools/slurm/armor.sbatch); defaults never override the user's env."""
    q = shlex.quote
    lines = [
        f"ARMOR_RUN_NAME={q(plan.run_name)}",
        f"ARMOR_LAUNCHER={q(plan.launcher)}",
        f"ARMOR_REQUEUE_EXIT_CODE={plan.requeue_exit_code}",
        f"export MASTER_ADDR={q(plan.master_addr)}",
        f"export MASTER_PORT={plan.master_port}",
    ]
    lines += [f'[ -n "${{{k}:-}}" ] || {k}={q(v)}; export {k}' for k, v in plan.env.items()]
    lines.append("ARMOR_ENGINE_URLS=(" + " ".join(q(u) for u in plan.engine_urls) + ")")
    lines.append("ARMOR_ENGINE_CMDS=(" + " ".join(q(shlex.join(e.command)) for e in plan.engines) + ")")
    if plan.engine_api_key:  # exported: srun hands it to the engine and trainer steps' environment, never their argv
        lines.append(f"export {API_KEY_ENV}={q(plan.engine_api_key)}")
    lines.append(f"ARMOR_TRAINER_CMD={q(shlex.join(plan.trainer_command))}")
    return "\n".join(lines) + "\n"


def render_text(plan: JobPlan) -> str:
    """The job as a person reads it: layout, then the environment and commands in the order they run."""
    out = [
        f"# run {plan.run_name}, SLURM job {plan.job_id}: {len(plan.nodes)} node(s) {' '.join(plan.nodes)}",
        f"# trainer: {len(plan.trainer_nodes)} node(s) x {plan.trainer_procs_per_node} process(es) = {plan.world_size} ranks"
        f" via {plan.launcher}; requeue exit code {plan.requeue_exit_code}",
    ]
    for e in plan.engines:
        out.append(f"# engine {e.index} ({e.group}): {e.node} GPUs {','.join(map(str, e.gpus))} -> {e.url}")
    out += [f"export MASTER_ADDR={plan.master_addr}", f"export MASTER_PORT={plan.master_port}"]
    out += [f"export {k}={shlex.quote(v)}" for k, v in plan.env.items()]
    if plan.engine_api_key:
        out.append(f"export {API_KEY_ENV}=<redacted>  # from rollout.sglang.api_key")
    out += [shlex.join(e.command) + " &" for e in plan.engines]
    out.append(shlex.join(plan.trainer_command))  # holds no secret: the plan passes those by environment
    return "\n".join(out) + "\n"
