"""Typed run configuration: YAML sections -> dataclasses, dotted overrides, one-line errors."""

from armor_megatron.config.load import load_config
from armor_megatron.config.schema import RunConfig
from armor_megatron.config.typed import ConfigError, to_dict

__all__ = ["ConfigError", "RunConfig", "load_config", "to_dict"]
