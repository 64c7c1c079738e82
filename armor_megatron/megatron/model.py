"""Megatron ``GPTModel`` for the supported HF families, built from a `ModelArch`.

Public interface::

    config = transformer_config_from_arch(arch, parallel, dtype=torch.float32, use_te=None,
                                          sequence_parallel=None, recompute=Recompute(),
                                          throughput=Throughput(), moe=MoESettings())
    model  = build_gpt_model(arch, parallel, dtype=..., vp_stage=None, ...)   # this rank's stage
    chunks = build_model_chunks(arch, parallel, dtype=..., ...)               # list, one per VPP chunk
    padded_vocab_size(arch, tp)     # rows of embedding / output layer (vocab padded to a multiple of 128)

Call after `dist.initialize(parallel)`. Every layer follows the HF model it stands for: RMSNorm
with the HF ε, SwiGLU MLP without biases, GQA with ``num_key_value_heads`` query groups, RoPE
with the HF θ (Llama-3 ``rope_scaling`` applied with the HF config's own factors), q/k bias for
qwen2, per-head q/k RMSNorm for qwen3(_moe), tied embeddings when the HF config ties them,
MoE with top-k routing (``norm_topk_prob`` -> softmax over the top-k logits; otherwise softmax
over all experts before top-k, without renormalising) and no shared experts. Dropout is 0.

Layer spec: Transformer Engine's when it imports (GPU), megatron-core's local spec otherwise.
The local spec's torch norms refuse sequence parallelism, and megatron-core needs sequence
parallelism for MoE with tp > 1, so that combination needs TE.

Vocabulary: the embedding and output layer have `padded_vocab_size(arch, tp)` rows, the HF
vocabulary rounded up to a multiple of 128 (of lcm(128, tp) for other tp), the same at every
power-of-two tp so checkpoints reshard. Rows beyond ``arch.vocab_size`` are padding;
`logprobs` masks them out of the softmax, so their contents never matter.

``model.sharded_state_dict()`` keys (no prefix; what a torch_dist checkpoint holds). Every
tensor is stored at its global shape: decoder layers stacked on a leading axis L (the layer
index is not in the key), MoE experts stacked on a second axis E, TP/EP/PP shards recorded as
offsets. h = hidden, d = head_dim, nq/nkv = heads/query groups, f / fe = dense / expert FFN size.

==========================================================  ===================  ==========================
key                                                         global shape         HF tensor(s)
==========================================================  ===================  ==========================
embedding.word_embeddings.weight                            [V_pad, h]           model.embed_tokens.weight
decoder.layers.self_attention.linear_qkv.layer_norm_weight  [L, h]               input_layernorm.weight
decoder.layers.self_attention.linear_qkv.weight             [L, (nq+2nkv)·d, h]  q/k/v_proj, per query group
decoder.layers.self_attention.linear_qkv.bias               [L, (nq+2nkv)·d]     q/k/v_proj.bias (qwen2)
decoder.layers.self_attention.q_layernorm.weight            [L, d]               self_attn.q_norm (qwen3*)
decoder.layers.self_attention.k_layernorm.weight            [L, d]               self_attn.k_norm (qwen3*)
decoder.layers.self_attention.linear_proj.weight            [L, h, nq·d]         self_attn.o_proj.weight
decoder.layers.mlp.linear_fc1.layer_norm_weight             [L, h]               post_attention_layernorm (dense)
decoder.layers.mlp.linear_fc1.weight                        [L, 2f, h]           [gate_proj; up_proj] (dense)
decoder.layers.mlp.linear_fc2.weight                        [L, h, f]            down_proj (dense)
decoder.layers.pre_mlp_layernorm.weight                     [L, h]               post_attention_layernorm (MoE)
decoder.layers.mlp.router.weight                            [L, E, h]            mlp.gate / block_sparse_moe.gate
decoder.layers.mlp.experts.experts.linear_fc1.weight        [L, E, 2fe, h]       experts.{e}.[gate; up] (w1; w3)
decoder.layers.mlp.experts.experts.linear_fc2.weight        [L, E, h, fe]        experts.{e}.down (w2)
decoder.layers.mlp.shared_experts.linear_fc1.weight         [L, 2fs, h]          shared_expert(s).[gate; up]
decoder.layers.mlp.shared_experts.linear_fc2.weight         [L, h, fs]           shared_expert(s).down_proj
decoder.layers.mlp.shared_experts.gate_weight               [L, 1, h]            mlp.shared_expert_gate (qwen2_moe)
decoder.final_layernorm.weight                              [h]                  model.norm.weight
output_layer.weight                                         [V_pad, h]           lm_head.weight (untied only)
==========================================================  ===================  ==========================

What differs per family is what its module declares (`models.family.MegatronSpec`: config class
and fields, layer-spec switches, the local spec's core attention and norm keys, where RoPE
scaling is applied); nothing here asks a family's name.
DeepSeek (MLA, see `models.families.deepseek`): ``decoder.layers.input_layernorm.weight``, ``self_attention.
linear_q_proj`` (or ``linear_q_down_proj`` + ``linear_q_up_proj.layer_norm_weight`` + ``linear_q_up_proj``),
``linear_kv_down_proj``, ``linear_kv_up_proj.layer_norm_weight``, ``linear_kv_up_proj``, ``linear_proj``;
the local spec's core attention is `local_mla_attention.LocalMLACoreAttention` (q/k and v head
sizes differ). With dense first layers (``first_k_dense_replace``) megatron's ``moe_layer_freq`` is
a list and every layer is stored under its own key, ``decoder.layers.{i}.<rest>`` (no layer axis).
DeepSeek-V3's ``mlp.gate.e_score_correction_bias`` [E] is the router's fp32 buffer
``mlp.router.expert_bias`` (a checkpoint tensor, not a parameter; never updated here).

Besides these, every linear layer has a ``<same prefix>._extra_state`` entry (TE's fp8
metadata; None under the local spec). The fused QKV rows are ordered per query group g:
its q heads, then k head g, then v head g. fc1 is stored globally as [gate; up] (megatron's
swiglu factory splits each half across TP ranks on load).

The keys are identical for the local and the TE spec, dense and MoE: the local spec maps its
separate norms onto TE's fused-norm names, SequentialMLP and TEGroupedMLP write the same expert
keys, and for MoE we drop the local spec's ``pre_mlp_layernorm`` -> ``mlp.linear_fc1.layer_norm_``
mapping (MoE has no fused fc1 norm, so TE files it as ``pre_mlp_layernorm.weight``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F

from armor_megatron.config.schema import TrainConfig
from armor_megatron.megatron import jit_fusions
from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.models.arch import ModelArch
from armor_megatron.models.family import family_of
from armor_megatron.models.megatron_options import MoESettings, Throughput

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def te_available() -> bool:
    """True when Transformer Engine's torch extension can be imported (GPU installs only)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE without CUDA libraries raises at import; treat as absent
        return False
    return True


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype named by ``dtype`` (fp32 or bf16); others raise ValueError."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16):
            return dtype
    elif str(dtype) in _DTYPES:
        return _DTYPES[str(dtype)]
    raise ValueError(f"dtype {dtype!r} is not supported (float32 or bfloat16)")


