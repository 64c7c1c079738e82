"""The PPO critic: the actor's Megatron GPT model with a value head in place of the LM head.

Public interface (after `dist.initialize(parallel, arch)`; every rank calls every method)::

    critic = MegatronCritic(settings, optimizer=OptimizerConfig(...),   # the actor's `ModelSettings`
                            loss=ValueLossConfig(clip_eps=0.5), total_steps=500, seed=1234,
                            value_head_init_std=0.0)
    critic.load_weights(path)                  # backbone: the actor's torch_dist checkpoint or HF dir
    values = critic.compute_values(input_ids, lengths)   # [N, L] fp32, no grad, every rank
    metrics = critic.train_step(batch)         # one optimizer step of the clipped value loss
    critic.sharded_state_dict() / critic.load_sharded_state_dict(...)   # keys prefixed "critic."

Model: ``GPTModel`` of the same `ModelArch` and parallel layout as the actor (embedding,
decoder, final norm), built untied, whose ``output_layer`` is a `ValueHead`: hidden [s, b, h]
-> values [s, b, 1], computed in fp32. The head is small (h + 1 parameters) and replicated on
every tensor-parallel rank, like the final norm: every TP rank sees the whole hidden state and
computes the same values, and megatron counts its gradient once in the grad norm (it has no
``tensor_model_parallel`` attribute). Under sequence parallelism (TE spec, GPUs) the head first
gathers the sequence shards; its backward then keeps this rank's shard of the (identical)
gradient rather than summing the tp copies. That path needs Transformer Engine and was not run
on the CPU development machines. It starts at zero (``value_head_init_std=0``: V ≡ 0 at
first, the backbone gets gradient from the second update on) or normal(0, std), drawn from a
generator seeded by `seed`, so every rank holds the same head. Building the untied model makes
the last stage allocate the LM head once before it is replaced (one [V/tp, h] tensor).

Values are aligned with log-probs: ``values[n, t]`` is the head at position t − 1, the state
that emits token t (tokens < t), for 1 <= t < lengths[n], 0 elsewhere; GAE reads them at the
response positions (``response_mask``).

``train_step(batch)``, keys (N rows, L positions; same splitting over data-parallel ranks,
micro-batches and pipeline stages as the actor, `trained_model.TrainedModel`)::

    input_ids [N, L], lengths [N], response_mask [N, L]   as for the actor
    old_values [N, L] fp32   V_old, the values GAE used (``compute_values`` before the update)
    returns    [N, L] fp32   GAE returns R = A + V_old

Loss: ``value_loss`` (algo/value_loss.py) with the GLOBAL normaliser of ``loss.loss_agg`` over
all N rows, so micro-batches and data-parallel ranks add up to the whole batch's loss. Returns,
identical on every rank: loss, grad_norm, lr, skipped, skipped_total, value_clip_frac,
value_mean, return_mean, value_error_sq_mean, explained_var, num_tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from armor_megatron.algo.loss import loss_normalizer
from armor_megatron.algo.value_loss import ValueLossConfig, explained_variance_from_moments, value_loss
from armor_megatron.config.schema import OptimizerConfig, StabilityConfig
from armor_megatron.megatron.hf_weights import load_weights
from armor_megatron.megatron.logprobs import forward_only, shift_to_predicted
from armor_megatron.megatron.microbatch import MicroBatch, to_device
from armor_megatron.megatron.model import build_model_chunks, resolve_dtype
from armor_megatron.megatron.trained_model import ModelSettings, TrainedModel, TrainMicroBatch, checked_rows

VALUE_HEAD = "output_layer."  # the head's key prefix in the model's state dict
_MOMENTS = ("value_error_mean", "return_sq_mean")  # only needed to compute explained_var


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] -> values [s, b, 1] in fp32: V = h·w + c.

    Called by ``GPTModel`` as its output layer (``weight`` and ``runtime_gather_output`` are the LM
    head's arguments, unused).
    """

    def __init__(
        self, hidden_size: int, *, dtype: torch.dtype, init_std: float, seed: int, sequence_parallel: bool = False
    ):
        super().__init__()
        weight = torch.zeros(1, hidden_size, dtype=torch.float32)
        if init_std > 0:
            weight.normal_(0.0, init_std, generator=torch.Generator().manual_seed(seed))
        self.weight = torch.nn.Parameter(weight.to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(
        self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        """Values [s, b, 1] in fp32 from hidden states [s, b, h] ([s/tp, b, h] under sequence parallelism)."""
        if self.sequence_parallel:
            # [s/tp, b, h] -> [s, b, h]. Every TP rank then computes the whole (identical) loss,
            # so the backward takes this rank's slice of the gradient instead of summing tp copies.
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states.float(), self.weight.float(), self.bias.float()), None


def token_values(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Values [b, mb.width] per predicted token from the value head's output.

    The value head's output [b, s, 1] ([1, t, 1] packed) of a micro-batch -> values
    [b, mb.width] per predicted token.
    """
    return shift_to_predicted(mb.unpack(output.squeeze(-1).float()), mb)


class MegatronCritic(TrainedModel):
    """The PPO critic: the actor's architecture with a scalar value head, trained with the value loss."""

    checkpoint_prefix = "critic."

    def __init__(
        self,
        settings: ModelSettings,
        *,
        optimizer: OptimizerConfig,
        loss: ValueLossConfig,
        total_steps: int,
        seed: int = 1234,
        value_head_init_std: float = 0.0,
        stability: StabilityConfig | None = None,
    ):
        if value_head_init_std < 0:
            raise ValueError(f"value_head_init_std must be >= 0, got {value_head_init_std}")
        self.loss_config, self.value_head_init_std = loss, float(value_head_init_std)
        super().__init__(settings, optimizer=optimizer, total_steps=total_steps, seed=seed, stability=stability)

    def _build_chunks(self, config: Any, seed: int) -> list[torch.nn.Module]:
        s = self.settings
        untied = dataclasses.replace(s.arch, tie_word_embeddings=False)
        chunks = build_model_chunks(untied, s.parallel, dtype=s.dtype, config=config, use_te=s.use_te)
        for chunk in chunks:
            if chunk.post_process:
                device = next(chunk.parameters()).device
                chunk.output_layer = ValueHead(
                    s.arch.hidden_size,
                    dtype=resolve_dtype(s.dtype),
                    init_std=self.value_head_init_std,
                    seed=seed,
                    sequence_parallel=config.sequence_parallel,
                ).to(device)
        return chunks

    def load_weights(self, path: str) -> None:
        """Load the critic's backbone from the actor's checkpoint or HF directory.

        The backbone (embedding, decoder, final norm) from a torch_dist model checkpoint of the
        actor's architecture, any layout, or from its HF directory; the value head keeps its
        initial weights.
        """
        load_weights(self.model_chunks, path, exclude=(VALUE_HEAD,))
        self.optimizer.reload_model_params()

    def compute_values(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """V(tokens < t) at [n, t] for 1 <= t < lengths[n], 0 elsewhere: [N, L] fp32, no grad, every rank."""
        return forward_only(
            self.model_chunks,
            input_ids,
            lengths,
            micro_batch_size=self.micro_batch_size,
            names=("values",),
            collect=lambda mb, output: (token_values(output, mb),),
            max_tokens=self.token_budget.forward,
        )["values"]

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step of the clipped value loss over all rows of `batch` (module docstring)."""
        keys = ("old_values", "returns")
        batch = checked_rows(batch, keys, keys)
        batch = {k: batch[k] for k in ("input_ids", "lengths", "response_mask", *keys)}
        normalizer = loss_normalizer(batch["response_mask"], self.loss_config.loss_agg).clamp(min=1).float()

        def loss_of(tmb: TrainMicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            values = token_values(output, tmb.mb)
            rows = {k: to_device(v, values.device) for k, v in tmb.rows.items()}
            return value_loss(
                values,
                rows["old_values"],
                rows["returns"],
                rows["response_mask"],
                self.loss_config,
                normalizer=to_device(normalizer, values.device),
            )

        metrics = self._train_on(batch, loss_of)
        metrics["explained_var"] = explained_variance_from_moments(metrics)
        for key in _MOMENTS:
            metrics.pop(key)
        return metrics
