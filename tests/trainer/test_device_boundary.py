"""Host/device discipline of the trainer, checked on CPU with models whose outputs claim to live on
an accelerator (tests/trainer/device_harness.py): the trainer must bring every result to the host
before mixing it with the broadcast batch, and its collectives must run on the GPU job's group."""

import tempfile
import types

import pytest
import torch
import torch.distributed as dist

from armor_megatron.config import load_config
from armor_megatron.megatron.dist import process_group_backend
from armor_megatron.trainer.collectives import any_rank
from armor_megatron.trainer.loop import ArmorTrainer, StepTimer
from tests.trainer.device_harness import MIXED_DEVICES, emulated_backend, is_host, on_accelerator
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


def test_the_pre_fix_trainer_would_mix_devices():
    """What dd0ccb9's update did with the actor's device result: subtract it from the host batch."""
    batch = step_batch()
    batch["old_logprobs"] = DeviceModel(0).compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs
    with pytest.raises(RuntimeError, match="same device"):
        batch["engine_logprobs"] - batch["old_logprobs"]
    assert "cuda:0 and cpu" in MIXED_DEVICES


def _any_rank_on(backend: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            # world size 1 skips the collective; run the reduction the way any_rank does at scale
            flag = torch.tensor([1.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return any_rank(bool(flag.item()))
        finally:
            dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_host_collectives_run_on_the_gpu_jobs_default_group():
    assert _any_rank_on(emulated_backend(process_group_backend(on_cuda=True)))
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        _any_rank_on(emulated_backend("nccl"))  # dd0ccb9's NCCL-only default group
