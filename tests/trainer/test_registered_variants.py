"""A variant registered anywhere (here: in the test; an estimator, a reset schedule, a policy loss, a
rollout engine) is picked up end to end, with no other edit:
the config accepts its name and checks the config keys it declares, the trainer's components build
it from those keys, and the trainer dispatches on its registered traits. A wrong name fails in one
line listing the registered ones."""

import contextlib
import dataclasses
import os

import pytest
import torch

from armor_megatron.algo import (
    ADVANTAGE_ESTIMATORS,
    RESET_SCHEDULES,
    needs_critic,
)
from armor_megatron.algo.loss import POLICY_LOSSES, aggregate_token_loss, bind_policy_loss
from armor_megatron.algo.reset import EveryTau, Never, OnValidationBest, StatelessSchedule, TwoStage, ValidationHook
from armor_megatron.config import ConfigError, load_config
from armor_megatron.config.schema import ROLLOUT_ENGINES
from armor_megatron.config.validate import model_arch_of
from armor_megatron.data.batch import RolloutBatch
from armor_megatron.launch.memory import plan_memory
from armor_megatron.rollout.engine import SamplingParams
from armor_megatron.rollout.testing.tiny_models import build_char_tokenizer, tiny_config, tiny_weights
from armor_megatron.trainer import components
from armor_megatron.trainer.advantages import gae_targets, group_advantages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
PPO = os.path.join(ROOT, "configs", "tiny_cpu_ppo.yaml")
RECIPE = os.path.join(ROOT, "configs", "qwen3_8b_base_two_stage.yaml")


@contextlib.contextmanager
def registered(registry, name, fn, **registration):
    registry.register(name, **registration)(fn)
    try:
        yield
    finally:
        registry.unregister(name)
    assert name not in registry


