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

from collections.abc import Mapping
from typing import Any

from armor_megatron.models.arch import FAMILIES, ModelArch, UnsupportedModelError
from armor_megatron.models.family import Family, MegatronSpec
from armor_megatron.models.tensors import DECODER, HF_LAYER, TensorRule, rule


@FAMILIES.register("deepseek")
class DeepSeek(Family):
    """DeepSeek-V2/V3: multi-head latent attention and routed plus shared experts."""

    model_types = ("deepseek_v2", "deepseek_v3", "deepseek")
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    rope_scaling_types = ("llama3", "yarn")

    def hf_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """MLA and MoE fields of a DeepSeek config (heads of the full MLA head dim)."""
        mla, moe = _deepseek_of(cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = mla["qk_rope_head_dim"] + int(cfg["qk_nope_head_dim"])
        return dict(num_key_value_heads=heads, head_dim=head_dim, **moe, **mla)

    def attention_rules(self, arch: ModelArch) -> list[TensorRule]:
        """The tensor rules of MLA."""
        return mla_rules(arch)

    def megatron(self, arch: ModelArch) -> MegatronSpec:
        """Megatron's MLA config class and fields for ``arch``."""
        return MegatronSpec(
            config_class="MLATransformerConfig",
            config_fields=mla_config_fields(arch),
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


def mla_rules(arch: ModelArch) -> list[TensorRule]:
    """Multi-head latent attention's tensors.

    Megatron's projections hold the HF rows in HF order (per head [nope | rope] for q, [nope | v]
    for kv_up; [c_kv | k_rope] for kv_down), so every tensor is a copy. The local spec splits the
    down projections over TP by rows (column parallel); the q/kv norms are kept under the TE spec's
    fused-norm keys for both specs.
    """
    h, n, d = arch.hidden_size, arch.num_attention_heads, arch.head_dim
    S, A = DECODER + "self_attention.", HF_LAYER + "self_attn."
    key = "decoder.layers.self_attention."

    def r(name: str, hf: str, tp: str, shape: tuple[int, ...]) -> TensorRule:
        return rule(key + name, S + name, A + hf, "copy", tp, shape)

    def norm(name: str, local: str, hf: str, size: int) -> TensorRule:
        return rule(
            key + name + ".layer_norm_weight",
            S + local,
            A + hf,
            "copy",
            "replicated",
            (size,),
            te=S + name + ".layer_norm_weight",
        )

    rules = [
        rule(
            "decoder.layers.input_layernorm.weight",
            DECODER + "input_layernorm.weight",
            HF_LAYER + "input_layernorm.weight",
            "copy",
            "replicated",
            (h,),
        )
    ]
    if arch.q_lora_rank:
        rules += [
            r("linear_q_down_proj.weight", "q_a_proj.weight", "column", (arch.q_lora_rank, h)),
            norm("linear_q_up_proj", "q_layernorm.weight", "q_a_layernorm.weight", arch.q_lora_rank),
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
        norm("linear_kv_up_proj", "kv_layernorm.weight", "kv_a_layernorm.weight", arch.kv_lora_rank),
        r(
            "linear_kv_up_proj.weight",
            "kv_b_proj.weight",
            "column",
            (n * (arch.qk_nope_head_dim + arch.v_head_dim), arch.kv_lora_rank),
        ),
        r("linear_proj.weight", "o_proj.weight", "row", (h, arch.attention_out_dim)),
    ]
    return rules


def mla_config_fields(arch: ModelArch) -> dict[str, Any]:
    """MLA fields of megatron's ``MLATransformerConfig``.

    LoRA ranks, head dims, RoPE or YaRN (YaRN with the HF config's factor, context, β and mscale
    values; megatron applies them as HF does: scaled inverse frequencies, cos/sin times
    mscale(factor, mscale)/mscale(factor, mscale_all_dim), and softmax scale mscale(factor,
    mscale_all_dim)² / √(d_nope + d_rope)).
    """
    s = arch.rope_scaling or {}
    out: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=arch.q_lora_rank or None,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_nope_head_dim,
        qk_pos_emb_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
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


def _deepseek_of(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(MLA fields, MoE fields) of a DeepSeek-V2/V3 config; refuses routings megatron-core cannot match."""
    v3 = cfg.get("model_type") == "deepseek_v3" or "DeepseekV3ForCausalLM" in (cfg.get("architectures") or ())
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError("deepseek with attention_bias / mlp_bias is not supported")
    mla = dict(
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
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
        moe_router_score_function="sigmoid" if v3 else "softmax",
        moe_router_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        moe_router_num_groups=groups if groups > 1 else 0,
        moe_router_group_topk=group_topk if groups > 1 else 0,
        moe_router_expert_bias=v3,
    )
    if moe["moe_first_dense_layers"] >= int(cfg["num_hidden_layers"]):
        moe = {}  # every layer dense: no expert tensors at all
    return mla, moe
