"""Mixtral: the Llama attention and routed experts in every layer.

The experts sit under ``block_sparse_moe.``, named w1 / w3 / w2 (gate / up / down); the top-k
weights are always renormalised.
"""

from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.families import llama
from armor_megatron.models.family import Family, routed_experts
from armor_megatron.models.tensors import MoENames

# HF names of one layer's MoE block, under ``model.layers.{layer}.``; the attention is Llama's
MOE = MoENames(
    pre_mlp_norm="post_attention_layernorm.weight",
    router="block_sparse_moe.gate.weight",
    experts="block_sparse_moe.experts.",
    expert_gate="w1.weight",
    expert_up="w3.weight",
    expert_down="w2.weight",
)


@FAMILIES.register("mixtral")
class Mixtral(Family):
    """The Mixtral family (HF ``mixtral``)."""

    model_types = ("mixtral",)
    architectures = ("MixtralForCausalLM",)
    attention_names = llama.ATTENTION
    moe_names = MOE

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The routed experts (top-k weights always renormalised)."""
        return routed_experts(cfg, "mixtral", always_renormalise=True)
