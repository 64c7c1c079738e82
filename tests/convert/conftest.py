"""Tiny random HF models of every supported family, saved by transformers (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=256,
    max_position_embeddings=256,
)

# DeepSeek-V2-Lite's layout scaled down: no q LoRA, a kv LoRA rank, YaRN rope, the first layer
# dense, then routed experts (softmax, greedy top-k, not renormalised) plus two shared experts.
DEEPSEEK_V2_LITE_TINY = dict(
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    head_dim=8,
    n_routed_experts=4,
    n_shared_experts=2,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    first_k_dense_replace=1,
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
)

# DeepSeek-V3's layout scaled down: q LoRA, sigmoid routing with a selection bias
# (e_score_correction_bias), experts in 2 groups ranked by their top-2, top-k renormalised and
# scaled, one shared expert, the first layer dense, one multi-token-prediction layer in the config
# (transformers builds none; tests/convert/test_families.py appends its tensors).
DEEPSEEK_V3_TINY = dict(
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    head_dim=8,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    moe_intermediate_size=24,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    num_nextn_predict_layers=1,
)

# family -> (transformers config class name, extra config)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mistral": ("MistralConfig", dict(sliding_window=128, rope_theta=1e6)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            use_sliding_window=False,
        ),
    ),
}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
# Built by save_tiny_model, tested end to end in tests/convert/test_families.py (MLA, mixed dense
# and MoE layers under per-layer keys).
DEEPSEEK_FAMILIES = {
    "deepseek": ("DeepseekV2Config", DEEPSEEK_V2_LITE_TINY),
    # V2-shaped attention (q LoRA rank) with every layer dense: homogeneous, stacked keys, TP=2
    "deepseek_dense": ("DeepseekV2Config", {**DEEPSEEK_V2_LITE_TINY, "q_lora_rank": 24, "first_k_dense_replace": 2}),
    "deepseek_v3": ("DeepseekV3Config", DEEPSEEK_V3_TINY),
}


def save_tokenizer(path: str) -> None:
    """A word-level tokenizer built locally (tokenizers), saved like a hub tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(253)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        path
    )


def save_tiny_model(family: str, path: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> str:
    """Build a random ``family`` model with transformers and ``save_pretrained`` it to ``path``.

    Every tensor is drawn at random (norm weights around 1; DeepSeek-V3's router bias buffer too),
    so a swapped or mis-ordered tensor changes the logits."""
    import transformers

    config_cls, extra = {**FAMILIES, **DEEPSEEK_FAMILIES}[family]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """family -> HF directory of a tiny fp32 model (saved once per test session)."""
    root = tmp_path_factory.mktemp("hf")
    return {family: save_tiny_model(family, os.path.join(root, family)) for family in FAMILIES}
