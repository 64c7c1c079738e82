"""Megatron options a run config chooses, as pure data: ``throughput.*`` and ``moe.*``.

`Throughput` and `MoESettings` map their config sections onto megatron-core's
``TransformerConfig`` / ``DistributedDataParallelConfig`` fields (plain dicts; nothing here
imports megatron), so `config.validate` checks a config with the same rules the trainer
applies when it builds the model (`megatron.model.transformer_config_from_arch`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from armor_megatron.models.arch import ModelArch
from armor_megatron.models.family import family_of

TOKEN_DISPATCHERS = ("alltoall", "allgather", "flex")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def grad_accumulation_fusion_available() -> bool:
    """True when APEX's ``fused_weight_gradient_mlp_cuda`` imports.

    Megatron's own linear layers (the local spec, and the output layer under the TE spec too) refuse
    ``gradient_accumulation_fusion`` without it; TE's layers would fuse on their own, but the output
    layer is megatron's.
    """
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def deep_ep_available() -> bool:
    """True when DeepEP (the ``flex`` token dispatcher's all-to-all kernels, GPU only) imports."""
    return importlib.util.find_spec("deep_ep") is not None


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Speed options of a model's megatron config and DDP wrapper (``throughput.*``).

    None changes the values computed, only how (fused kernels) or when (communication overlapped
    with compute).

    ``overlap_grad_reduce``: DDP starts each bucket's gradient reduction as soon as backward
    fills it (megatron's ``DistributedDataParallelConfig.overlap_grad_reduce``).
    ``overlap_param_gather``: the distributed optimizer's parameter all-gather runs in the next
    forward instead of right after the step (needs the distributed optimizer, i.e. a GPU run, and
    ``overlap_grad_reduce``).

    Kernel defaults are chosen so that every recipe runs on an image installed from the lock files
    alone (pip wheels: Transformer Engine, Triton with torch; no APEX, maybe no C compiler):

    * ``gradient_accumulation_fusion`` (False): weight gradients accumulate straight into the fp32
      main_grad buffers inside the GEMM. Needs APEX's ``fused_weight_gradient_mlp_cuda`` (megatron's
      output layer refuses the fusion without it), which is built from source, not on the index.
    * ``apply_rope_fusion`` (None = on with the TE spec): Transformer Engine's RoPE kernel, shipped
      compiled in TE. Off for families that declare they cannot use it (`MegatronSpec.fused_rope_refused`:
      DeepSeek's MLA, whose fused RoPE is training-only; log-prob passes run in eval).
    * ``bias_activation_fusion`` (None = on with the TE spec): megatron's SwiGLU as one autograd
      function that keeps only its input [tokens, 2f] for backward (what `launch.memory` plans for
      the TE spec; the unfused path also keeps silu's output [tokens, f]).
    * ``bias_dropout_fusion`` (False): our layers have neither linear biases nor dropout, so there
      is nothing to fuse: the fused path computes the same ``x + residual`` through a compiled function.
    * ``torch_compile`` (False): megatron's ``jit_fuser`` is ``torch.compile`` (torch >= 2.2), applied
      when megatron-core is imported to the SwiGLU and bias-dropout-add bodies and to MoE router
      and dispatcher helpers. Compiled, they need Triton and a C compiler on every node (Inductor
      and Triton build their launchers at run time), compile on every rank at the first step, and
      compile again when micro-batch token counts change (until dynamo marks the length dynamic)
      and for the no-grad log-prob passes. False runs them eagerly in the trainer's processes, as
      written (`armor_megatron.megatron.jit_fusions` defers their compilation to their first call,
      so no process imports dynamo for them): the same values and memory, a few more elementwise
      kernels. True compiles them: megatron's compiled kernels.

    Always off, not keys: ``masked_softmax_fusion`` (only megatron's local attention reads it; its
    kernels come from an APEX-style source build, and TE's attention has its own),
    ``persist_layer_norm`` (APEX) and ``moe_permute_fusion`` (TE's Triton permutation kernels).
    """

    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    gradient_accumulation_fusion: bool = False
    apply_rope_fusion: bool | None = None
    bias_activation_fusion: bool | None = None
    bias_dropout_fusion: bool = False
    torch_compile: bool = False

    @classmethod
    def of(cls, throughput: Any) -> Throughput:
        """From a run config's ``throughput`` section."""
        return cls(**{f.name: getattr(throughput, f.name) for f in dataclasses.fields(cls)})

    def config_kwargs(self, arch: ModelArch, *, use_te: bool, on_gpu: bool) -> dict[str, Any]:
        """The TransformerConfig fields.

        Raises ValueError (one line naming the key) for a kernel this process cannot run.
        """
        if self.gradient_accumulation_fusion:
            if not on_gpu:
                raise ValueError("throughput.gradient_accumulation_fusion needs CUDA; this process has no GPU")
            if not grad_accumulation_fusion_available():
                raise ValueError(
                    "throughput.gradient_accumulation_fusion needs APEX's fused_weight_gradient_mlp_cuda "
                    "(megatron's output layer refuses the fusion without it); install APEX or set it false"
                )
        fused = {}
        for key in ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion"):
            wanted = getattr(self, key)
            if wanted and not use_te:
                raise ValueError(f"throughput.{key} needs the Transformer Engine spec (GPU); the local spec is in use")
            fused[key] = use_te if wanted is None else wanted
        refused = family_of(arch).megatron(arch).fused_rope_refused
        if fused["apply_rope_fusion"] and refused:
            if self.apply_rope_fusion:
                raise ValueError(f"throughput.apply_rope_fusion: {refused}")
            fused["apply_rope_fusion"] = False
        return dict(
            gradient_accumulation_fusion=self.gradient_accumulation_fusion, masked_softmax_fusion=False, **fused
        )


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """Routing and token-dispatch options of MoE layers (``moe.*``) as megatron's ``moe_*`` fields.

    ``aux_loss_coeff`` (megatron ``moe_aux_loss_coeff``) weights the load-balancing loss of
    ``load_balancing_type`` (``moe_router_load_balancing_type``); None = the family default:
    the family's (`MegatronSpec.default_load_balancing`: ``aux_loss``, or ``seq_aux_loss`` for
    DeepSeek, whose V2/V3 balance per sequence) when the coefficient is > 0, else ``none``. DeepSeek-V3's aux-loss-free expert bias stays frozen either
    way (see `transformer_config_from_arch`). ``token_dispatcher_type`` moves tokens to the
    experts' ranks: ``alltoall`` (exchanges only routed tokens), ``allgather`` (every rank gets
    every token of the TP×EP group; needs the same token count on each of those ranks and fixed
    sequence lengths) or ``flex`` (DeepEP kernels, GPU). ``router_dtype`` (``fp32``/``fp64``/None)
    is the precision of the router's logits, softmax and the weighted sum of expert outputs.
    ``expert_capacity_factor``: None = dropless; c > 0 keeps at most c·tokens·topk/experts tokens
    per expert and micro-batch, dropping by ``token_drop_policy`` (``probs``: lowest router
    probability first; ``position``: last tokens first); ``pad_expert_input_to_capacity`` pads
    every expert's input to exactly that capacity (static shapes).
    """

    aux_loss_coeff: float = 0.0
    load_balancing_type: str | None = None
    token_dispatcher_type: str = "alltoall"
    router_dtype: str | None = "fp32"
    expert_capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    pad_expert_input_to_capacity: bool = False

    @classmethod
    def of(cls, moe: Any) -> MoESettings:
        """From a run config's ``moe`` section."""
        return cls(**{f.name: getattr(moe, f.name) for f in dataclasses.fields(cls)})

    def balancing_type(self, arch: ModelArch) -> str:
        """Megatron's ``moe_router_load_balancing_type`` for ``arch``."""
        if self.load_balancing_type is not None:
            return self.load_balancing_type
        if self.aux_loss_coeff > 0:
            return family_of(arch).megatron(arch).default_load_balancing
        return "none"

    def config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        """The TransformerConfig ``moe_*`` fields (and ``variable_seq_lengths`` for allgather).

        Raises ValueError (one line naming the key) for a setting megatron or this process refuses.
        """
        if self.token_dispatcher_type not in TOKEN_DISPATCHERS:
            raise ValueError(
                f"moe.token_dispatcher_type {self.token_dispatcher_type!r} is not one of {TOKEN_DISPATCHERS}"
            )
        balancing = self.balancing_type(arch)
        if balancing not in LOAD_BALANCING_TYPES:
            raise ValueError(f"moe.load_balancing_type {balancing!r} is not one of {LOAD_BALANCING_TYPES}")
        if self.aux_loss_coeff < 0:
            raise ValueError(f"moe.aux_loss_coeff {self.aux_loss_coeff} must be >= 0")
        if self.router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"moe.router_dtype {self.router_dtype!r} is not fp32, fp64 or None")
        capacity = self.expert_capacity_factor
        if capacity is not None and capacity <= 0:
            raise ValueError(f"moe.expert_capacity_factor {capacity} must be > 0 (None: dropless)")
        if capacity is not None and balancing == "sinkhorn":
            raise ValueError("moe.expert_capacity_factor does not work with load_balancing_type sinkhorn")
        if self.pad_expert_input_to_capacity and capacity is None:
            raise ValueError("moe.pad_expert_input_to_capacity needs moe.expert_capacity_factor")
        if not arch.is_moe:  # no dispatcher; megatron's post-init refuses allgather with variable lengths
            return dict(moe_token_dispatcher_type="alltoall")
        out: dict[str, Any] = dict(moe_token_dispatcher_type=self.token_dispatcher_type)
        if self.token_dispatcher_type == "flex":
            if not deep_ep_available():
                raise ValueError("moe.token_dispatcher_type flex needs DeepEP (deep_ep does not import here)")
            if self.pad_expert_input_to_capacity:
                raise ValueError("moe.pad_expert_input_to_capacity is not supported by the flex (DeepEP) dispatcher")
            out.update(moe_flex_dispatcher_backend="deepep")
        if self.token_dispatcher_type == "allgather":
            # megatron's post-init refuses allgather with variable lengths (only pipeline p2p reads the
            # flag): the caller must give every micro-batch one shape on all TP×EP ranks and stages
            out.update(variable_seq_lengths=False)
        out.update(
            moe_router_load_balancing_type=balancing,
            moe_aux_loss_coeff=self.aux_loss_coeff,
            moe_router_dtype=self.router_dtype,
            moe_expert_capacity_factor=capacity,
            moe_token_drop_policy=self.token_drop_policy,
            moe_pad_expert_input_to_capacity=self.pad_expert_input_to_capacity,
        )
        return out

    def trainer_problem(self, arch: ModelArch) -> str | None:
        """Why the trainer cannot train `arch` with these settings, or None.

        ``sinkhorn`` routes by Sinkhorn-normalised scores only in training mode and by plain
        top-k in eval mode, so the update's π_θ and the log-prob passes' π_old would differ
        before any update (and from the engine's routing). (Aux losses are trained as megatron
        means them, the mean over micro-batches and data-parallel ranks; see
        `megatron.trained_model._mean_aux_loss_coeff`.)
        """
        if self.balancing_type(arch) == "sinkhorn":
            return "load_balancing_type sinkhorn routes differently in training than in the log-prob passes; use none"
        return None
