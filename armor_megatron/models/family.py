"""What a model family declares, in one place: the base class of `models.families`' modules.

A family is one registered class (``@FAMILIES.register(name)``, the package's registry,
`armor_megatron.registry`) in one module of `models/families/`, as Megatron-Bridge keeps one
bridge per family. It declares, as data and pure functions:

* which HF configs it reads (``model_types``, ``architectures``) and the `ModelArch` fields they
  give beyond the ones every family shares (`Family.hf_fields`; `ModelArch.from_hf_config`
  reads the shared ones);
* its name table: the HF names of its decoder layer's tensors (``attention_names``,
  ``mlp_names``, ``moe_names``: `models.tensors.AttentionNames`, `MLPNames`, `MoENames`), spelled
  out in its module, from which `Family.attention_rules` and `Family.mlp_rules` build the layer's
  `models.tensors.TensorRule`s (a family with its own layout, such as DeepSeek's MLA, overrides
  them); `convert.rules` adds the embedding, the final norm and the output layer, and serves the
  converter and weight sync from them;
* the `ModelArch` parts only it has (DeepSeek: `ModelArch.mla`, `ModelArch.routing`), as
  dataclasses in its module;
* what megatron builds for it (`Family.megatron`: a `MegatronSpec`, data that
  `megatron.model` turns into megatron-core objects; nothing here imports megatron);
* its FLOPs (`models.flops`) and parameter memory (`launch.memory`) follow from its tensors;
  activation memory from the `ModelArch` fields it sets.

The shared code never asks a family's name: it reads what the family declares. The base class
builds a Llama-style layer (GQA attention, SwiGLU MLP, routed experts) from the name tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES, ModelArch, UnsupportedModelError
from armor_megatron.models.tensors import (
    AttentionNames,
    MLPNames,
    MoENames,
    TensorRule,
    dense_mlp_rules,
    gqa_attention_rules,
    moe_mlp_rules,
)

CONFIG_CLASSES = ("TransformerConfig", "MLATransformerConfig")
CORE_ATTENTIONS = ("packed", "mla")
LOAD_BALANCING_DEFAULTS = ("aux_loss", "seq_aux_loss")


@dataclasses.dataclass(frozen=True)
class MegatronSpec:
    """What megatron builds for a family, as data (`megatron.model` consumes it).

    ``config_class``: megatron's config class, ``TransformerConfig`` or ``MLATransformerConfig``.
    ``config_fields``: its fields that the family sets on top of those every family derives from
        `ModelArch` (a run's explicit overrides still win).
    ``qk_layernorm`` / ``multi_latent_attention``: the layer-spec switches of megatron's
        ``get_gpt_layer_*_spec`` (MLA's q / kv LoRA norms count as q/k norms).
    ``local_core_attention``: the core attention of the local (CPU) spec: ``packed`` (dot-product
        attention that takes packed micro-batches) or ``mla`` (separate q/k and v head sizes).
    ``local_keys_map``: the local spec's ``sharded_state_dict_keys_map`` (which maps its unfused
        norms onto the TE spec's fused-norm keys); None keeps megatron's.
    ``rope_scaling_in_model``: the GPT model applies ``arch.rope_scaling`` (Llama-3 scaled
        inverse frequencies); False where ``config_fields`` carry the scaling (YaRN).
    ``fused_rope_refused``: why TE's fused RoPE kernel cannot run for the family (None: it can).
    ``default_load_balancing``: ``moe.load_balancing_type`` when unset and the aux-loss
        coefficient is > 0: ``aux_loss`` (per micro-batch) or ``seq_aux_loss`` (per sequence).
    """

    config_class: str = "TransformerConfig"
    config_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    qk_layernorm: bool = False
    multi_latent_attention: bool = False
    local_core_attention: str = "packed"
    local_keys_map: Mapping[str, str] | None = None
    rope_scaling_in_model: bool = True
    fused_rope_refused: str | None = None
    default_load_balancing: str = "aux_loss"

    def __post_init__(self) -> None:
        for value, allowed in (
            (self.config_class, CONFIG_CLASSES),
            (self.local_core_attention, CORE_ATTENTIONS),
            (self.default_load_balancing, LOAD_BALANCING_DEFAULTS),
        ):
            if value not in allowed:
                raise ValueError(f"MegatronSpec: {value!r} is not one of {allowed}")


class Family:
    """A family: the configs it reads, its name table, what megatron builds (module docstring).

    Subclasses declare the class attributes; the methods build a Llama-style layer from the name
    tables, and a family with another layout overrides them.
    """

    model_types: tuple[str, ...] = ()  # HF ``model_type`` values this family reads
    architectures: tuple[str, ...] = ()  # HF ``architectures`` entries, when model_type is unknown
    rope_scaling_types: tuple[str, ...] = ("llama3",)  # HF rope scalings it takes ("default" always)
    # its name table (module docstring); the MoE names only where the family has routed experts
    attention_names: AttentionNames
    mlp_names: MLPNames | None = None  # None: no dense layers
    moe_names: MoENames | None = None  # None: no routed experts

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """`ModelArch` fields of an HF config beyond the shared ones (which they override).

        Raises UnsupportedModelError for a variant the project does not convert.
        """
        return {}

    def attention_rules(self, arch: ModelArch) -> list[TensorRule]:
        """One decoder layer's attention tensors (``{layer}`` templates), input norm first."""
        return gqa_attention_rules(arch, self.attention_names)

    def mlp_rules(self, arch: ModelArch, moe: bool) -> list[TensorRule]:
        """One decoder layer's MLP tensors, pre-MLP norm first: routed experts when `moe`."""
        names = self.moe_names if moe else self.mlp_names
        if names is None:
            what = "moe_names" if moe else "mlp_names"
            raise ValueError(f"{type(self).__name__} declares no {what}, but its config gives the model such layers")
        return moe_mlp_rules(arch, names) if isinstance(names, MoENames) else dense_mlp_rules(arch, names)

    def megatron(self, arch: ModelArch) -> MegatronSpec:
        """What megatron builds for `arch` (see `MegatronSpec`)."""
        return MegatronSpec(qk_layernorm=arch.qk_norm)


def family_of(arch: ModelArch) -> Family:
    """The registered family of `arch` (one-line ValueError listing the known ones)."""
    family: Family = FAMILIES.definition(arch.family)()
    return family


def layer_rules(arch: ModelArch, layer: int) -> list[TensorRule]:
    """Decoder layer `layer`'s tensors: its family's attention, then its MLP (MoE or dense)."""
    family = family_of(arch)
    return family.attention_rules(arch) + family.mlp_rules(arch, arch.is_moe_layer(layer))


# ---------------------------------------------------------------------- readers families share
def routed_experts(cfg: Mapping[str, Any], family: str, *, always_renormalise: bool = False) -> dict[str, Any]:
    """MoE fields of a config whose every layer routes.

    Read from ``num_experts`` or ``num_local_experts``, ``num_experts_per_tok``,
    ``moe_intermediate_size`` and ``norm_topk_prob``.
    """
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError(
            f"{family} with dense layers (mlp_only_layers / decoder_sparse_step) is not supported"
        )
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    return dict(
        num_experts=int(experts),
        moe_router_topk=int(cfg["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        moe_norm_topk_prob=True if always_renormalise else bool(cfg.get("norm_topk_prob", True)),
    )


def sliding_window(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``sliding_window`` of Mistral / Qwen2 configs (Qwen2: only with ``use_sliding_window``)."""
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return {}
    return {"sliding_window": int(cfg["sliding_window"])} if cfg.get("sliding_window") else {}
