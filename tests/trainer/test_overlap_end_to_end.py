"""``rollout.overlap: one_step`` through ``armor-train`` on the tiny model (local engine, one process):
the forced wait equals ``off`` bit for bit; one-step staleness with versions checked, TIS on, anchors
of an old reference resampled across resets; kill -9 and SIGTERM mid-overlap resume exactly."""

import subprocess

import pytest

from armor_megatron.megatron.checkpoint import load_trainer_state
from tests.processes import stopped_after
from tests.trainer.test_end_to_end import _args, _env, _kill_9_at_checkpoint, _latest, _train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ONE_STEP = ["parallelism.tp=1", "rollout.overlap=one_step", "algorithm.tis.enabled=true"]
# what a step computes: equal in two runs that trained alike
COMPARED = ("rollout/accuracy", "rollout/reward", "train/loss", "train/grad_norm", "train/tis_weight_mean")


def test_forced_wait_is_bit_identical_to_off(tiny, tmp_path):
    common = [
        "parallelism.tp=1",
        "algorithm.tis.enabled=true",
        "rollout.temperature=0.7",
        "train.steps=4",
        "reference.tau=2",
        "eval.every_steps=2",
        "checkpoint.every_steps=0",
    ]
    off = _train(tiny, tmp_path / "off", *common)
    waited = _train(tiny, tmp_path / "wait", *common, "rollout.overlap=one_step", "rollout.overlap_forced_wait=true")
    assert sorted(off) == sorted(waited) == [0, 1, 2, 3, 4]
    for step in range(5):
        keys = {k for k in off[step] if k.split("/")[0] in ("rollout", "train", "anchor", "eval", "reference")}
        keys -= {"anchor/stale_resampled"}
        assert keys, step
        for key in keys:
            assert waited[step][key] == off[step][key], (step, key)
    for step in range(1, 5):  # every batch came from the weights the step trains from
        assert waited[step]["rollout/lag"] == 0.0 and waited[step]["anchor/stale_resampled"] == 0.0


def test_one_step_staleness_resets_and_exact_resume_after_kill_9_and_sigterm(tiny, tmp_path):
    common = [
        *ONE_STEP,
        "train.steps=4",
        "checkpoint.every_steps=2",
        "eval.every_steps=2",
        "reference.tau=1",
        "reward.verifier=tests.trainer.user_hooks:odd_length_signalling",  # odd_length, unless told to signal
        "data.type_key=no_such_column",  # every row by reward.verifier
    ]
    straight = _train(tiny, tmp_path / "straight", *common)
    assert sorted(straight) == [0, 1, 2, 3, 4]
    assert straight[1]["rollout/lag"] == 0.0  # the first batch: generated before any update
    for step in (2, 3, 4):
        m = straight[step]
        # every on-policy sample of step t+1 carries the weights step t trained from (one update behind),
        # but those drawn after a reset to fill the slot of an anchor the new reference did not find
        assert m["rollout/lag"] == 1.0, (step, m)
        assert m["rollout/lag_min"] == 1.0 or m["anchor/stale_resampled"] > 0, (step, m)
        # the staleness is visible to TIS, which reweights by min(π_old/π_engine, C)
        assert m["rollout/logprob_abs_diff"] > 1e-4 and m["train/tis_weight_mean"] != 1.0
        # the next step's batch generated during the update; the last step starts none
        assert (m["time/generation"] > 0.0) == (step < 4) and "time/trainer_idle_frac" in m, (step, m)
        assert m["timeline/rollout_begin"] < m["timeline/update_begin"]
    # tau = 1: a reset after every step; the batch generated during step t held anchors of the old
    # reference, resampled before step t+1 trained (the loop refuses an anchor of another reference)
    assert sum(straight[step]["anchor/stale_resampled"] for step in (2, 3, 4)) > 0
    for step in (2, 3, 4):  # the batch generated during step t-1 overlapped that step's update
        assert straight[step]["timeline/rollout_begin"] < straight[step - 1]["timeline/update_end"]

    # kill -9 during step 3, while the generation of step 4's batch runs
    run = tmp_path / "killed"
    _kill_9_at_checkpoint(_args(tiny, run, *common), run, "iter_0000002")
    resumed = _train(tiny, run, *common)
    assert sorted(resumed) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for key in (*COMPARED, "rollout/lag", "anchor/stale_resampled"):
            assert resumed[step][key] == straight[step][key], (step, key)
    assert resumed[4]["eval/val/pass@1"] == straight[4]["eval/val/pass@1"]

    # SIGTERM while the batch of step 2 is scoring, generated beside step 1's update from the weights
    # before it (call 150: the evaluation at step 0 and step 1's rollout made 137): the generation finishes, the
    # preemption checkpoint holds its batch, and the resumed run trains on it exactly
    run = tmp_path / "preempted"
    calls = tmp_path / "calls"
    calls.mkdir()
    env = {**_env(), "ARMOR_TEST_CALL_DIR": str(calls), "ARMOR_TEST_SIGTERM_AT_CALL": "150"}
    proc = subprocess.Popen(
        _args(tiny, run, *common), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    with stopped_after(proc):
        _, err = proc.communicate(timeout=400)
    assert proc.returncode == 85, err[-2000:]
    assert "preempted: SIGTERM at step 1: checkpoint saved" in err, err[-2000:]
    pending = load_trainer_state(str(run / "ckpt" / _latest(run)))["pending_batch"]
    assert _latest(run) == "iter_0000001" and pending is not None and pending["for_step"] == 1
    resumed = _train(tiny, run, *common)
    assert sorted(resumed) == [0, 1, 2, 3, 4]  # steps 0 and 1 logged before the signal
    for step in (2, 3, 4):
        for key in (*COMPARED, "rollout/lag", "anchor/stale_resampled"):
            assert resumed[step][key] == straight[step][key], (step, key)


def test_the_tiny_task_still_learns_with_one_step(tiny, tmp_path):
    metrics = _train(
        tiny,
        tmp_path,
        *ONE_STEP,
        "train.steps=40",
        "rollout.prompts_per_step=32",
        "rollout.group_size=8",
        "train.micro_batch_size=32",
        "optimizer.lr=5e-4",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        timeout=1200,
    )
    reward = [metrics[step]["rollout/reward"] for step in range(1, 41)]
    # 256 samples a step at a success rate near 0.07: a 10-step mean has a standard error near 0.005
    assert sum(reward[-10:]) / 10 > sum(reward[:10]) / 10 + 0.01, reward
    assert all(metrics[step]["rollout/lag"] == 1.0 for step in range(2, 41))
