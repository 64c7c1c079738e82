"""``lora.sync: adapter`` on the trainer's side: the step's A and B to the policy engines, the base after a reset.

Each step (`ArmorTrainer.sync_weights`) every rank gathers the adapters (TP shards, PP stages) under
HF PEFT's names (`megatron.lora.peft_adapter_tensors`, the gathering of ``save_peft_adapter``); the
driver loads them as ``policy-step-<n>-ref-<k>`` (`rollout.sglang.lora_adapters.adapter_name`) and the
engines unload the previous adapter once it is in. A reference reset merges the adapters into the
base, so the engines' base is stale: the base (adapters off) goes through the usual weight sync,
then the fresh adapter (B = 0: the policy is the base until the next step). The engines start the same
way: the base, then the adapters (nonzero on a resumed run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from armor_megatron.rollout.engine import WeightSource
from armor_megatron.rollout.sglang.lora_adapters import adapter_name


class AdapterEngine(Protocol):
    """A policy engine that loads LoRA adapters at run time (`SGLangEngine`)."""

    def load_adapter(
        self, name: str, config: dict[str, Any], tensors: dict[str, Any], version: str, timeout: float | None = None
    ) -> int:
        """Load ``tensors`` as adapter ``name``, name it in policy requests, take ``version``; the bytes sent."""
        ...

    def update_weights(self, weights: WeightSource, version: str, timeout: float | None = None) -> None:
        """Push full weights with the configured sync mode."""
        ...


@dataclasses.dataclass(frozen=True)
class AdapterSync:
    """What the trainer sends the engines with ``lora.sync: adapter`` (every rank holds one).

    ``adapter()``: collective, every rank calls it; the adapters at full shape under PEFT's names on
    the driver, None elsewhere. ``config``: their PEFT ``adapter_config.json``. ``base()``: a read-once
    export of the actor's base weights (adapters off, nothing merged), as the weight export gives it.
    """

    adapter: Callable[[], dict[str, Any] | None]
    config: dict[str, Any]
    base: Callable[[], Any]

    def push_adapter(
        self, engine: AdapterEngine | None, policy_version: str, reference_version: str
    ) -> dict[str, float]:
        """Every rank: gather the adapters; the driver (``engine`` given) loads them. ``sync/adapter_bytes``: what was sent."""
        tensors = self.adapter()
        if engine is None:
            return {}
        if tensors is None:
            raise RuntimeError("the driver holds no gathered adapters (peft_adapter_tensors gives them to rank 0)")
        name = adapter_name(policy_version, reference_version)
        sent = engine.load_adapter(name, self.config, tensors, policy_version)
        return {"sync/adapter_bytes": float(sent)}

    def push_base(self, engine: AdapterEngine | None, policy_version: str) -> None:
        """Every rank: drive the base's export; the driver (``engine`` given) pushes it through the weight sync."""
        with self.base() as base:
            if engine is not None:
                engine.update_weights(base, policy_version)
            else:
                base.drain()
