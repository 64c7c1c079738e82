"""Qwen3: the Llama layout with RMSNorm on q and k per head (``self_attn.q_norm`` / ``k_norm``)."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.families import llama
from armor_megatron.models.family import Family

# HF names of one layer's attention, under ``model.layers.{layer}.``: Llama's and the per-head
# q/k norms; the MLP is Llama's
ATTENTION = dataclasses.replace(llama.ATTENTION, q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")


@FAMILIES.register("qwen3")
class Qwen3(Family):
    """The Qwen3 family (HF ``qwen3``)."""

    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)
    attention_names = ATTENTION
    mlp_names = llama.MLP

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Per-head q/k norms."""
        return dict(qk_norm=True)
