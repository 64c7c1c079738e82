"""Where anchors are sampled from: the frozen reference policy π_ref.

``separate``: a second engine (group) that holds π_ref and nothing else. Costs its own
GPUs, but anchors can be sampled (and pre-generated) while the policy engines work.

``swap``: the policy engines themselves; for each anchor request the reference weights are
pushed in, anchors sampled, and the policy weights pushed back. No extra GPUs, two weight
pushes per request, and nothing else may use the engines meanwhile (no background
pre-generation).

``base`` (not a config value: ``swap`` with ``lora.sync: adapter``, `build.anchor_source_kind`): the
policy engines hold the base and the policy's LoRA adapter, so π_ref is the base: anchor requests
name no adapter and sample it, with no weight swap (`BaseOfPolicyEngines`).

Either way :meth:`reset` is the reference reset θ_ref ← θ: it installs new reference weights
under a new ``version``; anchor caches keyed by that version drop their pools. The trainer
hands every policy push through :meth:`policy_weights_pushed`, so the source keeps what it
needs (``swap``: a host copy to push back after each anchor request); ``keeps_host_weights``
says whether it needs the weights as host copies rather than a stream.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, cast

from armor_megatron.rollout.engine import RolloutEngine, Sample, SamplingParams, WeightSource

WeightProvider = WeightSource | Callable[[], WeightSource]


def _provider(weights: WeightProvider) -> Callable[[], WeightSource]:
    """A zero-argument callable giving fresh weights each call.

    An iterator (a weight export stream, readable once) is read into a host list first.
    """
    if callable(weights):
        return weights
    if isinstance(weights, (str, os.PathLike, list, tuple)):
        return lambda: weights
    if isinstance(weights, Iterable):
        kept = list(weights)
        return lambda: kept
    raise TypeError(
        "reference weights must be a checkpoint directory, (name, tensor) pairs or a callable returning them"
    )


class AnchorSource(Protocol):
    """Where the anchor sampler draws π_ref's responses from (`SeparateReference`, `SwapReference`).

    ``supports_background``: anchors may be sampled while the policy engine generates;
    ``keeps_host_weights``: it needs the weights as host copies (`reset`, `policy_weights_pushed`
    read them more than once), not a read-once stream.
    """

    supports_background: bool
    keeps_host_weights: bool

    @property
    def version(self) -> str:
        """The reference weights' version (``ref-<n>``) the samples carry."""
        ...

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
    ) -> list[list[Sample]]:
        """``n`` samples of π_ref per prompt, in prompt order."""
        ...

    def reset(self, weights: WeightSource, version: str) -> None:
        """θ_ref ← the given weights, named ``version`` from now on."""
        ...

    def policy_weights_pushed(self, weights: WeightSource) -> WeightSource:
        """The policy the trainer pushes next (what to push: a host list where it keeps one)."""
        ...


class SeparateReference:
    """π_ref on its own engine; ``supports_background`` because nothing else uses it."""

    supports_background = True
    keeps_host_weights = False

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    @property
    def version(self) -> str:
        """The reference engine's weight version."""
        return self.engine.weight_version

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
    ) -> list[list[Sample]]:
        """Sample ``n`` responses per prompt from the reference engine."""
        return self.engine.generate(prompts_token_ids, n, sampling, timeout=timeout)

    def reset(self, weights: WeightSource, version: str) -> None:
        """Load new reference weights into the reference engine."""
        self.engine.update_weights(weights, version)

    def policy_weights_pushed(self, weights: WeightSource) -> WeightSource:
        """The policy weights, unchanged: the policy engine is not this source's."""
        return weights  # the policy engine is not ours