def padded_vocab_size(arch: ModelArch, tp: int = 1, divisible_by: int = 128) -> int:
    """HF vocabulary rounded up to a multiple of lcm(divisible_by, tp).

    VocabParallelEmbedding splits rows evenly over TP; rounding to 128 (megatron's default)
    makes the padded size the same for every power-of-two tp ≤ 128, so checkpoints reshard.
    """
    multiple = math.lcm(divisible_by, tp)
    return -(-arch.vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Activation recomputation (``train.recompute*``) as megatron's ``recompute_*`` fields.

    ``selective``: each layer's core attention (QKᵀ, softmax, ·V) runs again in backward, so
    its [b, heads, s, s] scores are never kept (megatron's ``recompute_modules=["core_attn"]``).
    ``full``: only the input of each unit of layers is kept; the unit runs again in backward.
    ``uniform`` splits every chunk's layers into units of ``num_layers``; ``block`` recomputes
    the first ``num_layers`` layers of each pipeline chunk (one layer each) and keeps the rest.
    Values are unchanged either way: recomputation replays the same ops with the same RNG state.
    Only training forwards (``model.train()``) recompute; forward-only log-probs keep nothing.
    """

    mode: str = "none"  # none | selective | full
    method: str = "uniform"  # uniform | block (full only)
    num_layers: int = 1  # (full only)

    @classmethod
    def of(cls, train: TrainConfig) -> Recompute:
        """From a run config's ``train`` section."""
        return cls(train.recompute, train.recompute_method, train.recompute_num_layers)

    def config_kwargs(self, layers_per_chunk: int) -> dict[str, Any]:
        """The TransformerConfig keywords of this recompute setting."""
        if self.mode == "none":
            return {}
        if self.mode == "selective":
            return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
        if self.mode != "full" or self.method not in ("uniform", "block") or self.num_layers < 1:
            raise ValueError(f"recompute {self} is not none | selective | full with method uniform | block")
        if self.method == "uniform" and layers_per_chunk % self.num_layers:
            raise ValueError(
                f"recompute_num_layers={self.num_layers} does not divide the {layers_per_chunk} layers of a "
                "pipeline chunk (uniform recompute)"
            )
        return dict(recompute_granularity="full", recompute_method=self.method, recompute_num_layers=self.num_layers)


def transformer_config_from_arch(
    arch: ModelArch,
    parallel: ParallelConfig = ParallelConfig(),
    *,
    dtype: str | torch.dtype = torch.float32,
    use_te: bool | None = None,
    sequence_parallel: bool | None = None,
    moe_aux_loss_coeff: float = 0.0,
    moe_token_dispatcher: str = "alltoall",
    init_method_std: float = 0.02,
    recompute: Recompute = Recompute(),
    throughput: Throughput | None = None,
    moe: MoESettings | None = None,
    **overrides: Any,
) -> Any:
    """The megatron ``TransformerConfig`` for `arch` under `parallel`; `overrides` win last.

    `moe` (`MoESettings`) replaces the shorthands ``moe_aux_loss_coeff`` / ``moe_token_dispatcher``
    when given. With ``calculate_per_token_loss=True`` (the trainer's convention: losses already
    divided by the global normalizer, gradients finalized without token scaling) settings the
    trainer cannot train (`MoESettings.trainer_problem`) raise ValueError.
    """
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config_classes = {"TransformerConfig": TransformerConfig, "MLATransformerConfig": MLATransformerConfig}
    declared = family_of(arch).megatron(arch)
    dtype = resolve_dtype(dtype)
    throughput = throughput or Throughput()
    jit_fusions.set_compiling(throughput.torch_compile)
    use_te = te_available() if use_te is None else use_te
    if sequence_parallel is None:
        sequence_parallel = parallel.sp if parallel.sp is not None else use_te and parallel.tp > 1
    if sequence_parallel and not use_te:
        raise ValueError(
            "sequence parallelism needs the Transformer Engine spec (the local spec's torch norms refuse it)"
        )
    if arch.is_moe and parallel.tp > 1 and not sequence_parallel:
        raise ValueError(
            f"MoE with tp={parallel.tp} needs sequence parallelism, which needs Transformer Engine; use tp=1 with ep"
        )
    on_cpu = not torch.cuda.is_available()
    if moe is None:
        moe = MoESettings(aux_loss_coeff=moe_aux_loss_coeff, token_dispatcher_type=moe_token_dispatcher)
    problem = moe.trainer_problem(arch) if arch.is_moe and overrides.get("calculate_per_token_loss") else None
    if problem:
        raise ValueError(f"moe.{problem}")
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_method_std,
        **parallel.megatron_sizes(),
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        # Fused kernels need CUDA (and TE / apex); the torch paths compute the same values.
        **throughput.config_kwargs(arch, use_te=use_te, on_gpu=not on_cpu),
        persist_layer_norm=False,
        # Micro-batches are padded to their own longest sequence, so PP stages exchange shapes.
        variable_seq_lengths=True,
        # Interleaved pp=2: a stage's previous and next stage are the same rank, and a batched
        # exchange posts [send grad, recv act, send act, recv grad] on both sides, so the peer's
        # first receive (an activation) is matched with the first send (a gradient) once forward
        # and backward overlap (more micro-batches than pp). The unbatched path orders even/odd ranks.
        batch_p2p_comm=not (parallel.vpp is not None and parallel.pp == 2),
        # train.deterministic on a GPU: megatron's deterministic kernels (embedding backward, TE attention
        # checks NVTE_ALLOW_NONDETERMINISTIC_ALGO=0); the CPU kernels are deterministic already
        deterministic_mode=not on_cpu and torch.are_deterministic_algorithms_enabled(),
        **recompute.config_kwargs(arch.num_layers // (parallel.pp * (parallel.vpp or 1))),
    )
    kwargs.update(moe.config_kwargs(arch))
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_router_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_pre_softmax=not arch.moe_norm_topk_prob,
            moe_grouped_gemm=use_te,
            moe_permute_fusion=False,
            # the family's routing (scores, groups, scaling, selection bias) comes with its config_fields;
            # DeepSeek-V3's selection bias stays as the checkpoint has it: megatron's aux-loss-free
            # balancing would move it after every step (by 1e-3·sign(load error)), changing the
            # policy's routing outside the loss (slime sets the same).
            moe_router_bias_update_rate=0.0,
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size or None,
            moe_shared_expert_gate=arch.moe_shared_expert_gate,
        )
        if not arch.homogeneous_layers:
            kwargs["moe_layer_freq"] = [int(arch.is_moe_layer(i)) for i in range(arch.num_layers)]
    if use_te and arch.sliding_window:  # the local spec's attention has no window (exact up to it)
        kwargs["window_size"] = (arch.sliding_window - 1, 0)
    kwargs.update(declared.config_fields)
    kwargs.update(overrides)
    return config_classes[declared.config_class](**kwargs)


def layer_spec(arch: ModelArch, use_te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
    """Transformer layer spec: TE fused modules on GPU, megatron-core local modules otherwise.

    Models whose layers differ (DeepSeek's first dense layers) get a block spec holding this
    pipeline stage's layers (needs ``config``).
    """
    if arch.homogeneous_layers:
        return _one_layer_spec(arch, use_te, moe=arch.is_moe)
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if config is None:
        raise ValueError(f"{arch.family} has dense and MoE layers: layer_spec needs the TransformerConfig")
    specs = [_one_layer_spec(arch, use_te, moe=arch.is_moe_layer(i)) for i in range(arch.num_layers)]
    first = gpt_layer_specs.get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = gpt_layer_specs.get_num_layers_to_build(config, vp_stage=vp_stage)
    norm = gpt_layer_specs.TENorm if use_te else gpt_layer_specs.LNImpl
    return TransformerBlockSubmodules(layer_specs=specs[first : first + count], layer_norm=norm)


def _one_layer_spec(arch: ModelArch, use_te: bool, moe: bool) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    experts = arch.num_experts if moe else None
    declared = family_of(arch).megatron(arch)
    switches = dict(qk_layernorm=declared.qk_layernorm, multi_latent_attention=declared.multi_latent_attention)
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=moe, **switches
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm", **switches
    )
    # the local DotProductAttention refuses packed (THD) micro-batches and takes no separate q/k
    # and v head sizes
    spec.submodules.self_attention.submodules.core_attention = _local_core_attention(declared.local_core_attention)
    # Keep every norm under the TE spec's key (see module docstring): the MoE pre-MLP norm is not
    # fused in TE; a family may map others (MLA: its q / kv norms, fused into the up projections).
    keys_map = dict(
        spec.submodules.sharded_state_dict_keys_map if declared.local_keys_map is None else declared.local_keys_map
    )
    if moe:
        keys_map.pop("pre_mlp_layernorm.", None)
    spec.submodules.sharded_state_dict_keys_map = keys_map
    return spec


def _local_core_attention(name: str) -> type:
    """The local spec's core attention class a family names (`MegatronSpec.local_core_attention`)."""
    if name == "mla":
        from armor_megatron.megatron.local_mla_attention import LocalMLACoreAttention

        return LocalMLACoreAttention
    from armor_megatron.megatron.packed_attention import PackedDotProductAttention

    return PackedDotProductAttention


def build_gpt_model(
    arch: ModelArch,
    parallel: ParallelConfig = ParallelConfig(),
    *,
    dtype: str | torch.dtype = torch.float32,
    vp_stage: int | None = None,
    use_te: bool | None = None,
    config: Any = None,
    **config_kwargs: Any,
) -> Any:
    """This rank's pipeline stage (or VPP chunk `vp_stage`) of the GPT model for `arch`.

    Embedding lives on the first stage, final norm and output layer on the last; with tied
    embeddings megatron keeps a copy of the embedding on the last stage and all-reduces its
    gradient. Returns a ``GPTModel`` in eval mode with all parameters in `dtype` (fp32 or bf16) on
    this rank's device. A bf16 model returns bf16 logits; `logprobs` reads them without an fp32
    copy of the whole [tokens, vocab] tensor (which megatron's Float16Module output cast would make).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    use_te = te_available() if use_te is None else use_te
    if config is None:
        config = transformer_config_from_arch(arch, parallel, dtype=dtype, use_te=use_te, **config_kwargs)
    # the model applies Llama-3 scaling; a family may carry its scaling in the config (MLA's YaRN)
    scaling = (arch.rope_scaling or {}) if family_of(arch).megatron(arch).rope_scaling_in_model else {}
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, use_te, config, vp_stage),
        vocab_size=padded_vocab_size(arch, parallel.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
        rope_scaling=bool(scaling),
        rope_scaling_factor=float(scaling.get("factor", 8.0)),
        vp_stage=vp_stage,
    )
    if scaling:  # megatron hard-codes Llama-3.1's low/high factors and context; use the config's
        model.rotary_pos_emb.inv_freq = llama3_inv_freq(arch).to(model.rotary_pos_emb.inv_freq.device)
    if config.bf16:  # as megatron's Float16Module does (norms are built in fp32), minus its fp32 output cast
        model.bfloat16()
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model.eval()


def build_model_chunks(arch: ModelArch, parallel: ParallelConfig = ParallelConfig(), **kwargs: Any) -> list[Any]:
    """All model chunks of this rank: one, or ``parallel.vpp`` with interleaved pipelining."""
    if parallel.vpp is None:
        return [build_gpt_model(arch, parallel, **kwargs)]
    return [build_gpt_model(arch, parallel, vp_stage=i, **kwargs) for i in range(parallel.vpp)]


def llama3_inv_freq(arch: ModelArch) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2] with Llama-3 scaling, as HF computes them.

    inv = θ^(-2i/d); wavelength λ = 2π/inv; with L = original_max_position_embeddings,
    λ > L/low: inv/factor; λ < L/high: inv; between: (1-s)·inv/factor + s·inv with
    s = (L/λ - low) / (high - low).
    """
    s = arch.rope_scaling or {}
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    context = float(s.get("original_max_position_embeddings", 8192))
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    wavelen = 2 * math.pi / inv
    smooth = (context / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > context / low, inv / factor, inv)
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
