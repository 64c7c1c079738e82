"""The overlap's driver side (trainer/overlap.py), its config checks, and TIS against a stale engine."""

import dataclasses
import os
import threading
import time

import pytest
import torch

from armor_megatron.algo.tis import truncated_is_weights
from armor_megatron.config import ConfigError, load_config
from armor_megatron.data.batch import RolloutBatch
from armor_megatron.data.prompts import PromptRow
from armor_megatron.rollout.anchor.sampler import AnchorResult
from armor_megatron.rollout.engine import SamplingParams, StaleWeightsError
from armor_megatron.rollout.hf_checkpoint import build_causal_lm
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.testing.tiny_models import build_char_tokenizer, encode, tiny_config, tiny_weights
from armor_megatron.trainer.driver_rollout import DriverRollout
from armor_megatron.trainer.overlap import (
    BackgroundRollout,
    LaggingBatchError,
    OneStepOverlap,
    PendingBatch,
    check_lag,
    generate_pending,
    load_pending,
    pending_state,
    timing_metrics,
)
from armor_megatron.trainer.rollout_phase import (
    RolloutSettings,
    collect_groups,
    replace_stale_anchors,
    rows_as_samples,
)
from tests.registered_verifiers import registered

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def _batch(versions, anchors):
    n = len(versions)
    return RolloutBatch(
        {"is_anchor": torch.tensor(anchors, dtype=torch.bool), "rewards": torch.zeros(n)},
        {"weight_version": versions},
    )


def test_lag_of_one_update_is_accepted_and_two_are_refused_in_one_line():
    batch = _batch(["step-4", "step-4", "step-5", "ref-2"], [False, False, False, True])
    assert check_lag(batch, trainer_step=5, reference_version="ref-2") == {"rollout/lag": 1.0, "rollout/lag_min": 0.0}
    stale = _batch(["step-4", "step-3", "ref-2"], [False, False, True])
    with pytest.raises(LaggingBatchError) as err:
        check_lag(stale, trainer_step=5, reference_version="ref-2")
    message = str(err.value)
    assert "\n" not in message and "'step-3', 2 updates behind the trainer's 'step-5'" in message
    assert isinstance(err.value, StaleWeightsError) and isinstance(err.value, ValueError)  # the CLI's one-line path
    for version in ("step-6", "v0"):  # from the future, or of no step
        with pytest.raises(LaggingBatchError, match=version):
            check_lag(_batch([version], [False]), trainer_step=5, reference_version=None)


def test_an_anchor_of_another_reference_is_refused():
    batch = _batch(["step-5", "ref-1"], [False, True])
    with pytest.raises(
        LaggingBatchError, match="anchor .row 1. of reference 'ref-1'.*this step's reference is 'ref-2'"
    ):
        check_lag(batch, trainer_step=5, reference_version="ref-2")
    assert check_lag(None, 3, "ref-0") == {}


def test_config_refuses_one_step_without_tis_with_colocated_engines_or_pregeneration():
    assert load_config(CONFIG, ["rollout.overlap=off"]).rollout.overlap == "off"  # YAML 1.1 reads off as false
    base = ["rollout.overlap=one_step"]
    with pytest.raises(ConfigError, match=r"^rollout.overlap: one_step needs algorithm.tis.enabled=true .*for that\)$"):
        load_config(CONFIG, base)
    tis = [*base, "algorithm.tis.enabled=true"]
    load_config(CONFIG, tis)  # the local engine runs in the driver: accepted
    with pytest.raises(ConfigError, match="needs rollout.sglang.placement=disaggregated") as err:
        load_config(CONFIG, [*tis, "rollout.engine=sglang", "rollout.sglang.placement=colocated"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="^rollout.overlap: one_step needs anchor.pregenerate=false"):
        load_config(CONFIG, [*tis, "anchor.pregenerate=true"])
    with pytest.raises(ConfigError, match="^rollout.overlap_forced_wait: needs rollout.overlap: one_step"):
        load_config(CONFIG, ["rollout.overlap_forced_wait=true"])


def test_every_unmet_requirement_of_one_step_is_named_in_one_message():
    """A GPU recipe turned to one_step: TIS, placement, engine GPUs and trainer GPUs, not one per --check round."""
    recipe = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["rollout.overlap=one_step"])
    line = str(err.value)
    assert line.startswith("rollout.overlap: one_step needs algorithm.tis.enabled=true ") and "\n" not in line
    for needed in (
        "; rollout.sglang.placement=disaggregated (",
        "; launch.engine_gpus=8 (the GPUs of 4 engines x tp_per_engine 2)",
        "; GPUs left for training: the engines take 8 of the job's 8; lower rollout.sglang.num_engines",
    ):
        assert needed in line, line
    fixed = ["algorithm.tis.enabled=true", "rollout.sglang.placement=disaggregated", "launch.engine_gpus=8"]
    assert load_config(recipe, ["rollout.overlap=one_step", *fixed, "launch.nodes=2"]).rollout.overlap == "one_step"


