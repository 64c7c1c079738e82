"""HF <-> Megatron-core tensor declarations: what a model family's module states about its tensors.

One :class:`TensorRule` describes one Megatron tensor per layer (and per expert) and the HF
tensors it is made of. A family (`models.family.Family`) lists its decoder layer's rules with the
builders below from its name tables (`AttentionNames`, `MLPNames`, `MoENames`), or with its own
rules; `convert.rules` adds the embedding, final norm and output layer and
applies the layouts, for the checkpoint converter and for weight sync alike. This module is pure
data: no torch, no megatron.

Layouts (h = hidden, d = head_dim, g = num_key_value_heads = query groups, p = q heads per
group, f = ffn hidden size):

* `Layout.QKV`: Megatron's fused ``linear_qkv`` interleaves per query group: group j holds its p
  query heads, then key head j, then value head j. Viewed as [g, (p+2)·d, h]; the bias is the
  same with the trailing h dropped. HF keeps q_proj [g·p·d, h], k_proj/v_proj [g·d, h].
* `Layout.GLU`: ``linear_fc1`` is [gate; up] = [2f, h] (HF gate_proj/w1 then up_proj/w3).
* `Layout.COPY`: the tensor is the same on both sides.

Names: ``{layer}`` and ``{expert}`` are global indices (a pipeline stage's local layer 0 and
an expert-parallel rank's local expert 0 must be offset by the caller before mapping).
Parameter names exist in three styles: the local spec, the Transformer-Engine spec (fused
layernorms) and grouped-GEMM experts (``experts.linear_fc1.weight{expert}``). torch_dist
checkpoints use one sharded key per rule with layers (and experts) stacked on leading axes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Sequence

from armor_megatron.models.arch import ModelArch


class _Named(str, enum.Enum):
    """An enum whose members are their string values (``==`` a string, printed as the value)."""

    def __str__(self) -> str:
        return str(self.value)


class Layout(_Named):
    """How the HF tensors of a rule make its Megatron tensor (module docstring)."""

    COPY = "copy"  # one HF tensor, the same on both sides
    QKV = "qkv"  # q, k, v interleaved per query group
    GLU = "glu"  # [gate; up]


class TPSplit(_Named):
    """How tensor parallelism splits a Megatron tensor."""

    REPLICATED = "replicated"  # every rank holds it whole
    COLUMN = "column"  # dim 0
    ROW = "row"  # dim 1
    VOCAB = "vocab"  # dim 0, the (padded) vocabulary
    QKV = "qkv"  # dim 0, whole query groups
    GLU = "glu"  # dim 0 of gate and of up separately


DECODER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorRule:
    """One Megatron tensor and the HF tensors it is made of.

    ckpt_key: torch_dist sharded key (layers/experts stacked on leading axes); the same for
        the local and TE specs. alt_ckpt_keys: other keys older checkpoints use (read only).
    local_name / te_name: parameter names of the local and TE layer specs.
    grouped_name: parameter name of grouped-GEMM experts (expert rules only).
    hf_names: HF tensor names, in the order ``layout`` concatenates them.
    layout: a `Layout`.
    tp: a `TPSplit`.
    shape: per-layer, per-expert shape of the Megatron tensor.
    buffer: a tensor of the checkpoint that megatron keeps as a buffer, not a parameter (never
        trained; not counted as a parameter).
    """

    ckpt_key: str
    local_name: str
    te_name: str
    hf_names: tuple[str, ...]
    layout: Layout
    tp: TPSplit
    shape: tuple[int, ...]
    grouped_name: str | None = None
    alt_ckpt_keys: tuple[str, ...] = ()
    buffer: bool = False

    @property
    def per_layer(self) -> bool:
        """Whether the rule has one tensor per layer."""
        return "{layer}" in self.local_name

    @property
    def per_expert(self) -> bool:
        """Whether the rule has one tensor per expert."""
        return "{expert}" in self.local_name

    def hf(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        """The HF tensor names of this rule at ``layer`` and ``expert``."""
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
        lead: tuple[int, ...] = (arch.num_layers,) if self.per_layer else ()
        lead += (arch.num_experts,) if self.per_expert else ()
        return lead + self.shape

    def indices(self, arch: ModelArch) -> Iterator[tuple[int | None, int | None]]:
        """Every (layer, expert) this rule covers, layers outermost."""
        for layer in range(arch.num_layers) if self.per_layer else (None,):
            for expert in range(arch.num_experts) if self.per_expert else (None,):
                yield layer, expert

    @property
    def numel(self) -> int:
        """Elements of one layer's (one expert's) tensor."""
        n = 1
        for size in self.shape:
            n *= size
        return n


def rule(
    *,
    ckpt: str,
    local: str,
    hf: str | Sequence[str],
    tp: TPSplit,
    shape: Sequence[int],
    layout: Layout = Layout.COPY,
    te: str | None = None,
    grouped: str | None = None,
    alt_ckpt_keys: Sequence[str] = (),
    buffer: bool = False,
) -> TensorRule:
    """A `TensorRule`; ``te`` defaults to the local name, ``hf`` may be one name."""
    return TensorRule(
        ckpt_key=ckpt,
        local_name=local,
        te_name=te or local,
        hf_names=(hf,) if isinstance(hf, str) else tuple(hf),
        layout=Layout(layout),
        tp=TPSplit(tp),
        shape=tuple(shape),
        grouped_name=grouped,
        alt_ckpt_keys=tuple(alt_ckpt_keys),
        buffer=buffer,
    )


# ---------------------------------------------------------------------- a family's name tables
# A family's module states the HF names of its decoder layer in these tables (relative to
# ``model.layers.{layer}.``); the builders below pair each with the Megatron tensor that megatron's
# layer spec gives it, shown in the field comments.


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionNames:
    """HF names of a GQA attention block; q/k/v without ``.weight`` / ``.bias``."""

    input_norm: str  # self_attention.linear_qkv.layer_norm_weight (TE) / input_layernorm.weight (local)
    q: str  # self_attention.linear_qkv.{weight,bias}: q, k and v interleaved per query group
    k: str
    v: str
    o: str  # self_attention.linear_proj.weight
    q_norm: str | None = None  # self_attention.q_layernorm.weight (families with per-head q/k norms)
    k_norm: str | None = None  # self_attention.k_layernorm.weight


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPNames:
    """HF names of a dense SwiGLU MLP."""

    pre_mlp_norm: str  # mlp.linear_fc1.layer_norm_weight (TE) / pre_mlp_layernorm.weight (local)
    gate: str  # mlp.linear_fc1.weight = [gate; up]
    up: str
    down: str  # mlp.linear_fc2.weight


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoENames:
    """HF names of a MoE block.

    Experts sit under ``experts + "{expert}."``; the optional names exist where the family has
    the tensor (shared experts, their sigmoid gate, the router's selection bias).
    """

    pre_mlp_norm: str  # pre_mlp_layernorm.weight
    router: str  # mlp.router.weight
    experts: str  # mlp.experts.local_experts.{expert}. / grouped-GEMM mlp.experts.linear_fc{1,2}.weight{expert}
    expert_gate: str  # ... linear_fc1.weight = [gate; up]
    expert_up: str
    expert_down: str  # ... linear_fc2.weight
    shared_gate_proj: str | None = None  # mlp.shared_experts.linear_fc1.weight = [gate; up]
    shared_up_proj: str | None = None
    shared_down_proj: str | None = None  # mlp.shared_experts.linear_fc2.weight
    shared_expert_gate: str | None = None  # mlp.shared_experts.gate_weight
    router_bias: str | None = None  # mlp.router.expert_bias (a buffer)


def _declared(name: str | None, what: str) -> str:
    """A name the family's table must hold because `ModelArch` says the tensor exists."""
    if name is None:
        raise ValueError(f"the family's name table has no {what}, which its config gives the model")
    return name


# ---------------------------------------------------------------------- the standard layer parts
def gqa_attention_rules(arch: ModelArch, names: AttentionNames) -> list[TensorRule]:
    """Llama-style attention.

    Input norm, fused q/k/v (+ its bias with ``qkv_bias``, + per-head q/k RMSNorm with ``qk_norm``),
    output projection.
    """
    h, d = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * d
    L, A = DECODER, HF_LAYER
    qkv_hf = [A + names.q, A + names.k, A + names.v]
    rules = [
        rule(
            ckpt="decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            local=L + "input_layernorm.weight",
            te=L + "self_attention.linear_qkv.layer_norm_weight",
            hf=A + names.input_norm,
            tp=TPSplit.REPLICATED,
            shape=(h,),
        ),
        rule(
            ckpt="decoder.layers.self_attention.linear_qkv.weight",
            local=L + "self_attention.linear_qkv.weight",
            hf=[n + ".weight" for n in qkv_hf],
            layout=Layout.QKV,
            tp=TPSplit.QKV,
            shape=(qkv_rows, h),
        ),
    ]
    if arch.qkv_bias:
        rules.append(
            rule(
                ckpt="decoder.layers.self_attention.linear_qkv.bias",
                local=L + "self_attention.linear_qkv.bias",
                hf=[n + ".bias" for n in qkv_hf],
                layout=Layout.QKV,
                tp=TPSplit.QKV,
                shape=(qkv_rows,),
            )
        )
    if arch.qk_norm:
        rules += [
            rule(
                ckpt=f"decoder.layers.self_attention.{x}_layernorm.weight",
                local=L + f"self_attention.{x}_layernorm.weight",
                hf=A + _declared(name, f"{x}_norm"),
                tp=TPSplit.REPLICATED,
                shape=(d,),
            )
            for x, name in (("q", names.q_norm), ("k", names.k_norm))
        ]
    rules.append(
        rule(
            ckpt="decoder.layers.self_attention.linear_proj.weight",
            local=L + "self_attention.linear_proj.weight",
            hf=A + names.o,
            tp=TPSplit.ROW,
            shape=(h, arch.attention_out_dim),
        )
    )
    return rules


def dense_mlp_rules(arch: ModelArch, names: MLPNames) -> list[TensorRule]:
    """SwiGLU MLP: pre-MLP norm (HF post_attention_layernorm), fc1 = [gate; up], fc2 = down."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    L, A = DECODER, HF_LAYER
    return [
        rule(
            ckpt="decoder.layers.mlp.linear_fc1.layer_norm_weight",
            local=L + "pre_mlp_layernorm.weight",
            te=L + "mlp.linear_fc1.layer_norm_weight",
            hf=A + names.pre_mlp_norm,
            tp=TPSplit.REPLICATED,
            shape=(h,),
        ),
        rule(
            ckpt="decoder.layers.mlp.linear_fc1.weight",
            local=L + "mlp.linear_fc1.weight",
            hf=[A + names.gate, A + names.up],
            layout=Layout.GLU,
            tp=TPSplit.GLU,
            shape=(2 * f, h),
        ),
        rule(
            ckpt="decoder.layers.mlp.linear_fc2.weight",
            local=L + "mlp.linear_fc2.weight",
            hf=A + names.down,
            tp=TPSplit.ROW,
            shape=(h, f),
        ),
    ]


def moe_mlp_rules(arch: ModelArch, names: MoENames, *, router_bias: bool = False) -> list[TensorRule]:
    """The tensor rules of an MoE layer's MLP.

    Pre-MLP norm, router (+ its selection bias with `router_bias`), experts, and the shared
    experts (+ their gate with ``moe_shared_expert_gate``) when ``arch`` has them.
    """
    h, f = arch.hidden_size, arch.moe_ffn_hidden_size
    A = HF_LAYER
    expert = A + names.experts + "{expert}."
    L = DECODER + "mlp."
    rules = [
        # The project's builder keeps the MoE pre-MLP norm under the TE key for both specs;
        # megatron's stock local spec files it under the dense fused-norm key (accepted on read).
        rule(
            ckpt="decoder.layers.pre_mlp_layernorm.weight",
            local=DECODER + "pre_mlp_layernorm.weight",
            hf=A + names.pre_mlp_norm,
            tp=TPSplit.REPLICATED,
            shape=(h,),
            alt_ckpt_keys=("decoder.layers.mlp.linear_fc1.layer_norm_weight",),
        ),
        rule(
            ckpt="decoder.layers.mlp.router.weight",
            local=L + "router.weight",
            hf=A + names.router,
            tp=TPSplit.REPLICATED,
            shape=(arch.num_experts, h),
        ),
    ]
    if router_bias:
        # megatron keeps the selection bias as the router's fp32 buffer (a tensor of the sharded
        # state dict, not a parameter), added to the scores for top-k only.
        rules.append(
            rule(
                ckpt="decoder.layers.mlp.router.expert_bias",
                local=L + "router.expert_bias",
                hf=A + _declared(names.router_bias, "router_bias"),
                tp=TPSplit.REPLICATED,
                shape=(arch.num_experts,),
                buffer=True,
            )
        )
    rules += [
        rule(
            ckpt="decoder.layers.mlp.experts.experts.linear_fc1.weight",
            local=L + "experts.local_experts.{expert}.linear_fc1.weight",
            grouped=L + "experts.linear_fc1.weight{expert}",
            hf=[expert + names.expert_gate, expert + names.expert_up],
            layout=Layout.GLU,
            tp=TPSplit.GLU,
            shape=(2 * f, h),
        ),
        rule(
            ckpt="decoder.layers.mlp.experts.experts.linear_fc2.weight",
            local=L + "experts.local_experts.{expert}.linear_fc2.weight",
            grouped=L + "experts.linear_fc2.weight{expert}",
            hf=expert + names.expert_down,
            tp=TPSplit.ROW,
            shape=(h, f),
        ),
    ]
    fs = arch.moe_shared_expert_ffn_hidden_size
    if fs:
        rules += [
            rule(
                ckpt="decoder.layers.mlp.shared_experts.linear_fc1.weight",
                local=L + "shared_experts.linear_fc1.weight",
                hf=[
                    A + _declared(names.shared_gate_proj, "shared_gate_proj"),
                    A + _declared(names.shared_up_proj, "shared_up_proj"),
                ],
                layout=Layout.GLU,
                tp=TPSplit.GLU,
                shape=(2 * fs, h),
            ),
            rule(
                ckpt="decoder.layers.mlp.shared_experts.linear_fc2.weight",
                local=L + "shared_experts.linear_fc2.weight",
                hf=A + _declared(names.shared_down_proj, "shared_down_proj"),
                tp=TPSplit.ROW,
                shape=(h, fs),
            ),
        ]
    if arch.moe_shared_expert_gate:
        rules.append(
            rule(
                ckpt="decoder.layers.mlp.shared_experts.gate_weight",
                local=L + "shared_experts.gate_weight",
                hf=A + _declared(names.shared_expert_gate, "shared_expert_gate"),
                tp=TPSplit.REPLICATED,
                shape=(1, h),
            )
        )
    return rules
