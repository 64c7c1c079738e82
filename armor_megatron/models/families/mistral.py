"""Mistral: the Llama layout with a sliding attention window.

The TE spec applies ``sliding_window``; the local spec's attention has none (exact for sequences
up to the window).
"""

from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.families import llama
from armor_megatron.models.family import Family, sliding_window


@FAMILIES.register("mistral")
class Mistral(Family):
    """The Mistral family (HF ``mistral``)."""

    model_types = ("mistral",)
    architectures = ("MistralForCausalLM",)
    attention_names = llama.ATTENTION  # Llama's names
    mlp_names = llama.MLP

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The sliding window, if the config sets one."""
        return sliding_window(cfg)
