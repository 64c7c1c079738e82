"""The whole ARMOR loop in this process: ``trainer.run.train`` at world size 1 (gloo), the Megatron
actor, reference and critic, the local engine, verified anchors, dynamic sampling, TIS, resets,
evaluation, checkpoints and their resumption, on a tiny random model the session builds once.

The multi-rank runs through ``armor-train`` (test_end_to_end*.py) check layouts and processes;
these check the loop's logic in the fast subset. The verifier rewards responses that start in
the lower half of the tiny model's alphabet: a random model writes them about half of the time,
so groups have signal and π_ref finds anchors without a warmed-up model.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from armor_megatron.config import load_config
from armor_megatron.rollout.testing.tiny_models import make_tiny_checkpoint
from armor_megatron.trainer.metrics_log import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARMOR = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
PPO = os.path.join(ROOT, "configs", "tiny_cpu_ppo.yaml")
LOW = "0123456789+-=? abcd"
pytestmark = pytest.mark.timeout(300)


def starts_low(response, ground_truth):
    """1 when the response starts with a digit, an operator, a space or a-d, else 0."""
    return float(bool(response) and response[0] in LOW)


def anchor_reference(samples):
    """logging.sample_metrics: N of the weights ``ref-N`` that sampled the step's anchors (none in evaluations)."""
    versions = {int(s["weight_version"].removeprefix("ref-")) for s in samples if s.get("is_anchor")}
    assert len(versions) <= 1, versions  # one reference per step
    return {"anchor_reference": versions.pop()} if versions else {}


