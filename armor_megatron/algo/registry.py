"""Name -> function registries for the algorithm's pluggable parts.

The registries of the algorithm's pluggable parts (advantage estimators, policy losses, reset
schedules) use the package's one registry mechanism, `armor_megatron.registry`.
"""

from armor_megatron.registry import Registry, RegistryEntry

__all__ = ["Registry", "RegistryEntry"]
