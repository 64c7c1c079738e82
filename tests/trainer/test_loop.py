"""Pure helpers of the loop (trainer/loop.py, trainer/driver_rollout.py)."""

import contextlib
import os
import signal
from types import SimpleNamespace

import pytest

from armor_megatron.trainer.driver_rollout import merge_rounds
from armor_megatron.trainer.loop import ArmorTrainer
from armor_megatron.trainer.preemption import Preempted


def test_rollout_rounds_merge_anchor_rates_and_sum_generation_costs():
    rounds = [
        {"rollout/accuracy": 0.5, "rollout/generated_tokens": 100.0, "anchor/found_rate": 0.0, "anchor/tries": 8.0},
        {"rollout/accuracy": 0.9, "rollout/generated_tokens": 60.0, "anchor/found_rate": 1.0, "anchor/tries": 4.0},
    ]
    merged = merge_rounds(rounds)
    assert merged["rollout/accuracy"] == 0.5  # the first round describes the policy
    assert merged["anchor/found_rate"] == 0.5 and merged["anchor/tries"] == 12.0
    assert merged["rollout/generated_tokens"] == 160.0


def _stub_trainer(steps: int, signal_at_step: int, signum):
    """What ArmorTrainer.run reads of its trainer, with a step that raises ``signum`` at a given step."""

    def step(save, save_hf=None):
        trainer.step += 1
        if trainer.step == signal_at_step:
            os.kill(os.getpid(), signum)
        return {"step": trainer.step}, False

    cfg = SimpleNamespace(train=SimpleNamespace(steps=steps), eval=SimpleNamespace(every_steps=0))
    trainer = SimpleNamespace(
        cfg=cfg,
        step=0,
        is_driver=False,
        driver=None,  # no driver: the signal stops the reward calls at once, no partial rollouts
        _step=step,
        _trainer_on_device=contextlib.nullcontext,  # no engines, no offload
        memory=SimpleNamespace(park_trainer=lambda: None),
        checkpoints=SimpleNamespace(step=None),
    )
    return trainer


def test_a_preemption_signal_checkpoints_and_stops_but_not_after_the_last_step():
    saves = []
    trainer = _stub_trainer(steps=5, signal_at_step=2, signum=signal.SIGUSR1)
    with pytest.raises(Preempted, match="SIGUSR1 at step 2: checkpoint saved"):
        ArmorTrainer.run(trainer, save=lambda: saves.append(trainer.step))
    assert saves == [2]
    # during the last step: the run is complete, its final checkpoint is the loop's; no requeue
    trainer = _stub_trainer(steps=3, signal_at_step=3, signum=signal.SIGTERM)
    ArmorTrainer.run(trainer, save=lambda: saves.append(trainer.step))
    assert trainer.step == 3 and saves == [2]
