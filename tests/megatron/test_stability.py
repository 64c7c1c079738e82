"""StabilityGuard: synthetic metric streams (skip, reduce, rebaseline, relax, rollback, no lock-out),
state round trips, config checks, and a real 1-rank CPU actor with an injected NaN and a spike."""

import math
import random

import pytest
import torch

from armor_megatron.config.schema import OptimizerConfig, StabilityConfig
from armor_megatron.config.typed import ConfigError, from_dict
from armor_megatron.megatron.stability import StabilityGuard
from tests.megatron.spawn import run_ranks


def step(norm, loss=0.1, **extra):
    return {"loss": loss, "grad_norm": norm, **extra}


def run(guard, stream):
    return [guard.check(m) for m in stream]


# ----------------------------------------------------------------------------- vetoes
def test_non_finite_loss_or_grad_norm_is_skipped_and_counted():
    guard = StabilityGuard(10.0)
    assert guard.check(step(1.0, loss=float("nan"))).reasons == ("non-finite loss nan",)
    decision = guard.check(step(float("inf")))
    assert decision.skip and decision.reasons == ("non-finite grad norm inf",) and decision.interventions == ("skip",)
    assert not guard.check(step(1.0)).skip
    assert guard.skipped_total == 2 and list(guard.history) == [1.0]


def test_spike_rule_uses_the_median_of_accepted_steps_once_warm():
    guard = StabilityGuard(3.0, window=4, min_history=3)
    # fewer than 3 accepted steps: only finiteness is checked, even for a large norm
    assert not guard.check(step(1.0)).skip and not guard.check(step(100.0)).skip
    assert guard.threshold() is None
    assert not guard.check(step(2.0)).skip
    assert guard.threshold() == 6.0  # history [1, 100, 2]: median 2, limit 3·2
    assert not guard.check(step(6.0)).skip  # equal to the limit passes; history [1, 100, 2, 6]
    # median of [1, 2, 6, 100] = 4 -> limit 12; a spike of 13 is skipped and not recorded
    assert guard.check(step(13.0)).reasons == ("grad norm 13 > 3 x running median 4",)
    assert list(guard.history) == [1.0, 100.0, 2.0, 6.0] and guard.skipped_total == 1
    # the window keeps the last 4 accepted norms: [100, 2, 6, 5] -> median 5.5
    assert not guard.check(step(5.0)).skip and guard.threshold() == 16.5


# ----------------------------------------------------------------------------- the protocol
def test_lasting_upward_shift_of_the_grad_norm_does_not_lock_training_out():
    """The old guard kept only accepted norms in its median, so after a lasting shift x50 it
    skipped every later step. Now K=3 skips in a row rebaseline the median and lower the LR;
    the new regime is accepted, and N=5 healthy steps later the LR is back."""
    guard = StabilityGuard(10.0, window=10, min_history=3, max_consecutive_skips=3, recover_after=5)
    decisions = run(guard, [step(1.0)] * 20 + [step(50.0)] * 40)
    skipped = [i for i, d in enumerate(decisions) if d.skip]
    assert skipped == [20, 21, 22]
    assert decisions[22].interventions == ("skip", "reduce", "rebaseline") and decisions[22].lr_scale == 0.5
    assert guard.threshold() == 500.0  # the median followed the shift
    assert [d.lr_scale for d in decisions[23:29]] == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0]
    assert decisions[27].interventions == ("relax",)
    assert guard.level == 0 and guard.healthy and guard.skipped_total == 3


def test_skip_then_lr_and_clip_reduction_then_recovery_after_n_healthy_steps():
    guard = StabilityGuard(
        4.0, window=8, min_history=2, max_consecutive_skips=2, recover_after=3, lr_factor=0.5, clip_factor=0.8
    )
    warm = run(guard, [step(1.0)] * 4)
    assert all(not d.skip and d.interventions == () for d in warm)
    burst = run(guard, [step(20.0), step(30.0)])  # two spikes: skip, then skip + reduce
    assert [d.interventions for d in burst] == [("skip",), ("skip", "reduce", "rebaseline")]
    assert (burst[0].lr_scale, burst[0].clip_scale) == (1.0, 1.0)
    assert (burst[1].lr_scale, burst[1].clip_scale) == (0.5, 0.8) and guard.clip_scale == 0.8
    burst = run(guard, [step(float("nan")), step(float("nan"))])  # again unhealthy twice: a second level
    assert burst[1].interventions == ("skip", "reduce") and burst[1].lr_scale == 0.25  # no finite norm: same H
    assert burst[1].clip_scale == pytest.approx(0.64) and guard.level == 2
    calm = run(guard, [step(1.0)] * 7)
    assert not any(d.skip for d in calm)
    assert [d.lr_scale for d in calm] == [0.25, 0.25, 0.5, 0.5, 0.5, 1.0, 1.0]  # one level per 3 healthy steps
    assert [d.interventions for d in calm].count(("relax",)) == 2 and guard.healthy
    metrics = calm[2].metrics()
    assert metrics["guard_relax"] == 1.0 and metrics["guard_level"] == 1.0 and metrics["skipped_total"] == 4.0