def test_background_rollout_returns_its_batch_and_reraises_its_error_in_the_caller():
    runner = BackgroundRollout()
    assert runner.join() is None
    runner.start(lambda: generate_pending(lambda: (None, {"rollout/accuracy": 0.5}), for_step=3))
    with pytest.raises(RuntimeError, match="already running"):
        runner.start(lambda: None)
    pending = runner.join()
    assert pending.for_step == 3 and pending.metrics == {"rollout/accuracy": 0.5} and pending.generation_s > 0
    runner.start(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.join()
    assert not runner.running


def test_the_driver_touching_the_generations_state_before_the_join_fails():
    runner, inside, release = BackgroundRollout(), [], threading.Event()

    def generate():
        runner.check_access("the prompt loader")  # the generation's own thread may
        inside.append(True)
        release.wait(timeout=30)
        return PendingBatch(None, {}, for_step=0)

    runner.check_access("the prompt loader")  # nothing running: the driver may
    runner.start(generate)
    try:
        with pytest.raises(RuntimeError, match="the prompt loader is in use by the background rollout"):
            runner.check_access("the prompt loader")
    finally:
        release.set()
    assert runner.join() is not None and inside == [True]
    runner.check_access("the prompt loader")  # joined: the driver's again


def test_the_trainer_guards_its_loader_engine_and_anchors_while_a_generation_runs():
    # the driver's accessors of the state a generation uses, on a driver holding only that state
    driver = DriverRollout.__new__(DriverRollout)
    driver.background, driver.loader, driver.policy_engine, driver.anchors = BackgroundRollout(), [], [], []
    release = threading.Event()
    driver.background.start(lambda: release.wait(timeout=30) and None)
    try:
        for accessor in ("prompts", "engine", "anchor_cache"):
            with pytest.raises(RuntimeError, match="in use by the background rollout"):
                getattr(driver, accessor)
    finally:
        release.set()
        driver.background.join()
    assert driver.prompts == [] and driver.engine == [] and driver.anchor_cache == []


def test_timing_metrics_count_the_hidden_generation():
    # 10 s step: the trainer busy 6 s, the engine generated 8 s of which the trainer waited 2 s
    m = timing_metrics(10.0, 6.0, 8.0, 2.0)
    assert m["time/overlap_saved"] == 6.0 and m["time/generation"] == 8.0
    assert m["time/trainer_idle_frac"] == pytest.approx(0.4) and m["time/engine_idle_frac"] == pytest.approx(0.2)
    assert timing_metrics(4.0, 1.0, 3.0, 3.0)["time/overlap_saved"] == 0.0  # off: generation on the critical path


@pytest.fixture(scope="module")
def stale_setup():
    """An engine holding step-0 weights, the trainer's weights one update further (step-1)."""
    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok))
    w0 = tiny_weights(cfg, seed=0, sharpen=4.0)
    gen = torch.Generator().manual_seed(1)
    w1 = [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in w0]  # "the update"
    engine = LocalEngine(cfg, w0, tokenizer=tok, weight_version="step-0", seed=7)
    return tok, cfg, engine, w1


def _settings(temperature=0.7, max_new_tokens=6):
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True)
    return RolloutSettings(group_size=3, sampling=sampling, verifier="math")


