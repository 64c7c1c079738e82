"""``eval.max_response_len`` must fit the model's context only when an evaluation samples it."""

import os

import pytest

from armor_megatron.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")  # a context of 128 tokens, prompts of up to 16
TOO_LONG = "eval.max_response_len=200"  # 16 + 200 tokens exceed the context


def test_a_response_length_no_evaluation_samples_is_not_checked():
    assert load_config(TINY, ["eval.datasets=[]", TOO_LONG]).eval.max_response_len == 200


def test_with_an_eval_dataset_it_must_fit_the_context():
    with pytest.raises(ConfigError, match=r"^eval.max_response_len: 200 \+ rollout.max_prompt_len=16 = 216 tokens"):
        load_config(TINY, [TOO_LONG])