@pytest.fixture(scope="module")
def random_tiny(tmp_path_factory, world_of_one):
    """A tiny random HF model (character tokenizer) and 24 training / 8 validation prompts."""
    root = tmp_path_factory.mktemp("loop_in_process")
    make_tiny_checkpoint(str(root / "hf"), seed=0)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(5)]
    for name, part in (("train", rows[:24]), ("val", rows[24:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return root


def _config(data, run_dir, *overrides, config=ARMOR):
    return load_config(
        config,
        [
            f"model.path={data}/hf",
            f"data.train_path={data}/train.jsonl",
            f"eval.datasets=[{{name: val, path: {data}/val.jsonl, k: 2}}]",
            "eval.pass_k=[1, 2]",
            "eval.max_response_len=6",
            f"reward.verifier={__name__}:starts_low",
            "parallelism.tp=1",
            "train.deterministic=false",  # torch's global switch would outlive the test
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_response_len=6",
            "train.micro_batch_size=8",
            f"checkpoint.dir={run_dir}/ckpt",
            f"logging.dir={run_dir}/runs",
            "name=run",
            *overrides,
        ],
    )


def _train(cfg, resume=None) -> dict:
    """Train ``cfg`` here on one thread (a tiny model's kernels are too small to share; two threads
    cost twice the CPU time); {step: metrics} as logged."""
    from armor_megatron.trainer.run import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(cfg, resume)
    finally:
        torch.set_num_threads(threads)
    return {r["step"]: r for r in read_metrics(os.path.join(cfg.logging.dir, cfg.name, "metrics.jsonl"))}


ARMOR_RUN = (
    "train.steps=3",
    "eval.every_steps=3",
    "reference.reset=every",
    "reference.tau=2",
    "algorithm.tis.enabled=true",
    "checkpoint.every_steps=1",
    "checkpoint.save_hf.every_steps=2",
    "train.max_tokens_per_micro_batch=40",  # rows packed into token-budget micro-batches (THD)
    f"logging.sample_metrics={__name__}:anchor_reference",
)


@pytest.fixture(scope="module")
def armor_run(random_tiny, tmp_path_factory):
    run = tmp_path_factory.mktemp("armor_run")
    return run, _train(_config(random_tiny, run, *ARMOR_RUN))


@pytest.mark.slow  # armor_run: three steps, a Megatron checkpoint each and an HF copy (~13 s of CPU)
def test_armor_steps_train_on_verified_anchors_with_tis_and_dynamic_sampling(armor_run):
    _, metrics = armor_run
    assert sorted(metrics) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        m = metrics[step]
        assert m["train/skipped"] == 0.0 and m["train/num_tokens"] > 0 and m["train/tokens"] > 0
        # the engine sampled with exactly the trainer's weights (weight sync after every step)
        assert m["rollout/logprob_abs_diff"] < 1e-5
        # engine and trainer agree: TIS weights are ~1 and none is truncated
        assert abs(m["train/tis_weight_mean"] - 1.0) < 1e-4 and m["train/tis_capped_frac"] == 0.0
        # TIS weighs on-policy tokens only: the trained anchors' tokens (sampled from π_ref) weigh 1
        assert m["anchor/trained_groups_rate"] > 0 and 0 < m["train/tis_num_tokens"] < m["train/num_tokens"]
        assert m["dynamic_sampling/rounds"] >= 1 and m["dynamic_sampling/groups_seen"] >= 4
        assert m["dynamic_sampling/keep_rate"] > 0.0
        assert m["anchor/reference_tokens"] >= m["anchor/generated_tokens"] > 0
        assert m["anchor/trained_groups_rate"] > 0 and m["anchor/zero_advantage_rate"] < 1.0
    assert max(metrics[s]["anchor/found_rate"] for s in (1, 2, 3)) > 0


@pytest.mark.slow  # armor_run: three steps, a Megatron checkpoint each and an HF copy (~13 s of CPU)
def test_the_reset_sets_the_reference_to_the_policy(armor_run):
    _, metrics = armor_run
    assert metrics[2]["reference/reset"] == 1.0 and "reference/reset" not in metrics[1] | metrics[3]
    # π_ref = π_θ before the first update and again right after the reset at step 2
    kl = {step: metrics[step]["train/approx_kl_ref"] for step in (1, 2, 3)}
    assert kl[1] < 1e-9 and kl[2] > 1e-7 and kl[3] < 1e-9, kl
    # and the anchor source: step 3's anchors come from the reference engine holding the reset weights
    assert [metrics[step]["rollout/anchor_reference"] for step in (1, 2, 3)] == [0.0, 0.0, 1.0]


@pytest.mark.slow  # armor_run: three steps, a Megatron checkpoint each and an HF copy (~13 s of CPU)
def test_evaluation_at_the_start_and_when_due(armor_run):
    _, metrics = armor_run
    for step in (0, 3):
        assert metrics[step]["eval/val/pass@1"] <= metrics[step]["eval/val/pass@2"]
        assert metrics[step]["eval/mean/pass@1"] == metrics[step]["eval/val/pass@1"]
    assert "eval/val/pass@1" not in metrics[1] and "eval/val/pass@1" not in metrics[2]
    assert "overopt/train_val_gap" in metrics[3]  # the monitor compares training and validation accuracy


@pytest.mark.slow  # armor_run: three steps, a Megatron checkpoint each and an HF copy (~13 s of CPU)
def test_checkpoints_and_hf_copies_of_the_policy(armor_run, random_tiny):
    run, _ = armor_run
    ckpt = run / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    start = {k: v for f in (random_tiny / "hf").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    for step in (2, 3):  # every 2 steps, and at the end
        hf = ckpt / "hf" / f"step_{step:07d}"
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(start)
        saved = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(str(hf / f)).items()}
        assert not torch.equal(
            saved["model.layers.0.mlp.down_proj.weight"], start["model.layers.0.mlp.down_proj.weight"]
        )
        assert (hf / "config.json").exists() and (hf / "tokenizer.json").exists()


@pytest.mark.slow  # armor_run: three steps, a Megatron checkpoint each and an HF copy (~13 s of CPU)
def test_resuming_a_checkpoint_repeats_the_next_step_bit_for_bit(armor_run, random_tiny):
    run, metrics = armor_run
    # the trainer's memory goes to the host around rollouts and evaluation (bit-exact round trip)
    cfg = _config(random_tiny, run, *ARMOR_RUN, f"logging.dir={run}/resumed", "train.offload_during_rollout=true")
    resumed = _train(cfg, resume=str(run / "ckpt" / "iter_0000002"))
    assert sorted(resumed) == [2, 3]
    for key in ("rollout/accuracy", "train/loss", "train/grad_norm", "anchor/found_rate", "eval/val/pass@1"):
        assert resumed[3][key] == metrics[3][key], key
    # this log had no record of the checkpointed step (as when a run is killed between the save and
    # its log line): the checkpoint's copy of the step's metrics is logged, marked, once
    assert resumed[2]["log/restored_from_checkpoint"] == 1.0 and "log/restored_from_checkpoint" not in resumed[3]
    for key in ("rollout/accuracy", "train/loss", "train/grad_norm", "reference/reset"):
        assert resumed[2][key] == metrics[2][key], key


def test_ppo_trains_a_critic_beside_the_actor_and_resumes_it(random_tiny, tmp_path):
    common = ("train.steps=2", "eval.every_steps=0", "checkpoint.every_steps=1", "reference.tau=100")
    metrics = _train(_config(random_tiny, tmp_path, *common, config=PPO))
    assert sorted(metrics) == [1, 2]
    # critic.warmup_steps=1: step 1 trains the critic alone, step 2 both
    assert "train/loss" not in metrics[1] and "train/loss" in metrics[2]
    for step in (1, 2):
        m = metrics[step]
        assert m["critic/skipped"] == 0.0 and m["critic/num_tokens"] > 0
        assert m["critic/loss"] > 0 and -10.0 < m["critic/explained_var"] <= 1.0
    assert metrics[1]["critic/value_mean"] == 0.0  # the zero-initialised head predicts 0 at first
    assert metrics[2]["critic/value_mean"] != 0.0
    resumed = _train(
        _config(random_tiny, tmp_path, *common, f"logging.dir={tmp_path}/resumed", config=PPO),
        resume=str(tmp_path / "ckpt" / "iter_0000001"),
    )
    for key in ("critic/loss", "critic/grad_norm", "critic/value_mean", "train/loss", "train/grad_norm"):
        assert resumed[2][key] == metrics[2][key], key


def test_a_step_without_signal_trains_nothing(random_tiny, tmp_path):
    cfg = _config(
        random_tiny,
        tmp_path,
        "train.steps=1",
        "eval.every_steps=0",
        "reward.verifier=tests.trainer.user_hooks:never_right",
        "algorithm.dynamic_sampling.max_oversample_rounds=0",
    )
    (step,) = _train(cfg).values()
    assert step["train/skipped_no_signal"] == 1.0 and "train/loss" not in step
    assert step["anchor/found_rate"] == 0.0 and step["dynamic_sampling/keep_rate"] == 0.0


def tool_turns(samples):
    """logging.sample_metrics of the multi-turn run: model turns per response, as its trajectories say."""
    return {"tool_turns": sum(len(s["trajectory"]) for s in samples) / len(samples)}


MULTI_TURN_RUN = (
    "train.steps=3",
    "eval.every_steps=3",
    f"logging.sample_metrics={__name__}:tool_turns",
    "reference.reset=every",
    "reference.tau=2",
    "algorithm.tis.enabled=true",
    "rollout.overlap=one_step",  # the pending batch, trajectories included, goes into each checkpoint
    "checkpoint.every_steps=1",
    "train.max_tokens_per_micro_batch=40",
    "rollout.environment.spec=tests.trainer.user_hooks:OneLookup",
    "rollout.environment.max_turn_tokens=3",
    "rollout.environment.max_total_tokens=40",
)


@pytest.mark.slow
def test_a_multi_turn_run_trains_on_model_tokens_and_resumes_bit_for_bit(random_tiny, tmp_path):
    metrics = _train(_config(random_tiny, tmp_path, *MULTI_TURN_RUN))
    assert sorted(metrics) == [0, 1, 2, 3]
    # the evaluation runs the environment loop too: a turn, the lookup, a turn
    assert metrics[0]["eval/val/tool_turns"] == metrics[3]["eval/val/tool_turns"] == 2.0
    for step in (1, 2, 3):
        m = metrics[step]
        assert m["train/skipped"] == 0.0 and m["train/num_tokens"] > 0
        assert 1.0 < m["rollout/turns"] <= 2.0 and m["rollout/env_tokens"] > 0
        assert m["rollout/response_len_max"] <= 6  # model tokens only; the observations come on top
        # engine and trainer agree on every model token (observations are masked out of the gap and TIS)
        assert m["rollout/logprob_abs_diff"] < 1e-5 or m.get("rollout/lag", 0) > 0
        assert m["rollout/env_truncated/tool_timeout"] == 0.0 and m["rollout/tool_turns"] == m["rollout/turns"]
    assert metrics[1]["rollout/logprob_abs_diff"] < 1e-5  # the first batch is on-policy
    # step 1 trains all 16 rows: the trained tokens are the model's, the 3 observation tokens of each row ("=<answer> ") are not
    assert (
        metrics[1]["train/tokens"] == metrics[1]["rollout/response_len"] * 16 and metrics[1]["rollout/env_tokens"] == 3
    )
    assert max(metrics[s]["anchor/found_rate"] for s in (1, 2, 3)) > 0
    # step 3's batch was generated before the reset of step 2: its anchors were resampled from its rows
    assert metrics[3]["anchor/stale_resampled"] > 0
    resumed = _train(
        _config(random_tiny, tmp_path, *MULTI_TURN_RUN, f"logging.dir={tmp_path}/resumed"),
        resume=str(tmp_path / "ckpt" / "iter_0000002"),
    )
    for key in ("rollout/accuracy", "rollout/env_tokens", "train/loss", "train/grad_norm", "eval/val/pass@1"):
        assert resumed[3][key] == metrics[3][key], key


@pytest.mark.slow  # two training steps in process: a few seconds of CPU
def test_dapo_with_a_kl_penalty_builds_the_reference_and_logs_the_penalty(random_tiny, tmp_path):
    overrides = ("anchor.enabled=false", "algorithm.alpha=1.0", "algorithm.kl_loss.coef=0.1", "train.steps=2")
    metrics = _train(_config(random_tiny, tmp_path, *overrides, "eval.every_steps=0", "reference.reset=never"))
    # k3 (the default estimator) over the same tokens as the logged KL to the reference: equal
    for step in (1, 2):
        assert metrics[step]["train/kl_loss"] == pytest.approx(metrics[step]["train/approx_kl_ref"], rel=1e-6)
    assert metrics[1]["train/kl_loss"] == 0.0  # step 1 trains the reference's own weights
    assert metrics[2]["train/kl_loss"] > 0.0  # after one update the policy has moved away from π_ref
