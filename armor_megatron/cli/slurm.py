"""``armor-slurm`` (or ``python -m armor_megatron.cli.slurm``): plan, submit and start SLURM jobs from a run config.

    # inside the allocation (tools/slurm/armor.sbatch evaluates --shell):
    armor-slurm [plan] --config FILE [key=value ...] (--dry-run | --shell) [--no-plan]
    # on the login node: the sbatch command for the config's resources (run it, or print it):
    armor-slurm submit --config FILE [key=value ...] [--dry-run] [--no-plan]
    # the batch script waits for its engine steps:
    armor-slurm wait-engines --timeout 1800 [--pid PID ...] URL ...
    # the allocation's hosts where scontrol is not installed, one a line:
    armor-slurm hostnames 'node[01-02]'

Outside a SLURM job, ``plan --dry-run`` previews the job on placeholder hosts node01..nodeN.
A config path may contain ``%a``, replaced by ``SLURM_ARRAY_TASK_ID`` (job arrays from tools/sweep.py).
``plan`` and ``submit`` refuse a layout whose device-memory plan (``armor-train --plan``) exceeds
``launch.gpu_memory_gib``; ``--no-plan`` accepts it (``submit`` passes it on to the job's plan).
Exit codes: 0 ok, 1 engines failed to start, 2 bad config or allocation.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from armor_megatron.cli.common import EXIT_FAILED, EXIT_OK, OneLineArgumentParser, fail
from armor_megatron.config import load_config
from armor_megatron.errors import UserInputError
from armor_megatron.launch.health import EngineStartError, wait_for_engines
from armor_megatron.launch.memory import plan_problem
from armor_megatron.launch.nodelist import expand_nodelist
from armor_megatron.launch.plan import (
    API_KEY_ENV,
    LAUNCHERS,
    LaunchOptions,
    LaunchPlanError,
    plan_job,
    preview_allocation,
)
from armor_megatron.launch.render import render_shell, render_text
from armor_megatron.launch.sbatch import DEFAULT_LOG_DIR, TEMPLATE, sbatch_command
from armor_megatron.launch.slurm_env import SlurmEnv, SlurmEnvError

PROG = "armor-slurm"
COMMANDS = ("plan", "submit", "wait-engines", "hostnames")


def build_parser() -> OneLineArgumentParser:
    """The ``armor-slurm`` argument parser (plan, submit, start)."""
    parser = OneLineArgumentParser(prog=PROG, description="Plan, submit and start ARMOR SLURM jobs.")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the job's commands for this allocation")
    _config_args(plan)
    mode = plan.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the plan for people (the default)")
    mode.add_argument("--shell", action="store_true", help="print bash assignments for tools/slurm/armor.sbatch")

    submit = sub.add_parser("submit", help="sbatch the template with the config's resources")
    _config_args(submit)
    submit.add_argument("--dry-run", action="store_true", help="print the sbatch command instead of running it")
    submit.add_argument("--template", default=TEMPLATE, help=f"batch script (default {TEMPLATE})")
    submit.add_argument("--log-dir", default=DEFAULT_LOG_DIR, help=f"SLURM output files (default {DEFAULT_LOG_DIR})")
    submit.add_argument(
        "--signal-grace", type=int, default=120, help="seconds of warning (SIGUSR1) before the time limit"
    )
    submit.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch option, repeatable")

    wait = sub.add_parser("wait-engines", help="wait until SGLang servers are healthy")
    wait.add_argument("urls", nargs="+")
    wait.add_argument("--timeout", type=float, default=1800.0, help="seconds (default 1800)")
    wait.add_argument("--pid", type=int, action="append", default=[], help="engine step process; its exit is a failure")
    wait.add_argument(
        "--api-key",
        default=None,
        help="engines' API key (default: $ARMOR_ENGINE_API_KEY; prefer the variable: ps shows arguments)",
    )

    hosts = sub.add_parser("hostnames", help="expand a SLURM node list, one host a line (scontrol show hostnames)")
    hosts.add_argument("nodelist", help="e.g. 'node[01-02],gpu5'")
    return parser


def _config_args(parser) -> None:
    parser.add_argument("--config", required=True, help="YAML run config; %%a = SLURM_ARRAY_TASK_ID")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument(
        "--launcher", choices=LAUNCHERS, default=None, help="srun: one task per GPU (default); torchrun: one per node"
    )
    parser.add_argument(
        "--no-plan", action="store_true", help="accept a layout whose memory plan exceeds launch.gpu_memory_gib"
    )


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run ``armor-slurm`` (``plan`` when no subcommand is given); returns the exit code."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in and args_in[0] not in COMMANDS and args_in[0] not in ("-h", "--help"):
        args_in.insert(0, "plan")  # `slurm --config X --dry-run` is `slurm plan --config X --dry-run`
    args = build_parser().parse_with_overrides(args_in)
    env = os.environ if environ is None else environ
    try:
        if args.command == "plan":
            return _plan(args, env)
        if args.command == "submit":
            return _submit(args, env)
        if args.command == "hostnames":
            print("\n".join(expand_nodelist(args.nodelist)))
            return EXIT_OK
        api_key = args.api_key or env.get(API_KEY_ENV) or None
        waited = wait_for_engines(args.urls, timeout_s=args.timeout, pids=args.pid, api_key=api_key)
        print(f"{PROG}: {len(args.urls)} engine(s) healthy after {waited:.0f}s", file=sys.stderr)
        return EXIT_OK
    except UserInputError as err:
        return fail(PROG, str(err))
    except EngineStartError as err:
        return fail(PROG, str(err), EXIT_FAILED)


def _plan(args, env: Mapping[str, str]) -> int:
    preview = "SLURM_JOB_ID" not in env
    if preview and args.shell:
        raise SlurmEnvError("SLURM_JOB_ID is not set: --shell runs inside an allocation (use --dry-run to preview)")
    config_path = _array_config_path(args.config, env)
    cfg = load_config(config_path, args.overrides)
    _check_memory_plan(cfg, args.no_plan)
    slurm = preview_allocation(cfg) if preview else SlurmEnv.from_environ(env)
    options = LaunchOptions.from_environ(env, launcher=args.launcher)
    plan = plan_job(cfg, slurm, train_args=["--config", config_path, *args.overrides], options=options)
    if args.shell:
        sys.stdout.write(render_shell(plan))
    else:
        if preview:
            print("# preview outside SLURM: job id 0, host names are placeholders")
        sys.stdout.write(render_text(plan))
    return EXIT_OK


def _submit(args, env: Mapping[str, str]) -> int:
    cfg = load_config(args.config, args.overrides)
    _check_memory_plan(cfg, args.no_plan)
    options = LaunchOptions.from_environ(env, launcher=args.launcher)
    plan_job(cfg, preview_allocation(cfg), train_args=[], options=options)  # refuse a layout that cannot start
    cmd = sbatch_command(
        cfg,
        ["--config", args.config, *args.overrides, *(["--no-plan"] if args.no_plan else [])],
        launcher=options.launcher,
        template=args.template,
        log_dir=args.log_dir,
        signal_grace_s=args.signal_grace,
        extra=args.sbatch_arg,
    )
    return run_or_print(PROG, cmd, dry_run=args.dry_run, make_dirs=[args.log_dir])


def _check_memory_plan(cfg, accept: bool) -> None:
    """Refuse a layout whose memory plan does not fit its GPUs (one line), unless ``accept``."""
    problem = None if accept else plan_problem(cfg)
    if problem is not None:
        raise LaunchPlanError(f"plan: {problem}; pass --no-plan to accept it")


def _array_config_path(path: str, env: Mapping[str, str]) -> str:
    if "%a" not in path:
        return path
    task = env.get("SLURM_ARRAY_TASK_ID")
    if task is None:
        raise SlurmEnvError(f"config path {path!r} uses %a but SLURM_ARRAY_TASK_ID is not set (not a job array task)")
    return path.replace("%a", task)


def run_or_print(prog: str, cmd: list[str], *, dry_run: bool, make_dirs: Sequence[str] = ()) -> int:
    """Print ``cmd`` (dry run) or create ``make_dirs`` and run it; a missing sbatch is one clear line."""
    if dry_run:
        print(shlex.join(cmd))
        return EXIT_OK
    if shutil.which(cmd[0]) is None:
        return fail(
            prog, f"{cmd[0]} not found on PATH: run this on a SLURM login node, or add --dry-run to print the command"
        )
    for d in make_dirs:
        os.makedirs(d, exist_ok=True)  # SLURM does not create the directory of --output
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
