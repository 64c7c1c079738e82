"""HF in, HF out: a tiny TP=2 run starts from an HF directory (no converted copy), writes the policy
as an HF model directory after every step, and each equals the converter's output
(``armor-convert mcore-to-hf``'s `convert_mcore_to_hf`) of the same step's checkpoint bit for bit; transformers loads it and matches the Megatron logits. Plus the
schedule, pruning and the recorded HF files in-process."""

import json
import os
import subprocess
import sys

import pytest

from armor_megatron.config.schema import SaveHFConfig
from armor_megatron.convert import convert_mcore_to_hf
from armor_megatron.convert.hf_io import HFCheckpoint
from armor_megatron.convert.verify import compare_tensors
from armor_megatron.trainer.hf_save import prune_hf, record_hf_files, save_hf_due, step_name
from tests.trainer.test_end_to_end import _args, _env, _latest, _train

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


def test_a_killed_export_is_found_and_its_leftovers_removed(tmp_path, capsys):
    """What a resume finishes: the copy its checkpoint's step was due (mid-run or final) and lacks."""
    from armor_megatron.trainer.hf_save import export_unfinished, remove_export_leftovers

    every_2 = SaveHFConfig(every_steps=2)
    assert export_unfinished(every_2, str(tmp_path), 4, 10)  # killed during the export of step 4
    assert export_unfinished(every_2, str(tmp_path), 10, 10)  # killed during the final export
    assert not export_unfinished(every_2, str(tmp_path), 3, 10)  # none was due at step 3
    assert not export_unfinished(SaveHFConfig(at_end=False), str(tmp_path), 10, 10)
    assert not export_unfinished(every_2, str(tmp_path), 0, 10)  # a fresh start
    (tmp_path / "hf" / step_name(4)).mkdir(parents=True)
    assert not export_unfinished(every_2, str(tmp_path), 4, 10)  # it finished

    staging, old = tmp_path / "hf" / ".step_0000006.tmp-ab12", tmp_path / "hf" / "step_0000004.tmp-old-cd34"
    staging.mkdir()
    old.mkdir()
    (staging / "model-rank00000-00000.safetensors").write_bytes(b"half")
    assert remove_export_leftovers(str(tmp_path)) == [str(staging), str(old)]
    assert os.listdir(tmp_path / "hf") == [step_name(4)]
    out = capsys.readouterr().out
    assert f"removed {staging}, left by an HF export that did not finish" in out and str(old) in out
    assert remove_export_leftovers(str(tmp_path / "nothing")) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_during_the_final_export_then_resume_writes_it(tiny, tmp_path):
    """``armor-train`` killed (-9, its whole process group) while exporting the policy after the last
    step: the checkpoint of that step is saved, its HF copy is not. Resuming the finished run writes
    the copy (equal to the converter's output of the checkpoint), removes the staging directory and
    exits 0. One process (TP=1): what is killed and what resumes does not depend on the layout, and
    the TP=2 exports are checked against the converter above."""
    import signal
    import time

    import psutil

    common = ["parallelism.tp=1", "train.steps=2", "eval.every_steps=0", "checkpoint.every_steps=1", "reference.tau=1"]
    hook = os.path.join(ROOT, "tests", "trainer", "slow_hf_export")
    env = dict(_env(), PYTHONPATH=hook + os.pathsep + _env()["PYTHONPATH"], ARMOR_TEST_EXPORT_STALL_S="600")
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        _args(tiny, tmp_path, *common), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 600
        staged = []
        while not staged:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "the run never reached its final export"
            hf = ckpt / "hf"
            staged = [n for n in os.listdir(hf) if ".tmp-" in n] if hf.is_dir() else []
            staged = [n for n in staged if (hf / n / "config.json").exists()]  # complete, not yet renamed
            time.sleep(0.05)
        ranks = psutil.Process(proc.pid).children(recursive=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    psutil.wait_procs(ranks, timeout=30)
    assert _latest(tmp_path) == "iter_0000002" and staged == [n for n in os.listdir(ckpt / "hf")]

    proc = subprocess.run(
        _args(tiny, tmp_path, *common), env=_env(), capture_output=True, text=True, timeout=420
    )  # the same command again: checkpoint.resume is auto
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"removed {ckpt / 'hf' / staged[0]}, left by an HF export that did not finish" in proc.stdout
    assert "the HF copy of step 2 was due but never finished: writing it now" in proc.stdout
    assert os.listdir(ckpt / "hf") == [step_name(2)]
    out = tmp_path / "converted"
    convert_mcore_to_hf(str(ckpt / "iter_0000002"), str(out))
    ours, theirs = HFCheckpoint(str(ckpt / "hf" / step_name(2))), HFCheckpoint(str(out))
    compared, mismatched = compare_tensors(theirs, ours)
    assert compared == len(theirs.tensors) == len(ours.tensors) and mismatched == [], mismatched

    again = subprocess.run(_args(tiny, tmp_path, *common), env=_env(), capture_output=True, text=True, timeout=420)
    assert again.returncode == 0 and "writing it now" not in again.stdout  # done once


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
    for step in (1, 2):
        saved = ckpt / "hf" / step_name(step)
        out = tmp_path / f"converted-{step}"
        convert_mcore_to_hf(str(ckpt / f"iter_{step:07d}"), str(out))  # no hf_config_dir: the run recorded it
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
    if offload == "true":  # the same bytes as the converter's, as without offload: loaded below once
        return
    # transformers loads the saved directory as it is; its logits match Megatron's on the checkpoint
    verify = [sys.executable, "-m", "armor_megatron.cli.convert", "verify"]
    proc = subprocess.run(
        [*verify, str(ckpt / "hf" / step_name(2)), str(ckpt / f"iter_{2:07d}")],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "logits" in proc.stdout, proc.stdout
