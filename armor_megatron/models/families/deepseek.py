"""DeepSeek-V2 / V3.

Multi-head latent attention (MLA), the first ``first_k_dense_replace`` layers dense, then routed +
shared experts.

MLA (per token, n heads): q = q_b(norm(q_a(x))) (or q_proj(x) without a q LoRA rank) gives
n·(d_nope + d_rope); kv_a(x) gives [c_kv (kv_lora_rank) | k_rope (d_rope, shared by all heads)];
kv_b(norm(c_kv)) gives n·(d_nope + d_v). `ModelArch.head_dim` is d_nope + d_rope (the q/k head
size) and there are as many key/value heads as query heads. Routing: V2 softmax over all
experts then top-k (group-limited only where the group score is the group's best expert), V3
sigmoid + a selection bias, groups scored by their top-2 experts, top-k renormalised; both
scaled by ``routed_scaling_factor``. V3's multi-token-prediction layers (``model.layers.{n}``,
n ≥ ``num_hidden_layers``; ``mtp_layers`` of them) are not part of the model here: the converter
skips them with a notice. The rope dims of q and k are interleaved (megatron's MLA reads them so;
a V3 config with ``rope_interleave: false`` is refused). Rope scaling: YaRN (or Llama-3's),
applied by megatron's ``MLATransformerConfig``.

Megatron: ``MLATransformerConfig``; the local spec's core attention takes separate q/k and v
head sizes; the q / kv LoRA norms are megatron's q/k layernorms, kept under the TE spec's
fused-norm keys for both specs; the load-balancing loss defaults to per-sequence (V2 and V3
balance per sequence); TE's fused RoPE is off (megatron's fused MLA RoPE is training-only, and
log-prob passes run in eval).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES, FamilyPart, LatentAttentionSizes, ModelArch, UnsupportedModelError
from armor_megatron.models.families import llama, qwen3_moe
from armor_megatron.models.family import Family, MegatronSpec
from armor_megatron.models.tensors import DECODER, HF_LAYER, TensorRule, TPSplit, moe_mlp_rules, rule


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentAttention(LatentAttentionSizes):
    """The sizes of multi-head latent attention (`ModelArch.mla`; module docstring).

    ``q_lora_rank``: c_q, 0 without a q LoRA (then q_proj [n·(d_nope + d_rope), h]);
    ``kv_lora_rank``: c_kv; ``qk_rope_head_dim``: d_rope; ``v_head_dim``: d_v.
    """

    q_lora_rank: int
    kv_lora_rank: int

    @property
    def latent_width(self) -> int:
        """Per token, the latents a layer keeps besides the heads: c_kv + d_rope (k's rope part) + c_q."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.q_lora_rank


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupRouting(FamilyPart):
    """How DeepSeek's router scores and selects experts (`ModelArch.routing`; module docstring).

    ``score_function``: ``softmax`` (V2) or ``sigmoid`` (V3); ``scaling_factor`` multiplies the
    top-k weights; experts in ``num_groups`` groups of which the best ``group_topk`` compete (0: no
    groups); ``expert_bias``: V3's selection bias (``e_score_correction_bias``), added to the scores
    for the top-k choice only.
    """

    score_function: str
    scaling_factor: float
    num_groups: int
    group_topk: int
    expert_bias: bool

    def megatron_fields(self) -> dict[str, Any]:
        """Megatron's router settings for this routing."""
        return dict(
            moe_router_score_function=self.score_function,
            moe_router_topk_scaling_factor=self.scaling_factor if self.scaling_factor != 1.0 else None,
            moe_router_num_groups=self.num_groups or None,
            moe_router_group_topk=self.group_topk or None,
            moe_router_enable_expert_bias=self.expert_bias,
        )


# HF names of one decoder layer, under ``model.layers.{layer}.``. MLA's are in `mla_rules` beside
# their Megatron tensors; the first dense layers use Llama's MLP names; the MoE block is
# Qwen3-MoE's routed experts, shared experts and V3's router selection bias.
MOE = dataclasses.replace(
    qwen3_moe.MOE,
    shared_gate_proj="mlp.shared_experts.gate_proj.weight",
    shared_up_proj="mlp.shared_experts.up_proj.weight",
    shared_down_proj="mlp.shared_experts.down_proj.weight",
    router_bias="mlp.gate.e_score_correction_bias",
)


@FAMILIES.register("deepseek")
class DeepSeek(Family):
    """DeepSeek-V2/V3: multi-head latent attention and routed plus shared experts."""

    model_types = ("deepseek_v2", "deepseek_v3", "deepseek")
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    rope_scaling_types = ("llama3", "yarn")
    mlp_names = llama.MLP
    moe_names = MOE

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """MLA and MoE fields of a DeepSeek config (heads of the full MLA head dim)."""
        mla, moe = _deepseek_of(cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = mla.qk_rope_head_dim + int(cfg["qk_nope_head_dim"])
        mtp_layers = int(cfg.get("num_nextn_predict_layers") or 0)
        return dict(num_key_value_heads=heads, head_dim=head_dim, mla=mla, mtp_layers=mtp_layers, **moe)

    def attention_rules(self, arch: ModelArch) -> list[TensorRule]:
        """The tensor rules of MLA."""
        return mla_rules(arch)

    def mlp_rules(self, arch: ModelArch, moe: bool) -> list[TensorRule]:
        """Llama's dense MLP in the first layers, then the MoE block (V3: with the router's selection bias)."""
        routing = _routing(arch)
        if not moe or routing is None:
            return super().mlp_rules(arch, moe)
        return moe_mlp_rules(arch, MOE, router_bias=routing.expert_bias)

    def megatron(self, arch: ModelArch) -> MegatronSpec:
        """Megatron's MLA config class and fields for ``arch``, and its router settings."""
        fields = mla_config_fields(arch)
        routing = _routing(arch)
        if routing is not None:
            fields.update(routing.megatron_fields())
        return MegatronSpec(
            config_class="MLATransformerConfig",
            config_fields=fields,
            qk_layernorm=True,  # the q / kv LoRA norms
            multi_latent_attention=True,
            local_core_attention="mla",
            local_keys_map={
                "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
            rope_scaling_in_model=False,
            fused_rope_refused="megatron's fused MLA RoPE is training-only",
            default_load_balancing="seq_aux_loss",
        )


def _mla(arch: ModelArch) -> LatentAttention:
    """``arch.mla``, which every DeepSeek arch has."""
    if not isinstance(arch.mla, LatentAttention):
        raise ValueError(f"{arch.family}: ModelArch.mla is {arch.mla!r}, not DeepSeek's LatentAttention")
    return arch.mla


def _routing(arch: ModelArch) -> GroupRouting | None:
    """``arch.routing`` (None for a model without experts)."""
    if arch.routing is not None and not isinstance(arch.routing, GroupRouting):
        raise ValueError(f"{arch.family}: ModelArch.routing is {arch.routing!r}, not DeepSeek's GroupRouting")
    return arch.routing


def mla_rules(arch: ModelArch) -> list[TensorRule]:
    """Multi-head latent attention's tensors: the Megatron tensor and the HF name side by side.

    Megatron's projections hold the HF rows in HF order (per head [nope | rope] for q, [nope | v]
    for kv_up; [c_kv | k_rope] for kv_down), so every tensor is a copy. The local spec splits the
    down projections over TP by rows (column parallel); the q/kv norms are kept under the TE spec's
    fused-norm keys for both specs.
    """
    h, n, d, mla = arch.hidden_size, arch.num_attention_heads, arch.head_dim, _mla(arch)
    S, A = DECODER + "self_attention.", HF_LAYER + "self_attn."
    key = "decoder.layers.self_attention."

    def proj(megatron: str, hf: str, tp: TPSplit, shape: tuple[int, ...]) -> TensorRule:
        return rule(ckpt=key + megatron, local=S + megatron, hf=A + hf, tp=tp, shape=shape)

    def norm(megatron: str, local: str, hf: str, size: int) -> TensorRule:
        te = megatron + ".layer_norm_weight"
        return rule(ckpt=key + te, local=S + local, te=S + te, hf=A + hf, tp=TPSplit.REPLICATED, shape=(size,))

    rules = [
        rule(
            ckpt="decoder.layers.input_layernorm.weight",
            local=DECODER + "input_layernorm.weight",
            hf=HF_LAYER + "input_layernorm.weight",
            tp=TPSplit.REPLICATED,
            shape=(h,),
        )
    ]
    if mla.q_lora_rank:
        rules += [
            proj("linear_q_down_proj.weight", "q_a_proj.weight", TPSplit.COLUMN, (mla.q_lora_rank, h)),
            norm("linear_q_up_proj", "q_layernorm.weight", "q_a_layernorm.weight", mla.q_lora_rank),
            proj("linear_q_up_proj.weight", "q_b_proj.weight", TPSplit.COLUMN, (n * d, mla.q_lora_rank)),
        ]
    else:
        rules.append(proj("linear_q_proj.weight", "q_proj.weight", TPSplit.COLUMN, (n * d, h)))
    rules += [
        proj(
            "linear_kv_down_proj.weight",
            "kv_a_proj_with_mqa.weight",
            TPSplit.COLUMN,
            (mla.kv_lora_rank + mla.qk_rope_head_dim, h),
        ),
        norm("linear_kv_up_proj", "kv_layernorm.weight", "kv_a_layernorm.weight", mla.kv_lora_rank),
        proj(
            "linear_kv_up_proj.weight",
            "kv_b_proj.weight",
            TPSplit.COLUMN,
            (n * (arch.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        ),
        proj("linear_proj.weight", "o_proj.weight", TPSplit.ROW, (h, arch.attention_out_dim)),
    ]
    return rules


def mla_config_fields(arch: ModelArch) -> dict[str, Any]:
    """MLA fields of megatron's ``MLATransformerConfig``.

    LoRA ranks, head dims, RoPE or YaRN (YaRN with the HF config's factor, context, β and mscale
    values; megatron applies them as HF does: scaled inverse frequencies, cos/sin times
    mscale(factor, mscale)/mscale(factor, mscale_all_dim), and softmax scale mscale(factor,
    mscale_all_dim)² / √(d_nope + d_rope)).
    """
    s, mla = arch.rope_scaling or {}, _mla(arch)
    out: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank or None,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=arch.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        qk_layernorm=True,  # the q / kv LoRA norms
        rotary_base=arch.rope_theta,
        rope_type="yarn" if s else "rope",
    )
    if s:
        out.update(
            rotary_scaling_factor=float(s["factor"]),
            original_max_position_embeddings=int(s.get("original_max_position_embeddings", 4096)),
            beta_fast=float(s.get("beta_fast", 32)),
            beta_slow=float(s.get("beta_slow", 1)),
            mscale=float(s.get("mscale", 1.0)),
            mscale_all_dim=float(s.get("mscale_all_dim", 0.0)),
        )
    return out


def _deepseek_of(cfg: Mapping[str, Any]) -> tuple[LatentAttention, dict[str, Any]]:
    """(MLA sizes, MoE fields) of a DeepSeek-V2/V3 config; refuses routings megatron-core cannot match."""
    v3 = cfg.get("model_type") == "deepseek_v3" or "DeepseekV3ForCausalLM" in (cfg.get("architectures") or ())
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError("deepseek with attention_bias / mlp_bias is not supported")
    mla = LatentAttention(
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
    )
    experts = int(cfg.get("n_routed_experts") or 0)
    if not experts:
        return mla, {}
    topk, groups = int(cfg["num_experts_per_tok"]), int(cfg.get("n_group") or 1)
    group_topk = int(cfg.get("topk_group") or groups)
    method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    norm = bool(cfg.get("norm_topk_prob", v3))
    if v3 and cfg.get("rope_interleave", True) is False:
        raise UnsupportedModelError(
            "deepseek_v3 with rope_interleave false is not supported (megatron's MLA takes the rope dims interleaved)"
        )
    if v3:  # sigmoid scores + selection bias; groups ranked by the sum of their top-2 scores
        if method != "noaux_tc" or not norm:
            raise UnsupportedModelError("deepseek_v3 needs topk_method 'noaux_tc' with norm_topk_prob")
        if groups > 1 and topk // group_topk != 2:
            raise UnsupportedModelError(
                f"deepseek_v3 groups are ranked by their top-2 experts; megatron-core ranks them by their top "
                f"num_experts_per_tok // topk_group = {topk // group_topk}"
            )
    else:  # softmax over all experts, top-k not renormalised; groups ranked by their best expert
        if norm:
            raise UnsupportedModelError("deepseek_v2 with norm_topk_prob is not supported")
        if method == "greedy":
            groups = group_topk = 1
        elif method != "group_limited_greedy" or (groups > 1 and topk // group_topk != 1):
            raise UnsupportedModelError(
                f"deepseek_v2 topk_method {method!r} with num_experts_per_tok // topk_group != 1 is not supported "
                "(megatron-core ranks groups by the sum of their top num_experts_per_tok // topk_group experts)"
            )
    shared = int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
    moe: dict[str, Any] = dict(
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        moe_norm_topk_prob=norm,
        moe_shared_expert_ffn_hidden_size=shared,
        moe_first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        routing=GroupRouting(
            score_function="sigmoid" if v3 else "softmax",
            scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            num_groups=groups if groups > 1 else 0,
            group_topk=group_topk if groups > 1 else 0,
            expert_bias=v3,
        ),
    )
    if moe["moe_first_dense_layers"] >= int(cfg["num_hidden_layers"]):
        moe = {}  # every layer dense: no expert tensors at all
    return mla, moe
