"""``armor-train --config FILE [section.key=value ...] [--check] [--print-config] [--plan] [--no-plan] [--no-files] [--resume auto|none|force|PATH]``.

Flags and overrides go in any order (the last override of a key wins). ``--check`` validates what
needs no GPU and prints one line (what the job's machines need, then ``config OK``);
``--print-config`` also prints the resolved config as YAML on stdout.

``armor-train --explain KEY`` prints one config key's entry of the reference (``docs/config.md``):
its type, default, accepted values and meaning; a config error names its key the same way.

``--plan`` prints the memory of one GPU per pipeline stage and per phase of a step
(``launch.memory``) and exits 2 with one line when the layout does not fit ``launch.gpu_memory_gib``;
with launched SGLang engines it then prints the step-time model of ``launch.step_time``: generation,
training and weight-sync seconds, the step with ``rollout.overlap`` off and one_step, and the
engine/trainer GPU split that balances them.
``--check`` refuses such a layout too (GPU runs whose architecture is known), unless ``--no-plan``.

Inside a distributed launcher (torchrun, srun) every process runs one rank of the job. Started
by hand with more than one rank needed (CPU runs: tp·pp processes; one GPU node:
``launch.gpus_per_node``), it re-launches itself under ``torchrun --standalone``.
Exit codes: 0 done, 1 failed (a bug: the traceback is printed), 2 bad input (a
``armor_megatron.errors.UserInputError``, also found at run time: a missing file, a damaged
checkpoint; one line), ``launch.requeue_exit_code`` (85) preempted after a checkpoint, so
``sbatch --requeue`` can restart it, 130 interrupted by Ctrl-C (SIGINT: no checkpoint, the last
complete one stays; one line, no traceback). SIGTERM/SIGUSR1 (SLURM's preemption and time-limit
warnings) make the ranks checkpoint and exit with the requeue code, whether they reach the
relaunching process, the ranks, or the whole process group (`relaunch`).
"""

from __future__ import annotations

import math
import os
import sys

import yaml

from armor_megatron.cli import relaunch
from armor_megatron.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    OneLineArgumentParser,
    fail,
    quiet_third_party_warnings,
)
from armor_megatron.config import ConfigError, load_config, needs, to_dict
from armor_megatron.config.files import check_files
from armor_megatron.errors import UserInputError
from armor_megatron.launch.memory import plan_problem
from armor_megatron.launch.plan import API_KEY_ENV, LaunchPlanError, without_secrets
from armor_megatron.trainer import preemption

PROG = "armor-train"
EXIT_INTERRUPTED = 128 + 2  # SIGINT, as a shell reports a process it ended
LAUNCHER_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")


