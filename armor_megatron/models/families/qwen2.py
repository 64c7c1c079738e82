"""Qwen2 / Qwen2.5: the Llama layout with a bias on the q/k/v projections.

A sliding window only with ``use_sliding_window``.
"""

from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.families import llama
from armor_megatron.models.family import Family, sliding_window


@FAMILIES.register("qwen2")
class Qwen2(Family):
    """The Qwen2 family (HF ``qwen2``)."""

    model_types = ("qwen2",)
    architectures = ("Qwen2ForCausalLM",)
    attention_names = llama.ATTENTION  # Llama's names; q/k/v have a ``.bias`` beside ``.weight``
    mlp_names = llama.MLP

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """q/k/v biases, and the sliding window if the config sets one."""
        return dict(qkv_bias=True, **sliding_window(cfg))
