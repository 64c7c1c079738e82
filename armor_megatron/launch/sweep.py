r"""Scale-out sweeps: a grid over config keys -> one resolved config per SLURM array task.

    python tools/sweep.py --config configs/qwen25_math_7b_dapo_armor.yaml --out sweeps/alpha-tau \
        --grid alpha=0.875,0.9375 --grid tau=80,160 --grid seed=1,2 --max-parallel 4

writes ``sweeps/alpha-tau/configs/{0..7}.yaml`` (every config validated by ``load_config``, and
read back), ``manifest.json`` (runs, their grid values, the sbatch command) and prints
``sbatch --array=0-7%4 ... tools/slurm/armor.sbatch --config sweeps/alpha-tau/configs/%a.yaml``.
``--dry-run`` writes nothing and prints the runs and the command; ``--submit`` also runs sbatch.

Grid keys are dotted config keys, or the short names alpha (algorithm.alpha), tau
(reference.tau), G (rollout.group_size) and seed (train.seed). Values are YAML scalars, split on
commas (``--grid-file`` takes a YAML mapping of key -> list for anything richer). Runs are the
product of the value lists, the first key varying slowest; run ``i`` is named
``<config name>-<label><value>...`` (e.g. ``qwen25-math-7b-dapo-armor-alpha0.875-tau160``), and its
checkpoints and logs go to ``<checkpoint.dir>/<name>`` and ``<logging.dir>/<name>``.
All runs of one array share the same ``launch`` section (one resource request).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from armor_megatron.config import ConfigError, RunConfig, load_config, to_dict
from armor_megatron.config.load import config_tree, parse_override, safe_load_yaml
from armor_megatron.errors import UserInputError
from armor_megatron.launch.plan import Launcher, LaunchOptions, LaunchPlanError, plan_job, preview_allocation
from armor_megatron.launch.sbatch import DEFAULT_LOG_DIR, TEMPLATE, sbatch_command

ALIASES = {"alpha": "algorithm.alpha", "tau": "reference.tau", "G": "rollout.group_size", "seed": "train.seed"}
_RESERVED = ("name", "checkpoint.dir", "logging.dir")


class SweepError(UserInputError):
    """A grid that cannot become a job array; the message names the key."""


@dataclasses.dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its index, name, grid values and the overrides that make its config."""

    index: int
    name: str
    values: dict[str, Any]  # dotted key -> grid value
    overrides: tuple[str, ...]  # everything applied on top of the base config, in order
    config: RunConfig


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A resolved sweep: the base config, output directory, grid and runs."""

    base_config: str
    out_dir: str
    grid: dict[str, list]
    fixed_overrides: tuple[str, ...]
    runs: tuple[SweepRun, ...]
    sbatch: tuple[str, ...]

    def config_path(self, index: int | str) -> str:
        """Where run ``index``'s config is written."""
        return os.path.join(self.out_dir, "configs", f"{index}.yaml")


def parse_grid(items: Sequence[str]) -> dict[str, list]:
    """``["alpha=0.875,0.9375", "seed=1,2"]`` -> ``{"algorithm.alpha": [0.875, 0.9375], "train.seed": [1, 2]}``."""
    grid: dict[str, list] = {}
    for item in items:
        key, raw = item.split("=", 1) if "=" in item else (item, "")
        if not raw.strip():
            raise SweepError(f"--grid {item!r}: give values as key=v1,v2,...")
        value = parse_override(f"{key}={raw}")[1]
        values = value if isinstance(value, list) else [parse_override(f"{key}={v}")[1] for v in raw.split(",")]
        add_grid_key(grid, key.strip(), values)
    return grid


def read_grid_file(path: str) -> dict[str, list]:
    """The grid of a YAML file (``{dotted key: [values]}``); one-line SweepError when it is unreadable."""
    try:
        with open(path) as f:
            data = safe_load_yaml(f.read())
    except (OSError, yaml.YAMLError) as err:
        raise SweepError(f"--grid-file {path}: {err}") from None
    if not isinstance(data, dict):
        raise SweepError(f"--grid-file {path}: must be a mapping of config key -> list of values")
    grid: dict[str, list] = {}
    for key, values in data.items():
        add_grid_key(grid, str(key), values if isinstance(values, list) else [values])
    return grid


