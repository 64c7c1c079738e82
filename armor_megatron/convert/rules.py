"""HF <-> Megatron-core tensor rules of a whole model, and the layouts applied to tensors.

Each family's module (`models.families`) declares its decoder layer's `TensorRule`s
(`models.tensors` describes the rules and their layouts); this module adds the embedding, the
final norm and the output layer, stores layers under per-layer keys where they differ, and
applies the layouts. The same rules serve the checkpoint converter (stacked torch_dist tensors)
and weight sync to the rollout engine (gathered Megatron parameters -> HF tensors).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

import torch

from armor_megatron.models import ModelArch
from armor_megatron.models.family import family_of, layer_rules
from armor_megatron.models.tensors import Layout, TensorRule, TPSplit
from armor_megatron.models.tensors import rule as _rule

__all__ = [
    "SPECS",
    "ParamRef",
    "TensorRule",
    "hf_shapes",
    "hf_tensor_names",
    "hf_to_mcore",
    "is_mtp_tensor",
    "mcore_to_hf",
    "mcore_to_hf_blocks",
    "mcore_to_hf_named",
    "resolve_param",
    "row_blocks",
    "tensor_rules",
]

SPECS = ("local", "te")


def tensor_rules(arch: ModelArch) -> tuple[TensorRule, ...]:
    """All tensors of ``arch`` in checkpoint order: embedding, layer tensors, final norm, output."""
    # a class is hashable; mypy matches type() of an instance against Hashable with the unbound __hash__
    return _tensor_rules(_hashable(arch), type(family_of(arch)))  # type: ignore[arg-type]


def hf_tensor_names(arch: ModelArch) -> list[str]:
    """Every HF tensor name a full checkpoint of ``arch`` holds, in checkpoint order.

    Each once (embedding, per layer and expert, final norm, lm_head unless tied): what a complete
    export must yield.
    """
    return [
        name for rule in tensor_rules(arch) for layer, expert in rule.indices(arch) for name in rule.hf(layer, expert)
    ]


_HF_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def is_mtp_tensor(arch: ModelArch, name: str) -> bool:
    """Whether ``name`` belongs to a DeepSeek-V3 multi-token-prediction layer.

    Whether ``name`` belongs to one of DeepSeek-V3's multi-token-prediction layers,
    ``model.layers.{n}.*`` with num_layers <= n < num_layers + mtp_layers (a draft head that
    transformers and this project's models leave out; the converter skips these tensors).
    """
    match = _HF_LAYER_INDEX.match(name)
    return match is not None and arch.num_layers <= int(match.group(1)) < arch.num_layers + arch.mtp_layers


def _hashable(arch: ModelArch) -> ModelArch:
    """``arch`` without its rope-scaling dict (which decides no name or shape), as a cache key."""
    return dataclasses.replace(arch, rope_scaling=None) if arch.rope_scaling else arch


@functools.cache
def _tensor_rules(arch: ModelArch, family: type) -> tuple[TensorRule, ...]:  # family: part of the cache key
    rules = [
        _rule(
            ckpt="embedding.word_embeddings.weight",
            local="embedding.word_embeddings.weight",
            hf="model.embed_tokens.weight",
            tp=TPSplit.VOCAB,
            shape=(arch.vocab_size, arch.hidden_size),
        )
    ]
    if arch.homogeneous_layers:
        rules += layer_rules(arch, 0)
    else:  # Megatron keeps each layer under its own key (no layer axis) when layers differ
        for layer in range(arch.num_layers):
            rules += [_at_layer(rule, layer) for rule in layer_rules(arch, layer)]
    rules.append(
        _rule(
            ckpt="decoder.final_layernorm.weight",
            local="decoder.final_layernorm.weight",
            hf="model.norm.weight",
            tp=TPSplit.REPLICATED,
            shape=(arch.hidden_size,),
        )
    )
    if not arch.tie_word_embeddings:
        rules.append(
            _rule(
                ckpt="output_layer.weight",
                local="output_layer.weight",
                hf="lm_head.weight",
                tp=TPSplit.VOCAB,
                shape=(arch.vocab_size, arch.hidden_size),
            )
        )
    return tuple(rules)


def _at_layer(rule: TensorRule, layer: int) -> TensorRule:
    """``rule`` for one layer of a model whose layers differ.

    ``{layer}`` filled in everywhere and the layer index in the checkpoint key
    (``decoder.layers.{i}.<rest>``, Megatron's key for non-homogeneous layers).
    """

    def fill(template):
        return None if template is None else template.replace("{layer}", str(layer))

    rest = rule.ckpt_key.removeprefix("decoder.layers.")
    return dataclasses.replace(
        rule,
        ckpt_key=f"decoder.layers.{layer}.{rest}",
        local_name=fill(rule.local_name),
        te_name=fill(rule.te_name),
        grouped_name=fill(rule.grouped_name),
        hf_names=tuple(map(fill, rule.hf_names)),
        alt_ckpt_keys=tuple(f"decoder.layers.{layer}.{k.removeprefix('decoder.layers.')}" for k in rule.alt_ckpt_keys),
    )


# ---------------------------------------------------------------------- layouts over single tensors
def hf_shapes(arch: ModelArch, rule: TensorRule) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors ``rule`` is made of, in ``rule.hf_names`` order."""
    if rule.layout is Layout.QKV:
        d, rest = arch.head_dim, rule.shape[1:]
        return [(arch.num_attention_heads * d, *rest)] + [(arch.num_key_value_heads * d, *rest)] * 2
    if rule.layout is Layout.GLU:
        return [(rule.shape[0] // 2, *rule.shape[1:])] * 2
    return [rule.shape]


def row_blocks(arch: ModelArch, rule: TensorRule) -> list[tuple[int, int, int, int]]:
    """How the HF tensors tile the Megatron tensor along dim 0 (every layout is a row permutation).

    Returns ``(hf_index, hf_row, mcore_row, rows)`` blocks: rows ``hf_row:hf_row+rows`` of HF
    tensor ``hf_index`` are rows ``mcore_row:mcore_row+rows`` of the Megatron tensor. For the
    fused QKV, group j's block is [q rows j·p·d.. | k rows j·d.. | v rows j·d..].
    """
    if rule.layout is Layout.COPY:
        return [(0, 0, 0, rule.shape[0] if rule.shape else 1)]
    if rule.layout is Layout.GLU:
        half = rule.shape[0] // 2
        return [(0, 0, 0, half), (1, 0, half, half)]
    p, d = arch.queries_per_group, arch.head_dim
    blocks = []
    for j in range(arch.num_key_value_heads):
        base = j * (p + 2) * d
        blocks += [(0, j * p * d, base, p * d), (1, j * d, base + p * d, d), (2, j * d, base + (p + 1) * d, d)]
    return blocks


def hf_to_mcore(arch: ModelArch, rule: TensorRule, hf_tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge the HF tensors of one layer/expert into the Megatron tensor (shape ``rule.shape``)."""
    if rule.layout is Layout.COPY:
        (tensor,) = hf_tensors
        return tensor
    out = torch.empty(rule.shape, dtype=hf_tensors[0].dtype)
    for i, hf_row, row, rows in row_blocks(arch, rule):
        out[row : row + rows] = hf_tensors[i][hf_row : hf_row + rows]
    return out


def mcore_to_hf_blocks(arch: ModelArch, rule: TensorRule, tensor: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per HF tensor, the views of ``tensor`` whose rows make it.

    Per HF tensor (``rule.hf_names`` order), the views of ``tensor`` whose rows, concatenated
    in order, are that HF tensor: a writer can stream them without assembling a copy.
    """
    if tuple(tensor.shape) != rule.shape:
        raise ValueError(f"{rule.ckpt_key}: shape {tuple(tensor.shape)} != expected {rule.shape}")
    blocks: list[list[torch.Tensor]] = [[] for _ in rule.hf_names]
    for i, _, row, rows in row_blocks(arch, rule):  # blocks come in HF row order per tensor
        blocks[i].append(tensor[row : row + rows] if tensor.dim() else tensor)
    return blocks


def mcore_to_hf(arch: ModelArch, rule: TensorRule, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Split one Megatron tensor into its HF tensors.

    Contiguous (views where the rows already are), in ``rule.hf_names`` order.
    """
    out = []
    for blocks, shape in zip(mcore_to_hf_blocks(arch, rule, tensor), hf_shapes(arch, rule)):
        out.append(blocks[0].reshape(shape) if len(blocks) == 1 else torch.cat(blocks).reshape(shape))
    return out


# ---------------------------------------------------------------------- names (weight sync)
@dataclasses.dataclass(frozen=True)
class ParamRef:
    """A Megatron parameter name resolved to its rule and global layer / expert index."""

    rule: TensorRule
    layer: int | None
    expert: int | None

    @property
    def hf_names(self) -> list[str]:
        """The HF tensor names this parameter holds."""
        return self.rule.hf(self.layer, self.expert)


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(escaped + r"\Z")


def _name_patterns(arch: ModelArch) -> tuple[tuple[re.Pattern, TensorRule], ...]:
    return _cached_name_patterns(_hashable(arch))


@functools.cache
def _cached_name_patterns(arch: ModelArch) -> tuple[tuple[re.Pattern, TensorRule], ...]:
    out = []
    for rule in tensor_rules(arch):
        for template in {rule.local_name, rule.te_name, rule.grouped_name}:
            if template is not None:
                out.append((_pattern(template), rule))
    return tuple(out)


def resolve_param(arch: ModelArch, name: str) -> ParamRef:
    """Resolve a Megatron parameter name (local, TE or grouped-GEMM spec, global indices)."""
    name = name.removeprefix("module.")
    for pattern, rule in _name_patterns(arch):
        match = pattern.match(name)
        if match:
            layer, expert = match.groupdict().get("layer"), match.groupdict().get("expert")
            ref = ParamRef(rule, None if layer is None else int(layer), None if expert is None else int(expert))
            if (ref.layer is not None and ref.layer >= arch.num_layers) or (
                ref.expert is not None and ref.expert >= arch.num_experts
            ):
                raise KeyError(f"{name}: layer/expert index out of range for {arch.family}")
            return ref
    raise KeyError(f"{name}: not a Megatron parameter of a {arch.family} model")


def mcore_to_hf_named(arch: ModelArch, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One gathered (full TP) Megatron parameter -> its HF-named tensors."""
    ref = resolve_param(arch, name)
    return list(zip(ref.hf_names, mcore_to_hf(arch, ref.rule, tensor)))
