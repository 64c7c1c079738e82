"""A model family is one registered definition: a family declared here, and nowhere else, is read
from its HF config, converted HF -> Megatron -> HF bit for bit, built by megatron with the options it
declares, and counted by the FLOPs and memory models."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from armor_megatron.models import FAMILIES, Family, MegatronSpec, ModelArch, UnsupportedModelError
from armor_megatron.models.tensors import AttentionNames, MoENames

TOY_CONFIG = {
    "model_type": "toy_moe",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "vocab_size": 64,
    "n_experts": 3,
    "experts_per_token": 2,
    "expert_width": 16,
    "torch_dtype": "float32",
}


class ToyMoE(Family):
    """What a new family's module holds: its name table (per-head q/k norms, experts named its own
    way), experts read from its own config keys, a per-sequence balancing loss, no fused RoPE, one extra config field."""

    model_types = ("toy_moe",)
    architectures = ("ToyMoeForCausalLM",)
    attention_names = AttentionNames(
        input_norm="input_layernorm.weight",
        q="self_attn.q_proj",
        k="self_attn.k_proj",
        v="self_attn.v_proj",
        o="self_attn.o_proj.weight",
        q_norm="self_attn.q_norm.weight",
        k_norm="self_attn.k_norm.weight",
    )
    moe_names = MoENames(
        pre_mlp_norm="post_attention_layernorm.weight",
        router="moe.router.weight",
        experts="moe.experts.",
        expert_gate="wg.weight",
        expert_up="wu.weight",
        expert_down="wd.weight",
    )

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return dict(
            qk_norm=True,
            num_experts=int(cfg["n_experts"]),
            moe_router_topk=int(cfg["experts_per_token"]),
            moe_ffn_hidden_size=int(cfg["expert_width"]),
        )

    def megatron(self, arch: ModelArch) -> MegatronSpec:
        return MegatronSpec(
            qk_layernorm=True,
            config_fields={"attention_softmax_in_fp32": True},
            fused_rope_refused="toy RoPE is not fused",
            default_load_balancing="seq_aux_loss",
        )


@pytest.fixture
def toy():
    FAMILIES.register("toy_moe")(ToyMoE)
    try:
        yield ModelArch.from_hf_config(TOY_CONFIG)
    finally:
        FAMILIES.unregister("toy_moe")


def test_config_reading(toy):
    assert (toy.family, toy.qk_norm, toy.num_experts, toy.moe_router_topk, toy.moe_ffn_hidden_size) == (
        "toy_moe",
        True,
        3,
        2,
        16,
    )
    by_architecture = {k: v for k, v in TOY_CONFIG.items() if k != "model_type"}
    assert ModelArch.from_hf_config({**by_architecture, "architectures": ["ToyMoeForCausalLM"]}).family == "toy_moe"


def test_an_unregistered_family_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'toy_moe'; supported families: .*llama"):
        ModelArch.from_hf_config(TOY_CONFIG)


def test_conversion_rules_and_a_bit_identical_round_trip(toy, tmp_path):
    from armor_megatron.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from armor_megatron.convert.hf_io import HFCheckpoint
    from armor_megatron.convert.rules import hf_shapes, hf_tensor_names, resolve_param, tensor_rules
    from armor_megatron.convert.verify import compare_tensors

    names = hf_tensor_names(toy)
    assert "model.layers.1.moe.experts.2.wu.weight" in names and "model.layers.0.self_attn.k_norm.weight" in names
    ref = resolve_param(toy, "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight")
    assert ref.hf_names == ["model.layers.1.moe.experts.2.wg.weight", "model.layers.1.moe.experts.2.wu.weight"]

    torch.manual_seed(0)
    tensors = {}
    for rule in tensor_rules(toy):
        for layer, expert in rule.indices(toy):
            for name, shape in zip(rule.hf(layer, expert), hf_shapes(toy, rule)):
                tensors[name] = torch.randn(shape)
    assert sorted(tensors) == sorted(names)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file(tensors, str(hf_dir / "model.safetensors"))
    (hf_dir / "config.json").write_text(json.dumps(TOY_CONFIG))

    convert_hf_to_mcore(str(hf_dir), str(tmp_path / "mcore"), progress_stream=None)
    convert_mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "back"), progress_stream=None)
    compared, mismatched = compare_tensors(HFCheckpoint(str(hf_dir)), HFCheckpoint(str(tmp_path / "back")))
    assert mismatched == [] and compared == len(tensors)


def test_megatron_options(toy):
    from armor_megatron.models.megatron_options import MoESettings, Throughput

    assert MoESettings(aux_loss_coeff=0.1).config_kwargs(toy)["moe_router_load_balancing_type"] == "seq_aux_loss"
    assert not Throughput().config_kwargs(toy, use_te=True, on_gpu=True)["apply_rope_fusion"]
    with pytest.raises(ValueError, match="throughput.apply_rope_fusion: toy RoPE is not fused"):
        Throughput(apply_rope_fusion=True).config_kwargs(toy, use_te=True, on_gpu=True)


def test_megatron_builds_what_the_family_declares(toy):
    from armor_megatron.megatron.model import layer_spec, transformer_config_from_arch

    config = transformer_config_from_arch(toy, use_te=False)
    assert config.attention_softmax_in_fp32 and config.qk_layernorm and config.num_moe_experts == 3
    attention = layer_spec(toy, use_te=False).submodules.self_attention.submodules
    assert attention.q_layernorm is not None and attention.k_layernorm is not None


def test_flops_and_memory_follow_its_tensors(toy):
    from armor_megatron.launch.memory import layer_params
    from armor_megatron.models.flops import attention_weights, mlp_weights

    h, d, nq, nkv, E, k, fe = 32, 8, 4, 2, 3, 2, 16
    assert attention_weights(toy) == h * (nq + 2 * nkv) * d + nq * d * h
    assert mlp_weights(toy, 0) == h * E + k * 3 * h * fe
    split = h * (nq + 2 * nkv) * d + nq * d * h
    replicated = 2 * h + 2 * d + E * h  # input and pre-MLP norms, q/k norms, router
    assert layer_params(toy, 1) == (split, replicated, E * 3 * h * fe)


def test_a_name_table_without_the_experts_the_config_gives_is_a_clear_error(toy):
    from armor_megatron.convert.rules import tensor_rules

    class NoExpertNames(ToyMoE):
        moe_names = None

    FAMILIES.unregister("toy_moe")
    FAMILIES.register("toy_moe")(NoExpertNames)
    with pytest.raises(ValueError, match="NoExpertNames declares no moe_names, but its config gives the model such"):
        tensor_rules(toy)
