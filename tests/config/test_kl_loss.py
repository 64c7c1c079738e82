"""algorithm.kl_loss: the KL penalty's keys reach the built-in policy loss, and a penalty on top of the
mixed ratio is refused in one line unless asked for."""

import os

import pytest

from armor_megatron.algo.loss import PolicyLossConfig
from armor_megatron.config import ConfigError, load_config
from armor_megatron.config.schema import needs_reference_logprobs
from armor_megatron.trainer import components
from armor_megatron.trainer.run import needs_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")  # ARMOR: α = 0.9375, anchors
DAPO = ["algorithm.alpha=1.0", "anchor.enabled=false"]


def test_off_by_default_and_dapo_needs_no_reference():
    cfg = load_config(TINY, DAPO)
    assert cfg.algorithm.kl_loss.coef == 0.0 and components.loss_config(cfg).kl_coef == 0.0
    assert not needs_reference(cfg) and not needs_reference_logprobs(cfg)


def test_dapo_with_a_kl_penalty_builds_the_loss_from_the_declared_keys_and_needs_the_reference():
    cfg = load_config(TINY, [*DAPO, "algorithm.kl_loss.coef=0.01", "algorithm.kl_loss.estimator=k2"])
    loss = components.loss_config(cfg)
    assert loss == PolicyLossConfig(alpha=1.0, kl_coef=0.01, kl_estimator="k2") and loss.needs_ref_logp
    assert needs_reference(cfg) and needs_reference_logprobs(cfg)


def test_a_penalty_on_top_of_the_mixed_ratio_is_refused_unless_asked_for():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["algorithm.kl_loss.coef=0.01"])
    message = str(err.value)
    assert "\n" not in message and message.startswith("algorithm.kl_loss.coef: a KL penalty on top of the mixed ratio")
    assert "algorithm.kl_loss.with_mixed_ratio: true" in message
    cfg = load_config(TINY, ["algorithm.kl_loss.coef=0.01", "algorithm.kl_loss.with_mixed_ratio=true"])
    assert components.loss_config(cfg).kl_coef == 0.01


@pytest.mark.parametrize(
    ("override", "starts"),
    [
        ("algorithm.kl_loss.coef=-0.1", "algorithm.kl_loss.coef: "),
        ("algorithm.kl_loss.estimator=low_var_kl", "algorithm.kl_loss.estimator: "),
    ],
)
def test_bad_values_are_refused_in_one_line(override, starts):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [*DAPO, override])
    assert "\n" not in str(err.value) and str(err.value).startswith(starts)
