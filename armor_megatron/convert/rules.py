"""HF <-> Megatron-core tensor rules, declared once for every supported family.

One :class:`TensorRule` describes one Megatron tensor per layer (and per expert) and the HF
tensors it is made of. The same rules serve the checkpoint converter (stacked torch_dist
tensors) and weight sync to the rollout engine (gathered Megatron parameters -> HF tensors).

Layouts (h = hidden, d = head_dim, g = num_key_value_heads = query groups, p = q heads per
group, f = ffn hidden size):

* ``qkv``: Megatron's fused ``linear_qkv`` interleaves per query group: group j holds its p
  query heads, then key head j, then value head j. Viewed as [g, (p+2)·d, h]; the bias is the
  same with the trailing h dropped. HF keeps q_proj [g·p·d, h], k_proj/v_proj [g·d, h].
* ``glu``: ``linear_fc1`` is [gate; up] = [2f, h] (HF gate_proj/w1 then up_proj/w3).
* ``copy``: the tensor is the same on both sides.

Names: ``{layer}`` and ``{expert}`` are global indices (a pipeline stage's local layer 0 and
an expert-parallel rank's local expert 0 must be offset by the caller before mapping).
Parameter names exist in three styles: the local spec, the Transformer-Engine spec (fused
layernorms) and grouped-GEMM experts (``experts.linear_fc1.weight{expert}``). torch_dist
checkpoints use one sharded key per rule with layers (and experts) stacked on leading axes.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator, Sequence

import torch

from armor_megatron.models import ModelArch

SPECS = ("local", "te")

_DECODER = "decoder.layers.{layer}."
_HF_LAYER = "model.layers.{layer}."


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One Megatron tensor and the HF tensors it is made of.

    ckpt_key: torch_dist sharded key (layers/experts stacked on leading axes); the same for
        the local and TE specs. alt_ckpt_keys: other keys older checkpoints use (read only).
    local_name / te_name: parameter names of the local and TE layer specs.
    grouped_name: parameter name of grouped-GEMM experts (expert rules only).
    hf_names: HF tensor names, in the order ``layout`` concatenates them.
    layout: ``copy`` | ``qkv`` | ``glu``.
    tp: how tensor parallelism splits it: ``replicated`` | ``column`` (dim 0) | ``row``
        (dim 1) | ``vocab`` (dim 0, vocabulary) | ``qkv`` (dim 0, whole query groups) |
        ``glu`` (dim 0 of gate and of up separately).
    shape: per-layer, per-expert shape of the Megatron tensor.
    """

    ckpt_key: str
    local_name: str
    te_name: str
    hf_names: tuple[str, ...]
    layout: str
    tp: str
    shape: tuple[int, ...]
    grouped_name: str | None = None
    alt_ckpt_keys: tuple[str, ...] = ()

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.local_name

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.local_name

    def hf(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        return [n.format(layer=layer, expert=expert) for n in self.hf_names]

    def name(
        self, layer: int | None = None, expert: int | None = None, spec: str = "local", grouped: bool = False
    ) -> str:
        """Megatron parameter name for one layer / expert."""
        template = (
            self.grouped_name if grouped and self.grouped_name else (self.te_name if spec == "te" else self.local_name)
        )
        return template.format(layer=layer, expert=expert)

    def stacked_shape(self, arch: ModelArch) -> tuple[int, ...]:
        """Global checkpoint shape: [layers, (experts,)] + shape."""
        lead = (arch.num_layers,) if self.per_layer else ()
        lead += (arch.num_experts,) if self.per_expert else ()
        return lead + self.shape

    def indices(self, arch: ModelArch) -> Iterator[tuple[int | None, int | None]]:
        """Every (layer, expert) this rule covers, layers outermost."""
        for layer in range(arch.num_layers) if self.per_layer else (None,):
            for expert in range(arch.num_experts) if self.per_expert else (None,):
                yield layer, expert


def _rule(ckpt_key, local, hf, layout, tp, shape, te=None, grouped=None, alt_ckpt_keys=()) -> TensorRule:
    hf = (hf,) if isinstance(hf, str) else tuple(hf)
    return TensorRule(ckpt_key, local, te or local, hf, layout, tp, tuple(shape), grouped, tuple(alt_ckpt_keys))


def tensor_rules(arch: ModelArch) -> tuple[TensorRule, ...]:
    """All tensors of ``arch`` in checkpoint order: embedding, layer tensors, final norm, output."""
    return _tensor_rules(_hashable(arch))


def hf_tensor_names(arch: ModelArch) -> list[str]:
    """Every HF tensor name a full checkpoint of ``arch`` holds, each once, in checkpoint order
    (embedding, per layer and expert, final norm, lm_head unless tied): what a complete export
    must yield."""
    return [
        name for rule in tensor_rules(arch) for layer, expert in rule.indices(arch) for name in rule.hf(layer, expert)
    ]


_HF_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def is_mtp_tensor(arch: ModelArch, name: str) -> bool:
    """Whether ``name`` belongs to one of DeepSeek-V3's multi-token-prediction layers,
    ``model.layers.{n}.*`` with num_layers <= n < num_layers + mtp_layers (a draft head that
    transformers and this project's models leave out; the converter skips these tensors)."""
    match = _HF_LAYER_INDEX.match(name)
    return bool(match) and arch.num_layers <= int(match.group(1)) < arch.num_layers + arch.mtp_layers


def _hashable(arch: ModelArch) -> ModelArch:
    """``arch`` without its rope-scaling dict (which decides no name or shape), as a cache key."""
    return dataclasses.replace(arch, rope_scaling=None) if arch.rope_scaling else arch


@functools.cache
def _tensor_rules(arch: ModelArch) -> tuple[TensorRule, ...]:
    rules = [
        _rule(
            "embedding.word_embeddings.weight",
            "embedding.word_embeddings.weight",
            "model.embed_tokens.weight",
            "copy",
            "vocab",
            (arch.vocab_size, arch.hidden_size),
        )
    ]
    if arch.homogeneous_layers:
        rules += _layer_rules(arch, moe=arch.is_moe)
    else:  # Megatron keeps each layer under its own key (no layer axis) when layers differ
        for layer in range(arch.num_layers):
            rules += [_at_layer(rule, layer) for rule in _layer_rules(arch, moe=arch.is_moe_layer(layer))]
    rules.append(
        _rule(
            "decoder.final_layernorm.weight",
            "decoder.final_layernorm.weight",
            "model.norm.weight",
            "copy",
            "replicated",
            (arch.hidden_size,),
        )
    )
    if not arch.tie_word_embeddings:
        rules.append(
            _rule(
                "output_layer.weight",
                "output_layer.weight",
                "lm_head.weight",
                "copy",
                "vocab",
                (arch.vocab_size, arch.hidden_size),
            )
        )
    return tuple(rules)


def _at_layer(rule: TensorRule, layer: int) -> TensorRule:
    """``rule`` for one layer of a model whose layers differ: ``{layer}`` filled in everywhere and
    the layer index in the checkpoint key (``decoder.layers.{i}.<rest>``, Megatron's key for
    non-homogeneous layers)."""

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


def _layer_rules(arch: ModelArch, moe: bool) -> list[TensorRule]:
    """One decoder layer's rules (``{layer}`` templates): attention, then the MLP."""
    attention = _mla_rules(arch) if arch.is_mla else _attention_rules(arch)
    return attention + (_mlp_rules(arch) if moe else _dense_mlp_rules(arch.hidden_size, arch.ffn_hidden_size))


def _attention_rules(arch: ModelArch) -> list[TensorRule]:
    h, d = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * d
    L, A = _DECODER, _HF_LAYER
    qkv_hf = [f"{A}self_attn.{x}_proj" for x in "qkv"]
    rules = [
        _rule(
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            L + "input_layernorm.weight",
            A + "input_layernorm.weight",
            "copy",
            "replicated",
            (h,),
            te=L + "self_attention.linear_qkv.layer_norm_weight",
        ),
        _rule(
            "decoder.layers.self_attention.linear_qkv.weight",
            L + "self_attention.linear_qkv.weight",
            [n + ".weight" for n in qkv_hf],
            "qkv",
            "qkv",
            (qkv_rows, h),
        ),
    ]
    if arch.qkv_bias:
        rules.append(
            _rule(
                "decoder.layers.self_attention.linear_qkv.bias",
                L + "self_attention.linear_qkv.bias",
                [n + ".bias" for n in qkv_hf],
                "qkv",
                "qkv",
                (qkv_rows,),
            )
        )
    if arch.qk_norm:
        rules += [
            _rule(
                f"decoder.layers.self_attention.{x}_layernorm.weight",
                L + f"self_attention.{x}_layernorm.weight",
                A + f"self_attn.{x}_norm.weight",
                "copy",
                "replicated",
                (d,),
            )
            for x in "qk"
        ]
    rules.append(
        _rule(
            "decoder.layers.self_attention.linear_proj.weight",
            L + "self_attention.linear_proj.weight",
            A + "self_attn.o_proj.weight",
            "copy",
            "row",
            (h, arch.attention_out_dim),
        )
    )
    return rules


def _mla_rules(arch: ModelArch) -> list[TensorRule]:
    """DeepSeek multi-head latent attention. Megatron's projections hold the HF rows in HF order
    (per head [nope | rope] for q, [nope | v] for kv_up; [c_kv | k_rope] for kv_down), so every
    tensor is a copy. The local spec splits the down projections over TP by rows (column
    parallel); the q/kv norms are kept under the TE spec's fused-norm keys for both specs."""
    h, n, d = arch.hidden_size, arch.num_attention_heads, arch.head_dim
    S, A = _DECODER + "self_attention.", _HF_LAYER + "self_attn."
    key = "decoder.layers.self_attention."

    def r(name, hf, tp, shape, te=None):
        return _rule(key + name, S + name, A + hf, "copy", tp, shape, te=te and S + te)

    rules = [
        _rule(
            "decoder.layers.input_layernorm.weight",
            _DECODER + "input_layernorm.weight",
            _HF_LAYER + "input_layernorm.weight",
            "copy",
            "replicated",
            (h,),
        )
    ]
    if arch.q_lora_rank:
        rules += [
            r("linear_q_down_proj.weight", "q_a_proj.weight", "column", (arch.q_lora_rank, h)),
            _rule(
                key + "linear_q_up_proj.layer_norm_weight",
                S + "q_layernorm.weight",
                A + "q_a_layernorm.weight",
                "copy",
                "replicated",
                (arch.q_lora_rank,),
                te=S + "linear_q_up_proj.layer_norm_weight",
            ),
            r("linear_q_up_proj.weight", "q_b_proj.weight", "column", (n * d, arch.q_lora_rank)),
        ]
    else:
        rules.append(r("linear_q_proj.weight", "q_proj.weight", "column", (n * d, h)))
    rules += [
        r(
            "linear_kv_down_proj.weight",
            "kv_a_proj_with_mqa.weight",
            "column",
            (arch.kv_lora_rank + arch.qk_rope_head_dim, h),
        ),
        _rule(
            key + "linear_kv_up_proj.layer_norm_weight",
            S + "kv_layernorm.weight",
            A + "kv_a_layernorm.weight",
            "copy",
            "replicated",
            (arch.kv_lora_rank,),
            te=S + "linear_kv_up_proj.layer_norm_weight",
        ),
        r(
            "linear_kv_up_proj.weight",
            "kv_b_proj.weight",
            "column",
            (n * (arch.qk_nope_head_dim + arch.v_head_dim), arch.kv_lora_rank),
        ),
        r("linear_proj.weight", "o_proj.weight", "row", (h, arch.attention_out_dim)),
    ]
    return rules


def _dense_mlp_rules(h: int, f: int) -> list[TensorRule]:
    L, A = _DECODER, _HF_LAYER + "mlp."
    return [
        _rule(
            "decoder.layers.mlp.linear_fc1.layer_norm_weight",
            L + "pre_mlp_layernorm.weight",
            _HF_LAYER + "post_attention_layernorm.weight",
            "copy",
            "replicated",
            (h,),
            te=L + "mlp.linear_fc1.layer_norm_weight",
        ),
        _rule(
            "decoder.layers.mlp.linear_fc1.weight",
            L + "mlp.linear_fc1.weight",
            [A + "gate_proj.weight", A + "up_proj.weight"],
            "glu",
            "glu",
            (2 * f, h),
        ),
        _rule(
            "decoder.layers.mlp.linear_fc2.weight",
            L + "mlp.linear_fc2.weight",
            A + "down_proj.weight",
            "copy",
            "row",
            (h, f),
        ),
    ]


def _mlp_rules(arch: ModelArch) -> list[TensorRule]:
    """Router + experts (+ shared experts). Qwen3-MoE, Qwen2-MoE, DeepSeek: mlp.gate,
    mlp.experts.{e}.{gate,up,down}_proj; Mixtral: block_sparse_moe.gate,
    block_sparse_moe.experts.{e}.{w1,w3,w2} (gate, up, down). Shared experts: Qwen2-MoE
    mlp.shared_expert.* with mlp.shared_expert_gate [1, h]; DeepSeek mlp.shared_experts.*.
    DeepSeek-V3's router bias mlp.gate.e_score_correction_bias [E] is megatron's router.expert_bias."""
    h, f = arch.hidden_size, arch.moe_ffn_hidden_size
    if arch.family == "mixtral":
        moe, gate, up, down = _HF_LAYER + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        moe, gate, up, down = _HF_LAYER + "mlp.", "gate_proj", "up_proj", "down_proj"
    expert = moe + "experts.{expert}."
    L = _DECODER + "mlp."
    rules = [
        # The project's builder keeps the MoE pre-MLP norm under the TE key for both specs;
        # megatron's stock local spec files it under the dense fused-norm key (accepted on read).
        _rule(
            "decoder.layers.pre_mlp_layernorm.weight",
            _DECODER + "pre_mlp_layernorm.weight",
            _HF_LAYER + "post_attention_layernorm.weight",
            "copy",
            "replicated",
            (h,),
            alt_ckpt_keys=("decoder.layers.mlp.linear_fc1.layer_norm_weight",),
        ),
        _rule(
            "decoder.layers.mlp.router.weight",
            L + "router.weight",
            moe + "gate.weight",
            "copy",
            "replicated",
            (arch.num_experts, h),
        ),
    ]
    if arch.moe_router_expert_bias:
        # DeepSeek-V3's selection bias: megatron keeps it as the router's fp32 buffer (a tensor of
        # the sharded state dict, not a parameter), added to the sigmoid scores for top-k only.
        rules.append(
            _rule(
                "decoder.layers.mlp.router.expert_bias",
                L + "router.expert_bias",
                moe + "gate.e_score_correction_bias",
                "copy",
                "replicated",
                (arch.num_experts,),
            )
        )
    rules += [
        _rule(
            "decoder.layers.mlp.experts.experts.linear_fc1.weight",
            L + "experts.local_experts.{expert}.linear_fc1.weight",
            [expert + f"{gate}.weight", expert + f"{up}.weight"],
            "glu",
            "glu",
            (2 * f, h),
            grouped=L + "experts.linear_fc1.weight{expert}",
        ),
        _rule(
            "decoder.layers.mlp.experts.experts.linear_fc2.weight",
            L + "experts.local_experts.{expert}.linear_fc2.weight",
            expert + f"{down}.weight",
            "copy",
            "row",
            (h, f),
            grouped=L + "experts.linear_fc2.weight{expert}",
        ),
    ]
    fs = arch.moe_shared_expert_ffn_hidden_size
    if fs:
        shared = moe + ("shared_expert." if arch.family == "qwen2_moe" else "shared_experts.")
        rules += [
            _rule(
                "decoder.layers.mlp.shared_experts.linear_fc1.weight",
                L + "shared_experts.linear_fc1.weight",
                [shared + "gate_proj.weight", shared + "up_proj.weight"],
                "glu",
                "glu",
                (2 * fs, h),
            ),
            _rule(
                "decoder.layers.mlp.shared_experts.linear_fc2.weight",
                L + "shared_experts.linear_fc2.weight",
                shared + "down_proj.weight",
                "copy",
                "row",
                (h, fs),
            ),
        ]
    if arch.moe_shared_expert_gate:
        rules.append(
            _rule(
                "decoder.layers.mlp.shared_experts.gate_weight",
                L + "shared_experts.gate_weight",
                moe + "shared_expert_gate.weight",
                "copy",
                "replicated",
                (1, h),
            )
        )
    return rules


# ---------------------------------------------------------------------- layouts over single tensors
def hf_shapes(arch: ModelArch, rule: TensorRule) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors ``rule`` is made of, in ``rule.hf_names`` order."""
    if rule.layout == "qkv":
        d, rest = arch.head_dim, rule.shape[1:]
        return [(arch.num_attention_heads * d, *rest)] + [(arch.num_key_value_heads * d, *rest)] * 2
    if rule.layout == "glu":
        return [(rule.shape[0] // 2, *rule.shape[1:])] * 2
    return [rule.shape]


def row_blocks(arch: ModelArch, rule: TensorRule) -> list[tuple[int, int, int, int]]:
    """How the HF tensors tile the Megatron tensor along dim 0 (every layout is a row permutation).

    Returns ``(hf_index, hf_row, mcore_row, rows)`` blocks: rows ``hf_row:hf_row+rows`` of HF
    tensor ``hf_index`` are rows ``mcore_row:mcore_row+rows`` of the Megatron tensor. For the
    fused QKV, group j's block is [q rows j·p·d.. | k rows j·d.. | v rows j·d..].
    """
    if rule.layout == "copy":
        return [(0, 0, 0, rule.shape[0] if rule.shape else 1)]
    if rule.layout == "glu":
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
    if rule.layout == "copy":
        (tensor,) = hf_tensors
        return tensor
    out = torch.empty(rule.shape, dtype=hf_tensors[0].dtype)
    for i, hf_row, row, rows in row_blocks(arch, rule):
        out[row : row + rows] = hf_tensors[i][hf_row : hf_row + rows]
    return out


def mcore_to_hf_blocks(arch: ModelArch, rule: TensorRule, tensor: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per HF tensor (``rule.hf_names`` order), the views of ``tensor`` whose rows, concatenated
    in order, are that HF tensor: a writer can stream them without assembling a copy."""
    if tuple(tensor.shape) != rule.shape:
        raise ValueError(f"{rule.ckpt_key}: shape {tuple(tensor.shape)} != expected {rule.shape}")
    blocks: list[list[torch.Tensor]] = [[] for _ in rule.hf_names]
    for i, _, row, rows in row_blocks(arch, rule):  # blocks come in HF row order per tensor
        blocks[i].append(tensor[row : row + rows] if tensor.dim() else tensor)
    return blocks


def mcore_to_hf(arch: ModelArch, rule: TensorRule, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Split one Megatron tensor into its HF tensors (contiguous; views where the rows already
    are), in ``rule.hf_names`` order."""
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
        for template in {rule.local_name, rule.te_name, rule.grouped_name} - {None}:
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