def test_drift_signals_are_applied_not_skipped_and_escalate_after_k_in_a_row():
    guard = StabilityGuard(
        10.0, max_consecutive_skips=2, max_kl_ref=0.5, max_clip_frac=0.3, max_abs_log_ratio=2.0, min_entropy=0.1
    )
    fine = dict(approx_kl_ref=0.1, clip_frac_low=0.1, clip_frac_high=0.1, ratio_min=0.5, ratio_max=3.0, entropy=1.0)
    assert guard.check(step(1.0, **fine)).reasons == ()
    cases = {
        "KL to the reference 0.7 > 0.5": {"approx_kl_ref": 0.7},
        "clip fraction 0.35 > 0.3": {"clip_frac_high": 0.25},
        "max |log r| 2.303 > 2": {"ratio_min": 0.1},  # |log 0.1| = 2.303
        "entropy 0.05 < 0.1": {"entropy": 0.05},
        "non-finite entropy nan": {"entropy": float("nan")},
    }
    for reason, change in cases.items():
        fresh = StabilityGuard(10.0, max_kl_ref=0.5, max_clip_frac=0.3, max_abs_log_ratio=2.0, min_entropy=0.1)
        decision = fresh.check(step(1.0, **{**fine, **change}))
        assert decision.reasons == (reason,) and not decision.skip and decision.metrics()["guard_unhealthy"] == 1.0
    first, second = run(guard, [step(1.0, **{**fine, "approx_kl_ref": 0.9})] * 2)
    assert not first.skip and first.interventions == ()
    assert not second.skip and second.interventions == ("reduce",) and second.lr_scale == 0.5  # this update at 0.5
    # keys a model does not report are not judged (the critic); no tokens: ratio_min = ratio_max = 0
    assert (
        StabilityGuard(10.0, max_kl_ref=0.5, max_abs_log_ratio=1.0)
        .check(step(1.0, ratio_min=0.0, ratio_max=0.0))
        .reasons
        == ()
    )


def test_engine_trainer_gap_from_observe_step_judges_the_following_steps():
    guard = StabilityGuard(10.0, max_logprob_gap=0.2, max_consecutive_skips=5)
    assert guard.observe_step({"rollout/logprob_abs_diff": 0.5, "train/loss": 1.0}) is None
    assert guard.check(step(1.0)).reasons == ("engine-trainer log-prob gap 0.5 > 0.2",)
    guard.observe_step({"train/loss": 1.0})  # no gap this step: the last one stands
    assert guard.check(step(1.0)).reasons != ()
    guard.observe_step({"rollout/logprob_abs_diff": 0.01})
    assert guard.check(step(1.0)).reasons == () and guard.strikes == 0


def test_never_more_than_k_skips_in_a_row_without_a_change_then_rollback_once_then_exhausted():
    guard = StabilityGuard(10.0, max_consecutive_skips=3, max_reductions=2, max_rollbacks=1)
    decisions = run(guard, [step(float("nan"))] * 12)
    assert all(d.skip for d in decisions)
    changed = {i: d.interventions[1:] for i, d in enumerate(decisions) if len(d.interventions) > 1}
    assert changed == {2: ("reduce",), 5: ("reduce",), 8: ("rollback",), 11: ("exhausted",)}
    assert not guard.healthy and guard.observe_step({}) == "rollback" and guard.observe_step({}) is None
    guard.rolled_back()
    assert guard.level == 2 and guard.strikes == 0 and len(guard.history) == 0  # reductions kept, reference afresh
    line = decisions[8].log_line()
    assert line == (
        "stability guard: skip, rollback (non-finite grad norm nan); lr scale 0.25, clip scale 0.25, 9 steps skipped so far"
    )
    assert decisions[0].log_line() == (
        "stability guard: skip (non-finite grad norm nan); lr scale 1, clip scale 1, 1 steps skipped so far"
    )


