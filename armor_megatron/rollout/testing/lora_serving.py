"""TEST DOUBLE — NOT SGLang. The LoRA serving of the SGLang test double, as SGLang 0.5.23 answers it.

``--enable-lora --max-lora-rank R --lora-target-modules m ...`` start it. Requests and answers
as :mod:`armor_megatron.rollout.sglang.lora_adapters` lists them from SGLang's source:

* ``/load_lora_adapter_from_tensors`` {lora_name, config_dict, serialized_named_tensors,
  load_format}: 200 ``{"success": true, "error_message": "", "loaded_adapters": {name: "__tensor__"}}``;
  400 with ``success: false`` and SGLang's message when LoRA is not enabled, the name is loaded,
  the rank exceeds ``--max-lora-rank`` or the modules leave ``--lora-target-modules``, or the
  adapter is DoRA (``LoRAManager.validate_new_adapter``); tensors are read from entry 0 (TP rank 0)
  under SGLang's unpickling allowlist;
* ``/unload_lora_adapter`` {lora_name}: the same answer; an unknown name is 400
  ("LoRA with name ... does not exist");
* a ``/generate`` naming ``lora_path`` samples with that adapter; an unknown name is 400
  ("Got LoRA adapter that has never been loaded"), any name without ``--enable-lora`` is 400.

How the double applies an adapter: a copy of the local engine's model with every adapted weight
merged, W + (lora_alpha / r)·B·A in fp32 (SGLang adds s·(x·Aᵀ)·Bᵀ to the base output instead: the
same function up to rounding). The copy is rebuilt when the base weights change (a weight update
bumps the parameters' in-place version counters), since SGLang applies an adapter to whatever
base it holds.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from armor_megatron.rollout.local import LocalEngine

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
_LAYER_MODULE = re.compile(r"layers\.\d+\.[a-z_]+\.([a-z_]+)\.lora_[AB]\.weight$")


class LoRARefusal(ValueError):
    """What SGLang answers with ``success: false`` (HTTP 400)."""


class LoRAServing:
    """The adapters a double holds: ``max_rank`` and ``target_modules`` as the server flags set them."""

    def __init__(self, max_rank: int, target_modules: Sequence[str]):
        if max_rank < 1 or not target_modules:
            raise ValueError("--enable-lora needs --max-lora-rank and --lora-target-modules (no --lora-paths here)")
        self.max_rank, self.target_modules = max_rank, set(target_modules)
        self.adapters: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}  # name -> (config, tensors)
        self._merged: dict[str, tuple[tuple[int, int], LocalEngine]] = {}  # name -> (base fingerprint, engine)
        self._lock = threading.Lock()

    def loaded(self) -> dict[str, str]:
        """SGLang's ``loaded_adapters``: name -> path (``__tensor__`` for adapters loaded from tensors)."""
        return dict.fromkeys(self.adapters, "__tensor__")

    def load(self, name: str, config: Any, tensors: dict[str, Any]) -> None:
        """Hold adapter ``name``; raises LoRARefusal with SGLang's message where it refuses."""
        if not isinstance(config, dict) or not {"r", "lora_alpha", "target_modules"} <= set(config):
            raise LoRARefusal(f"config_dict of {name} needs r, lora_alpha and target_modules")
        if config.get("use_dora", False):
            raise LoRARefusal(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        with self._lock:
            if name in self.adapters:
                raise LoRARefusal(f"Failed to load LoRA adapter {name} because it is already loaded")
            modules = set(config["target_modules"])
            if config["r"] > self.max_rank or not modules <= self.target_modules:
                raise LoRARefusal(
                    f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
                )
            unnamed = [n for n in tensors if not _LAYER_MODULE.search(n)]
            if unnamed:
                raise LoRARefusal(f"adapter {name}: {unnamed[0]!r} is not a PEFT name of a layer's lora_A/lora_B")
            self.adapters[name] = (dict(config), {n: t.detach().clone() for n, t in tensors.items()})

    def unload(self, name: str) -> None:
        """Drop adapter ``name``; raises LoRARefusal when it is not loaded."""
        with self._lock:
            if name not in self.adapters:
                raise LoRARefusal(f"LoRA with name {name} does not exist. Loaded LoRAs: {self.adapters.keys()}")
            del self.adapters[name]
            self._merged.pop(name, None)

    def engine_for(self, name: str, base: LocalEngine) -> LocalEngine:
        """The engine that samples ``base`` with adapter ``name`` (its version the base's)."""
        with self._lock:
            if name not in self.adapters:
                raise LoRARefusal(
                    f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {self.adapters.keys()}."
                )
            fingerprint = (id(base.model), sum(p._version for p in base.model.parameters()))
            cached = self._merged.get(name)
            if cached is None or cached[0] != fingerprint:
                cached = (fingerprint, _merged_engine(base, *self.adapters[name]))
                self._merged[name] = cached
            engine = cached[1]
            engine.weight_version = base.weight_version
            return engine


def _merged_engine(base: LocalEngine, config: dict[str, Any], tensors: dict[str, Any]) -> LocalEngine:
    """A copy of ``base`` whose adapted weights are W + (lora_alpha / r)·B·A (fp32 sum, W's dtype)."""
    state = {n: t.detach().clone() for n, t in base.model.state_dict().items()}
    scale = float(config["lora_alpha"]) / float(config["r"])
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        target = name.replace(".lora_A.weight", ".weight").removeprefix("base_model.model.")
        w = state[target]
        state[target] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return LocalEngine(
        base.hf_config,
        list(state.items()),
        tokenizer=base.tokenizer,
        weight_version=base.weight_version,
        seed=base._seed,
    )
