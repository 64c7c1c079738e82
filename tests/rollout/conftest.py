"""Shared fixtures: one tiny Qwen2 checkpoint with a character tokenizer, built locally.

Under ``tools/gpu_smoke.sh`` (ARMOR_SGLANG_MODEL set) the checkpoint is the one the real
SGLang server was started from, so weight updates built from its config fit that server.
"""

import os

import pytest

from armor_megatron.rollout.testing.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """(directory, hf_config, tokenizer) of a tiny model (lm_head × 8: fairly confident next tokens)."""
    model = os.environ.get("ARMOR_SGLANG_MODEL")
    if model:
        import transformers

        from armor_megatron.models.arch import load_hf_config

        return model, load_hf_config(model), transformers.AutoTokenizer.from_pretrained(model)
    path = str(tmp_path_factory.mktemp("tiny") / "policy")
    cfg, tok = make_tiny_checkpoint(path, seed=0, sharpen=8.0)
    return path, cfg, tok


@pytest.fixture
def decoding_double(tiny_ckpt):
    """The SGLang TEST DOUBLE on the tiny model, decoding one token per 100 ms (weight_version step-0)."""
    from armor_megatron.rollout.local import LocalEngine
    from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer

    path, _, _ = tiny_ckpt
    engine = LocalEngine.from_pretrained(path, weight_version="step-0")
    with SGLangTestServer(engine, model_path=path, seconds_per_token=0.1) as server:
        yield server
