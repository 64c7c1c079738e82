"""HF <-> Megatron-core tensor declarations: what a model family's module states about its tensors.

One :class:`TensorRule` describes one Megatron tensor per layer (and per expert) and the HF
tensors it is made of. A family (`models.family.Family`) lists its decoder layer's rules with the
builders below (or its own); `convert.rules` adds the embedding, final norm and output layer and
applies the layouts, for the checkpoint converter and for weight sync alike. This module is pure
data: no torch, no megatron.

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
from collections.abc import Iterator, Sequence

from armor_megatron.models.arch import ModelArch

LAYOUTS = ("copy", "qkv", "glu")
TP_SPLITS = ("replicated", "column", "row", "vocab", "qkv", "glu")

DECODER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."


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
    buffer: a tensor of the checkpoint that megatron keeps as a buffer, not a parameter (never
        trained; not counted as a parameter).
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
    ckpt_key: str,
    local: str,
    hf: str | Sequence[str],
    layout: str,
    tp: str,
    shape: Sequence[int],
    te: str | None = None,
    grouped: str | None = None,
    alt_ckpt_keys: Sequence[str] = (),
    buffer: bool = False,
) -> TensorRule:
    """A `TensorRule`; ``te`` defaults to the local name, ``hf`` may be one name."""
    if layout not in LAYOUTS or tp not in TP_SPLITS:
        raise ValueError(f"{ckpt_key}: layout {layout!r} / tp {tp!r} is not one of {LAYOUTS} / {TP_SPLITS}")
    names = (hf,) if isinstance(hf, str) else tuple(hf)
    return TensorRule(
        ckpt_key, local, te or local, names, layout, tp, tuple(shape), grouped, tuple(alt_ckpt_keys), buffer
    )


# ---------------------------------------------------------------------- the standard layer parts
def gqa_attention_rules(arch: ModelArch) -> list[TensorRule]:
    """Llama-style attention.

    Input norm, fused q/k/v (+ its bias with ``qkv_bias``, + per-head q/k RMSNorm with ``qk_norm``),
    output projection.
    """
    h, d = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * d
    L, A = DECODER, HF_LAYER
    qkv_hf = [f"{A}self_attn.{x}_proj" for x in "qkv"]
    rules = [
        rule(
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            L + "input_layernorm.weight",
            A + "input_layernorm.weight",
            "copy",
            "replicated",
            (h,),
            te=L + "self_attention.linear_qkv.layer_norm_weight",
        ),
        rule(
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
            rule(
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
            rule(
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
        rule(
            "decoder.layers.self_attention.linear_proj.weight",
            L + "self_attention.linear_proj.weight",
            A + "self_attn.o_proj.weight",
            "copy",
            "row",
            (h, arch.attention_out_dim),
        )
    )
    return rules


def dense_mlp_rules(arch: ModelArch) -> list[TensorRule]:
    """SwiGLU MLP: pre-MLP norm (HF post_attention_layernorm), fc1 = [gate; up], fc2 = down."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    L, A = DECODER, HF_LAYER + "mlp."
    return [
        rule(
            "decoder.layers.mlp.linear_fc1.layer_norm_weight",
            L + "pre_mlp_layernorm.weight",
            HF_LAYER + "post_attention_layernorm.weight",
            "copy",
            "replicated",
            (h,),
            te=L + "mlp.linear_fc1.layer_norm_weight",
        ),
        rule(
            "decoder.layers.mlp.linear_fc1.weight",
            L + "mlp.linear_fc1.weight",
            [A + "gate_proj.weight", A + "up_proj.weight"],
            "glu",
            "glu",
            (2 * f, h),
        ),
        rule(
            "decoder.layers.mlp.linear_fc2.weight",
            L + "mlp.linear_fc2.weight",
            A + "down_proj.weight",
            "copy",
            "row",
            (h, f),
        ),
    ]


