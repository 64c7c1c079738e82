"""armor_megatron: ARMOR (Anchor Rollout and Mixed Optimization for RL) on Megatron-core.

Importing the package is cheap and GPU-free: subpackages that need megatron-core,
transformer-engine or SGLang import them lazily, where they are used.
"""

__version__ = "0.1.0"