def test_tis_weights_of_a_one_step_stale_batch_equal_a_float64_hand_computation(stale_setup):
    tok, cfg, engine, w1 = stale_setup
    rows = [PromptRow(0, "12+7=", "19"), PromptRow(1, "3+4=", "7")]
    settings = _settings()
    batch, _ = collect_groups(rows, lambda p: encode(tok, p), engine, settings)
    assert check_lag(batch, trainer_step=1, reference_version=None) == {"rollout/lag": 1.0, "rollout/lag_min": 1.0}
    # the trainer's lp_old: π at step-1, teacher-forced at the sampling temperature, kept in fp32 as the trainer does
    trainer = build_causal_lm(cfg, dtype=torch.float64)
    trainer.load_state_dict(dict(w1), strict=False)
    with torch.no_grad():
        logits = trainer(input_ids=batch["input_ids"]).logits
    lp = torch.log_softmax(logits / settings.sampling.temperature, -1)
    shifted = torch.zeros_like(batch["engine_logprobs"], dtype=torch.float64)
    shifted[:, 1:] = lp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["response_mask"]
    old = (shifted * mask).float()
    cap = 1.05
    weights, metrics = truncated_is_weights(old, batch["engine_logprobs"], mask, batch["is_anchor"], cap=cap)
    # by hand, in float64, from the same fp32 log-probs
    on = mask.bool()
    hand = torch.exp(old.double() - batch["engine_logprobs"].double()).clamp(max=cap)
    torch.testing.assert_close(weights.double()[on], hand[on], rtol=1e-6, atol=0)
    assert (weights[~on] == 0).all()
    assert (hand[on] - 1).abs().max() > 1e-3  # the weights one update moved: staleness is visible
    assert 0 < metrics["tis_capped_frac"] < 1  # and some are truncated at C


def test_pending_batch_survives_a_checkpoint_file_bit_for_bit(stale_setup, tmp_path):
    tok, _, engine, _ = stale_setup
    batch, metrics = collect_groups([PromptRow(5, "1+1=", "2")], lambda p: encode(tok, p), engine, _settings())
    pending = generate_pending(lambda: (batch, metrics), for_step=4)
    torch.save(pending_state(pending), tmp_path / "trainer_state.pt")
    back = load_pending(torch.load(tmp_path / "trainer_state.pt", weights_only=True))
    assert back.for_step == 4 and back.metrics == metrics
    for key in batch.tensors:
        assert torch.equal(back.batch[key], batch[key]), key
    assert back.batch.objects == batch.objects
    assert load_pending(pending_state(None)) is None


JUDGED: list[tuple[str, ...]] = []


def _judges_groups(responses, ground_truth):
    """A group verifier recording each group it scores; 0.25 for every response."""
    JUDGED.append(tuple(responses))
    return [0.25] * len(responses)


def test_a_group_verifier_scores_a_group_whose_stale_anchor_changed_again_whole(stale_setup):
    tok, _, engine, _ = stale_setup
    rows = {10: PromptRow(10, "12+7=", "19"), 11: PromptRow(11, "3+4=", "7")}
    with registered(test_judges_groups=_judges_groups):
        settings = dataclasses.replace(_settings(), verifier="test_judges_groups")
        batch, _ = collect_groups(list(rows.values()), lambda p: encode(tok, p), engine, settings)
        batch["is_anchor"] = torch.tensor([False, False, True] * 2)
        batch["weight_version"] = ["step-0", "step-0", "ref-1"] * 2
        JUDGED.clear()
        out, n = replace_stale_anchors(
            batch, "ref-2", rows, lambda p: encode(tok, p), engine, settings, _NewReference(engine), tok.pad_token_id
        )
    texts = out["response_text"]
    assert n == 2 and JUDGED[-2:] == [tuple(texts[:3]), tuple(texts[3:])]  # each changed group, whole, in order
    assert out["accuracy"].tolist() == [0.25] * 6  # the new anchor's too, scored in its group


class _NewReference:
    """The anchor cache of the reference after a reset: it finds an anchor for prompt index 10 only."""

    def __init__(self, engine):
        self.engine, self.asked = engine, []

    def get(self, prompt_ids, truths, keys=None, timeout=None):
        self.asked.extend(keys)
        out = []
        for i, (ids, key) in enumerate(zip(prompt_ids, keys)):
            if key != 10:
                out.append(AnchorResult(i, None, 4, 20))
                continue
            sample = self.engine.generate([ids], n=1, sampling=_settings().sampling)[0][0]
            out.append(AnchorResult(i, dataclasses.replace(sample, weight_version="ref-2"), 1, 6, reward=1.0))
        return out


