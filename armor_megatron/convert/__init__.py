"""HF <-> Megatron-core conversion: per-family tensor rules and streaming checkpoint conversion.

Rules (``rules``, ``tp``) are pure torch and serve weight sync as well as the converter:

* ``tensor_rules(arch)``: every Megatron tensor of a model and the HF tensors it is made of.
* ``hf_to_mcore(arch, rule, hf_tensors)`` / ``mcore_to_hf(arch, rule, tensor)``: one tensor's layout
  (``row_blocks`` states it as dim-0 row blocks; ``mcore_to_hf_blocks`` gives views, no copy).
* ``resolve_param(arch, name)`` / ``mcore_to_hf_named(arch, name, tensor)``: Megatron parameter
  names (local, TE or grouped-GEMM spec) -> HF names and tensors.
* ``tp_split`` / ``tp_gather``: Megatron's tensor-parallel layouts of one global tensor.

Checkpoints: ``convert_hf_to_mcore`` and ``convert_mcore_to_hf`` stream between HF safetensors
and torch_dist on CPU without importing megatron-core (``verify`` checks the round trip; `armor_megatron.megatron.verify`
adds the Megatron logits).
"""

from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.rules import (
    ParamRef,
    TensorRule,
    hf_shapes,
    hf_to_mcore,
    mcore_to_hf,
    mcore_to_hf_blocks,
    mcore_to_hf_named,
    resolve_param,
    row_blocks,
    tensor_rules,
)
from armor_megatron.convert.to_hf import convert_mcore_to_hf
from armor_megatron.convert.to_mcore import convert_hf_to_mcore
from armor_megatron.convert.tp import tp_gather, tp_split

__all__ = [
    "CheckpointError",
    "ParamRef",
    "TensorRule",
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
    "hf_shapes",
    "hf_to_mcore",
    "mcore_to_hf",
    "mcore_to_hf_blocks",
    "mcore_to_hf_named",
    "resolve_param",
    "row_blocks",
    "tensor_rules",
    "tp_gather",
    "tp_split",
]
