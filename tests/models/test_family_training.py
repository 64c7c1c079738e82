"""A 3-step ``armor-train`` run on CPU for each family added after the first five (Mistral,
Qwen2-MoE, DeepSeek-V2-Lite's layout): the tiny CPU config with ``model.arch`` swapped for an
untrained tiny model of the family (converted, trained with weight sync to the local engine every
step), rewarded by a verifier that random responses satisfy about half the time."""

import os

import pytest

from armor_megatron.config import load_config
from armor_megatron.tasks import tiny_run
from armor_megatron.tasks.arithmetic import write_jsonl
from tests.trainer.test_end_to_end import _train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
ODD_LENGTH = "reward.verifier=tests.trainer.user_hooks:odd_length"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ARCHS = {
    "mistral": (
        [
            "model.arch.model_type=mistral",
            "model.arch.architectures=[MistralForCausalLM]",
            "model.arch.sliding_window=64",
        ],
        ["parallelism.tp=2"],
    ),
    "qwen2_moe": (
        [
            "model.arch.model_type=qwen2_moe",
            "model.arch.architectures=[Qwen2MoeForCausalLM]",
            "model.arch.num_experts=4",
            "model.arch.num_experts_per_tok=2",
            "model.arch.moe_intermediate_size=32",
            "model.arch.shared_expert_intermediate_size=48",
            "model.arch.norm_topk_prob=false",
        ],
        # MoE with tp > 1 needs sequence parallelism (Transformer Engine): experts over ep instead
        ["parallelism.tp=1", "parallelism.ep=2"],
    ),
    # DeepSeek-V2-Lite's layout (MLA without q LoRA, YaRN, first layer dense, routed + 2 shared experts)
    "deepseek": (
        [
            "model.arch.model_type=deepseek_v2",
            "model.arch.architectures=[DeepseekV2ForCausalLM]",
            "model.arch.num_key_value_heads=4",
            "model.arch.q_lora_rank=null",
            "model.arch.kv_lora_rank=32",
            "model.arch.qk_nope_head_dim=16",
            "model.arch.qk_rope_head_dim=8",
            "model.arch.head_dim=8",
            "model.arch.v_head_dim=16",
            "model.arch.n_routed_experts=4",
            "model.arch.n_shared_experts=2",
            "model.arch.num_experts_per_tok=2",
            "model.arch.moe_intermediate_size=24",
            "model.arch.first_k_dense_replace=1",
            "model.arch.topk_method=greedy",
            "model.arch.norm_topk_prob=false",
            "model.arch.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 64, "
            "beta_fast: 32.0, beta_slow: 1.0, mscale: 0.707, mscale_all_dim: 0.707}",
        ],
        ["parallelism.tp=1", "parallelism.ep=2"],
    ),
}


@pytest.mark.parametrize("family", list(ARCHS))
def test_three_steps_of_armor_train(family, tmp_path):
    arch, layout = ARCHS[family]
    paths = [
        f"model.path={tmp_path}/hf",
        f"data.train_path={tmp_path}/train.jsonl",
        f"eval.datasets=[{{name: val, path: {tmp_path}/val.jsonl, k: 1}}]",
        *arch,
    ]
    rows = tiny_run.prepare_tiny_run(load_config(CONFIG, paths + layout), num_val=8, warmup_steps=0, log=None)
    # an untrained model and a verifier that random responses satisfy half the time: groups have signal
    # and anchors are found without the warm-up (which costs more than the run for MoE families)
    write_jsonl(f"{tmp_path}/train.jsonl", [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows["train"]])
    # the ranks as torchrun starts them, on pooled processes (a process start costs more than a step here)
    metrics = _train(
        paths, tmp_path, *layout, ODD_LENGTH, "train.steps=3", "eval.every_steps=0", "checkpoint.every_steps=0"
    )
    assert sorted(metrics) == [1, 2, 3], sorted(metrics)
    assert any(metrics[step].get("train/num_tokens", 0) > 0 for step in (1, 2, 3)), metrics
    for step in (1, 2, 3):
        if metrics[step].get("train/skipped_no_signal"):
            continue
        # the engine sampled with exactly the trainer's weights (weight export after every step)
        assert metrics[step]["rollout/logprob_abs_diff"] < 1e-5
