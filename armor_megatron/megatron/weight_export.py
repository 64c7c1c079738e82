"""Gather a TP/PP/EP-sharded Megatron model into HF-named full tensors on global rank 0.

Used for weight sync (trainer -> rollout engine) and for exporting a reference policy. Every
rank must iterate the generator to the end (it drives collectives); rank 0 receives
``(hf_name, tensor)`` pairs, the others yield nothing.

Per parameter of this rank's model chunks:

1. its Megatron name is made global: ``decoder.layers.{i}`` -> the layer's global index
   (``layer_number − 1``), ``local_experts.{j}`` -> ``ep_rank · experts_per_rank + j``;
2. tensor-parallel shards are all-gathered in the (expert-)TP group and merged with the
   converter's layout rules (``convert.tp_gather``); the padded vocabulary is trimmed;
3. the owner of the full tensor (TP rank 0 of the first data-parallel replica) maps it to HF
   names (the converter's rules) and ships it to rank 0 in buckets of at most ``bucket_bytes``
   (point-to-point object messages), rank by rank.

Memory: an owner rank holds its stage's full (TP-gathered) tensors on the host while it
ships them; rank 0 receives one bucket at a time. With tied embeddings the last pipeline
stage's copy of the output layer is skipped (the embedding is the HF tensor).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from armor_megatron.convert import resolve_param, tp_gather
from armor_megatron.convert.rules import mcore_to_hf
from armor_megatron.models.arch import ModelArch

DEFAULT_BUCKET_BYTES = 256 << 20
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def export_hf_weights(
    model_chunks: Sequence[torch.nn.Module], arch: ModelArch, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every HF tensor of the model on global rank 0 (full, detached, on CPU)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    # Materialised first: the TP all-gathers must run in lockstep on every rank of a group,
    # before any rank starts its blocking sends to rank 0.
    owned = list(_owned_hf_tensors(model_chunks, arch))
    if not distributed:
        yield from owned
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        yield from owned
    for src in range(1, world):
        if rank == src:
            for bucket in _buckets(owned, bucket_bytes):
                dist.send_object_list([bucket], dst=0)
            dist.send_object_list([None], dst=0)
        elif rank == 0:
            while True:
                msg = [None]
                dist.recv_object_list(msg, src=src)
                if msg[0] is None:
                    break
                yield from msg[0]


def _owned_hf_tensors(model_chunks, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's share: full-TP tensors of its stage, only where it is the owner."""
    from megatron.core import parallel_state as ps

    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        layer_of = (
            {i: layer.layer_number - 1 for i, layer in enumerate(getattr(module.decoder, "layers", []))}
            if hasattr(module, "decoder")
            else {}
        )
        for name, param in module.named_parameters():
            if arch.tie_word_embeddings and name == "output_layer.weight":
                continue
            expert = "local_experts." in name
            full_name = _global_name(name, layer_of, expert, arch)
            ref = resolve_param(arch, full_name)
            group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            tensor = _gather_tp(arch, ref.rule, param.detach(), group)
            if ref.rule.tp == "vocab":
                tensor = tensor[: arch.vocab_size]
            owner = (
                (ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0)
                if expert
                else (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0)
            )
            if owner:
                for hf_name, hf_tensor in zip(ref.hf_names, mcore_to_hf(arch, ref.rule, tensor)):
                    yield hf_name, hf_tensor.to("cpu", copy=True).contiguous()


def _global_name(name: str, layer_of: dict, expert: bool, arch: ModelArch) -> str:
    from megatron.core import parallel_state as ps

    match = _LAYER.search(name)
    if match:
        name = name.replace(match.group(0), f"decoder.layers.{layer_of[int(match.group(1))]}.", 1)
    if expert:
        per_rank = arch.num_experts // ps.get_expert_model_parallel_world_size()
        local = _EXPERT.search(name)
        global_index = ps.get_expert_model_parallel_rank() * per_rank + int(local.group(1))
        name = name.replace(local.group(0), f"local_experts.{global_index}.", 1)
    return name


def _gather_tp(arch: ModelArch, rule, shard: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1 or rule.tp == "replicated":
        return shard
    shards = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return tp_gather(arch, rule, shards)


def _buckets(items: Iterator[tuple[str, torch.Tensor]], limit: int) -> Iterator[list]:
    bucket: list = []
    size = 0
    for name, tensor in items:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def export_to_list(model_chunks, arch: ModelArch) -> list | None:
    """The whole export as a list on rank 0, None elsewhere (all ranks must call it)."""
    items = list(export_hf_weights(model_chunks, arch))
    return items if not dist.is_initialized() or dist.get_rank() == 0 else None