def build_parser() -> OneLineArgumentParser:
    """The ``armor-train`` argument parser."""
    parser = OneLineArgumentParser(prog=PROG, description="Run ARMOR RL post-training from a YAML config.")
    parser.add_argument("--config", help="YAML run config (see configs/); required unless --explain")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted config overrides")
    parser.add_argument(
        "--check", action="store_true", help="validate everything that needs no GPU, print one line and exit"
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="--check, and print the resolved config (every key, defaults filled in, secrets redacted) as YAML",
    )
    parser.add_argument(
        "--resume", default=None, help="auto | none | force | checkpoint path (default: checkpoint.resume)"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the device memory per GPU of the layout and the step-time model (off vs one_step, the suggested "
        "engine/trainer split), and exit; exit 2 when it does not fit launch.gpu_memory_gib",
    )
    parser.add_argument(
        "--no-plan",
        action="store_true",
        help="--check: accept a layout whose memory plan exceeds launch.gpu_memory_gib",
    )
    parser.add_argument(
        "--explain", metavar="KEY", help="print one config key's type, default, accepted values and meaning, and exit"
    )
    parser.add_argument(
        "--no-files",
        action="store_true",
        help="skip the checks of files, datasets, optional packages and checkpoint ownership on this machine "
        "(e.g. --check on a machine without the model)",
    )
    return parser


def processes_needed(cfg) -> int:
    """Ranks of the job.

    On CPU the fewest the layout admits (tp·pp, also divisible by the expert layout ep·pp: expert
    parallelism takes its ranks from data parallelism), on a GPU node its trainer GPUs.
    """
    par = cfg.parallelism
    if cfg.launch.gpus_per_node == 0:
        return math.lcm(par.tp * par.pp, par.ep * par.pp)
    return cfg.launch.gpus_per_node - cfg.launch.engine_gpus


def main(argv: list[str] | None = None) -> int:
    """Run ``armor-train``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_with_overrides(argv)
    if args.explain is not None:
        return explain(args.explain)
    if args.config is None:
        parser.error("the following arguments are required: --config")
    args.check = args.check or args.print_config
    warnings: list[str] = []
    try:
        cfg = load_config(args.config, args.overrides)
        if args.resume:
            cfg.checkpoint.resume = args.resume
        # the config's own problems first (the memory plan is one), then what it names on this machine
        problem = None if args.no_plan or not args.check else plan_problem(cfg)
        if problem is None and not (args.no_files or args.plan):
            # before any process starts: a missing file fails in a second, not after the build
            warnings = check_files(cfg)
    except ConfigError as err:
        return fail(PROG, f"config: {err}{_explain_hint(err.key)}")
    for warning in warnings if _says_warnings() else []:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    if args.plan:
        return plan(cfg)
    if problem is not None:
        return fail(PROG, f"plan: {problem}; pass --no-plan to accept it")
    if args.print_config:
        yaml.safe_dump(to_dict(cfg), sys.stdout, sort_keys=False)
    if args.check:
        if needed := needs.describe(cfg):
            print(f"{PROG}: {needed}", file=sys.stderr)
        print(f"{PROG}: config OK ({args.config}); every key: docs/config.md, {PROG} --explain KEY", file=sys.stderr)
        return EXIT_OK
    nprocs = processes_needed(cfg)
    if nprocs > 1 and _inside_one_slurm_task():
        return fail(
            PROG,
            f"running as a single SLURM task, but this config needs {nprocs} processes: start it with "
            f"`srun --ntasks-per-node={nprocs} --cpus-per-task=<cores per GPU> python -m armor_megatron.cli.train ...` "
            "(one task per GPU) or submit tools/slurm/armor.sbatch",
        )
    if nprocs > 1 and not any(v in os.environ for v in LAUNCHER_VARS):
        try:
            argv = without_secrets(argv)  # the ranks' command lines show in `ps`; the key goes by environment
        except LaunchPlanError as err:
            return fail(PROG, str(err))
        key, before = cfg.rollout.sglang.api_key, os.environ.get(API_KEY_ENV)
        if key:
            os.environ[API_KEY_ENV] = key  # for the ranks only: restored when they are done
        try:
            return relaunch_under_torchrun(argv, nprocs, cfg.launch.requeue_exit_code)
        finally:
            if key and before is None:
                del os.environ[API_KEY_ENV]
            elif key and before is not None:
                os.environ[API_KEY_ENV] = before
    return _train(cfg, args.resume)


def explain(key: str) -> int:
    """``--explain KEY``: the key's reference entry on stdout; one line and exit 2 for an unknown key."""
    from armor_megatron.config.reference import explain as entry

    try:
        print(entry(key))
    except ConfigError as err:
        return fail(PROG, f"explain: {err}")
    return EXIT_OK


def _explain_hint(key: str) -> str:
    """`` (armor-train --explain KEY)`` after an error that names a config key."""
    from armor_megatron.config.reference import schema_key

    return f" ({PROG} --explain {key})" if key and schema_key(key) else ""


def plan(cfg) -> int:
    """``--plan``: the memory table of `launch.memory`; one line and exit 2 when a GPU overflows."""
    from armor_megatron.config.validate import model_arch_of
    from armor_megatron.launch.memory import plan_memory
    from armor_megatron.launch.step_time import plan_step_time

    arch = model_arch_of(cfg)
    if arch is None:
        return fail(PROG, "plan: no model architecture (set model.arch or a model.path with config.json)")
    memory = plan_memory(cfg, arch)
    print(memory.table())
    steps = plan_step_time(cfg, arch)
    if steps is not None:
        print("\n" + steps.table())
    problem = memory.problem()
    return EXIT_OK if problem is None else fail(PROG, f"plan: {problem}")


def _says_warnings() -> bool:
    """Whether this process prints the checks' warnings: the first rank of a launcher, once per job.

    Not a rank this command re-launched (its parent said them) nor any rank but the first.
    """
    first = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    return first and relaunch.RankReport.from_env() is None


def _inside_one_slurm_task() -> bool:
    """Inside a batch script (or ``srun -n1``): SLURM names this process task 0 of a 1-task step."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS"))
    return "SLURM_PROCID" in os.environ and "RANK" not in os.environ and tasks in (None, "1")


def _train(cfg, resume) -> int:
    try:
        return _train_ranks(cfg, resume)
    except KeyboardInterrupt:  # Ctrl-C: no checkpoint (SIGTERM/SIGUSR1 save one)
        if relaunch.RankReport.from_env() is not None:
            return EXIT_INTERRUPTED  # the relaunching parent says it once
        return fail(
            PROG, "interrupted by SIGINT: stopped without a checkpoint (the last complete one stays)", EXIT_INTERRUPTED
        )


def _train_ranks(cfg, resume) -> int:
    """`_train` but for Ctrl-C, which may also arrive while a rank handles another error (below)."""
    relaunch.die_with_launcher()
    quiet_third_party_warnings()
    preemption.record_early_signals()
    from armor_megatron.trainer.preemption import Preempted
    from armor_megatron.trainer.run import train

    try:
        train(cfg, resume)
    except Preempted as why:
        report = relaunch.RankReport.from_env()
        if report is not None:
            report.preempted()
        if os.environ.get("RANK", "0") == "0":
            print(f"{PROG}: preempted: {why}; exiting {cfg.launch.requeue_exit_code} for requeue", file=sys.stderr)
        return cfg.launch.requeue_exit_code
    except UserInputError as err:  # anything else is a bug: it keeps its traceback and exits 1
        line = str(err).splitlines()[0] if str(err) else type(err).__name__
        report = relaunch.RankReport.from_env()
        if report is None:
            return fail(PROG, line)
        report.failed(line)  # the relaunching parent prints the first failing rank's line
        return EXIT_BAD_INPUT
    except Exception:
        report = relaunch.RankReport.from_env()
        if report is not None:
            # a peer that left on Ctrl-C breaks this rank's collective; the launcher sent this rank the
            # same SIGINT, which raises KeyboardInterrupt in this wait (a consequence, not a bug)
            relaunch.wait_for_stop_signal()
            if report.others_failed():
                return EXIT_FAILED  # a consequence (e.g. a collective's peer left): that rank's line says why
        raise
    return EXIT_OK


def relaunch_under_torchrun(argv: list[str], nprocs: int, requeue_code: int) -> int:
    """Run ``nprocs`` ranks of this command under torchrun's agent, in this process.

    SIGTERM and SIGUSR1 go to the ranks (which checkpoint), the exit code is the requeue code when
    they did, and a rank's bad-input line is printed once.
    """
    result = relaunch.run_ranks(
        ["--standalone", f"--nproc-per-node={nprocs}", "-m", "armor_megatron.cli.train", *argv],
        signals=preemption.SIGNALS,
    )
    if result.preempted:
        return requeue_code
    if result.code == EXIT_OK:
        return EXIT_OK
    if result.interrupted:
        return fail(PROG, f"{result.summary}: stopped without a checkpoint (the last complete one stays)", result.code)
    if result.line is not None:
        return fail(PROG, result.line)
    return fail(PROG, result.summary, EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
