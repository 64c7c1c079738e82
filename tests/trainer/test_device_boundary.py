"""Host/device discipline of the trainer, checked on CPU with models whose outputs claim to live on
an accelerator (tests/trainer/device_harness.py): the trainer must bring every result to the host
before mixing it with the broadcast batch, and its collectives must run on the GPU job's group."""

import types

import pytest
import torch
import torch.distributed as dist

from armor_megatron.config import load_config
from armor_megatron.megatron.dist import process_group_backend
from armor_megatron.trainer.collectives import any_rank
from armor_megatron.trainer.loop import ArmorTrainer
from armor_megatron.trainer.step_report import StepTimer
from tests.trainer.device_harness import emulated_backend, is_host, on_accelerator
from tests.trainer.test_advantages import PPO_CONFIG

N, L = 4, 6


def test_harness_raises_like_cuda_on_mixed_devices():
    device, host = on_accelerator(torch.ones(2, 3)), torch.ones(2, 3)
    with pytest.raises(RuntimeError, match="same device"):
        device - host
    assert not is_host(device * 2 + torch.tensor(1.0))  # 0-dim host tensors mix, results stay put
    assert is_host(device.cpu()) and is_host(device.to("cpu")) and float(device.sum()) == 6.0


class DeviceModel:
    """A Megatron model's public surface whose results live on the (emulated) accelerator; it
    records the batches it is given for training."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.trained_on: list[dict] = []

    def _per_token(self, input_ids):
        return on_accelerator(-torch.rand(input_ids.shape, generator=self.gen))

    def compute_logprobs(self, input_ids, lengths, with_entropy=False):
        return types.SimpleNamespace(logprobs=self._per_token(input_ids), entropy=None)

    def compute_values(self, input_ids, lengths):
        return self._per_token(input_ids)

    def train_step(self, batch):
        assert all(is_host(v) for v in batch.values()), "train batches cross to the device inside the model"
        self.trained_on.append(batch)
        return {"loss": 0.5}


def step_batch():
    mask = torch.zeros(N, L)
    mask[:, 2:5] = 1.0
    return {
        "input_ids": torch.randint(0, 9, (N, L)),
        "lengths": torch.full((N,), 5),
        "response_mask": mask,
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "engine_logprobs": -torch.rand(N, L) * mask,
        "is_anchor": torch.tensor([False, False, False, True]),
    }


@pytest.mark.parametrize("with_critic", [False, True])
def test_update_brings_every_model_result_to_the_host(with_critic):
    cfg = load_config(PPO_CONFIG) if with_critic else load_config(PPO_CONFIG, ["algorithm.estimator=dapo"])
    trainer = object.__new__(ArmorTrainer)  # update() needs the models and the config, not engines or data
    trainer.cfg, trainer.step = cfg, cfg.critic.warmup_steps
    trainer.actor, trainer.reference = DeviceModel(0), DeviceModel(1)
    trainer.critic = DeviceModel(2) if with_critic else None
    batch = step_batch()
    metrics = trainer.update(batch, StepTimer())
    for key in ("old_logprobs", "ref_logprobs") + (("old_values", "advantages", "returns") if with_critic else ()):
        assert is_host(batch[key]), key
    assert metrics["rollout/logprob_abs_diff"] > 0 and trainer.actor.trained_on
    if with_critic:
        assert trainer.critic.trained_on and "critic/old_explained_var" in metrics


@pytest.mark.parametrize("with_critic", [False, True])
def test_a_trainer_that_keeps_model_results_on_the_device_fails_here(with_critic, monkeypatch):
    """The test above can fail: with ``to_host`` a no-op (results left on the device, as the trainer
    once did), update() mixes them with the host batch and the harness raises CUDA's error."""
    from armor_megatron.trainer import update_phase

    monkeypatch.setattr(update_phase, "to_host", lambda t: t.detach())
    with pytest.raises(RuntimeError, match="same device"):
        test_update_brings_every_model_result_to_the_host(with_critic)


def any_rank_worker(rank, backend):
    """``any_rank`` at world size 2 on a group of `backend`: rank 1 alone raises its flag, then no
    rank does; returns (both results) or the error a group refusing host tensors raises."""
    dist.init_process_group(backend)
    try:
        return any_rank(rank == 1), any_rank(False)
    except RuntimeError as e:
        return str(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_host_collectives_run_on_the_gpu_jobs_default_group():  # two 2-rank launches
    from tests.megatron.spawn import run_ranks

    gpu_job = emulated_backend(process_group_backend(on_cuda=True))  # cpu:gloo,cuda:nccl -> cpu:gloo,cuda:gloo
    assert run_ranks(any_rank_worker, 2, gpu_job, timeout=100) == [(True, False), (True, False)]
    nccl_only = emulated_backend("nccl")  # the NCCL-only default group: it carries device tensors alone
    for error in run_ranks(any_rank_worker, 2, nccl_only, timeout=100):
        assert "No backend type associated with device type cpu" in error