def test_stale_anchors_are_resampled_from_the_new_reference_or_replaced_by_an_on_policy_sample(stale_setup):
    tok, _, engine, _ = stale_setup
    rows = {10: PromptRow(10, "12+7=", "19"), 11: PromptRow(11, "3+4=", "7")}
    settings = _settings()
    batch, _ = collect_groups(list(rows.values()), lambda p: encode(tok, p), engine, settings)
    batch["is_anchor"] = torch.tensor([False, False, True] * 2)  # the last row of each group: an anchor of ref-1
    batch["weight_version"] = ["step-0", "step-0", "ref-1"] * 2
    before_prompts, before = rows_as_samples(batch)
    new_ref = _NewReference(engine)
    out, n = replace_stale_anchors(
        batch, "ref-2", rows, lambda p: encode(tok, p), engine, settings, new_ref, pad_id=tok.pad_token_id
    )
    assert n == 2 and new_ref.asked == [10, 11]
    assert out["weight_version"] == ["step-0", "step-0", "ref-2", "step-0", "step-0", "step-0"]
    assert out["is_anchor"].tolist() == [False, False, True, False, False, False]  # no anchor found: on-policy
    assert out["accuracy"][2] == 1.0  # the new anchor's verified reward
    prompts, after = rows_as_samples(out)
    assert prompts == before_prompts
    for i in (0, 1, 3, 4):  # untouched rows keep their tokens and engine log-probs
        assert after[i].token_ids == before[i].token_ids and after[i].logprobs == before[i].logprobs
    assert check_lag(out, trainer_step=0, reference_version="ref-2") == {"rollout/lag": 0.0, "rollout/lag_min": 0.0}
    assert replace_stale_anchors(out, "ref-2", rows, None, engine, settings, new_ref)[1] == 0


class _Loader:
    def __init__(self):
        self.state = {"drawn": 1}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def _joining_overlap(generate, timeout_s):
    """What `OneStepOverlap.join` reads: a background generation begun beside the update, and a preemption signal."""
    from types import SimpleNamespace

    from armor_megatron.trainer.preemption import PreemptionHandler

    cfg = SimpleNamespace(name="run", reward=SimpleNamespace(timeout_s=timeout_s))
    overlap = OneStepOverlap(BackgroundRollout(), rollout=None, loader=_Loader(), cfg=cfg)
    overlap._loader_before = {"drawn": 0}
    overlap.beside_update = True
    overlap.background.start(generate)
    preemption = PreemptionHandler()
    preemption.received = 15  # SIGTERM, as the handler records it
    return overlap, preemption


def _scoring(seconds):
    """A generation whose reward calls take ``seconds``, and stop when the calls are interrupted."""
    from armor_megatron.rewards.isolated import CallsInterrupted, calls_interrupted

    def generate():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if calls_interrupted():
                raise CallsInterrupted("reward calls were stopped (a preemption signal)")
            time.sleep(0.01)
        return PendingBatch(None, {"rollout/reward": 0.5}, for_step=1)

    return generate


def test_after_a_preemption_signal_the_next_batch_finishes_within_the_grace_and_is_kept():
    """The signal leaves the generation beside the update alone (`OneStepOverlap.stop_reward_calls`);
    the join waits for it, so the preemption checkpoint holds its batch; with the batch in hand the
    reward calls are stopped, so the step's evaluation is skipped as without overlap."""
    from armor_megatron.rewards.isolated import allow_calls, calls_interrupted

    overlap, preemption = _joining_overlap(_scoring(0.3), timeout_s=30.0)
    overlap.stop_reward_calls()
    assert not calls_interrupted()
    try:
        pending = overlap.join(1, preemption)
        assert calls_interrupted()
    finally:
        allow_calls()
    assert pending is not None and pending.metrics == {"rollout/reward": 0.5}
    assert overlap._loader.state == {"drawn": 1} and not overlap.beside_update


def test_a_next_batch_stuck_past_the_grace_is_stopped_and_its_prompts_go_back(capsys):
    from armor_megatron.rewards.isolated import allow_calls

    overlap, preemption = _joining_overlap(_scoring(3600.0), timeout_s=0.3)
    begin = time.monotonic()
    try:
        pending = overlap.join(1, preemption)
    finally:
        allow_calls()
    assert pending is None and time.monotonic() - begin < 30
    assert overlap._loader.state == {"drawn": 0}  # drawn again by the resumed run
    assert "did not finish within reward.timeout_s=0.3s of the preemption signal" in capsys.readouterr().out


def test_a_signal_outside_the_overlap_stops_the_reward_calls_at_once():
    from types import SimpleNamespace

    from armor_megatron.rewards.isolated import allow_calls, calls_interrupted

    try:
        OneStepOverlap.stop_reward_calls(SimpleNamespace(beside_update=False))
        assert calls_interrupted()
    finally:
        allow_calls()
