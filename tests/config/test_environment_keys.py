"""rollout.environment: a multi-turn run's keys are checked before anything starts, each refusal one line
naming its key."""

import os

import pytest

from armor_megatron.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
ENV = "rollout.environment.spec=tests.trainer.user_hooks:OneLookup"


def _refused(*overrides):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, list(overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_multi_turn_config_loads():
    cfg = load_config(TINY, [ENV, "rollout.environment.max_total_tokens=96"])
    assert cfg.rollout.environment.spec.endswith(":OneLookup") and cfg.rollout.environment.max_total_tokens == 96


def test_a_spec_that_does_not_import_is_named():
    message = _refused("rollout.environment.spec=tests.trainer.user_hooks:NoSuchEnvironment")
    assert message.startswith("rollout.environment.spec:") and "NoSuchEnvironment" in message


def test_a_token_total_without_room_or_beyond_the_context_is_refused():
    assert _refused(ENV, "rollout.max_prompt_len=32", "rollout.environment.max_total_tokens=32").startswith(
        "rollout.environment.max_total_tokens: 32 leaves no room for a response"
    )
    assert "exceed the model's context" in _refused(ENV, "rollout.environment.max_total_tokens=100000")


def test_token_budget_micro_batches_need_the_token_total():
    message = _refused(ENV, "train.max_tokens_per_micro_batch=256")
    assert message.startswith("rollout.environment.max_total_tokens: must be set with token-budget micro-batches")


def test_swapped_anchor_weights_are_refused_with_an_environment():
    message = _refused(ENV, "anchor.source=swap")
    assert message.startswith("anchor.source: 'swap' with rollout.environment") and "anchor.source: separate" in message


def test_unset_the_token_total_is_the_models_context():
    from armor_megatron.config.validate import model_arch_of
    from armor_megatron.trainer import components

    cfg = load_config(TINY, [ENV])
    assert cfg.rollout.environment.max_total_tokens is None
    context = model_arch_of(cfg).max_position_embeddings
    assert components.multi_turn_rollout(cfg, tokenizer=object()).settings.max_total_tokens == context
    cfg = load_config(TINY, [ENV, "rollout.environment.max_total_tokens=96"])
    assert components.multi_turn_rollout(cfg, tokenizer=object()).settings.max_total_tokens == 96
