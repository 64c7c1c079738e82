"""The frozen reference policy π_ref: the actor's layout, no optimizer, no gradients.

Public interface (after `dist.initialize(parallel, arch)`; every rank calls every method)::

    ref = ReferenceModel(settings, offload=False, temperature=1.0)   # the actor's `ModelSettings`
    ref.compute_logprobs(input_ids, lengths) -> LogProbs     # log π_ref [N, L], every rank
    ref.reset_from(actor)                                    # θ_ref <- θ, bit for bit
    ref.load_weights(path)                                   # torch_dist checkpoint (any layout) or HF dir
    ref.sharded_state_dict() / ref.load_sharded_state_dict(loaded)   # keys prefixed "reference."

ARMOR's reference reset (every τ steps θ_ref <- θ) calls `reset_from`; it copies the actor's
model parameters (the bf16 weights the actor computes with, not its fp32 master copy)
tensor by tensor, so reference log-probs equal the actor's exactly until the actor's next
update. With ``offload=True`` the weights live in host memory between calls and are moved
to the device only inside `compute_logprobs` / `reset_from` (a no-op on CPU-only runs);
loading and saving work on the weights wherever they are. Give it the actor's
``temperature`` (log-probs of softmax(logits / T), as the rollouts were sampled). Forwards take
``settings.micro_batch_size`` rows per micro-batch, or pack ``settings.token_budget.forward``
tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from armor_megatron.megatron.hf_weights import load_weights
from armor_megatron.megatron.logprobs import LogProbs, compute_logprobs
from armor_megatron.megatron.model import build_model_chunks
from armor_megatron.megatron.model_state import chunks_sharded_state_dict, load_chunks_state
from armor_megatron.megatron.trained_model import ModelSettings, TrainedModel, check_layout

CHECKPOINT_PREFIX = "reference."


class ReferenceModel:
    """The frozen reference policy π_ref: the actor's architecture, no grads, in host memory between uses with ``offload``."""

    def __init__(self, settings: ModelSettings, *, offload: bool = False, temperature: float = 1.0):
        check_layout(settings.parallel)
        self.settings, self.temperature = settings, float(temperature)
        self.arch, self.parallel = settings.arch, settings.parallel
        # `recompute` and `throughput` only keep the config equal to the actor's: a frozen forward keeps
        # no activations and has no gradients; `moe` routes and dispatches tokens as the actor does.
        # settings.init_weights=False: the caller loads every weight next
        self.model_chunks = build_model_chunks(settings.arch, settings.parallel, **settings.config_kwargs())
        self.device = next(self.model_chunks[0].parameters()).device
        self.offload = offload and self.device.type != "cpu"
        # Frozen by construction: no optimizer, forward only under no_grad. The parameters keep
        # requires_grad=True on purpose: megatron's TP linears switch to linear_with_frozen_weight
        # for frozen weights, which rounds differently from the actor's path and would break
        # bit-equality after reset_from.
        for chunk in self.model_chunks:
            chunk.eval()
        self._to(torch.device("cpu") if self.offload else self.device)

    def compute_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> LogProbs:
        """Log-probs log π_ref of every token of ``input_ids`` [B, T] (true ``lengths`` [B]), on every rank."""
        with self._on_device():
            return compute_logprobs(
                self.model_chunks,
                input_ids,
                lengths,
                micro_batch_size=self.settings.micro_batch_size,
                vocab_size=self.arch.vocab_size,
                temperature=self.temperature,
                max_tokens=self.settings.token_budget.forward,
            )

    @torch.no_grad()
    def reset_from(self, actor: TrainedModel) -> None:
        """Copy the actor's current model weights into the reference (same arch and layout)."""

        def dtype(chunks: list[torch.nn.Module]) -> torch.dtype:
            return next(chunks[0].parameters()).dtype

        if (actor.arch, actor.parallel, dtype(actor.model_chunks)) != (
            self.arch,
            self.parallel,
            dtype(self.model_chunks),
        ):
            raise ValueError("reset_from needs an actor with the reference's architecture, parallel layout and dtype")
        with self._on_device():
            for ours, theirs in zip(self.model_chunks, actor.model_chunks):
                mine, src = ours.state_dict(keep_vars=True), theirs.state_dict(keep_vars=True)
                if mine.keys() != src.keys():
                    raise ValueError(
                        f"reset_from: actor and reference modules differ: {sorted(mine.keys() ^ src.keys())[:3]}"
                    )
                for name, tensor in mine.items():
                    if torch.is_tensor(tensor):
                        tensor.copy_(src[name])

    def load_weights(self, path: str) -> None:
        """Model weights from a torch_dist checkpoint (any layout) or an HF directory."""
        load_weights(self.model_chunks, path)

    # ------------------------------------------------------------------ checkpoint hooks
    def sharded_state_dict(self) -> dict[str, Any]:
        """The reference's model weights as a sharded state dict (checkpoint prefix ``reference.``)."""
        return chunks_sharded_state_dict(self.model_chunks, CHECKPOINT_PREFIX)

    def load_sharded_state_dict(self, loaded: dict[str, Any]) -> None:
        """Load the reference's weights from what ``dist_checkpointing.load`` returned."""
        load_chunks_state(self.model_chunks, loaded, CHECKPOINT_PREFIX)

    # ------------------------------------------------------------------ offload
    def _to(self, device: torch.device) -> None:
        for chunk in self.model_chunks:
            chunk.to(device)

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        if not self.offload:
            yield
            return
        self._to(self.device)
        try:
            yield
        finally:
            self._to(torch.device("cpu"))
