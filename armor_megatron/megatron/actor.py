"""The trained policy: a TP/PP/EP Megatron GPT model with its optimizer and the ARMOR train step.

Public interface (call after `dist.initialize(parallel, arch)`; every rank calls every method;
the constructor seeds torch and megatron's model-parallel RNG with `seed` before building the
weights, so a seed gives the same initial weights whatever ran before)::

    settings = ModelSettings(arch, parallel, dtype="bfloat16", micro_batch_size=2)   # or ModelSettings.of(cfg, ...)
    actor = MegatronActor(settings, optimizer=OptimizerConfig(...), loss=PolicyLossConfig(alpha=0.9),
                          total_steps=500, seed=1234, temperature=1.0, stability=StabilityConfig(...))
    actor.model_chunks                      # this rank's unwrapped GPTModel chunks (one, or vpp)
    actor.optimizer, actor.scheduler        # megatron optimizer, OptimizerParamScheduler
    actor.load_weights(path)                # torch_dist checkpoint (any TP/PP/EP layout) or HF dir
    actor.base_source                       # LoRA: where the unmerged base came from (None: the checkpoint holds it)
    out = actor.compute_logprobs(input_ids, lengths, with_entropy=False)   # LogProbs, no grad
    metrics = actor.train_step(batch)       # one optimizer step over the whole batch
    actor.guard                             # StabilityGuard (skips, LR / clip scales, counters)
    actor.sharded_state_dict() / actor.load_sharded_state_dict(...)   # used by `checkpoint`

The base class `trained_model.TrainedModel` (shared with the critic) holds the model chunks,
DDP, optimizer, LR schedule, guard, micro-batching and the guarded optimizer step.

``train_step(batch)``: the batch is identical on every rank; rows are split over data-parallel
ranks (contiguous shares whose sizes differ by at most one), each share over micro-batches
of ``micro_batch_size`` rows run through megatron's pipeline schedule with gradient
accumulation -- or with ``token_budget`` (`microbatch.TokenBudget`) balanced over ranks by
tokens and packed into micro-batches of at most ``token_budget.train`` tokens (log-prob
forwards: ``token_budget.forward``). Keys (N rows, L positions):

    input_ids      [N, L] long    prompt + response tokens, any padding beyond `lengths`
    lengths        [N]    long    true lengths
    response_mask  [N, L]         1 at positions t whose token is a response token; t is
                                  predicted from tokens < t, so 1 <= t < lengths[n]
    advantages     [N] or [N, L]  per sequence or per token
    old_logprobs   [N, L] fp32    log π_old(token t), same positions as compute_logprobs
    ref_logprobs   [N, L] fp32    log π_ref(token t); may be absent when loss.alpha == 1 and loss.kl_coef == 0
    tis_weights    [N, L] fp32    optional per-token loss weights (truncated importance sampling)

Loss: the registered policy loss ``loss_name`` (algo/loss.py; ``"armor"``) of every micro-batch with ``normalizer`` = the GLOBAL
count of aggregation units over all N rows (token-mean: every response token), so that the
micro-batch losses of all data-parallel ranks add up to exactly the loss of the whole batch,
and their summed gradients (DDP sums, see `optimizer`) are its gradient, whatever the split.
Padding rows (a rank without rows; under VPP, full micro-batches of the batch's length L and
a multiple of pp of them, as the interleaved schedule needs) carry an all-zero response mask:
zero loss, zero gradient.

The loss clips with ε_low, ε_high × ``guard.clip_scale``. Then: grad norm (pre-clipping) ->
`StabilityGuard` -> clip to ``clip_grad`` and Adam step at lr(k) × the guard's LR scale, or skip
(no update, LR schedule not advanced, counted); each intervention is logged by rank 0. Returned
on every rank, identical (lr: the rate of this step's update; the guard's metrics see
`stability.GuardDecision.metrics`)::

    loss, grad_norm, lr, skipped (0/1), skipped_total, lr_scale, clip_scale, guard_level, guard_unhealthy,
    guard_reduce, guard_rebaseline, guard_relax, guard_rollback, guard_exhausted (0/1),
    clip_frac_low, clip_frac_high, dual_clip_frac, ratio_mean, ratio_min, ratio_max,
    approx_kl_old, approx_kl_ref, mixture_weight_mean (with ref_logprobs), kl_loss (with the KL penalty),
    entropy, log_ratio_clamped_frac,
    num_tokens

(the policy-loss metrics are token-weighted over the whole batch, see algo/metrics.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from armor_megatron.algo.loss import PolicyLossConfig, bind_policy_loss, loss_normalizer
from armor_megatron.config.schema import OptimizerConfig, StabilityConfig
from armor_megatron.errors import UserInputError
from armor_megatron.megatron.base_source import LORA_BASE, BaseSource, on_rank_0
from armor_megatron.megatron.logprobs import LogProbs, compute_logprobs, token_logprobs
from armor_megatron.megatron.lora import LORA_SETTINGS, LoRASettings, adapter_sharded_state_dict, attach_adapters
from armor_megatron.megatron.microbatch import to_device
from armor_megatron.megatron.trained_model import ModelSettings, TrainedModel, TrainMicroBatch, checked_rows


class MegatronActor(TrainedModel):
    """The policy π_θ: log-probs and the ARMOR/DAPO train step (module docstring)."""

    def __init__(
        self,
        settings: ModelSettings,
        *,
        optimizer: OptimizerConfig,
        loss: PolicyLossConfig,
        total_steps: int,
        seed: int = 1234,
        temperature: float = 1.0,
        loss_name: str = "armor",
        stability: StabilityConfig | None = None,
        lora: LoRASettings | None = None,
    ):
        self.loss_config, self.temperature = loss, float(temperature)
        self.loss_fn = bind_policy_loss(loss_name)
        self.lora = lora
        super().__init__(settings, optimizer=optimizer, total_steps=total_steps, seed=seed, stability=stability)

    def _build_chunks(self, config: Any, seed: int) -> list[Any]:
        chunks = super()._build_chunks(config, seed)
        if self.lora is not None:  # base frozen, adapters added, before DDP and the optimizer see the parameters
            attach_adapters(chunks, self.lora)
        return chunks

    # ------------------------------------------------------------------ LoRA: the base in checkpoints
    base_source: BaseSource | None = (
        None  # the files of a LoRA actor's unmerged base; None: its checkpoints hold the base
    )

    def load_weights(self, path: str) -> None:
        """Load the weights at ``path``; a LoRA actor records it as its base's source (`base_source`)."""
        super().load_weights(path)
        if self.lora is not None:
            self.base_source = on_rank_0(lambda: BaseSource.of(path))

    def model_sharded_state_dict(self) -> dict[str, Any]:
        """The base weights and, with LoRA, the adapters (`lora.adapter_sharded_state_dict`).

        A LoRA actor whose base is still the files it was loaded from (no reset has merged into it:
        `base_source` is set) has the adapters alone: its checkpoints record the source instead.
        """
        state = super().model_sharded_state_dict()
        if self.lora is not None:
            if self.base_source is not None:
                state = {chunk: {} for chunk in state}
            for chunk, adapters in adapter_sharded_state_dict(self.model_chunks, self.checkpoint_prefix).items():
                state[chunk].update(adapters)
        return state

    def sharded_state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves (`TrainedModel.sharded_state_dict`), and what LoRA records beside it.

        ``lora_settings``: the adapters' rank, alpha, dropout and targets; ``lora_base``: the source
        of a base left out.
        """
        state = super().sharded_state_dict()
        if self.lora is not None:
            state[LORA_SETTINGS] = self.lora.to_state()  # what `armor-convert lora-to-peft` writes as the PEFT config
        if self.lora is not None and self.base_source is not None:
            state[LORA_BASE] = self.base_source.to_state()
        return state

    def restore_base(self, checkpoint: str, saved: dict[str, Any] | None) -> None:
        """Before loading ``checkpoint``: load the base from the source it records (``saved``), if it left the base out.

        Refused in one line when that source is gone or its files changed. Without ``saved`` the
        checkpoint holds the base (loaded with the rest). Every rank calls it.
        """
        if saved is None or self.lora is None:
            super().restore_base(checkpoint, saved)  # refuses a base left out when this actor has no adapters
            self.base_source = None
            return
        source = BaseSource.from_state(saved)
        problem = on_rank_0(source.problem)
        if problem is not None:
            raise UserInputError(
                f"{checkpoint} holds LoRA adapters, not their base, which it reads from {source.path}: {problem}; "
                "restore those files to resume"
            )
        super().load_weights(source.path)
        self.base_source = source

    def load_sharded_state_dict(self, loaded: dict[str, Any]) -> None:
        """Restore a checkpoint; one without the base (`restore_base` loaded it) restores the adapters around it."""
        if self.lora is not None and self.base_source is not None:
            for i, chunk in enumerate(self.model_chunks):
                ours = {self.checkpoint_prefix + k: v for k, v in chunk.state_dict(keep_vars=True).items()}
                loaded["model"][f"chunk{i}"] = {**ours, **loaded["model"][f"chunk{i}"]}
        super().load_sharded_state_dict(loaded)

    def restart_adapter_optimizer(self) -> None:
        """After a reference reset put new adapters in place: Adam starts afresh for them, masters copied from them."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            opt.optimizer.state.clear()
            for group in opt.optimizer.param_groups:  # fused Adams (TE, apex) count steps per group
                group.pop("step", None)
        self.optimizer.reload_model_params()

    def compute_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor, with_entropy: bool = False) -> LogProbs:
        """Per-token log-probs log π_θ(token t | tokens < t) [N, L] (0 outside 1 <= t < length), no grad; every rank."""
        return compute_logprobs(
            self.model_chunks,
            input_ids,
            lengths,
            micro_batch_size=self.micro_batch_size,
            vocab_size=self.arch.vocab_size,
            temperature=self.temperature,
            with_entropy=with_entropy,
            max_tokens=self.token_budget.forward,
        )

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step over all rows of `batch` (see module docstring)."""
        batch = _checked_batch(batch, self.loss_config)
        normalizer = loss_normalizer(batch["response_mask"], self.loss_config.loss_agg).clamp(min=1).float()
        loss_config = _clip_scaled(self.loss_config, self.guard.clip_scale)

        def loss_of(tmb: TrainMicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            lp, ent = token_logprobs(
                logits, tmb.mb, vocab_size=self.arch.vocab_size, temperature=self.temperature, with_entropy=True
            )
            rows = {k: to_device(v, lp.device) for k, v in tmb.rows.items()}
            return self.loss_fn(
                logp=lp,
                old_logp=rows["old_logprobs"],
                ref_logp=rows.get("ref_logprobs"),
                advantages=rows["advantages"],
                mask=rows["response_mask"],
                cfg=loss_config,
                normalizer=to_device(normalizer, lp.device),
                entropy=ent,
                token_weights=rows.get("tis_weights"),
            )

        return self._train_on(batch, loss_of)


# ----------------------------------------------------------------------------- helpers
def _clip_scaled(cfg: PolicyLossConfig, scale: float) -> PolicyLossConfig:
    """The loss config with the clip range tightened by the stability guard: ε_low, ε_high × scale."""
    return cfg if scale == 1.0 else cfg.replace(eps_low=cfg.eps_low * scale, eps_high=cfg.eps_high * scale)


def _checked_batch(batch: Mapping[str, torch.Tensor], cfg: PolicyLossConfig) -> dict[str, torch.Tensor]:
    """Validate the actor's batch; returns CPU tensors (ref_logprobs may be None)."""
    out = checked_rows(batch, ("advantages", "old_logprobs"), ("old_logprobs", "ref_logprobs", "tis_weights"))
    if out.get("ref_logprobs") is None and cfg.needs_ref_logp:
        raise ValueError(
            f"ref_logprobs is required when alpha < 1 or kl_coef > 0 (alpha={cfg.alpha}, kl_coef={cfg.kl_coef})"
        )
    ids = out["input_ids"]
    if out["advantages"].shape not in (ids.shape[:1], ids.shape):
        raise ValueError(f"advantages has shape {tuple(out['advantages'].shape)}, expected [N] or [N, L]")
    return {k: v for k, v in out.items() if v is not None}
