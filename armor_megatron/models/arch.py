"""One model description shared by the converter, the Megatron model builder and the engines.

`ModelArch` is read from a Hugging Face ``config.json`` (dict) of a supported family and
holds exactly the facts that decide tensor names and shapes. It imports nothing heavy, so
the converter, the Megatron builder (``armor_megatron.megatron``) and the rollout engines
can all depend on it.

Each family is one module of `models/families/` registered in `FAMILIES` (see
`models.family.Family`); `ModelArch.from_hf_config` reads the fields every family shares and
asks the family for the rest. The families (``ModelArch.family``):

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

DeepSeek's MLA and routing are described in `models.families.deepseek`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from armor_megatron.errors import UserInputError
from armor_megatron.registry import Registry

# name -> family class (`models.family.Family`); each module of `models.families` registers one
FAMILIES = Registry("model family")


class UnsupportedModelError(ValueError):
    """The HF config names an architecture or a feature this project does not convert."""


class InconsistentModelConfigError(UserInputError):
    """The HF config's sizes contradict each other (heads that do not divide the hidden size, ...)."""


class ParallelismError(ValueError):
    """A model size does not divide by a parallel size; ``axis`` names it ("tp", "pp" or "ep")."""

    def __init__(self, axis: str, message: str):
        super().__init__(message)
        self.axis = axis


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilyPart:
    """A part of `ModelArch` only some families have; the family's module declares the subclass."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentAttentionSizes(FamilyPart):
    """What the shared code reads of a latent attention (its family declares the rest).

    ``qk_rope_head_dim``: d_rope, the rotary part of the q/k head (k's is shared by all heads);
    ``v_head_dim``: d_v, the value head width.
    """

    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_width(self) -> int:
        """Per token, the latents a layer keeps for backward besides the heads."""
        raise NotImplementedError(f"{type(self).__name__} does not say its latent width")


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """Shape-deciding facts of a decoder-only transformer, in HF terms.

    Shapes that follow (h = hidden_size, d = head_dim, nq = num_attention_heads,
    nkv = num_key_value_heads, f = ffn_hidden_size, V = vocab_size):
    q_proj [nq·d, h], k_proj/v_proj [nkv·d, h], o_proj [h, nq·d],
    gate/up [f, h], down [h, f], embed/lm_head [V, h]; experts use ``moe_ffn_hidden_size``,
    shared experts ``moe_shared_expert_ffn_hidden_size`` (0: none).

    Parts only some families have are `FamilyPart` subclasses declared by the family's module:
    ``mla``, multi-head latent attention's sizes (DeepSeek's `LatentAttention`; nq = nkv,
    ``head_dim`` = d_nope + d_rope is the q/k head size): q_a_proj [q_lora_rank, h] (or q_proj
    [nq·head_dim, h] when ``q_lora_rank`` is 0), q_b_proj [nq·head_dim, q_lora_rank],
    kv_a_proj_with_mqa [kv_lora_rank + d_rope, h], kv_b_proj [nq·(d_nope + d_v), kv_lora_rank],
    o_proj [h, nq·d_v]; ``routing``, how the router scores and groups experts (DeepSeek's
    `GroupRouting`, which only its family reads; None: softmax over all experts, unscaled, no
    selection bias).
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
    mtp_layers: int = 0
    mla: LatentAttentionSizes | None = None
    routing: FamilyPart | None = None

    @property
    def is_moe(self) -> bool:
        """Whether the model has routed experts."""
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek's MLA)."""
        return self.mla is not None

    @property
    def qk_nope_head_dim(self) -> int:
        """The query/key head dimension without the rotary part (MLA; head_dim otherwise)."""
        return self.head_dim - (self.mla.qk_rope_head_dim if self.mla else 0)

    @property
    def value_head_dim(self) -> int:
        """Width of one head's values: MLA's ``v_head_dim``, else head_dim."""
        return self.mla.v_head_dim if self.mla else self.head_dim

    @property
    def attention_out_dim(self) -> int:
        """Input size of o_proj: nq · d_v."""
        return self.num_attention_heads * self.value_head_dim

    @property
    def homogeneous_layers(self) -> bool:
        """All layers hold the same tensors (Megatron then stacks them on a leading layer axis)."""
        return not (self.is_moe and self.moe_first_dense_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` is an MoE layer (the first ``moe_first_dense_layers`` are dense)."""
        return self.is_moe and layer >= self.moe_first_dense_layers

    @property
    def queries_per_group(self) -> int:
        """Query heads per key/value head (GQA)."""
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
        """Build from a parsed HF ``config.json``.

        The fields every family shares, then those its family reads
        (`models.family.Family.hf_fields`); raises UnsupportedModelError.
        """
        name = _family_of(cfg)
        family = FAMILIES.definition(name)()
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if not cfg.get("head_dim") and hidden % heads:
            raise InconsistentModelConfigError(
                f"hidden_size {hidden} is not divisible by num_attention_heads {heads} (and no head_dim is given)"
            )
        if heads % kv_heads:
            raise InconsistentModelConfigError(
                f"num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}"
            )
        rope_theta, rope_scaling = _rope_of(cfg, name, family.rope_scaling_types)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={cfg['hidden_act']!r} is not supported (only silu)")
        fields: dict[str, Any] = dict(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            hidden_act="silu",
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )
        fields.update(family.hf_fields(cfg))
        return cls(family=name, **fields)

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelArch:
        """Build from an HF model directory's ``config.json``.

        A key it lacks or a value of the wrong type is one ValueError line naming the file.
        """
        cfg = load_hf_config(path)
        try:
            return cls.from_hf_config(cfg)
        except UnsupportedModelError:
            raise
        except InconsistentModelConfigError as e:
            raise InconsistentModelConfigError(f"{os.path.join(path, 'config.json')}: {e}") from None
        except KeyError as e:
            raise ValueError(f"{os.path.join(path, 'config.json')}: no {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{os.path.join(path, 'config.json')}: {e}") from None


def load_hf_config(path: str) -> dict[str, Any]:
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


def _family_class(name: str) -> Any:
    """The `models.family.Family` subclass registered as ``name`` (that module imports this one)."""
    return FAMILIES[name]


def _family_of(cfg: Mapping[str, Any]) -> str:
    """The registered family reading ``cfg``: by ``model_type``, else by ``architectures``."""
    model_type = cfg.get("model_type")
    for name in FAMILIES:
        if model_type in _family_class(name).model_types:
            return name
    for arch in cfg.get("architectures") or ():
        for name in FAMILIES:
            if arch in _family_class(name).architectures:
                return name
    shown = model_type or (cfg.get("architectures") or ["<none>"])[0]
    raise UnsupportedModelError(f"unsupported architecture {shown!r}; supported families: {', '.join(FAMILIES)}")


def _rope_of(cfg: Mapping[str, Any], family: str, scalings: tuple[str, ...]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling, from either transformers ≥5 ``rope_parameters`` or the older keys.

    A scaling the family does not take (`scalings`) is refused.
    """
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in scalings:
        raise UnsupportedModelError(
            f"rope scaling {rope_type!r} is not supported for {family} (only {', '.join(scalings) or 'none'})"
        )
    return theta, scaling
