"""Model descriptions shared by every part (no megatron, no engine imports).

Importing the package registers every model family of `models.families`.
"""

from armor_megatron.models import families  # noqa: F401  (registers the families)
from armor_megatron.models.arch import FAMILIES, ModelArch, ParallelismError, UnsupportedModelError, load_hf_config
from armor_megatron.models.family import Family, MegatronSpec, family_of

__all__ = [
    "FAMILIES",
    "Family",
    "MegatronSpec",
    "ModelArch",
    "ParallelismError",
    "UnsupportedModelError",
    "family_of",
    "load_hf_config",
]
