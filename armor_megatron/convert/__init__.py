"""HF <-> Megatron-core conversion: per-family tensor rules and streaming checkpoint conversion.

Rules (``rules``, ``tp``) are pure torch and serve weight sync as well as the converter:

* ``tensor_rules(arch)``: every Megatron tensor of a model and the HF tensors it is made of.
* ``hf_to_mcore(arch, rule, hf_tensors)`` / ``mcore_to_hf(arch, rule, tensor)``: one tensor's layout.
* ``resolve_param(arch, name)`` / ``mcore_to_hf_named(arch, name, tensor)``: Megatron parameter
  names (local, TE or grouped-GEMM spec) -> HF names and tensors.
* ``tp_split`` / ``tp_gather``: Megatron's tensor-parallel layouts of one global tensor.

Checkpoints: ``convert_hf_to_mcore`` and ``convert_mcore_to_hf`` (megatron-core is imported
only when they run).
"""

from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.to_mcore import convert_hf_to_mcore
from armor_megatron.convert.to_hf import convert_mcore_to_hf
from armor_megatron.convert.rules import (
    ParamRef,
    TensorRule,
    hf_shapes,
    hf_to_mcore,
    mcore_to_hf,
    mcore_to_hf_named,
    resolve_param,
    tensor_rules,
)
from armor_megatron.convert.tp import tp_gather, tp_split


__all__ = [
    "CheckpointError", "ParamRef", "TensorRule", "convert_hf_to_mcore", "convert_mcore_to_hf", "hf_shapes",
    "hf_to_mcore", "mcore_to_hf", "mcore_to_hf_named", "resolve_param", "tensor_rules", "tp_gather", "tp_split",
]
