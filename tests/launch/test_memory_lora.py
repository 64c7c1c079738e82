"""The memory plan of a LoRA run (``lora.enabled``): the base in the model dtype only, the adapters
trained (gradients and optimizer state), no reference weights; adapter counts as megatron builds them."""

import os

from armor_megatron.config import load_config
from armor_megatron.config.validate import model_arch_of
from armor_megatron.launch.memory import lora_params_per_gpu, params_per_gpu, plan_memory
from armor_megatron.megatron.dist import ParallelConfig
from tests.megatron.test_lora import ARCH, _actor, _lora

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEVEN_B = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_adapter_parameters_per_gpu_are_what_megatron_builds(world_of_one):
    from armor_megatron.megatron import dist as mdist

    mdist.set_model_parallel(ParallelConfig(), ARCH, seed=5)
    actor = _actor(lora=_lora())  # rank 4, every target
    built = sum(p.numel() for c in actor.model_chunks for p in c.parameters() if p.requires_grad)
    planned, width = lora_params_per_gpu(ARCH, TARGETS, 4, tp=1, pp=1, stage=0)
    assert planned == built and width == 4 * 7 * ARCH.num_layers
    # tp=2: B of the column-parallel and A of the row-parallel linears are halved; pp=2: half the layers
    h, q, kv, f = 32, 32, 16, 48
    column = 4 * h * 3 + (q + 2 * kv) * 4 / 2 + 4 * h * 2 + 2 * f * 4 / 2
    row = 4 * q / 2 + h * 4 + 4 * f / 2 + h * 4
    assert lora_params_per_gpu(ARCH, TARGETS, 4, tp=2, pp=2, stage=1)[0] == (column + row) * ARCH.num_layers / 2


def test_the_7b_recipe_at_rank_64_holds_under_half_the_state_of_full_fine_tuning():
    plans = {}
    for lora in (False, True):
        extra = ["lora.enabled=true", "lora.rank=64", "lora.alpha=128"] if lora else []
        cfg = load_config(SEVEN_B, ["model.spec=local", "parallelism.sp=false", *extra])
        plans[lora] = plan_memory(cfg, model_arch_of(cfg)).stages[0].terms
    full, lora = plans[False], plans[True]
    cfg = load_config(SEVEN_B, [])
    dense, _ = params_per_gpu(model_arch_of(cfg), 2, 1, 1, 0)
    assert full["reference"] == 2 * dense and lora["reference"] == 0.0  # the base is the reference
    assert 2 * dense < lora["weights"] < 2.1 * dense  # rank-64 adapters: ~3 % of the base per GPU
    assert lora["gradients"] < 0.03 * full["gradients"] and lora["optimizer"] < 0.03 * full["optimizer"]
    state = [sum(t[k] for k in ("weights", "gradients", "optimizer", "reference")) for t in (full, lora)]
    assert state[1] / state[0] <= 0.45
    assert lora["activations"] > full["activations"]  # the r-wide products x·Aᵀ are kept for B's gradient
