"""Shared fixtures: one tiny Qwen2 checkpoint with a character tokenizer, built locally."""

import pytest

from armor_megatron.rollout.testing.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """(directory, hf_config, tokenizer) of a sharpened tiny model (confident next-token choices)."""
    path = str(tmp_path_factory.mktemp("tiny") / "policy")
    cfg, tok = make_tiny_checkpoint(path, seed=0, sharpen=8.0)
    return path, cfg, tok


def pytest_configure(config):
    config.addinivalue_line("markers", "double_only: needs the SGLang test double's fault-injection hooks")