@dataclasses.dataclass(frozen=True)
class MoENames:
    """HF names of a MoE block, under ``model.layers.{layer}.``.

    ``block`` + ``gate`` is the router, ``block`` + ``experts.{e}.`` + ``expert_gate`` /
    ``expert_up`` / ``expert_down`` the experts' SwiGLU, ``block`` + ``shared`` the shared experts
    (gate_proj / up_proj / down_proj), ``block`` + ``shared_gate`` the sigmoid gate of the shared
    expert, ``block`` + ``router_bias`` the router's selection bias.
    """

    block: str = "mlp."
    router: str = "gate.weight"
    expert_gate: str = "gate_proj"
    expert_up: str = "up_proj"
    expert_down: str = "down_proj"
    shared: str = "shared_experts."
    shared_gate: str = "shared_expert_gate.weight"
    router_bias: str = "gate.e_score_correction_bias"


def moe_mlp_rules(arch: ModelArch, names: MoENames = MoENames()) -> list[TensorRule]:
    """The tensor rules of an MoE layer's MLP.

    Pre-MLP norm, router (+ its selection bias with ``moe_router_expert_bias``), experts, and the
    shared experts (+ their gate with ``moe_shared_expert_gate``) when ``arch`` has them.
    """
    h, f = arch.hidden_size, arch.moe_ffn_hidden_size
    moe = HF_LAYER + names.block
    expert = moe + "experts.{expert}."
    L = DECODER + "mlp."
    rules = [
        # The project's builder keeps the MoE pre-MLP norm under the TE key for both specs;
        # megatron's stock local spec files it under the dense fused-norm key (accepted on read).
        rule(
            "decoder.layers.pre_mlp_layernorm.weight",
            DECODER + "pre_mlp_layernorm.weight",
            HF_LAYER + "post_attention_layernorm.weight",
            "copy",
            "replicated",
            (h,),
            alt_ckpt_keys=("decoder.layers.mlp.linear_fc1.layer_norm_weight",),
        ),
        rule(
            "decoder.layers.mlp.router.weight",
            L + "router.weight",
            moe + names.router,
            "copy",
            "replicated",
            (arch.num_experts, h),
        ),
    ]
    if arch.moe_router_expert_bias:
        # megatron keeps the selection bias as the router's fp32 buffer (a tensor of the sharded
        # state dict, not a parameter), added to the scores for top-k only.
        rules.append(
            rule(
                "decoder.layers.mlp.router.expert_bias",
                L + "router.expert_bias",
                moe + names.router_bias,
                "copy",
                "replicated",
                (arch.num_experts,),
                buffer=True,
            )
        )
    rules += [
        rule(
            "decoder.layers.mlp.experts.experts.linear_fc1.weight",
            L + "experts.local_experts.{expert}.linear_fc1.weight",
            [expert + f"{names.expert_gate}.weight", expert + f"{names.expert_up}.weight"],
            "glu",
            "glu",
            (2 * f, h),
            grouped=L + "experts.linear_fc1.weight{expert}",
        ),
        rule(
            "decoder.layers.mlp.experts.experts.linear_fc2.weight",
            L + "experts.local_experts.{expert}.linear_fc2.weight",
            expert + f"{names.expert_down}.weight",
            "copy",
            "row",
            (h, f),
            grouped=L + "experts.linear_fc2.weight{expert}",
        ),
    ]
    fs = arch.moe_shared_expert_ffn_hidden_size
    if fs:
        shared = moe + names.shared
        rules += [
            rule(
                "decoder.layers.mlp.shared_experts.linear_fc1.weight",
                L + "shared_experts.linear_fc1.weight",
                [shared + "gate_proj.weight", shared + "up_proj.weight"],
                "glu",
                "glu",
                (2 * fs, h),
            ),
            rule(
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
            rule(
                "decoder.layers.mlp.shared_experts.gate_weight",
                L + "shared_experts.gate_weight",
                moe + names.shared_gate,
                "copy",
                "replicated",
                (1, h),
            )
        )
    return rules
