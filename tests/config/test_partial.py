"""``rollout.partial``: off by default, its checks, one-line refusals of what it does not support yet, anchors allowed."""

import os

import pytest

from armor_megatron.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
ON = ["rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:1]", "anchor.enabled=false"]


def test_off_by_default_and_read_when_on():
    assert load_config(TINY).rollout.partial.enabled is False
    cfg = load_config(
        TINY,
        [*ON, "rollout.partial.enabled=true", "rollout.partial.over_provision=2", "rollout.partial.stale=drop"],
    )
    part = cfg.rollout.partial
    assert (part.enabled, part.over_provision, part.max_versions, part.stale) == (True, 2.0, 2, "drop")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.partial.over_provision=0.5", "rollout.partial.over_provision: 0.5 must be >= 1"),
        ("rollout.partial.max_versions=1", "rollout.partial.max_versions: 1 must be >= 2"),
        ("rollout.partial.stale=keep", "rollout.partial.stale"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [*ON, "rollout.partial.enabled=true", override])


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["rollout.engine=local", "rollout.sglang.urls=[]"], "needs rollout.engine sglang .*cannot abort"),
        (["rollout.environment.spec=m:C"], "not supported with rollout.environment"),
        (
            ["rollout.overlap=one_step", "algorithm.tis.enabled=true", "rollout.sglang.placement=disaggregated"],
            "not supported with rollout.overlap .one_step.",
        ),
        (
            [
                "anchor.enabled=true",
                "anchor.pregenerate=true",
                "anchor.reference_urls=[http://127.0.0.1:2]",
                "rollout.sglang.placement=disaggregated",
            ],
            "not supported with anchor.pregenerate",
        ),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(overrides, why):
    with pytest.raises(ConfigError, match=f"^rollout.partial.enabled: {why}") as err:
        load_config(TINY, [*ON, "rollout.partial.enabled=true", *overrides])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["rollout.overlap=one_step"], "not supported with rollout.overlap .one_step."),
        (["anchor.enabled=true", "anchor.pregenerate=true"], "not supported with anchor.pregenerate"),
    ],
)
def test_the_unsupported_combination_is_said_before_what_its_other_half_needs(overrides, why):
    """one_step alone would first ask for TIS and disaggregated engines, pregenerate for a separate
    reference: a user who set those would then learn that partial rollouts refuse the combination."""
    with pytest.raises(ConfigError, match=f"^rollout.partial.enabled: {why}"):
        load_config(TINY, [*ON, "rollout.partial.enabled=true", *overrides])


@pytest.mark.parametrize("source", ["separate", "swap"])
def test_anchors_are_generated_with_partial_rollouts_from_either_source(source):
    cfg = load_config(TINY, [*ON, "rollout.partial.enabled=true", "anchor.enabled=true", f"anchor.source={source}"])
    assert cfg.rollout.partial.enabled and cfg.anchor.enabled and cfg.anchor.source == source
