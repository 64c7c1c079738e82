"""LoRA adapters loaded into running SGLang 0.5.23 servers: ``lora.sync: adapter`` (docs/lora.md).

What SGLang 0.5.23 takes (read from its source):

* the server starts with ``--enable-lora --max-lora-rank R --lora-target-modules m ...``
  (``arg_groups/lora_hook.py``: without ``--lora-paths`` both are required), else every load
  answers "LoRA is not enabled";
* ``POST /load_lora_adapter_from_tensors`` (``entrypoints/http_server.py``) with
  ``LoadLoRAAdapterFromTensorsReqInput`` (``managers/io_struct.py``): ``lora_name``,
  ``config_dict`` (the PEFT ``adapter_config.json``: ``r``, ``lora_alpha``, ``target_modules``
  are read, ``use_dora`` is refused, ``lora/lora_config.py``), ``serialized_named_tensors``
  (one entry per TP rank; rank i unpickles entry i, ``managers/tp_worker.py``), ``load_format``
  (None: the entry is a dict name -> tensor; ``flattened_bucket``: SGLang's bucket dict), and
  optional ``pinned``, ``added_tokens_config``, ``expected_checksums``. Tensor names are PEFT's:
  ``lora/lora.py`` files each under ``layers.<i>.`` (any prefix, ``base_model.model.`` included)
  and each rank slices its TP shard itself, so every entry holds the whole adapter. The answer is
  ``LoRAUpdateOutput`` {success, error_message, loaded_adapters: {name: path}} with HTTP 200, or
  400 and ``success: false`` for: LoRA not enabled, a name already loaded, a rank above
  ``--max-lora-rank`` or modules outside ``--lora-target-modules`` ("incompatible with the current
  LoRA memory pool"), DoRA, added tokens. Engine data parallelism (``dp_size`` > 1) fails an
  assertion (``managers/tokenizer_control_mixin.py``);
* ``POST /unload_lora_adapter`` {lora_name}: same answer; an unknown name is 400 ("does not exist").
  The unload waits for the requests that use the adapter;
* ``/generate`` with ``lora_path: <name>`` samples with the adapter, without it the base model;
  a name never loaded is refused ("has never been loaded").

The payload here is by value (`tensor_payload.serialize_by_value`): the adapter is small, and
bytes reach an engine on any node (CUDA IPC handles would need the trainer's node).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from armor_megatron.rollout.engine import WeightUpdateError
from armor_megatron.rollout.sglang import tensor_payload
from armor_megatron.rollout.sglang.client import SGLangClient, SGLangHTTPError

LOAD_PATH = "/load_lora_adapter_from_tensors"
UNLOAD_PATH = "/unload_lora_adapter"
ADAPTER_PREFIX = "policy-"  # the names this project gives the policy's adapters; stale ones are unloaded


def adapter_name(policy_version: str, reference_version: str) -> str:
    """The adapter's name on the engines: the policy step and the base (reference) it applies to, e.g. ``policy-step-6-ref-2``."""
    return f"{ADAPTER_PREFIX}{policy_version}-{reference_version}"


def adapter_bytes(tensors: Mapping[str, Any]) -> int:
    """The bytes of the adapter's tensors (what one engine TP rank receives, before pickling)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def load_adapter(
    client: SGLangClient,
    name: str,
    config: Mapping[str, Any],
    tensors: Mapping[str, Any],
    tp_size: int,
    timeout: float | None = None,
) -> dict[str, str]:
    """Load ``tensors`` (PEFT names, whole) as adapter ``name`` on one server; its ``loaded_adapters`` after.

    Raises WeightUpdateError with SGLang's reason when it refuses.
    """
    entry = tensor_payload.serialize_by_value(sorted(tensors.items()))
    body = {
        "lora_name": name,
        "config_dict": dict(config),
        "serialized_named_tensors": [entry] * tp_size,  # each rank slices its own shard from the whole adapter
        "load_format": tensor_payload.FLATTENED_BUCKET,
    }
    result = _post(client, LOAD_PATH, body, timeout)
    return dict(result.get("loaded_adapters") or {})


def unload_adapter(client: SGLangClient, name: str, timeout: float | None = None) -> None:
    """Unload adapter ``name`` from one server (it waits for the requests using it)."""
    _post(client, UNLOAD_PATH, {"lora_name": name}, timeout)


def _post(client: SGLangClient, path: str, body: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    try:
        result = client.post(path, body, timeout=timeout, retry=False)
    except SGLangHTTPError as e:
        raise WeightUpdateError(f"{client.url}{path} ({body['lora_name']}) failed: {e.message}") from None
    if not isinstance(result, dict) or result.get("success") is not True:
        raise WeightUpdateError(f"{client.url}{path} ({body['lora_name']}) failed: {result}")
    return result
