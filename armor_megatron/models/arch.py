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
==========  ===============================  ==========================================
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")

_ARCHITECTURE_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
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
    gate/up [f, h], down [h, f], embed/lm_head [V, h]; experts use ``moe_ffn_hidden_size``.
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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
        rope_theta, rope_scaling = _rope_of(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={cfg['hidden_act']!r} is not supported (only silu)")
        moe: dict[str, Any] = {}
        if family in ("qwen3_moe", "mixtral"):
            if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
                raise UnsupportedModelError(
                    "qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step) is not supported"
                )
            experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            moe = dict(
                num_experts=int(experts),
                moe_router_topk=int(cfg["num_experts_per_tok"]),
                moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                # Mixtral always renormalises its top-k weights.
                moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if family == "qwen3_moe" else True,
            )
        return cls(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            hidden_act="silu",
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            **moe,
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelArch:
        return cls.from_hf_config(load_hf_config(path))


def load_hf_config(path: str) -> dict:
    """Read ``config.json`` from an HF model directory; one clear error if it is absent."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
    with open(cfg_path) as f:
        return json.load(f)


def _family_of(cfg: Mapping[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_FAMILIES:
        return model_type
    for arch in cfg.get("architectures") or ():
        if arch in _ARCHITECTURE_TO_FAMILY:
            return _ARCHITECTURE_TO_FAMILY[arch]
    name = model_type or (cfg.get("architectures") or ["<none>"])[0]
    raise UnsupportedModelError(
        f"unsupported architecture {name!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}"
    )


def _rope_of(cfg: Mapping[str, Any]) -> tuple[float, dict | None]:
    """RoPE base and scaling, from either transformers ≥5 ``rope_parameters`` or the older keys."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported (only llama3)")
    return theta, scaling
