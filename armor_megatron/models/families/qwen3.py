"""Qwen3: the Llama layout with RMSNorm on q and k per head (``self_attn.q_norm`` / ``k_norm``)."""

from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.family import Family


@FAMILIES.register("qwen3")
class Qwen3(Family):
    """The Qwen3 family (HF ``qwen3``)."""

    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Per-head q/k norms."""
        return dict(qk_norm=True)
