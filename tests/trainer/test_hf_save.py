"""HF in, HF out: a tiny TP=2 run starts from an HF directory (no converted copy), writes the policy
as an HF model directory after every step, and each equals ``armor-convert mcore-to-hf`` of the
same step's checkpoint bit for bit; transformers loads it and matches the Megatron logits. Plus the
schedule, pruning and the recorded HF files in-process."""

import json
import os
import subprocess
import sys

import pytest

from armor_megatron.config.schema import SaveHFConfig
from armor_megatron.convert.hf_io import HFCheckpoint
from armor_megatron.convert.verify import compare_tensors
from armor_megatron.trainer.hf_save import prune_hf, record_hf_files, save_hf_due, step_name
from tests.trainer.test_end_to_end import _train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_due_every_n_steps_and_at_the_end():
    assert [s for s in range(1, 8) if save_hf_due(SaveHFConfig(every_steps=3), s, 7)] == [3, 6, 7]
    assert [s for s in range(1, 8) if save_hf_due(SaveHFConfig(), s, 7)] == [7]
    assert not any(save_hf_due(SaveHFConfig(at_end=False), s, 7) for s in range(1, 8))


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / "hf" / step_name(step)).mkdir(parents=True)
    (tmp_path / "hf" / ".step_0000004.tmp-x").mkdir()  # a save in progress is not counted
    assert prune_hf(str(tmp_path), 0) == []
    assert prune_hf(str(tmp_path), 2) == [str(tmp_path / "hf" / step_name(1))]
    assert sorted(os.listdir(tmp_path / "hf")) == [".step_0000004.tmp-x", step_name(2), step_name(3)]


def test_record_copies_config_and_tokenizer_not_weights(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors", "model.safetensors.index.json"):
        (src / name).write_text("{}")
    path = record_hf_files(str(src), str(tmp_path / "ckpt"))
    assert sorted(os.listdir(path)) == ["config.json", "tokenizer.json"]
    (src / "config.json").write_text('{"a": 1}')
    record_hf_files(str(src), str(tmp_path / "ckpt"))  # a new start records again
    assert (tmp_path / "ckpt" / "hf_config" / "config.json").read_text() == '{"a": 1}'
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["hf_config"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("offload", ["false", "true"])  # true: saved from the trainer's host copy
def test_tp2_run_from_hf_saves_hf_every_step_equal_to_the_converter(tiny, tmp_path, offload):
    metrics = _train(
        tiny,
        tmp_path,
        f"train.offload_during_rollout={offload}",
        "train.steps=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=1",
        "checkpoint.save_hf.every_steps=1",
        "reference.tau=1",
        timeout=800,
    )
    assert sorted(metrics) == [1, 2] and all(m["time/save_hf"] > 0 for m in metrics.values())
    ckpt = tmp_path / "ckpt"
    assert "base_mcore" not in os.listdir(ckpt)  # started from model.path itself
    assert sorted(os.listdir(ckpt / "hf")) == [step_name(1), step_name(2)]
    env = dict(os.environ, PYTHONPATH=ROOT)
    for step in (1, 2):
        saved = ckpt / "hf" / step_name(step)
        out = tmp_path / f"converted-{step}"
        cmd = [sys.executable, "-m", "armor_megatron.cli.convert", "mcore-to-hf", str(ckpt / f"iter_{step:07d}")]
        proc = subprocess.run([*cmd, str(out), "--quiet"], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]  # no --hf-config: the run recorded it
        ours, theirs = HFCheckpoint(str(saved)), HFCheckpoint(str(out))
        assert sorted(ours.tensors) == sorted(theirs.tensors)
        compared, mismatched = compare_tensors(theirs, ours)
        assert compared == len(theirs.tensors) and mismatched == [], mismatched
        assert json.loads((saved / "config.json").read_text()) == json.loads((out / "config.json").read_text())
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(saved))
    # the policy changed between the steps
    assert compare_tensors(
        HFCheckpoint(str(ckpt / "hf" / step_name(1))), HFCheckpoint(str(ckpt / "hf" / step_name(2)))
    )[1]
    # transformers loads the saved directory as it is; its logits match Megatron's on the checkpoint
    verify = [sys.executable, "-m", "armor_megatron.cli.convert", "verify"]
    proc = subprocess.run(
        [*verify, str(ckpt / "hf" / step_name(2)), str(ckpt / f"iter_{2:07d}")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "logits" in proc.stdout, proc.stdout