def expand_grid(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """All combinations, the first key varying slowest: ``{a: [1, 2], b: [x, y]}`` -> a1bx a1by a2bx a2by."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def plan_sweep(
    config_path: str,
    grid: Mapping[str, Sequence[Any]],
    out_dir: str,
    *,
    fixed_overrides: Sequence[str] = (),
    max_parallel: int | None = None,
    launcher: Launcher = "srun",
    template: str = TEMPLATE,
    log_dir: str = DEFAULT_LOG_DIR,
    signal_grace_s: int = 120,
) -> Sweep:
    """Resolve and validate every run of the grid (nothing is written)."""
    if not grid:
        raise SweepError("empty grid: give at least one --grid key=v1,v2")
    if max_parallel is not None and max_parallel < 1:
        raise SweepError(f"--max-parallel {max_parallel} must be >= 1")
    base = load_config(config_path, fixed_overrides)
    # An unset checkpoint.dir already gives each run checkpoints/<name>; a set one is a root for the runs.
    checkpoint_root = (config_tree(config_path, fixed_overrides).get("checkpoint") or {}).get("dir")
    labels = _labels(list(grid))
    options = LaunchOptions(launcher=launcher, signal_grace_s=signal_grace_s)
    runs = []
    for index, values in enumerate(expand_grid(grid)):
        name = "-".join([base.name] + [f"{labels[k]}{_format(v)}" for k, v in values.items()])
        overrides = (
            *fixed_overrides,
            *(f"{k}={json.dumps(v)}" for k, v in values.items()),
            f"name={name}",
            f"logging.dir={os.path.join(base.logging.dir, name)}",
        )
        if checkpoint_root:
            overrides += (f"checkpoint.dir={os.path.join(checkpoint_root, name)}",)
        try:
            cfg = load_config(config_path, overrides)
        except ConfigError as err:
            raise SweepError(f"run {index} ({describe_values(values)}): {err}") from None
        if to_dict(cfg.launch) != to_dict(base.launch):
            raise SweepError(
                f"run {index} ({describe_values(values)}) changes the launch section: one job array needs one resource request"
            )
        try:  # the same layout checks the batch script will run, on placeholder hosts
            plan_job(cfg, preview_allocation(cfg), train_args=[], options=options)
        except LaunchPlanError as err:
            raise SweepError(f"run {index} ({describe_values(values)}): {err}") from None
        runs.append(SweepRun(index, name, dict(values), overrides, cfg))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise SweepError("two runs got the same name: grid values must differ after formatting")
    array = f"0-{len(runs) - 1}" + (f"%{max_parallel}" if max_parallel else "")
    sweep_name = os.path.basename(os.path.normpath(out_dir))
    cmd = sbatch_command(
        base,
        ["--config", os.path.join(out_dir, "configs", "%a.yaml")],
        launcher=launcher,
        template=template,
        log_dir=log_dir,
        signal_grace_s=signal_grace_s,
        array=array,
        job_name=sweep_name,
    )
    return Sweep(
        config_path, out_dir, {k: list(v) for k, v in grid.items()}, tuple(fixed_overrides), tuple(runs), tuple(cmd)
    )


def write_sweep(sweep: Sweep, *, overwrite: bool = False) -> None:
    """Write configs and manifest into a temporary directory beside ``out_dir``, then rename it into place."""
    out = os.path.normpath(sweep.out_dir)
    if os.path.exists(out) and not overwrite:
        raise SweepError(f"{out} already exists (pass --overwrite to replace it)")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
    try:
        os.makedirs(os.path.join(tmp, "configs"))
        for run in sweep.runs:
            path = os.path.join(tmp, "configs", f"{run.index}.yaml")
            with open(path, "w") as f:
                f.write(
                    f"# sweep run {run.index}: {run.name}\n# from {sweep.base_config} with {shlex.join(run.overrides)}\n"
                )
                yaml.safe_dump(to_dict(run.config, secrets=True), f, sort_keys=False)  # the job needs its key
            if to_dict(load_config(path), secrets=True) != to_dict(
                run.config, secrets=True
            ):  # the file alone reproduces the run
                raise SweepError(f"{path}: the written config does not read back to the same run")
        manifest = {
            "base_config": sweep.base_config,
            "grid": sweep.grid,
            "fixed_overrides": list(sweep.fixed_overrides),
            "runs": [
                {"index": r.index, "name": r.name, "values": r.values, "config": sweep.config_path(r.index)}
                for r in sweep.runs
            ],
            "sbatch": list(sweep.sbatch),
        }
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def add_grid_key(grid: dict[str, list], key: str, values: list) -> None:
    """Add grid key ``key`` (aliases resolved) with ``values``; a reserved or repeated key raises SweepError."""
    key = ALIASES.get(key, key)
    if key in _RESERVED:
        raise SweepError(f"grid key {key!r} is set per run by the sweep itself")
    if key in grid:
        raise SweepError(f"grid key {key!r} given twice")
    if not values:
        raise SweepError(f"grid key {key!r} has no values")
    if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
        raise SweepError(f"grid key {key!r} repeats a value: {values}")
    grid[key] = list(values)


def _labels(keys: list[str]) -> dict[str, str]:
    """Short label of each key: its alias, else its last dotted part, else (on a clash) the whole key."""
    short = {k: next((a for a, full in ALIASES.items() if full == k), k.rsplit(".", 1)[-1]) for k in keys}
    clashes = {s for s in short.values() if list(short.values()).count(s) > 1}
    return {k: (k.replace(".", "_") if s in clashes else s) for k, s in short.items()}


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = json.dumps(value) if not isinstance(value, str) else value
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "_"


def describe_values(values: Mapping[str, Any]) -> str:
    """``key=value`` pairs of a run's grid values, values as JSON."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())
