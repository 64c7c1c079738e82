"""The rollout engine interface: token ids in, sampled responses with log-probs out.

Every engine (the in-process :class:`~armor_megatron.rollout.local.LocalEngine`, the HTTP
:class:`~armor_megatron.rollout.sglang.engine.SGLangEngine`) implements
:class:`RolloutEngine`. Weights are always HF-named tensors (``model.layers.0.mlp.up_proj.weight``)
or an HF checkpoint directory; an engine never sees Megatron names.

Every update is tagged with a ``weight_version`` string and every sample carries the version
of the weights that produced it, so a trainer can prove that its rollouts come from the policy
it thinks they come from (:class:`StaleWeightsError` otherwise).
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from armor_megatron.errors import UserInputError

FINISH_REASONS = ("stop", "length", "abort")
# what an engine may release while a colocated trainer uses the device: SGLang 0.5.23's memory-saver tags
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

NamedTensors = Iterable[tuple[str, Any]]  # (HF name, torch.Tensor); may be ShardedWeights
WeightSource = NamedTensors | str | os.PathLike[str]


def check_memory_tags(tags: Sequence[str]) -> None:
    """Refuse memory tags no engine knows (a caller's bug: SGLang would answer 400)."""
    if isinstance(tags, str) or not set(tags) <= set(MEMORY_TAGS):
        raise ValueError(f"memory tags must be a sequence of {list(MEMORY_TAGS)}, got {tags!r}")


class ShardSink(abc.ABC):
    """One trainer rank's end of a delivery: takes that rank's HF-named tensors bucket by bucket."""

    @abc.abstractmethod
    def put(self, bucket: list[tuple[str, Any]]) -> None:
        """Deliver one bucket of ``(HF name, tensor)`` (the caller may free it afterwards)."""

    @abc.abstractmethod
    def close(self) -> Any:
        """All of this rank's buckets are in; returns a small picklable report for the driver."""

    # Coordinated deliveries only (``ShardDelivery.coordinated``): the driver hears of each step.
    def announce(self) -> Any:
        """A small picklable note for the driver's :meth:`ShardDelivery.conduct_join`."""
        return None

    def join(self) -> None:
        """Blocking set-up, run by every owner while the driver conducts it (e.g. a rendezvous)."""

    def describe(self, *buckets: list[tuple[str, Any]]) -> Any:
        """A small picklable note on this round's ``buckets`` (names, dtypes, shapes) for the driver.

        For :meth:`ShardDelivery.conduct_bucket`, gathered before any owner's :meth:`put` of that
        round; the sink then gets one :meth:`put` per bucket, in this order. More than one bucket
        only with :attr:`ShardDelivery.per_stage`, where the tensors may be stand-ins on the
        ``meta`` device (their names, dtypes and shapes are all a description may read).
        """
        return None


class ShardDelivery(abc.ABC):
    """How every trainer rank delivers its own share of the weights to the engines.

    Made on the driver by the engine's weight sync, sent (pickled: keep it small, no tensors,
    no open connections) to every rank, where :meth:`open` makes that rank's sink.
    ``bucket_bytes``: the most bytes a rank should hand to :meth:`ShardSink.put` at once.
    """

    bucket_bytes: int
    # True: the driver conducts every step. The owners' announcements are gathered on the driver,
    # which starts :meth:`conduct_join` while every owner runs :meth:`ShardSink.join`; then, round
    # by round (each owner's k-th bucket in round k, possibly none), the owners' descriptions are
    # gathered, the driver starts :meth:`conduct_bucket` while each owner puts its bucket, and
    # :meth:`settle` waits for the driver's part of each step.
    coordinated: bool = False
    # Coordinated only. True: one sink per pipeline stage, on the stage's lowest owner rank (its
    # sender). Each round the stage's other owners hand their bucket to the sender, which describes
    # its own and theirs at once and puts them one at a time (own first, then by rank), so the
    # engines meet one sender per stage. False: every owner has a sink of its own.
    per_stage: bool = False

    @abc.abstractmethod
    def open(self, rank: int) -> ShardSink:
        """The sink of trainer rank ``rank`` (called only on ranks that own tensors)."""

    def conduct_join(self, announcements: dict[int, Any]) -> None:
        """Driver, coordinated.

        Start the engines' side of the owners' joins (``announcements``: owner rank ->
        :meth:`ShardSink.announce`); must not block on the owners.
        """

    def conduct_bucket(self, descriptions: dict[int, Any], last: bool) -> None:
        """Driver, coordinated.

        Start the engines' side of one round (owner rank -> :meth:`ShardSink.describe`, owners
        without a bucket this round left out); ``last``: the delivery's final round.
        """

    def settle(self) -> None:
        """Driver, coordinated: wait for what the last ``conduct_*`` started; raise on its failure."""


@runtime_checkable
class ShardedWeights(Protocol):
    """HF weights spread over the trainer's ranks (a Megatron weight export), read on the driver.

    Iterating gathers every tensor on the driver; :meth:`deliver` lets each rank send its own share
    through ``delivery`` and returns the ranks' sink reports (rank order, None for ranks without
    tensors). Either way every rank takes part, and reads its export once and to the end (the
    Megatron export raises on a second read and on a rank that leaves it early: its reads are
    collectives).
    """

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """Every rank's read drives the export's collectives; the driver's yields the gathered tensors."""
        ...

    def deliver(self, delivery: ShardDelivery) -> list[Any]:
        """Stream every owner's tensors into ``delivery``; returns what each owner reported."""


class RolloutError(RuntimeError):
    """Base class of rollout failures."""


class EngineReplyError(RolloutError, UserInputError):
    """An engine's reply that cannot be used; the message names the engine and the request.

    Token ids outside the vocabulary, log-probabilities above 0, a malformed body. Also a :class:`~armor_megatron.errors.UserInputError`: a server that serves another model (another
    vocabulary) than the trainer's is a setup a user fixes, so the command-line tools report it in one line.
    """


class EngineUnavailableError(RolloutError):
    """An engine stayed unreachable (or kept failing) past its retry budget."""


class StaleWeightsError(RolloutError):
    """A response was produced by other weights than the version the caller expects."""


class WeightUpdateError(RolloutError):
    """An engine refused or failed a weight update."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample; field names and meaning follow SGLang's ``sampling_params``.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    Generation stops at ``max_new_tokens`` (finish reason ``length``), at a token in
    ``stop_token_ids`` or the model's EOS (``stop``; the stop token is kept in ``token_ids``
    but not in ``text``), or at a ``stop`` string (``stop``; the text is cut before it).
    ``ignore_eos`` disables EOS *and* ``stop_token_ids``, as in SGLang 0.5.x.
    ``seed`` makes sampling reproducible: the local engine's generator, SGLang's ``sampling_seed``
    (which SGLang honours only on servers run with ``--enable-deterministic-inference``).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(str(s) for s in self.stop))

    def to_sglang(self, n: int = 1) -> dict[str, Any]:
        """The ``sampling_params`` body of an SGLang ``/generate`` request."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
            "n": n,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            params["stop"] = list(self.stop)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sampled response.

    ``token_ids``: the generated tokens only (no prompt), length T.
    ``logprobs``: length T, ``log softmax(logits / temperature)[token]`` of each generated token
    under the engine's model at the sampling temperature (see the engine's docs), or
    ``None`` if not requested.
    ``finish_reason``: ``stop`` | ``length`` | ``abort``.

    A multi-turn response (`armor_megatron.rollout.multiturn`) interleaves model tokens with
    environment tokens (tool results, user turns) in ``token_ids``: ``loss_mask`` (length T) is 1
    at the model's tokens and 0 at the environment's, whose ``logprobs`` are 0 (the engine never
    sampled them); None means every token is the model's. ``trajectory``: the turns as mappings
    (``response``, ``observation``, ``truncated``), None for a single-turn response.
    """

    prompt_index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None
    finish_reason: str
    weight_version: str
    loss_mask: tuple[int, ...] | None = None
    trajectory: tuple[dict[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"{len(self.logprobs)} logprobs for {len(self.token_ids)} tokens in sample of prompt {self.prompt_index}"
            )
        if self.loss_mask is not None:
            object.__setattr__(self, "loss_mask", tuple(int(m) for m in self.loss_mask))
            if len(self.loss_mask) != len(self.token_ids) or not set(self.loss_mask) <= {0, 1}:
                raise ValueError(
                    f"loss_mask of sample of prompt {self.prompt_index} must hold one 0 or 1 per token "
                    f"({len(self.token_ids)} tokens), got {len(self.loss_mask)} values {sorted(set(self.loss_mask))}"
                )
        if self.trajectory is not None:
            object.__setattr__(self, "trajectory", tuple(dict(turn) for turn in self.trajectory))

    @property
    def num_tokens(self) -> int:
        """The number of tokens after the prompt (a multi-turn response's environment tokens included)."""
        return len(self.token_ids)

    @property
    def model_tokens(self) -> int:
        """The number of tokens the model generated (the ones trained on)."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def env_tokens(self) -> int:
        """The number of environment tokens (tool results, user turns; never trained on)."""
        return len(self.token_ids) - self.model_tokens


def check_versions(groups: Sequence[Sequence[Sample]], expected: str | None) -> None:
    """Raise :class:`StaleWeightsError` if any sample was produced by other weights than ``expected``."""
    if expected is None:
        return
    for group in groups:
        for s in group:
            if s.weight_version != expected:
                raise StaleWeightsError(
                    f"sample of prompt {s.prompt_index} came from weight_version {s.weight_version!r}, "
                    f"expected {expected!r}"
                )


LOGPROB_TOLERANCE = 1e-3
"""How far above 0 an engine's log-probability may round (bf16 log-softmax) before it is refused."""


def check_samples(groups: Sequence[Sequence[Sample]], vocab_size: int, source: str) -> None:
    """:func:`check_sample` on every sample of ``groups`` (per prompt, its samples) from engine ``source``."""
    for group in groups:
        for k, s in enumerate(group):
            check_sample(s, vocab_size, f"{source}: sample {k} of prompt {s.prompt_index}")


def check_sample(sample: Sample, vocab_size: int, where: str) -> None:
    """Raise :class:`EngineReplyError` (one line, starting with ``where``) for an unusable sample.

    Every token id must lie in ``[0, vocab_size)`` (an id outside it would index past the
    embedding and the log-prob gather) and every log-probability must be at most
    ``LOGPROB_TOLERANCE`` (a probability cannot exceed 1; NaN is refused, -inf kept: SGLang writes
    a non-finite log-prob as null, read as -inf).
    """
    bad = next((i for i, t in enumerate(sample.token_ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise EngineReplyError(
            f"{where}: token id {sample.token_ids[bad]} at position {bad} is outside the vocabulary "
            f"[0, {vocab_size}) (does the engine serve the trainer's model?)"
        )
    if sample.logprobs is not None:
        high = next((i for i, lp in enumerate(sample.logprobs) if not lp <= LOGPROB_TOLERANCE), None)  # NaN too
        if high is not None:
            raise EngineReplyError(
                f"{where}: {sample.logprobs[high]:g} at position {high} is not a log-probability "
                f"(must be <= 0, tolerance {LOGPROB_TOLERANCE:g})"
            )


def check_prompts(prompts_token_ids: Sequence[Sequence[int]], n: int) -> None:
    """Raise ValueError for ``n`` < 1 or an empty prompt."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for i, p in enumerate(prompts_token_ids):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")


class RolloutEngine(abc.ABC):
    """A policy that samples responses and can load new weights.

    ``weight_version`` is the version of the weights the engine holds (set by
    :meth:`update_weights`); :meth:`generate` checks every sample against it.
    """

    weight_version: str

    @abc.abstractmethod
    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
        return_logprob: bool = True,
    ) -> list[list[Sample]]:
        """Sample ``n`` responses for each prompt.

        Returns ``list[list[Sample]]``: one list of ``n`` samples per prompt, in prompt order.
        Raises :class:`StaleWeightsError` if a sample's weight_version is not ``self.weight_version``,
        ``TimeoutError`` past ``timeout`` seconds.
        """

    @abc.abstractmethod
    def update_weights(self, weights: WeightSource, version: str, timeout: float | None = None) -> None:
        """Load new weights: HF-named tensors ``(name, tensor)`` or an HF checkpoint directory."""

    @abc.abstractmethod
    def health(self, timeout: float | None = None) -> bool:
        """True if the engine can generate now."""

    def reseed(self, seed: int) -> None:
        """Restart the seeds of requests that bring none of their own at ``seed``.

        A trainer calls it at every step, so a run resumed from a checkpoint samples exactly
        what the uninterrupted run sampled. Engines without seeded sampling ignore it.
        """

    def release_memory(self, timeout: float | None = None, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the accelerator memory of ``tags`` (of `MEMORY_TAGS`) while a colocated trainer is on the device.

        Default: nothing to free (an engine sharing no device); unknown tags raise ValueError.
        """
        check_memory_tags(tags)

    def resume_memory(self, timeout: float | None = None, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Take the memory of ``tags`` back after :meth:`release_memory`; default as there."""
        check_memory_tags(tags)

    @abc.abstractmethod
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and free what it holds."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
