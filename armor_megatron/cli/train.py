"""``armor-train --config FILE [section.key=value ...] [--check] [--resume auto|none|PATH]``.

Inside a distributed launcher (torchrun, srun) every process runs one rank of the job. Started
by hand with more than one rank needed (CPU runs: tp·pp·cp processes; one GPU node:
``launch.gpus_per_node``), it re-launches itself under ``torchrun --standalone``.
Exit codes: 0 done, 1 failed, 2 bad input, ``launch.requeue_exit_code`` (85) preempted after a
checkpoint, so ``sbatch --requeue`` can restart it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from armor_megatron.cli.common import EXIT_FAILED, EXIT_OK, OneLineArgumentParser, fail, quiet_third_party_warnings
from armor_megatron.config import ConfigError, load_config, to_dict

PROG = "armor-train"
LAUNCHER_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")


def build_parser() -> OneLineArgumentParser:
    parser = OneLineArgumentParser(prog=PROG, description="Run ARMOR RL post-training from a YAML config.")
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted config overrides")
    parser.add_argument("--check", action="store_true", help="validate, print the resolved config and exit")
    parser.add_argument("--resume", default=None, help="auto | none | checkpoint path (default: checkpoint.resume)")
    return parser


def processes_needed(cfg) -> int:
    par = cfg.parallelism
    if cfg.launch.gpus_per_node == 0:
        return par.tp * par.pp * par.cp
    return cfg.launch.gpus_per_node - cfg.launch.engine_gpus


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return fail(PROG, f"config: {err}")
    if args.check:
        yaml.safe_dump(to_dict(cfg), sys.stdout, sort_keys=False)
        print(f"{PROG}: config OK ({args.config})", file=sys.stderr)
        return EXIT_OK
    nprocs = processes_needed(cfg)
    if nprocs > 1 and not any(v in os.environ for v in LAUNCHER_VARS):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nprocs}",
            "-m",
            "armor_megatron.cli.train",
            *argv,
        ]
        return subprocess.call(cmd)
    return _train(cfg, args.resume)


def _train(cfg, resume) -> int:
    quiet_third_party_warnings()
    from armor_megatron.trainer.loop import Preempted
    from armor_megatron.trainer.run import train

    try:
        train(cfg, resume)
    except Preempted as why:
        print(f"{PROG}: preempted: {why}; exiting {cfg.launch.requeue_exit_code} for requeue", file=sys.stderr)
        return cfg.launch.requeue_exit_code
    except (ConfigError, FileNotFoundError, ValueError) as err:
        return fail(PROG, str(err).splitlines()[0] if str(err) else type(err).__name__, EXIT_FAILED)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
