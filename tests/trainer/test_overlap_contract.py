"""The collective contract with ``rollout.overlap: one_step``: the driver's background generation runs
no collective, so at TP=2 every rank makes the same sequence, step for step the synchronous one."""

import os

import pytest

from tests.megatron.spawn import run_ranks
from tests.trainer.test_collective_contract import _train_recorded, first_divergence, loop_level

STEP = [
    "ArmorTrainer._step",
    "broadcast_tensors",
    "broadcast_object",
    "ArmorTrainer._trainer_on_device",
    "barrier",
    "ArmorTrainer.update",
    "barrier",
    "ArmorTrainer.sync_weights",
    "broadcast_object",
    "ArmorTrainer._trainer_on_device",
    "barrier",
    "ArmorTrainer.reset_reference",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_overlapped_run_keeps_every_ranks_collectives_identical(tiny, tmp_path):
    overrides = [
        *tiny,
        "parallelism.tp=2",
        "rollout.overlap=one_step",
        "algorithm.tis.enabled=true",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "train.micro_batch_size=4",
        "train.steps=3",
        "eval.every_steps=1",
        "reference.tau=1",
        "checkpoint.every_steps=2",
        f"checkpoint.dir={tmp_path}/ckpt",
        f"logging.dir={tmp_path}/runs",
        "name=contract",
    ]
    results = run_ranks(_train_recorded, 2, overrides, timeout=540)
    final = results[0][1]
    assert final["rollout/lag"] == 1.0 and final["reference/reset"] == 1.0 and "eval/val/pass@1" in final
    sequences = {r: loop_level(events) for r, (events, _) in enumerate(results)}
    assert first_divergence(sequences) is None, first_divergence(sequences)
    calls = [e[1] for e in sequences[0] if e[0] == "call"]
    starts = [i for i, c in enumerate(calls) if c == "ArmorTrainer._step"]
    assert len(starts) == 3
    for at in starts:
        assert calls[at : at + len(STEP)] == STEP, calls[at:]
    assert calls.count("checkpoint") == 2  # step 2 and the last
    assert os.path.exists(tmp_path / "ckpt" / "latest")
