"""Qwen2-MoE: Qwen2's attention, routed experts in every layer and one gated shared expert.

Qwen2-MoE: Qwen2's attention (q/k/v bias unless ``qkv_bias`` is false), routed experts in
every layer, and one shared expert (``mlp.shared_expert.*``, width
``shared_expert_intermediate_size``) scaled by sigmoid(``mlp.shared_expert_gate`` · x).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.families import llama, qwen3_moe
from armor_megatron.models.family import Family, routed_experts, sliding_window

# HF names of one layer's MoE block, under ``model.layers.{layer}.``: Qwen3-MoE's routed experts
# and one gated shared expert; the attention is Qwen2's (Llama's names, q/k/v with biases)
MOE = dataclasses.replace(
    qwen3_moe.MOE,
    shared_gate_proj="mlp.shared_expert.gate_proj.weight",
    shared_up_proj="mlp.shared_expert.up_proj.weight",
    shared_down_proj="mlp.shared_expert.down_proj.weight",
    shared_expert_gate="mlp.shared_expert_gate.weight",
)


@FAMILIES.register("qwen2_moe")
class Qwen2MoE(Family):
    """The Qwen2-MoE family (HF ``qwen2_moe``)."""

    model_types = ("qwen2_moe",)
    architectures = ("Qwen2MoeForCausalLM",)
    attention_names = llama.ATTENTION
    moe_names = MOE

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Attention biases, routed experts, the shared expert and the sliding window."""
        fields = dict(
            qkv_bias=bool(cfg.get("attention_bias", False)) or bool(cfg.get("qkv_bias", True)),
            **routed_experts(cfg, "qwen2_moe"),
            **sliding_window(cfg),
        )
        if int(cfg.get("shared_expert_intermediate_size") or 0):
            fields.update(
                moe_shared_expert_ffn_hidden_size=int(cfg["shared_expert_intermediate_size"]),
                moe_shared_expert_gate=True,
            )
        return fields
