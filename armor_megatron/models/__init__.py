"""Model descriptions shared by every part (no megatron, no engine imports)."""

from armor_megatron.models.arch import (
    SUPPORTED_FAMILIES,
    ModelArch,
    ParallelismError,
    UnsupportedModelError,
    load_hf_config,
)

__all__ = ["SUPPORTED_FAMILIES", "ModelArch", "ParallelismError", "UnsupportedModelError", "load_hf_config"]
