"""One model description shared by the converter, the Megatron model builder and the engines.

`ModelArch` is read from a Hugging Face ``config.json`` (dict) of a supported family and
holds exactly the facts that decide tensor names and shapes. It imports nothing heavy, so
the converter, the Megatron builder (``armor_megatron.megatron``) and the rollout engines
can all depend on it.

Supported families (``ModelArch.family``):

==========  ===============================  ==========================================
family      HF ``model_type``                what differs
==========  ===============================  ==========================================
llama       llama                            optional rope scaling (Llama-3 ``llama3``)
qwen2       qwen2                            bias on q/k/v projections
qwen3       qwen3                            RMSNorm on q and k per head (q_norm, k_norm)
qwen3_moe   qwen3_moe                        qwen3 attention + routed experts
mixtral     mixtral                          routed experts named w1/w3/w2
mistral     mistral                          llama layout; ``sliding_window`` recorded
qwen2_moe   qwen2_moe                        qwen2 attention + routed experts + one shared
                                             expert scaled by sigmoid(shared_expert_gate)
deepseek    deepseek_v2, deepseek_v3         multi-head latent attention (MLA), the first
                                             ``first_k_dense_replace`` layers dense, then
                                             routed + shared experts
==========  ===============================  ==========================================

DeepSeek MLA (per token, n heads): q = q_b(norm(q_a(x))) (or q_proj(x) without a q LoRA rank)
gives n·(d_nope + d_rope); kv_a(x) gives [c_kv (kv_lora_rank) | k_rope (d_rope, shared by all
heads)]; kv_b(norm(c_kv)) gives n·(d_nope + d_v). Routing: V2 softmax over all experts then
top-k (group-limited only where the group score is the group's best expert), V3 sigmoid + a
selection bias, groups scored by their top-2 experts, top-k renormalised; both scaled by
``routed_scaling_factor``. V3's multi-token-prediction layers (``model.layers.{n}``, n ≥
``num_hidden_layers``; ``mtp_layers`` of them) are not part of the model here: the converter skips
them with a notice. The rope dims of q and k are interleaved (megatron's MLA reads them so; a V3
config with ``rope_interleave: false`` is refused).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral", "qwen2_moe", "deepseek")
_MODEL_TYPE_TO_FAMILY = {
    **{f: f for f in SUPPORTED_FAMILIES},
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
}

_ARCHITECTURE_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "MistralForCausalLM": "mistral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
}


class UnsupportedModelError(ValueError):
    """The HF config names an architecture or a feature this project does not convert."""


class ParallelismError(ValueError):
    """A model size does not divide by a parallel size; ``axis`` names it ("tp", "pp" or "ep")."""

    def __init__(self, axis: str, message: str):
        super().__init__(message)
        self.axis = axis


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """Shape-deciding facts of a decoder-only transformer, in HF terms.

    Shapes that follow (h = hidden_size, d = head_dim, nq = num_attention_heads,
    nkv = num_key_value_heads, f = ffn_hidden_size, V = vocab_size):
    q_proj [nq·d, h], k_proj/v_proj [nkv·d, h], o_proj [h, nq·d],
    gate/up [f, h], down [h, f], embed/lm_head [V, h]; experts use ``moe_ffn_hidden_size``,
    shared experts ``moe_shared_expert_ffn_hidden_size`` (0: none).

    MLA (``kv_lora_rank`` > 0; nq = nkv, ``head_dim`` = d_nope + d_rope is the q/k head size):
    q_a_proj [q_lora_rank, h] (or q_proj [nq·head_dim, h] when ``q_lora_rank`` is 0),
    q_b_proj [nq·head_dim, q_lora_rank], kv_a_proj_with_mqa [kv_lora_rank + d_rope, h],
    kv_b_proj [nq·(d_nope + d_v), kv_lora_rank], o_proj [h, nq·d_v].
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    hidden_act: str = "silu"
    dtype: str = "bfloat16"
    sliding_window: int | None = None
    moe_shared_expert_ffn_hidden_size: int = 0
    moe_shared_expert_gate: bool = False
    moe_first_dense_layers: int = 0
    moe_router_score_function: str = "softmax"
    moe_router_scaling_factor: float = 1.0
    moe_router_num_groups: int = 0
    moe_router_group_topk: int = 0
    moe_router_expert_bias: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def attention_out_dim(self) -> int:
        """Input size of o_proj: nq · (d_v under MLA, else head_dim)."""
        return self.num_attention_heads * (self.v_head_dim if self.is_mla else self.head_dim)

    @property
    def homogeneous_layers(self) -> bool:
        """All layers hold the same tensors (Megatron then stacks them on a leading layer axis)."""
        return not (self.is_moe and self.moe_first_dense_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.moe_first_dense_layers

    @property
    def queries_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def validate_parallelism(self, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
        """Raise ParallelismError naming the first size that does not divide as Megatron needs."""
        checks = [
            ("num_attention_heads", self.num_attention_heads, "tp", tp),
            ("num_key_value_heads", self.num_key_value_heads, "tp", tp),
            ("num_layers", self.num_layers, "pp", pp),
        ]
        if self.is_moe:
            checks.append(("num_experts", self.num_experts, "ep", ep))
        elif ep != 1:
            raise ParallelismError("ep", f"ep={ep} needs a MoE model; {self.family} is dense")
        for what, size, axis, n in checks:
            if n < 1 or size % n:
                raise ParallelismError(axis, f"{what}={size} is not divisible by {axis}={n}")

    # ------------------------------------------------------------------ HF config I/O
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelArch:
        """Build from a parsed HF ``config.json``; raises UnsupportedModelError."""
        family = _family_of(cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _rope_of(cfg, family)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={cfg['hidden_act']!r} is not supported (only silu)")
        moe: dict[str, Any] = {}
        if family in ("qwen3_moe", "mixtral", "qwen2_moe"):
            if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
                raise UnsupportedModelError(
                    f"{family} with dense layers (mlp_only_layers / decoder_sparse_step) is not supported"
                )
            experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            moe = dict(
                num_experts=int(experts),
                moe_router_topk=int(cfg["num_experts_per_tok"]),
                moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                # Mixtral always renormalises its top-k weights.
                moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if family != "mixtral" else True,
            )
            if family == "qwen2_moe" and int(cfg.get("shared_expert_intermediate_size") or 0):
                moe.update(
                    moe_shared_expert_ffn_hidden_size=int(cfg["shared_expert_intermediate_size"]),
                    moe_shared_expert_gate=True,
                )
        extra: dict[str, Any] = {}
        if family == "deepseek":
            extra, moe = _deepseek_of(cfg)
            head_dim = extra["qk_rope_head_dim"] + int(cfg["qk_nope_head_dim"])
        if family in ("mistral", "qwen2", "qwen2_moe") and _sliding_window_of(cfg):
            extra["sliding_window"] = _sliding_window_of(cfg)
        return cls(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=heads if family == "deepseek" else int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=(family == "qwen2" or bool(cfg.get("attention_bias", False)))
            or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True))),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            hidden_act="silu",
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            **moe,
            **extra,
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelArch:
        """Build from an HF model directory's ``config.json``; a key it lacks or a value of the
        wrong type is one ValueError line naming the file."""
        cfg = load_hf_config(path)
        try:
            return cls.from_hf_config(cfg)
        except UnsupportedModelError:
            raise
        except KeyError as e:
            raise ValueError(f"{os.path.join(path, 'config.json')}: no {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{os.path.join(path, 'config.json')}: {e}") from None


def load_hf_config(path: str) -> dict:
    """Read ``config.json`` from an HF model directory; one clear error if it is absent."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"{cfg_path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: must hold a JSON object, not a {type(cfg).__name__}")
    return cfg


def _family_of(cfg: Mapping[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type in _MODEL_TYPE_TO_FAMILY:
        return _MODEL_TYPE_TO_FAMILY[model_type]
    for arch in cfg.get("architectures") or ():
        if arch in _ARCHITECTURE_TO_FAMILY:
            return _ARCHITECTURE_TO_FAMILY[arch]
    name = model_type or (cfg.get("architectures") or ["<none>"])[0]
    raise UnsupportedModelError(
        f"unsupported architecture {name!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}"
    )


def _sliding_window_of(cfg: Mapping[str, Any]) -> int | None:
    """The attention window of Mistral (``sliding_window``) or Qwen2 (only with ``use_sliding_window``)."""
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None
    return int(cfg["sliding_window"]) if cfg.get("sliding_window") else None


def _deepseek_of(cfg: Mapping[str, Any]) -> tuple[dict, dict]:
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
    moe = dict(
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


def _rope_of(cfg: Mapping[str, Any], family: str = "llama") -> tuple[float, dict | None]:
    """RoPE base and scaling, from either transformers ≥5 ``rope_parameters`` or the older keys.
    Llama-3 scaling for any family, YaRN for DeepSeek."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn" and family == "deepseek":
        return theta, scaling
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported (only llama3, yarn for deepseek)")
    return theta, scaling
