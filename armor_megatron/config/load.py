"""Load a run config: YAML file (optionally ``extends:`` another) + dotted overrides -> RunConfig.

    cfg = load_config("configs/qwen25_math_7b_dapo_armor.yaml", ["algorithm.alpha=0.875", "parallelism.tp=4"])

Override values are parsed as YAML scalars/lists (``x=0.5``, ``x=true``, ``x=[1,2]``, ``x=null``).
Every problem raises ``ConfigError`` with one line naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import yaml

from armor_megatron.config.schema import API_KEY_ENV, RunConfig
from armor_megatron.config.typed import ConfigError, from_dict
from armor_megatron.config.validate import validate_run_config
from armor_megatron.rewards.isolated import configure_pool
from armor_megatron.rewards.remote import RemoteJudgeError, RemoteJudgeSettings, configure_remote_judge
from armor_megatron.rewards.spec import add_search_paths
from armor_megatron.rewards.user_calls import configure_user_verifiers

# libyaml's loader where PyYAML was built with it (the wheels are): the same documents and errors as
# yaml.SafeLoader, several times faster, which a sweep or a `--check` of many configs feels
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def safe_load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, with libyaml's loader where it is available."""
    return yaml.load(text, Loader=_SAFE_LOADER)


DEFAULT_CHECKPOINT_ROOT = "checkpoints"


def load_config(path: str, overrides: Iterable[str] = ()) -> RunConfig:
    """The checked RunConfig.

    An unset ``checkpoint.dir`` becomes ``checkpoints/<name>`` (one run, one directory).
    ``$ARMOR_ENGINE_API_KEY``, when set, is ``rollout.sglang.api_key``.
    ``reward.python_path`` entries, relative to the config file, become absolute and are searched
    for user modules (``module:function`` verifiers and hooks) from here on; ``reward.timeout_s``,
    ``reward.max_consecutive_timeouts`` and ``reward.memory_limit_mb`` hold for this process's
    verifier calls from here on.
    """
    cfg = from_dict(RunConfig, config_tree(path, overrides))
    if os.environ.get(API_KEY_ENV):  # how the SLURM plan and the torchrun relaunch hand ranks the key
        cfg.rollout.sglang.api_key = os.environ[API_KEY_ENV]
    if cfg.checkpoint.dir is None:
        cfg.checkpoint.dir = os.path.join(DEFAULT_CHECKPOINT_ROOT, cfg.name)
    here = os.path.dirname(os.path.abspath(path))
    cfg.reward.python_path = add_search_paths(os.path.join(here, d) for d in cfg.reward.python_path)
    remote = cfg.reward.remote
    try:  # the verifier 'remote', before validation loads reward.verifier
        configure_remote_judge(RemoteJudgeSettings(**dataclasses.asdict(remote)) if remote.url else None)
    except RemoteJudgeError as err:
        raise ConfigError("reward.remote.api_key_env", str(err)) from None
    validate_run_config(cfg)
    # reward.* settings that hold for every verifier call of this process (the start-up probe too)
    configure_user_verifiers(cfg.reward.timeout_s, cfg.reward.max_consecutive_timeouts)
    configure_pool(memory_limit_mb=cfg.reward.memory_limit_mb)
    return cfg


def config_tree(path: str, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The plain data of ``path`` (``extends`` resolved) with the dotted ``overrides`` applied, unchecked."""
    data = read_yaml_tree(path)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    return data


def read_yaml_tree(path: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read ``path``; a top-level ``extends: other.yaml`` (relative to it) is read first and deep-merged under it."""
    real = os.path.realpath(path)
    if real in _seen:
        raise ConfigError("extends", f"circular extends through {path}")
    if os.path.isdir(path):
        raise ConfigError("", f"{path} is a directory, not a YAML config file")
    if not os.path.isfile(path):
        raise ConfigError("", f"config file not found: {path}")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError("", f"{path} line {line}: not UTF-8 text (byte 0x{raw[err.start]:02x})") from None
    try:
        data = safe_load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError("", f"{path}{where}: invalid YAML ({getattr(err, 'problem', None) or err})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: top level must be a mapping of sections")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError("extends", "must be a path to another YAML file")
    parent = read_yaml_tree(os.path.join(os.path.dirname(path), base), _seen + (real,))
    return deep_merge(parent, data)


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``section.key=value`` into the dotted key and its YAML-parsed value."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(item, "override must look like section.key=value")
    try:
        value = safe_load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(key, f"cannot parse override value {raw!r}") from None
    return key, value


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted ``key`` in nested ``data``, creating sections on the way."""
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section")
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``; nested mappings merge, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
