"""One run, one checkpoint directory.

The run's config recorded beside its checkpoints, and the refusal to resume a checkpoint that
another run wrote.

``<checkpoint.dir>/run_config.yaml`` holds the whole resolved config (secrets redacted), so
tools that look for a run's config beside its checkpoints (as for Megatron-LM's) find it.
Resuming compares the *defining* part of the config: everything except what may change
between the jobs of one run without changing what is trained:

* where things go and how often: ``logging``, ``checkpoint``, ``eval`` (how the run is watched);
* how long: ``train.steps`` (extending a run), ``train.collective_timeout_minutes``;
* where memory and engines live: ``train.offload_during_rollout`` (bit-exact), ``rollout.local_device``,
  how rows become micro-batches (``train.micro_batch_size``, ``train.*max_tokens_per_micro_batch``),
  activation recomputation (``train.recompute*``, bit-exact) and ``throughput`` (fused kernels,
  overlapped communication): they change memory and speed, not the loss;
* where it runs: ``launch``, ``parallelism`` (torch_dist checkpoints load at any TP/PP/EP),
  ``rollout.sglang`` (servers, ports, weight-sync transport; the SLURM launcher passes new URLs
  every job), ``anchor.reference_urls`` / ``anchor.reference_engines``, ``reward.workers``, ``reward.python_path``,
  ``reference.offload``, ``model.spec``, ``model.arch`` (facts for checks), ``model.mcore_path``
  (the starting weights, already consumed; a LoRA checkpoint that left out its base reads it from the
  path it recorded, checked against its fingerprint);
* how user verifiers are held: ``reward.timeout_s``, ``reward.max_consecutive_timeouts``,
  ``reward.memory_limit_mb``, ``rollout.environment.tool_timeout_s`` (a run stopped by a hanging
  verifier or tool resumes with other limits);
* resume options: ``reference.init_from`` (recovery restarts a run with a better reference).

A key the record lacks (a run recorded before the key existed) counts as the schema default, so
adding a config key never locks older runs out of resuming.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from armor_megatron.config.schema import RunConfig
from armor_megatron.config.typed import ConfigError, to_dict

RECORD_NAME = "run_config.yaml"
NOT_DEFINING = (
    "logging",
    "checkpoint",
    "eval",
    "launch",
    "parallelism",
    "train.steps",
    "train.collective_timeout_minutes",
    "train.offload_during_rollout",
    "train.micro_batch_size",
    "train.max_tokens_per_micro_batch",
    "train.forward_max_tokens_per_micro_batch",
    "train.recompute",
    "train.recompute_method",
    "train.recompute_num_layers",
    "throughput",
    "rollout.local_device",
    "rollout.sglang",
    "anchor.reference_urls",
    "anchor.reference_engines",
    "reward.workers",
    "reward.python_path",
    "reward.timeout_s",
    "reward.max_consecutive_timeouts",
    "reward.memory_limit_mb",
    "rollout.environment.tool_timeout_s",
    "reference.offload",
    "reference.init_from",
    "model.spec",
    "model.arch",
    "model.mcore_path",
)


def checkpoint_dir(cfg: RunConfig) -> str:
    """``checkpoint.dir``; :func:`~armor_megatron.config.load.load_config` names one when the file does not."""
    if cfg.checkpoint.dir is None:
        raise ConfigError("checkpoint.dir", "is not set (load_config sets checkpoints/<name> when the file does not)")
    return cfg.checkpoint.dir


def record_path(cfg: RunConfig) -> str:
    """Where the run record of ``cfg``'s run lives: ``<checkpoint.dir>/run_config.yaml``."""
    return os.path.join(checkpoint_dir(cfg), RECORD_NAME)


def defining_config(data: dict[str, Any]) -> dict[str, Any]:
    """``{dotted key: value}`` of a config's plain-data form, without the NOT_DEFINING keys."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if prefix in NOT_DEFINING:
            return
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = node

    walk(data, "")
    return flat


def differences(recorded: dict[str, Any], cfg: RunConfig) -> list[str]:
    """The defining keys whose recorded value differs from ``cfg``'s.

    ``key: recorded -> now`` for each defining key that differs, in key order (a key the record
    lacks is read as its schema default).
    """
    before, now = defining_config(recorded), defining_config(to_dict(cfg))
    for key in now.keys() - before.keys():
        default = schema_default(key)
        if default is not _NO_DEFAULT:
            before[key] = default
    return [
        f"{key}: {before.get(key, '<unset>')!r} -> {now.get(key, '<unset>')!r}"
        for key in sorted(set(before) | set(now))
        if before.get(key, "<unset>") != now.get(key, "<unset>")
    ]


_NO_DEFAULT = object()


def schema_default(key: str) -> Any:
    """The plain-data default of dotted `key` in the RunConfig schema (``_NO_DEFAULT`` if none)."""
    node: Any = RunConfig
    for name in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        field = fields.get(name)
        if field is None:
            return _NO_DEFAULT
        if field.default is not dataclasses.MISSING:
            node = field.default
        elif field.default_factory is not dataclasses.MISSING:
            node = field.default_factory()
        else:
            return _NO_DEFAULT
    return to_dict(node) if dataclasses.is_dataclass(node) else node


def has_checkpoint(root: str) -> bool:
    """A complete ``iter_*`` checkpoint directory (not a ``.tmp-`` one being written) is in ``root``."""
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return any(n.startswith("iter_") and ".tmp-" not in n and os.path.isdir(os.path.join(root, n)) for n in names)


def check_run_identity(cfg: RunConfig, resume: str) -> None:
    """Refuse (ConfigError, one line) to resume a checkpoint another run recorded.

    ``resume``: ``auto`` checks ``checkpoint.dir`` when it holds a checkpoint; a path checks the
    record in the directory above it (its run's root); ``none`` and ``force`` check nothing.
    A root without a record (written before records existed) is accepted.
    """
    if resume in ("none", "force"):
        return
    root = checkpoint_dir(cfg) if resume == "auto" else os.path.dirname(os.path.normpath(resume))
    if resume == "auto" and not has_checkpoint(root):
        return
    key = "checkpoint.dir" if resume == "auto" else "checkpoint.resume"  # the setting that points there
    path = os.path.join(root, RECORD_NAME)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            recorded = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(key, f"{path}: unreadable run record ({str(err).splitlines()[0]})") from None
    if not isinstance(recorded, dict):
        raise ConfigError(key, f"{path}: a run record must be a mapping")
    diff = differences(recorded, cfg)
    if not diff:
        return
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    if key == "checkpoint.dir":
        fix = "give this run its own checkpoint.dir (or name), start fresh with --resume none"
    else:
        fix = "name a checkpoint of this run in checkpoint.resume (or --resume), start fresh with --resume none"
    raise ConfigError(
        key,
        f"{resume if key == 'checkpoint.resume' else root} holds the checkpoints of another run ({shown}); "
        f"{fix}, or resume it anyway with --resume force",
    )


def write_run_record(cfg: RunConfig) -> str:
    """Write ``run_config.yaml`` into ``checkpoint.dir`` (atomically: temporary file, then rename)."""
    path = record_path(cfg)
    os.makedirs(checkpoint_dir(cfg), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)
    return path