@pytest.mark.parametrize("seed", range(5))
def test_random_streams_never_skip_more_than_k_in_a_row_without_an_intervention(seed):
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    guard = StabilityGuard(3.0, window=6, min_history=2, max_consecutive_skips=k, max_reductions=2)
    level, run_of_skips = 1.0, 0
    for _ in range(400):
        level *= rng.choice([1.0, 1.0, 1.0, 5.0, 0.2])  # lasting shifts up and down
        norm = rng.choice([level, level, level * 20, float("nan")])
        decision = guard.check(step(norm, approx_kl_ref=rng.random()))
        changed = set(decision.interventions) - {"skip"}
        run_of_skips = 0 if changed or not decision.skip else run_of_skips + 1
        assert run_of_skips < k
    assert guard.skipped_total > 0


def test_disabled_guard_only_skips_non_finite_steps():
    guard = StabilityGuard(2.0, enabled=False, min_history=1, max_consecutive_skips=1, max_kl_ref=0.1)
    decisions = run(guard, [step(1.0), step(100.0, approx_kl_ref=5.0), step(float("nan")), step(float("nan"))])
    assert [d.skip for d in decisions] == [False, False, True, True]
    assert {d.lr_scale for d in decisions} == {1.0} and decisions[1].reasons == ()
    assert [d.interventions for d in decisions] == [(), (), ("skip",), ("skip",)]


# ----------------------------------------------------------------------------- state and config
def test_state_round_trip_mid_escalation_and_old_state_shape():
    guard = StabilityGuard(2.0, window=3, min_history=1, max_consecutive_skips=2, max_rollbacks=1, max_reductions=0)
    run(guard, [step(1.0), step(2.0), step(3.0), step(4.0), step(40.0)])
    guard.observe_step({"rollout/logprob_abs_diff": 0.3})
    other = StabilityGuard(2.0, window=3, min_history=1, max_consecutive_skips=2, max_rollbacks=1, max_reductions=0)
    other.load_state_dict(guard.state_dict())
    assert other.state_dict() == guard.state_dict()
    assert list(other.history) == [2.0, 3.0, 4.0] and other.strikes == 1 and other.logprob_gap == 0.3
    # the next spike completes the run of K=2 in both: rollback asked for, then H = the skipped norms
    assert guard.check(step(50.0)) == other.check(step(50.0))
    assert other.observe_step({}) == "rollback" and list(other.history) == [40.0, 50.0]
    legacy = StabilityGuard(2.0, window=3, min_history=1)
    legacy.load_state_dict({"history": [1.0, 2.0], "skipped_total": 7})  # a checkpoint of the skip-only guard
    assert list(legacy.history) == [1.0, 2.0] and legacy.skipped_total == 7 and legacy.healthy


def test_bad_config_fails_with_one_clear_line():
    with pytest.raises(ValueError, match="max_ratio must be > 1"):
        StabilityGuard(1.0)
    with pytest.raises(ValueError, match=r"stability.min_history \(3\) must be <= window \(2\)"):
        StabilityGuard(2.0, window=2, min_history=3)
    with pytest.raises(ValueError, match=r"^stability.lr_factor: 0.0 is out of range, must be in \(0, 1\]$"):
        StabilityGuard(2.0, lr_factor=0.0)
    with pytest.raises(ValueError, match="stability.max_consecutive_skips: 0 must be >= 1"):
        StabilityGuard(2.0, config=StabilityConfig(max_consecutive_skips=0))
    with pytest.raises(TypeError):
        StabilityGuard(2.0, no_such_field=1)
    cfg = from_dict(StabilityConfig, {"max_kl_ref": 0.2, "recover_after": 4}, "stability")
    assert StabilityGuard(2.0, cfg).config.recover_after == 4
    with pytest.raises(ConfigError, match=r"^stability.clip_factor: 1.5 is out of range"):
        from_dict(StabilityConfig, {"clip_factor": 1.5}, "stability")


