"""What `ArmorTrainer` needs of the objects it is built from.

The loop (`trainer.loop`) drives models it does not build and engines it does not know. Each
Protocol below lists exactly what the loop and its helpers call, and how; `trainer/run.py` passes
the Megatron classes (`megatron.actor.MegatronActor`, `megatron.reference.ReferenceModel`,
`megatron.critic.MegatronCritic`, `megatron.weight_export.HFWeightExport`) and the configured
rollout engines; a test may pass anything with the same surface (``tests/trainer/
test_colocated_memory.py`` wraps HF models). Shapes: ``input_ids`` [B, T] (right-padded token ids),
``lengths`` [B] (true lengths); per-token outputs are [B, T], position t belonging to token t (0
at t = 0 and at t ≥ length). Every model method is a collective: every rank calls it, in the same
order (`trainer.collectives`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from armor_megatron.megatron.collective_export import CollectiveExport
from armor_megatron.rollout.engine import RolloutEngine, WeightSource


class ModelChunks(Protocol):
    """A model held as Megatron model chunks (one per virtual pipeline stage on this rank).

    The weight export reads them, and the host offload (`megatron.offload.HostOffload`) moves
    their parameters and buffers (and, where present, ``ddp_chunks``' gradient buffers and an
    ``optimizer``'s state) between the device and the host.
    """

    @property
    def model_chunks(self) -> Sequence[torch.nn.Module]:
        """This rank's chunks, first pipeline stage first."""
        ...


class TokenLogProbs(Protocol):
    """Per-token log-probs [B, T] fp32 and, when asked for, entropies [B, T] (else None)."""

    @property
    def logprobs(self) -> torch.Tensor:
        """[B, T] fp32."""
        ...

    @property
    def entropy(self) -> torch.Tensor | None:
        """[B, T] fp32 where asked for (``with_entropy``), else None."""
        ...


class StepGuard(Protocol):
    """The actor's stability guard: reads each step's metrics to judge the next updates."""

    def observe_step(self, metrics: Mapping[str, float]) -> str | None:
        """Take the step's metrics (the engine-vs-trainer gap among them); a note of what it decided, or None."""
        ...


class Actor(ModelChunks, Protocol):
    """The trained policy π_θ."""

    @property
    def guard(self) -> StepGuard:
        """Told each step's metrics once they are agreed on every rank."""
        ...

    def compute_logprobs(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, with_entropy: bool = False
    ) -> TokenLogProbs:
        """The log-probs log π_θ(token t | tokens < t) at the sampling temperature, no gradient."""
        ...

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step of the policy loss over every row of ``batch``; the step's scalar metrics.

        ``batch``: ``input_ids``, ``lengths``, ``response_mask`` [B, T], ``advantages`` [B, T],
        ``old_logprobs`` [B, T], and where the algorithm uses them ``ref_logprobs`` and
        ``tis_weights`` [B, T] (`trainer.update_phase.TRAIN_KEYS`).
        """
        ...


class Reference(Protocol):
    """The frozen reference policy π_ref of the mixed ratio and the anchors.

    The weight exporter reads it (its model chunks, or a LoRA reference's base views of the actor's:
    `megatron.lora.export_chunks`), and the host offload moves whatever tensors it owns.
    """

    def compute_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> TokenLogProbs:
        """The log-probs log π_ref(token t | tokens < t) at the sampling temperature."""
        ...

    def reset_from(self, actor: Any) -> None:
        """θ_ref ← θ: copy the trainer's actor's weights (same architecture, layout and dtype; else raise)."""
        ...


class Critic(ModelChunks, Protocol):
    """The value model V of estimator ``gae``."""

    def compute_values(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """V(tokens < t) at [b, t] for 1 ≤ t < lengths[b], 0 elsewhere: [B, T] fp32, no gradient."""
        ...

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step of the clipped value loss (`trainer.update_phase.CRITIC_KEYS`); its scalar metrics."""
        ...


class Tokenizer(Protocol):
    """The model's tokenizer (a transformers tokenizer).

    Besides these ids, `data.prompts.encode_prompt` calls it on a string (``tok(text)["input_ids"]``)
    and, when it has a ``chat_template``, ``apply_chat_template(messages, add_generation_prompt=True,
    tokenize=True)``.
    """

    @property
    def eos_token_id(self) -> int | None:
        """Ends a response (the engines' stop token); None: the model declares none."""
        ...

    @property
    def pad_token_id(self) -> int | None:
        """Pads the batch's rows (0 when None)."""
        ...


class EngineFactory(Protocol):
    """Builds the rollout engines on the driver from the first weights (`components.engine_factory`)."""

    def __call__(
        self,
        policy: WeightSource,
        reference: WeightSource | None,
        *,
        policy_version: str,
        reference_version: str,
    ) -> tuple[RolloutEngine, RolloutEngine | None]:
        """``(policy engine, reference engine or None)``, each loaded with its weights and version.

        ``policy`` and ``reference`` are the actor's and the reference's exports (host lists when
        the anchor source keeps copies); an export the factory reads, it reads to the end.
        """
        ...


class WeightExporter(Protocol):
    """Exports a model's weights as HF-named tensors: a fresh read-once `CollectiveExport` per call."""

    def __call__(self, model: ModelChunks | Reference) -> CollectiveExport:
        """``model``'s export (the actor or the reference); every rank calls it and reads the result once."""
        ...
