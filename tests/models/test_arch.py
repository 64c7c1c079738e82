import json

import pytest
from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from armor_megatron.errors import UserInputError
from armor_megatron.models import ModelArch, UnsupportedModelError
from armor_megatron.models.arch import InconsistentModelConfigError
from armor_megatron.models.families.deepseek import GroupRouting, LatentAttention

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


@pytest.mark.parametrize(
    "sizes, message",
    [
        (
            dict(num_attention_heads=5, num_key_value_heads=5),
            "hidden_size 64 is not divisible by num_attention_heads 5",
        ),
        (
            dict(num_attention_heads=4, num_key_value_heads=3),
            "num_attention_heads 4 is not divisible by num_key_value_heads 3",
        ),
    ],
)
def test_heads_that_do_not_divide_are_named_not_blamed_on_a_tensor(tmp_path, sizes, message):
    with pytest.raises(InconsistentModelConfigError, match=f"^{message}") as err:
        ModelArch.from_hf_config({"model_type": "llama", **SMALL, **sizes})
    assert isinstance(err.value, UserInputError) and "\n" not in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **SMALL, **sizes}))
    with pytest.raises(InconsistentModelConfigError, match=f"config.json: {message}"):
        ModelArch.from_hf_dir(str(tmp_path))
    # a head_dim of its own frees the hidden size from the heads (Qwen3-style configs)
    assert (
        ModelArch.from_hf_config(
            {"model_type": "llama", **SMALL, "num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 16}
        ).head_dim
        == 16
    )


def test_parallel_divisibility_names_the_key():
    arch = ModelArch.from_hf_config({"model_type": "llama", **SMALL})
    arch.validate_parallelism(tp=2, pp=2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp=4"):
        arch.validate_parallelism(tp=4)
    with pytest.raises(ValueError, match="needs a MoE model"):
        arch.validate_parallelism(ep=2)


def test_mistral_is_llama_layout_with_its_window_recorded():
    from transformers import MistralConfig

    arch = ModelArch.from_hf_config(MistralConfig(**SMALL, sliding_window=4096).to_dict())
    assert (arch.family, arch.qkv_bias, arch.qk_norm, arch.num_experts, arch.sliding_window) == (
        "mistral",
        False,
        False,
        0,
        4096,
    )


def test_qwen2_moe_has_a_gated_shared_expert():
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    )
    arch = ModelArch.from_hf_config(cfg.to_dict())
    assert (arch.family, arch.qkv_bias, arch.moe_norm_topk_prob) == ("qwen2_moe", True, False)
    assert (arch.moe_shared_expert_ffn_hidden_size, arch.moe_shared_expert_gate) == (48, True)
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        ModelArch.from_hf_config({**cfg.to_dict(), "mlp_only_layers": [0]})


DEEPSEEK = dict(
    SMALL,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    first_k_dense_replace=1,
)


def test_deepseek_v2_lite_layout():
    from transformers import DeepseekV2Config

    arch = ModelArch.from_hf_config(DeepseekV2Config(**DEEPSEEK).to_dict())
    assert arch.mla == LatentAttention(q_lora_rank=0, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=12)
    assert (arch.family, arch.is_mla, arch.head_dim, arch.qk_nope_head_dim) == ("deepseek", True, 24, 16)
    assert arch.num_key_value_heads == arch.num_attention_heads and arch.attention_out_dim == 4 * 12
    assert (arch.num_experts, arch.moe_shared_expert_ffn_hidden_size, arch.moe_norm_topk_prob) == (8, 48, False)
    assert [arch.is_moe_layer(i) for i in range(2)] == [False, True] and not arch.homogeneous_layers


def test_deepseek_v3_routing_and_mtp():
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(**{**DEEPSEEK, "q_lora_rank": 24}, n_group=4, topk_group=1, routed_scaling_factor=2.5)
    arch = ModelArch.from_hf_config(cfg.to_dict())
    assert arch.routing == GroupRouting(
        score_function="sigmoid", scaling_factor=2.5, num_groups=4, group_topk=1, expert_bias=True
    )
    assert arch.moe_norm_topk_prob and arch.mtp_layers == 1 and arch.mla is not None and arch.mla.q_lora_rank == 24
    # megatron-core ranks groups by their top (topk // topk_group) experts; V3 by its top 2
    with pytest.raises(UnsupportedModelError, match="top-2"):
        ModelArch.from_hf_config({**cfg.to_dict(), "topk_group": 2})
    with pytest.raises(UnsupportedModelError, match="rope_interleave false"):
        ModelArch.from_hf_config({**cfg.to_dict(), "rope_interleave": False})


def test_deepseek_v2_group_limited_routing_only_where_megatron_matches():
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(**DEEPSEEK, topk_method="group_limited_greedy", n_group=4, topk_group=2).to_dict()
    arch = ModelArch.from_hf_config(cfg)
    assert arch.routing is not None and (arch.routing.num_groups, arch.routing.group_topk) == (4, 2)
    with pytest.raises(UnsupportedModelError, match="group_limited_greedy"):
        ModelArch.from_hf_config({**cfg, "topk_group": 1})
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob"):
        ModelArch.from_hf_config({**cfg, "norm_topk_prob": True})


def test_yarn_only_for_deepseek():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        ModelArch.from_hf_config({"model_type": "llama", **SMALL, "rope_scaling": yarn})


@pytest.mark.parametrize(
    "content, message",
    [
        (b"[1]", "config.json: must hold a JSON object, not a list"),
        (b"{", r"config.json:1: invalid JSON"),
        (b'{"model_type": "llama\xff"}', "config.json: not UTF-8 text"),
        (
            b'{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}',
            "config.json: no 'vocab_size'",
        ),
        (
            b'{"model_type": "llama", "hidden_size": "two", "num_attention_heads": 4}',
            r"config.json: invalid literal for int\(\) with base 10: 'two'",
        ),
        (b'{"model_type": "gpt2"}', "unsupported architecture 'gpt2'"),
    ],
    ids=["list", "torn", "latin1", "missing-key", "wrong-type", "unsupported"],
)
def test_a_broken_config_json_is_one_line_naming_it(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        ModelArch.from_hf_dir(str(tmp_path))
    assert "\n" not in str(err.value)
