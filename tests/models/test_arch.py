import pytest
from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from armor_megatron.models import ModelArch, UnsupportedModelError

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
)


@pytest.mark.parametrize(
    "config_cls, family, qkv_bias, qk_norm, experts",
    [
        (LlamaConfig, "llama", False, False, 0),
        (Qwen2Config, "qwen2", True, False, 0),
        (Qwen3Config, "qwen3", False, True, 0),
        (Qwen3MoeConfig, "qwen3_moe", False, True, 4),
        (MixtralConfig, "mixtral", False, False, 4),
    ],
)
def test_families_from_transformers_configs(config_cls, family, qkv_bias, qk_norm, experts):
    extra = {"num_local_experts": 4, "num_experts_per_tok": 2} if experts else {}
    if config_cls is Qwen3MoeConfig:
        extra["moe_intermediate_size"] = 32
    arch = ModelArch.from_hf_config(config_cls(**SMALL, **extra).to_dict())
    assert (arch.family, arch.qkv_bias, arch.qk_norm, arch.num_experts) == (family, qkv_bias, qk_norm, experts)
    assert arch.num_key_value_heads == 2 and arch.queries_per_group == 2
    if config_cls is Qwen3MoeConfig:
        assert arch.moe_ffn_hidden_size == 32 and arch.moe_router_topk == 2


def test_rope_from_old_and_new_keys():
    old = {
        "model_type": "llama",
        **SMALL,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    arch = ModelArch.from_hf_config(old)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling["factor"] == 8.0
    new = {"model_type": "qwen2", **SMALL, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    arch = ModelArch.from_hf_config(new)
    assert arch.rope_theta == 1e6 and arch.rope_scaling is None
    assert arch.head_dim == 16


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        ModelArch.from_hf_config({"model_type": "gpt2", **SMALL})


def test_parallel_divisibility_names_the_key():
    arch = ModelArch.from_hf_config({"model_type": "llama", **SMALL})
    arch.validate_parallelism(tp=2, pp=2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp=4"):
        arch.validate_parallelism(tp=4)
    with pytest.raises(ValueError, match="needs a MoE model"):
        arch.validate_parallelism(ep=2)