class SwapReference:
    """π_ref swapped into the policy ``engine`` around each anchor request.

    ``reference_weights`` / ``policy_weights``: directories, lists of ``(name, tensor)`` or
    callables returning fresh iterators. The engine is taken to hold the reference exactly
    when its ``weight_version`` equals ``reference_version``, so reference and policy
    versions must be distinct strings (e.g. ``ref-3`` and ``step-480``). After
    :meth:`generate` the engine holds the policy
    again, at the version it had before, unless ``swap_back=False`` (the trainer pushes new
    policy weights next anyway).
    """

    supports_background = False
    keeps_host_weights = True

    def __init__(
        self,
        engine: RolloutEngine,
        reference_weights: WeightProvider,
        reference_version: str,
        policy_weights: WeightProvider,
        swap_back: bool = True,
    ):
        self.engine = engine
        self._reference = _provider(reference_weights)
        self._policy = _provider(policy_weights)
        self.version = str(reference_version)
        self.swap_back = swap_back
        self._lock = threading.Lock()

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
    ) -> list[list[Sample]]:
        """Sample from the reference weights, swapped into the policy engine for the call (and back, unless not ``swap_back``)."""
        with self._lock:
            policy_version = self.engine.weight_version
            if policy_version != self.version:
                self.engine.update_weights(self._reference(), self.version)
            try:
                return self.engine.generate(prompts_token_ids, n, sampling, timeout=timeout)
            finally:
                if self.swap_back and policy_version != self.version:
                    self.engine.update_weights(self._policy(), policy_version)

    def policy_weights_pushed(self, weights: WeightSource) -> WeightSource:
        """The policy the trainer pushes next, kept to be swapped back after anchor requests.

        Returns what to push (a host list when given a stream).
        """
        self._policy = _provider(weights)
        return self._policy()

    def reset(self, weights: WeightProvider, version: str) -> None:
        """Take new reference weights (used at the next anchor request)."""
        with self._lock:
            self._reference = _provider(weights)
            self.version = str(version)


class BaseServingEngine(Protocol):
    """An engine that samples its base weights when asked (`SGLangEngine` with a loaded LoRA adapter)."""

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
        return_logprob: bool = True,
        base: bool = False,
    ) -> list[list[Sample]]:
        """``base``: sample the base weights, without the adapter that policy requests name."""
        ...


class BaseOfPolicyEngines:
    """π_ref as the policy engines' base weights: requests without the policy's LoRA adapter.

    The trainer keeps the base current (it pushes the merged base after each reset, before the
    fresh adapter), so nothing is swapped; the samples are labelled with the reference version
    (``ref-<n>``), which the engines' own version (the policy's) does not say. Background
    sampling is left off, as with ``swap``: the trainer's pushes expect no anchor requests in flight.
    """

    supports_background = False
    keeps_host_weights = False

    def __init__(self, engine: BaseServingEngine, reference_version: str):
        self.engine = engine
        self.version = str(reference_version)

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
    ) -> list[list[Sample]]:
        """``n`` samples of the base per prompt, labelled with the reference's version."""
        groups = self.engine.generate(prompts_token_ids, n, sampling, timeout=timeout, base=True)
        return [[dataclasses.replace(s, weight_version=self.version) for s in group] for group in groups]

    def reset(self, weights: WeightSource, version: str) -> None:
        """Take the new reference's name; its weights, the merged base, reach the engines by the trainer's push."""
        self.version = str(version)

    def policy_weights_pushed(self, weights: WeightSource) -> WeightSource:
        """The policy weights, unchanged (nothing to keep)."""
        return weights


ANCHOR_SOURCES: dict[str, type[SeparateReference] | type[SwapReference] | type[BaseOfPolicyEngines]] = {
    "separate": SeparateReference,
    "swap": SwapReference,
    "base": BaseOfPolicyEngines,
}


def make_anchor_source(
    kind: str,
    policy_engine: RolloutEngine | None = None,
    reference_engine: RolloutEngine | None = None,
    reference_weights: WeightProvider | None = None,
    reference_version: str | None = None,
    policy_weights: WeightProvider | None = None,
) -> AnchorSource:
    """The ``anchor_source`` config switch: ``separate`` needs ``reference_engine``; ``swap`` needs the rest.

    ``base`` (`build.anchor_source_kind`) needs the policy engine and the reference version.
    """
    if kind == "base":
        if policy_engine is None or reference_version is None:
            raise ValueError("anchor source 'base' needs the policy engine and the reference version")
        return BaseOfPolicyEngines(cast(BaseServingEngine, policy_engine), reference_version)
    if kind == "separate":
        if reference_engine is None:
            raise ValueError("anchor_source 'separate' needs a reference engine")
        return SeparateReference(reference_engine)
    if kind == "swap":
        missing = [
            n
            for n, v in (
                ("policy_engine", policy_engine),
                ("reference_weights", reference_weights),
                ("reference_version", reference_version),
                ("policy_weights", policy_weights),
            )
            if v is None
        ]
        if missing:
            raise ValueError(f"anchor_source 'swap' needs {', '.join(missing)}")
        assert policy_engine is not None and reference_weights is not None  # none is missing
        assert reference_version is not None and policy_weights is not None
        return SwapReference(policy_engine, reference_weights, reference_version, policy_weights)
    raise ValueError(f"anchor_source must be one of {tuple(ANCHOR_SOURCES)}, got {kind!r}")
