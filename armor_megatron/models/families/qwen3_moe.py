"""Qwen3-MoE: Qwen3's attention and routed experts in every layer.

Qwen3-MoE: Qwen3's attention (per-head q/k norms) and routed experts in every layer
(``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``), top-k renormalised when ``norm_topk_prob``.
"""

from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.families import qwen3
from armor_megatron.models.family import Family, routed_experts
from armor_megatron.models.tensors import MoENames

# HF names of one layer's MoE block, under ``model.layers.{layer}.``; the attention is Qwen3's
MOE = MoENames(
    pre_mlp_norm="post_attention_layernorm.weight",
    router="mlp.gate.weight",
    experts="mlp.experts.",
    expert_gate="gate_proj.weight",
    expert_up="up_proj.weight",
    expert_down="down_proj.weight",
)


@FAMILIES.register("qwen3_moe")
class Qwen3MoE(Family):
    """The Qwen3-MoE family (HF ``qwen3_moe``)."""

    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    attention_names = qwen3.ATTENTION
    moe_names = MOE

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Per-head q/k norms and the routed experts."""
        return dict(qk_norm=True, **routed_experts(cfg, "qwen3_moe"))
