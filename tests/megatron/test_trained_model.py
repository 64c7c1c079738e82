"""`trained_model.ModelSettings`: one run config gives the actor, critic and reference the same build."""

import pytest
import torch

from armor_megatron.config.load import load_config
from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.megatron.microbatch import TokenBudget
from armor_megatron.megatron.model import MoESettings, Recompute, Throughput
from armor_megatron.megatron.trained_model import ModelSettings
from tests.megatron.test_parallel_logprobs import QWEN3


def test_settings_of_a_run_config_carry_its_model_train_throughput_and_moe_sections():
    cfg = load_config(
        "configs/tiny_cpu.yaml",
        [
            "model.dtype=bfloat16",
            "model.spec=te",
            "train.micro_batch_size=3",
            "train.max_tokens_per_micro_batch=96",
            "train.recompute=selective",
        ],
    )
    parallel = ParallelConfig(tp=2)
    settings = ModelSettings.of(cfg, QWEN3, parallel, init_weights=False)
    assert settings == ModelSettings(
        QWEN3,
        parallel,
        dtype=torch.bfloat16,
        micro_batch_size=3,
        use_te=True,
        token_budget=TokenBudget(96, 96),
        recompute=Recompute("selective", cfg.train.recompute_method, cfg.train.recompute_num_layers),
        throughput=Throughput.of(cfg.throughput),
        moe=MoESettings.of(cfg.moe),
        init_weights=False,
    )
    use_te = {s: ModelSettings.of(load_config("configs/tiny_cpu.yaml", [f"model.spec={s}"]), QWEN3, parallel).use_te
              for s in ("auto", "local", "te")}  # fmt: skip
    assert use_te == {"auto": None, "local": False, "te": True}


def test_settings_refuse_an_empty_micro_batch():
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1, got 0"):
        ModelSettings(QWEN3, ParallelConfig(), dtype="float32", micro_batch_size=0)