# ----------------------------------------------------------------------------- a real actor
def guarded_actor_worker(rank):
    """1 rank, the tiny Qwen3 of test_actor: an accepted step, a NaN advantage, a grad-norm spike
    (K=2 unhealthy in a row -> LR and clip halved), two healthy steps (N=2 -> relaxed), one more.
    Then twin actors from the same weights, one at guard level 1: one update each."""
    from armor_megatron.megatron import dist as mdist
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.dist import ParallelConfig
    from tests.megatron.test_actor import ARCH, LOSS, make_batch, settings

    mdist.initialize(ParallelConfig(), ARCH, seed=5)
    try:
        optimizer = OptimizerConfig(lr=5e-3, weight_decay=0.01, clip_grad=1.0, skip_grad_norm_ratio=3.0)
        stability = StabilityConfig(window=4, min_history=1, max_consecutive_skips=2, recover_after=2)

        def new_actor():
            return MegatronActor(
                settings(ARCH, ParallelConfig()), optimizer=optimizer, loss=LOSS, total_steps=20, seed=5,
                stability=stability,
            )  # fmt: skip

        def params(actor):
            return [p.detach().clone() for chunk in actor.model_chunks for p in chunk.parameters()]

        def on_policy(actor, advantages):
            lp = actor.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs
            return {**batch, "old_logprobs": lp, "ref_logprobs": lp, "advantages": advantages}

        batch = make_batch()
        adv = batch["advantages"]
        nan_adv = adv.clone()
        nan_adv[2] = float("nan")
        actor, out = new_actor(), {"unchanged": []}
        steps = [actor.train_step(on_policy(actor, adv))]
        for bad in (nan_adv, adv * 1e4):  # on-policy: the grad norm is linear in the advantages
            before = params(actor)
            steps.append(actor.train_step(on_policy(actor, bad)))
            out["unchanged"].append(all(torch.equal(a, b) for a, b in zip(before, params(actor))))
        steps += [actor.train_step(on_policy(actor, adv)) for _ in range(3)]
        out["steps"] = steps

        # twins from the same weights, at guard level 0 and 1: an on-policy update (ratio 1, nothing
        # clipped: the same gradient), and from fresh twins an off-policy one (ratios spread around 1)
        g = torch.Generator()
        deltas, twin_steps = [], []
        for level in (0, 1):
            twin = new_actor()
            twin.guard.level = level
            start = params(twin)
            twin.train_step(on_policy(twin, adv))
            deltas.append([b - a for a, b in zip(start, params(twin))])
            twin = new_actor()
            twin.guard.level = level
            off = on_policy(twin, adv)
            g.manual_seed(0)
            off["old_logprobs"] = off["old_logprobs"] + 0.3 * torch.randn(off["old_logprobs"].shape, generator=g)
            twin_steps.append(twin.train_step(off))
        out["twin_steps"] = twin_steps
        out["delta_ratio_err"] = max((d1 - 0.5 * d0).abs().max().item() for d0, d1 in zip(*deltas))
        out["delta_max"] = max(d.abs().max().item() for d in deltas[0])
        return out
    finally:
        mdist.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_actor_skips_nan_and_spike_then_lowers_lr_and_clip_then_recovers():
    out = run_ranks(guarded_actor_worker, 1, timeout=280)[0]
    steps, lr = out["steps"], 5e-3
    assert [s["skipped"] for s in steps] == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0] and out["unchanged"] == [True, True]
    nan, spike = steps[1], steps[2]
    assert math.isnan(nan["loss"]) and spike["grad_norm"] > 3.0 * steps[0]["grad_norm"]
    assert (spike["guard_reduce"], spike["guard_rebaseline"], spike["skipped_total"]) == (1.0, 1.0, 2.0)
    assert [s["lr_scale"] for s in steps] == [1.0, 1.0, 0.5, 0.5, 1.0, 1.0]
    assert [s["clip_scale"] for s in steps] == [1.0, 1.0, 0.5, 0.5, 1.0, 1.0]
    assert [s["lr"] for s in steps] == pytest.approx([lr, lr, lr / 2, lr / 2, lr, lr])
    assert steps[4]["guard_relax"] == 1.0 and steps[5]["guard_level"] == 0.0
    # level 1: the same gradient moves every weight half as far (AdamW's first step is linear in
    # the lr), and the clip range ε·0.5 clips more of the same ratios
    level0, level1 = out["twin_steps"]
    assert level1["lr"] == pytest.approx(lr / 2) and out["delta_max"] > 1e-3 and out["delta_ratio_err"] < 1e-6
    assert level1["ratio_max"] == level0["ratio_max"] and level1["loss"] != level0["loss"]
    clipped0 = level0["clip_frac_low"] + level0["clip_frac_high"]
    assert level1["clip_frac_low"] + level1["clip_frac_high"] > clipped0 > 0
