"""The checkpointed trainer state is versioned (`trainer.state_format`): the current format carries
``format_version``, an older one is migrated, a newer one is refused in one line, and a checkpoint of
the previous format (version 1, checked in under ``data/trainer_state_v1``) resumes and trains on."""

import json
import os
import shutil

import pytest
import torch

from armor_megatron.config import load_config
from armor_megatron.errors import UserInputError
from armor_megatron.trainer.state_format import FORMAT_VERSION, TrainerStateVersionError, migrated

V1_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "trainer_state_v1", "iter_0000001")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V1_REQUIRED = dict(step=3, loader={"epoch": 0}, monitor={}, ref_resets=1, last_train_accuracy=0.5)


def test_a_version_1_state_gains_its_version_and_the_keys_it_may_lack():
    assert migrated(V1_REQUIRED) == {
        "format_version": FORMAT_VERSION,
        **V1_REQUIRED,
        "reset_schedule": None,
        "anchor_cache": None,
        "pending_batch": None,
        "step_record": None,
        "partial_rollouts": None,
    }
    v2 = {**V1_REQUIRED, "format_version": 2, "reset_schedule": None, "anchor_cache": None}
    v2 |= {"pending_batch": None, "step_record": None}
    assert migrated(v2) == {**v2, "format_version": FORMAT_VERSION, "partial_rollouts": None}  # version 2 -> 3
    group = {"key": "3:1", "prompt_ids": [1], "max_new_tokens": [4, 4], "done": {}, "must_finish": False}
    v3 = {**v2, "format_version": 3, "partial_rollouts": {"generator": {"buffer": {}, "groups": [group]}}}
    v3["partial_rollouts"] |= {"queue": [5], "draws": 1}
    assert migrated(v3)["partial_rollouts"] == {  # version 3 -> 4: partial rollouts ran without anchors
        "generator": {"buffer": {}, "calls": 0, "groups": [{**group, "anchor": None, "reference": None, "started": 0}]},
        "queue": [5],
        "draws": 1,
        "anchors": [],
    }
    assert migrated({**v3, "partial_rollouts": None})["partial_rollouts"] is None
    kept = {**V1_REQUIRED, "step_record": {"step": 3, "metrics": {}}}
    assert migrated(kept)["step_record"] == {"step": 3, "metrics": {}}
    current = migrated(kept)
    assert migrated(current) == current  # the current version passes unchanged


@pytest.mark.parametrize(
    "version, message",
    [
        (FORMAT_VERSION + 1, f"format_version {FORMAT_VERSION + 1} is newer than this armor_megatron reads"),
        (0, "format_version 0 is not a version"),
        ("2", "format_version '2' is not a version"),
    ],
)
def test_a_version_it_cannot_read_is_refused_in_one_line_naming_the_checkpoint(version, message):
    with pytest.raises(TrainerStateVersionError, match=f"^ckpt/iter_0000009: trainer state {message}") as err:
        migrated({**V1_REQUIRED, "format_version": version}, "ckpt/iter_0000009")
    assert isinstance(err.value, UserInputError) and "\n" not in str(err.value)


def starts_low(response, ground_truth):
    """The verifier the checked-in run used: 1 when the response starts low in the alphabet."""
    return float(bool(response) and response[0] in "0123456789+-=? abcd")


@pytest.mark.timeout(300)
def test_a_checkpoint_of_the_previous_format_resumes_and_trains_on(tmp_path, world_of_one):
    """``data/trainer_state_v1`` was written by the trainer before ``format_version`` existed (a tiny
    qwen2 of hidden size 16, one step; its README says how). Resumed, the loop restores its step,
    its step record (logged once, marked as restored) and trains step 2; the new checkpoint is of the
    current format."""
    from armor_megatron.rollout.testing.tiny_models import make_tiny_checkpoint
    from armor_megatron.trainer.metrics_log import read_metrics
    from armor_megatron.trainer.run import train

    old = torch.load(os.path.join(V1_CHECKPOINT, "trainer_state.pt"), weights_only=True)
    assert "format_version" not in old and old["step"] == 1
    make_tiny_checkpoint(str(tmp_path / "hf"), seed=0, hidden_size=16)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(5)]
    for name, part in (("train", rows[:24]), ("val", rows[24:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    shutil.copytree(V1_CHECKPOINT, tmp_path / "ckpt" / "iter_0000001")
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
        [
            f"model.path={tmp_path}/hf",
            f"data.train_path={tmp_path}/train.jsonl",
            f"eval.datasets=[{{name: val, path: {tmp_path}/val.jsonl, k: 2}}]",
            "eval.max_response_len=6",
            "eval.every_steps=0",
            f"reward.verifier={__name__}:starts_low",
            "parallelism.tp=1",
            "train.deterministic=false",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_response_len=6",
            "train.micro_batch_size=8",
            f"checkpoint.dir={tmp_path}/ckpt",
            f"logging.dir={tmp_path}/runs",
            "name=run",
            "train.steps=2",
            "reference.reset=every",
            "reference.tau=2",
            "checkpoint.every_steps=1",
            "checkpoint.save_hf.every_steps=0",
        ],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(cfg, str(tmp_path / "ckpt" / "iter_0000001"))
    finally:
        torch.set_num_threads(threads)
    metrics = {r["step"]: r for r in read_metrics(str(tmp_path / "runs" / "run" / "metrics.jsonl"))}
    assert sorted(metrics) == [1, 2]
    restored = {k: v for k, v in metrics[1].items() if k != "time"}  # when it was logged
    assert restored == {
        **old["step_record"]["metrics"],
        "step": 1,
        "log/restored_from_checkpoint": 1.0,
    }
    assert metrics[2]["reference/reset"] == 1.0 and torch.isfinite(torch.tensor(metrics[2]["train/loss"]))
    new = torch.load(str(tmp_path / "ckpt" / "iter_0000002" / "trainer_state.pt"), weights_only=True)
    assert new["format_version"] == FORMAT_VERSION and new["step"] == 2 and new["ref_resets"] == old["ref_resets"] + 1
