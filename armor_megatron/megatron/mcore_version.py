"""The megatron-core release this subpackage supports, checked when `armor_megatron.megatron` is imported.

The CPU compatibility layer (`cpu_compat`) patches megatron-core internals and `model.layer_spec`
edits the local layer spec's submodules; both were written against `SUPPORTED` (setup.py pins
``megatron-core>=0.16.1,<0.17``). Another minor release is refused in one line: 0.17 needs
Python >= 3.12 and moved what both touch. Another patch release of a supported minor is accepted
with a warning. The installed version is read from the package metadata, so the check imports
nothing of megatron-core (a source checkout without metadata is checked by `cpu_compat.apply`).
"""

from __future__ import annotations

import importlib.metadata
import warnings

SUPPORTED = ("0.16.1",)
PIN = "megatron-core>=0.16.1,<0.17"


def installed_version() -> str | None:
    """The installed megatron-core's version from its metadata, or None when there is none."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def check(version: str) -> None:
    """Raise ImportError for a minor release other than `SUPPORTED`'s; warn for another patch release."""
    if version in SUPPORTED:
        return
    checked = ", ".join(SUPPORTED)
    if all(_minor(version) != _minor(v) for v in SUPPORTED):
        raise ImportError(
            f"armor_megatron.megatron supports megatron-core {checked}, not {version}: "
            f"its CPU work-arounds and local-spec edits touch internals that moved (pip install '{PIN}')"
        )
    warnings.warn(
        f"megatron-core {version} is not the release armor_megatron was checked against ({checked})", stacklevel=2
    )
