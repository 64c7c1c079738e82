"""A LoRA training checkpoint's adapters as an HF PEFT adapter directory (``armor-convert lora-to-peft``).

Read from the checkpoint's files alone, in one process (no model, no process group): the adapter
tensors ``decoder.layers.<module>.lora.{A,B}.<projection>`` are stored at their global shapes with
the layers stacked on a leading axis (`lora.adapter_sharded_state_dict`, any TP/PP/VPP), so layer
i's A [r, in] and B [out, r] are rows of them, written under HF PEFT's names (`lora.peft_name`) by
the same writer the trainer's ``save_peft_adapter`` uses (`lora.write_peft_adapter`). The PEFT
config (rank, alpha, dropout, target modules) is the one the checkpoint records (``lora_settings``
in its common state), its ``base_model_name_or_path`` the base the run loaded (``lora_base``).

Only a checkpoint from before the first reference reset converts: after one, its base is the
merge of the adapters so far, held in no HF directory (`armor-convert mcore-to-hf` refuses LoRA
checkpoints), so an adapter of it would apply to no model one can load; that is refused in one
line, pointing at the run's merged HF copies (``checkpoint.save_hf``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import torch

from armor_megatron.convert.dcp_safety import read_metadata
from armor_megatron.convert.errors import CheckpointError
from armor_megatron.megatron.base_source import LORA_BASE
from armor_megatron.megatron.checkpoint_manifest import damaged_file
from armor_megatron.megatron.lora import LORA_SETTINGS, LoRASettings, peft_adapter_config, peft_name, write_peft_adapter
from armor_megatron.megatron.model_state import resolve_checkpoint_dir

# decoder.layers.self_attention.linear_qkv.lora.A.q_proj: owner, target, A or B, projection
ADAPTER_KEY = re.compile(r"^decoder\.layers\.(?:self_attention|mlp)\.(linear_\w+)\.lora\.([AB])\.(\w+)$")


@dataclasses.dataclass(frozen=True)
class PeftExport:
    """What `lora_checkpoint_to_peft` wrote: where, how many adapter matrices, of how many layers, and their config."""

    out_dir: str
    matrices: int
    layers: int
    config: dict[str, Any]

    def line(self) -> str:
        """One line for the command to print."""
        c = self.config
        base = c["base_model_name_or_path"] or "the run's model.path"
        return (
            f"wrote {self.out_dir}: {self.matrices} adapter matrices of {self.layers} layers (r {c['r']}, alpha "
            f"{c['lora_alpha']:g}, {', '.join(c['target_modules'])}) for the base {base}; "
            f"peft.PeftModel.from_pretrained(<that model>, {self.out_dir!r}) loads it"
        )


def lora_checkpoint_to_peft(path: str, out_dir: str, *, overwrite: bool = False) -> PeftExport:
    """Write the adapters of the LoRA checkpoint ``path`` (or the one a root's ``latest`` names) to ``out_dir``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from armor_megatron.convert.torch_dist import read_whole_tensors

    if os.path.lexists(out_dir) and not overwrite:
        raise CheckpointError(f"{out_dir} exists; pass --overwrite to replace it")
    ckpt = resolve_checkpoint_dir(path)
    damage = damaged_file(ckpt)
    if damage is not None:
        raise CheckpointError(damage)
    stored = [k for k, v in read_metadata(ckpt).state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    adapters = {k: m for k in stored if (m := ADAPTER_KEY.match(k))}
    if not adapters:
        raise CheckpointError(f"{ckpt}: holds no LoRA adapters (decoder.layers.<module>.lora.A.<projection>)")
    base_tensor = next((k for k in stored if ".lora." not in k and not k.startswith(("reference.", "critic."))), None)
    if base_tensor is not None:
        raise CheckpointError(
            f"{ckpt}: holds the base a reference reset merged its earlier adapters into ({base_tensor}), which no HF "
            "directory holds, so its adapters apply to no model one can load; use the run's merged HF copies "
            "(checkpoint.save_hf)"
        )
    common = _common_state(ckpt)
    settings = _settings(ckpt, common)
    tensors: dict[str, torch.Tensor] = {}
    layers = 0
    for key, stacked in read_whole_tensors(ckpt, sorted(adapters)).items():
        target, kind, projection = adapters[key].groups()
        layers = max(layers, stacked.shape[0])
        for layer, matrix in enumerate(stacked):
            tensors[peft_name(layer, target, projection, kind)] = matrix.contiguous()
    base = str(common.get(LORA_BASE, {}).get("path", ""))
    config = peft_adapter_config(settings, base)
    write_peft_adapter(tensors, config, out_dir)
    return PeftExport(out_dir, len(tensors), layers, config)


def _common_state(ckpt: str) -> dict[str, Any]:
    """The checkpoint's common state (``common.pt``: plain data, loaded with ``weights_only``)."""
    try:
        common = torch.load(os.path.join(ckpt, "common.pt"), weights_only=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"{ckpt}: common.pt cannot be read ({str(e).splitlines()[0] if str(e) else e!r})"
        ) from None
    return common if isinstance(common, dict) else {}


def _settings(ckpt: str, common: dict[str, Any]) -> LoRASettings:
    """The adapters' settings the checkpoint records (``lora_settings``)."""
    recorded = common.get(LORA_SETTINGS)
    if not isinstance(recorded, dict):
        raise CheckpointError(
            f"{ckpt}: records no LoRA settings (lora_settings: rank, alpha, dropout, targets), which checkpoints "
            "hold since armor-convert lora-to-peft exists; save a checkpoint with this version (the run resumes it)"
        )
    return LoRASettings(
        int(recorded["rank"]), float(recorded["alpha"]), float(recorded["dropout"]), tuple(recorded["targets"])
    )
