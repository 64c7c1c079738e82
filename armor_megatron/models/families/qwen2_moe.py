"""Qwen2-MoE: Qwen2's attention, routed experts in every layer and one gated shared expert.

Qwen2-MoE: Qwen2's attention (q/k/v bias unless ``qkv_bias`` is false), routed experts in
every layer, and one shared expert (``mlp.shared_expert.*``, width
``shared_expert_intermediate_size``) scaled by sigmoid(``mlp.shared_expert_gate`` · x).
"""

from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.family import Family, routed_experts, sliding_window
from armor_megatron.models.tensors import MoENames


@FAMILIES.register("qwen2_moe")
class Qwen2MoE(Family):
    """The Qwen2-MoE family (HF ``qwen2_moe``)."""

    model_types = ("qwen2_moe",)
    architectures = ("Qwen2MoeForCausalLM",)
    moe_names = MoENames(shared="shared_expert.")

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