def _one_line_error(config, overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(config, overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


# ----------------------------------------------------------------------------- advantage estimators
def max_baseline(rewards: torch.Tensor, margin: float) -> torch.Tensor:
    """A_gi = r_gi − max_g − margin: every response but the group's best is pushed down."""
    return (rewards - rewards.amax(dim=1, keepdim=True) - margin).float()


def td0(values, rewards, mask, gamma: float = 1.0):
    """One-step TD: A_t = r_t + γ·V_{t+1} − V_t (V after the last token 0), R_t = A_t + V_t; on a
    fully valid row only (enough for the test)."""
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    adv = (rewards + gamma * next_values - values) * mask
    return adv, (adv + values) * mask


def test_a_registered_group_estimator_runs_from_config_to_advantages():
    with registered(ADVANTAGE_ESTIMATORS, "test-max-baseline", max_baseline, config_keys={"margin": "std_eps"}):
        cfg = load_config(TINY, ["algorithm.estimator=test-max-baseline", "algorithm.std_eps=0.5"])
        assert not needs_critic(cfg.algorithm.estimator)
        settings = components.rollout_settings(cfg, SamplingParams(max_new_tokens=4))
        assert settings.estimator_kwargs == {"margin": 0.5}  # from its declared config key
        # two groups of G = 8: rewards 0/1 in the first, all 1 in the second
        rewards = torch.tensor([[1.0, 0, 0, 1, 0, 0, 0, 0], [1.0] * 8])
        batch = RolloutBatch({"rewards": rewards.reshape(-1), "is_anchor": torch.zeros(16, dtype=torch.bool)})
        batch, _ = group_advantages(batch, settings)
        # first group: max 1, so 1 → −0.5 and 0 → −1.5; second group: 1 − 1 − 0.5 = −0.5 everywhere
        expected = torch.tensor([-0.5, -1.5, -1.5, -0.5, -1.5, -1.5, -1.5, -1.5] + [-0.5] * 8)
        torch.testing.assert_close(batch["advantages"], expected)


def test_a_registered_critic_estimator_is_planned_checked_and_computed_as_one_with_a_critic():
    with registered(ADVANTAGE_ESTIMATORS, "test-td0", td0, critic=True, config_keys={"gamma": "gamma"}):
        overrides = ["algorithm.estimator=test-td0", "algorithm.gamma=0.5", "critic.whiten_advantages=false"]
        cfg = load_config(PPO, overrides)
        assert needs_critic("test-td0")
        # the group step leaves advantages to the critic ...
        settings = components.rollout_settings(cfg, SamplingParams(max_new_tokens=4))
        batch = RolloutBatch({"rewards": torch.ones(16), "is_anchor": torch.zeros(16, dtype=torch.bool)})
        assert torch.equal(group_advantages(batch, settings)[0]["advantages"], torch.zeros(16))
        # ... whose per-token targets come from the registered function, with γ from algorithm.gamma:
        # reward 1 on the last token; A_0 = 0 + 0.5·0.25 − 0.5 = −0.375, A_1 = 1 + 0 − 0.25 = 0.75
        host = {
            "response_mask": torch.tensor([[1.0, 1.0]]),
            "rewards": torch.tensor([1.0]),
            "old_values": torch.tensor([[0.5, 0.25]]),
        }
        adv, ret = gae_targets(host, cfg)
        torch.testing.assert_close(adv, torch.tensor([[-0.375, 0.75]]))
        torch.testing.assert_close(ret, torch.tensor([[0.125, 1.0]]))
        # the critic's config checks apply to it, and the memory plan holds a critic
        message = _one_line_error(PPO, [*overrides, "critic.warmup_steps=20", "train.steps=20"])
        assert message.startswith("critic.warmup_steps: 20 leaves no actor update")
        plain = load_config(RECIPE)
        with_critic = load_config(RECIPE, ["algorithm.estimator=test-td0"])
        arch = model_arch_of(plain)
        assert plan_memory(plain, arch).stages[0].terms["critic"] == 0
        assert plan_memory(with_critic, arch).stages[0].terms["critic"] > 0


def test_an_estimator_registered_with_a_missing_config_key_is_refused_in_one_line():
    with registered(ADVANTAGE_ESTIMATORS, "test-max-baseline", max_baseline, config_keys={"margin": "margin"}):
        message = _one_line_error(TINY, ["algorithm.estimator=test-max-baseline"])
    assert message == (
        "algorithm.estimator: advantage estimator 'test-max-baseline' takes margin from algorithm.margin, "
        "which is not a config key"
    )


def test_an_unknown_estimator_fails_in_one_line_listing_the_registered_ones():
    message = _one_line_error(TINY, ["algorithm.estimator=grpo2"])
    assert (
        message == f"algorithm.estimator: unknown advantage estimator 'grpo2'; known: {', '.join(ADVANTAGE_ESTIMATORS)}"
    )
    assert "gae" in message and "qae" in message


# ----------------------------------------------------------------------------- reset schedules
class EveryOther(StatelessSchedule):
    """Reset after the steps 2·tau, 4·tau, ...: every other τ."""

    def __init__(self, tau: int):
        self.tau = tau

    def should_reset(self, step, metrics=None):
        return step % (2 * self.tau) == 0


class OnHook(StatelessSchedule):
    """Resets when a hook (a ``module:function`` path, no default) says so, after validation."""

    def __init__(self, hook: str):
        self.hook = hook

    def should_reset(self, step, metrics=None):
        return False


def test_a_registered_reset_schedule_runs_from_config_to_the_schedule():
    with registered(RESET_SCHEDULES, "test-every-other", EveryOther, config_keys={"tau": "tau"}):
        cfg = load_config(TINY, ["reference.reset=test-every-other", "reference.tau=3"])
        schedule = components.reset_schedule(cfg)
        assert isinstance(schedule, EveryOther) and schedule.tau == 3
        assert [s for s in range(1, 20) if schedule.should_reset(s)] == [6, 12, 18]
        assert schedule.state_dict() == {}


def test_a_reset_schedule_s_traits_and_required_keys_are_checked():
    with registered(RESET_SCHEDULES, "test-hook", OnHook, needs_eval=True, config_keys={"hook": "validation_hook"}):
        assert _one_line_error(TINY, ["reference.reset=test-hook"]) == (
            "reference.validation_hook: required when reference.reset is 'test-hook'"
        )
        assert _one_line_error(
            TINY,
            ["reference.reset=test-hook", f"reference.validation_hook={__name__}:never_reset", "eval.every_steps=0"],
        ) == ("reference.reset: 'test-hook' needs periodic evaluation (eval.every_steps > 0)")
        cfg = load_config(TINY, ["reference.reset=test-hook", f"reference.validation_hook={__name__}:never_reset"])
        assert components.reset_schedule(cfg).hook == f"{__name__}:never_reset"
        bad = _one_line_error(TINY, ["reference.reset=test-hook", "reference.validation_hook=no_such_module:f"])
        assert bad.startswith("reference.validation_hook: cannot load 'no_such_module:f'")


def never_reset(step, metrics):
    return False


def test_the_built_in_schedules_come_from_their_config_keys():
    def built(*overrides):
        return components.reset_schedule(load_config(TINY, ["reference.tau=7", *overrides]))

    assert built("reference.reset=every") == EveryTau(7)
    assert built("reference.reset=two_stage", "reference.stage_one_steps=30") == TwoStage(30, tau=7)
    assert built("reference.reset=never") == Never()
    best = built("reference.reset=validation_best", "reference.validation_metric=val/acc")
    assert isinstance(best, OnValidationBest) and best.metric == "val/acc"
    hook = built("reference.reset=validation_hook", f"reference.validation_hook={__name__}:never_reset")
    assert isinstance(hook, ValidationHook) and hook.hook is never_reset


def test_an_unknown_reset_schedule_fails_in_one_line_listing_the_registered_ones():
    message = _one_line_error(TINY, ["reference.reset=evry"])
    assert message == f"reference.reset: unknown reset schedule 'evry'; known: {', '.join(RESET_SCHEDULES)}"
    assert "two_stage" in message and "validation_best" in message


# ----------------------------------------------------------------------------- policy losses
@dataclasses.dataclass(frozen=True)
class ClippedPGConfig:
    loss_agg: str
    clip: float  # |A| is bounded by it


def clipped_pg(logp, advantages, mask, cfg, *, normalizer=None):
    """REINFORCE with bounded advantages: ℓ_it = −clip(A_i, ±c)·lp_θ,it (no ratio, no reference)."""
    adv = advantages.float().clamp(-cfg.clip, cfg.clip).unsqueeze(-1)
    return aggregate_token_loss(-adv * logp, mask.bool(), cfg.loss_agg, normalizer), {}


def test_a_registered_policy_loss_is_built_from_the_keys_it_declares_and_given_the_inputs_it_takes():
    keys = {"loss_agg": "loss_agg", "clip": "dual_clip_c"}
    with registered(POLICY_LOSSES, "test-pg", clipped_pg, config=ClippedPGConfig, config_keys=keys):
        assert _one_line_error(TINY, ["algorithm.policy_loss=test-pg", "algorithm.dual_clip_c=null"]) == (
            "algorithm.dual_clip_c: required when algorithm.policy_loss is 'test-pg'"
        )
        cfg = load_config(TINY, ["algorithm.policy_loss=test-pg", "algorithm.dual_clip_c=2.0"])
        loss_cfg = components.loss_config(cfg)
        assert loss_cfg == ClippedPGConfig(loss_agg=cfg.algorithm.loss_agg, clip=2.0)

        loss_fn = bind_policy_loss("test-pg")  # what the actor calls, with every input it has
        logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        inputs = dict(logp=logp, old_logp=logp.detach(), ref_logp=None, advantages=torch.tensor([5.0]))
        inputs.update(mask=torch.ones(1, 2), cfg=loss_cfg, normalizer=torch.tensor(2.0), entropy=torch.ones(1, 2))
        loss, _ = loss_fn(**inputs, token_weights=None)
        assert loss.item() == 2.0 * 3.0 / 2  # −clip(5, ±2)·(−1 − 2) / N
        with pytest.raises(ValueError, match="^policy loss 'test-pg' does not take token_weights, which this run"):
            loss_fn(**inputs, token_weights=torch.ones(1, 2))  # TIS on: the loss would drop its correction

    def needs_kl_coef(logp, mask, cfg, kl_coef):
        return logp.sum(), {}

    with registered(POLICY_LOSSES, "test-kl", needs_kl_coef, config=ClippedPGConfig):
        with pytest.raises(ValueError, match="^policy loss 'test-kl' needs kl_coef, which the actor does not give"):
            bind_policy_loss("test-kl")


# ----------------------------------------------------------------------------- rollout engines
def test_a_registered_rollout_engine_is_chosen_by_rollout_engine():
    made = []

    def recording_engines(cfg, hf_config, tokenizer):
        local = components.make_local_engines(cfg, hf_config, tokenizer)

        def make(policy, reference, *, policy_version, reference_version):
            made.append(policy_version)
            return local(policy, reference, policy_version=policy_version, reference_version=reference_version)

        return make

    assert _one_line_error(TINY, ["rollout.engine=test-recording"]) == (
        "rollout.engine: unknown rollout engine 'test-recording'; known: local, sglang"
    )
    with registered(ROLLOUT_ENGINES, "test-recording", recording_engines):
        cfg = load_config(TINY, ["rollout.engine=test-recording"])
        tokenizer = build_char_tokenizer()
        hf_config = tiny_config(len(tokenizer))
        make = components.engine_factory(cfg, hf_config, tokenizer)
        policy, _ = make(tiny_weights(hf_config), None, policy_version="v0", reference_version="r0")
        assert made == ["v0"] and policy.weight_version == "v0"
    assert components.engine_factory(
        load_config(TINY, ["rollout.engine=local"]), hf_config, tokenizer
    ).__qualname__ == ("make_local_engines.<locals>.make")
