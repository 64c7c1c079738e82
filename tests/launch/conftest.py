import os

import pytest

from armor_megatron.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_path(name: str) -> str:
    return os.path.join("configs", f"{name}.yaml")


@pytest.fixture
def load():
    """load("qwen3_8b_base_two_stage", "key=value", ...) -> RunConfig, paths relative to the repository."""

    def _load(name, *overrides):
        return load_config(os.path.join(ROOT, config_path(name)), list(overrides))

    return _load
