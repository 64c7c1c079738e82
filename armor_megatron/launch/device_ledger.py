"""What one GPU holds, phase by phase of a training step: the device-memory ledger.

A `DeviceLedger` is told the memory transitions of a step as they happen (the trainer moved to
the device or the host, the allocator's cache emptied, a log-prob pass or an update computing,
an engine releasing or resuming a memory tag, a weight bucket pushed, a checkpoint written),
charges or frees the bytes of each from `DeviceSizes` (the planner's formulas,
`armor_megatron.launch.memory.device_sizes`) and records every phase's total. Pure Python:
tests drive it with the trainer's real calls on CPU, and ``armor-train --plan`` replays a
step's order through it (`replay_colocated_step`, `replay_disaggregated_step`) and, colocated,
the job's start-up (`replay_colocated_start`).

What a GPU holds at any moment (bytes):

    trainer          weights, gradients, optimizer state, reference, critic (when on the device)
    allocator cache  the last computation's peak (activations, logits): PyTorch's caching
                     allocator keeps freed blocks reserved until ``torch.cuda.empty_cache()``
    computing        the activations of the computation running now (transient)
    engine           per role (policy, reference) and SGLang memory tag: ``weights``,
                     ``kv_cache`` (the rest of ``mem_fraction_static``), ``cuda_graph``
    bucket           one weight-sync bucket while it is pushed
    contexts         the CUDA contexts of the trainer's and the engine's processes (always)

Each GPU of a colocated layout hosts one engine rank, of the policy or of the reference group:
a phase's total is the common part plus the larger of the two roles' holdings.
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
ENGINE_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang 0.5.x memory-saver tags
ROLES = ("policy", "reference")


@dataclasses.dataclass(frozen=True)
class EngineSizes:
    """Bytes one GPU holds of an engine rank, per SGLang memory tag."""

    weights: float
    kv_cache: float
    cuda_graph: float

    def tag(self, name: str) -> float:
        """The bytes an engine holds under memory tag ``name``."""
        return getattr(self, name)


@dataclasses.dataclass(frozen=True)
class DeviceSizes:
    """The sizes a ledger charges, per GPU (one pipeline stage's worth for the trainer)."""

    gpu: float
    trainer: dict  # what the trainer keeps on the device (weights, gradients, ...) -> bytes
    logprobs: float  # peak of a forward-only log-prob pass (the logits chunk)
    update: float  # peak of an update: activations + the logits chunk with its gradient
    engines: dict  # role -> EngineSizes (only the roles with engines on this GPU)
    contexts: float  # CUDA contexts of the processes on this GPU
    bucket: float  # one weight-sync bucket

    @property
    def trainer_state(self) -> float:
        """Bytes of the trainer's state on one GPU (weights, grads, optimizer state)."""
        return sum(self.trainer.values())


@dataclasses.dataclass(frozen=True)
class Phase:
    """One recorded moment of a step: its label, the GPU's total bytes and what they are made of."""

    label: str
    total: float
    holdings: dict  # what the total is made of: name -> bytes


class DeviceLedger:
    """Bytes one GPU holds while a step runs (module docstring).

    ``trainer_on_device`` and ``engines_hold``: the state before the first event (engines hold every
    tag).
    """

    def __init__(self, sizes: DeviceSizes, *, trainer_on_device: bool = True, engines_hold: bool = True):
        self.sizes = sizes
        self.trainer_on_device = trainer_on_device
        self.cache = 0.0
        self.held = {(role, tag): engines_hold for role in sizes.engines for tag in ENGINE_TAGS}
        self.phases: list[Phase] = []

    # ------------------------------------------------------------------ events
    def start(self, label: str = "start") -> None:
        """Record the state before the first event."""
        self._record(label)

    def trainer_built(self) -> None:
        """The trainer's models are built and loaded on the device (start-up)."""
        self.trainer_on_device = True
        self._record("trainer built")

    def trainer_to_device(self) -> None:
        """The trainer's state comes back to the device."""
        self.trainer_on_device = True
        self._record("trainer to the device")

    def trainer_to_host(self, *, emptied_cache: bool) -> None:
        """The trainer's storages freed on the device.

        ``emptied_cache``: and the allocator's cached blocks returned (``torch.cuda.empty_cache()``).
        """
        self.trainer_on_device = False
        if emptied_cache:
            self.cache = 0.0
        self._record("trainer to the host" + (" + empty_cache" if emptied_cache else ""))

    def compute(self, kind: str) -> None:
        """A log-prob pass (``logprobs``) or an update (``update``) runs.

        Its peak is charged on top, and stays reserved by the allocator afterwards (until
        `trainer_to_host` empties it).
        """
        peak = {"logprobs": self.sizes.logprobs, "update": self.sizes.update}[kind]
        self._record(kind, computing=max(peak - self.cache, 0.0))
        self.cache = max(self.cache, peak)

    def engine_released(self, role: str, tags) -> None:
        """The ``role`` engine released the memory under ``tags``."""
        self._set(role, tags, False)
        self._record(f"{role} engine released {'+'.join(tags)}")

    def engine_resumed(self, role: str, tags) -> None:
        """The ``role`` engine took the memory under ``tags`` back."""
        self._set(role, tags, True)
        self._record(f"{role} engine resumed {'+'.join(tags)}")

    def weights_pushed(self, role: str) -> None:
        """A weight sync into ``role``'s engines: one bucket on the device on top of what is held."""
        self._record(f"weights pushed to the {role} engine", bucket=self.sizes.bucket)

    def checkpoint(self) -> None:
        """Record a checkpoint save (no change in holdings)."""
        self._record("checkpoint")

    # ------------------------------------------------------------------ results
    @property
    def peak(self) -> Phase:
        """The phase with the most bytes on the GPU."""
        return max(self.phases, key=lambda p: p.total)

    def problem(self, what: str = "step") -> str | None:
        """One line naming the first phase over the GPU and its largest holding; None when all fit."""
        for phase in self.phases:
            if phase.total > self.sizes.gpu:
                name, size = max(phase.holdings.items(), key=lambda kv: kv[1])
                return (
                    f"{what}, phase '{phase.label}': {phase.total / GIB:.1f} GiB > launch.gpu_memory_gib "
                    f"{self.sizes.gpu / GIB:g} (largest: {name} {size / GIB:.1f} GiB)"
                )
        return None

    # ------------------------------------------------------------------ internals
    def _set(self, role: str, tags, held: bool) -> None:
        if role not in self.sizes.engines:
            return  # no engine of that role shares this GPU
        for tag in tags:
            if tag not in ENGINE_TAGS:
                raise ValueError(f"unknown engine memory tag {tag!r}; SGLang has {list(ENGINE_TAGS)}")
            self.held[(role, tag)] = held

    def holdings(self, computing: float = 0.0, bucket: float = 0.0) -> dict:
        """What the GPU holds now, by name (bytes), with ``computing`` and ``bucket`` on top."""
        parts: dict = {}
        if self.trainer_on_device:
            parts.update({k: v for k, v in self.sizes.trainer.items() if v})
        roles = {
            role: {
                f"{role} engine {tag}": engine.tag(tag)
                for tag in ENGINE_TAGS
                if self.held[(role, tag)] and engine.tag(tag)
            }
            for role, engine in self.sizes.engines.items()
        }
        if roles:  # one engine rank per GPU: the heavier role's GPU
            heaviest = max(roles.values(), key=lambda r: sum(r.values()))
            parts.update(heaviest)
        extra = {
            "allocator cache": self.cache,
            "activations": computing,
            "weight bucket": bucket,
            "CUDA contexts": self.sizes.contexts,
        }
        parts.update({k: v for k, v in extra.items() if v})
        return parts

    def _record(self, label: str, computing: float = 0.0, bucket: float = 0.0) -> None:
        parts = self.holdings(computing, bucket)
        self.phases.append(Phase(label, sum(parts.values()), parts))


# ----------------------------------------------------------------------------- the plan's replays
POLICY_RELEASE = ("weights", "kv_cache", "cuda_graph")
REFERENCE_RELEASE = ("kv_cache", "cuda_graph")  # a frozen engine keeps its weights: released ones come back empty
KV_AND_GRAPHS = ("kv_cache", "cuda_graph")


def replay_colocated_step(
    ledger: DeviceLedger,
    *,
    offload: bool = True,
    ref_logprobs: bool = True,
    reset_and_checkpoint: bool = True,
    policy_keeps_weights: bool = False,
) -> DeviceLedger:
    """Replay one colocated step's memory events on a GPU's ledger.

    ``ArmorTrainer._step``'s memory order with colocated SGLang engines (trainer/device_memory.py; a
    test checks the loop records these very phases): rollout with the trainer on the host →
    engines released → trainer to the device → log-probs, update → trainer to the host and
    ``empty_cache`` → policy weights resumed → weights pushed from the host copy → KV cache and
    graphs resumed; a reference reset and a checkpoint bring the trainer back while the engines
    keep only their weights. ``offload=False``: the trainer stays on the device throughout;
    ``ref_logprobs``: the reference computes log-probs too (after the actor);
    ``policy_keeps_weights``: the policy engines keep their weights through the update, as a
    reference engine does (``lora.sync: adapter``: they hold the base and take new adapters only).
    """
    ledger.start("rollout")
    ledger.engine_released("policy", REFERENCE_RELEASE if policy_keeps_weights else POLICY_RELEASE)
    ledger.engine_released("reference", REFERENCE_RELEASE)
    if offload:
        ledger.trainer_to_device()
    for _ in range(2 if ref_logprobs else 1):
        ledger.compute("logprobs")
    ledger.compute("update")
    if offload:
        ledger.trainer_to_host(emptied_cache=True)
    if not policy_keeps_weights:
        ledger.engine_resumed("policy", ("weights",))
    ledger.weights_pushed("policy")
    ledger.engine_resumed("policy", KV_AND_GRAPHS)
    ledger.engine_resumed("reference", KV_AND_GRAPHS)
    if reset_and_checkpoint:
        ledger.engine_released("policy", KV_AND_GRAPHS)
        ledger.engine_released("reference", KV_AND_GRAPHS)
        if offload:
            ledger.trainer_to_device()
        ledger.weights_pushed("reference")
        ledger.checkpoint()
        if offload:
            ledger.trainer_to_host(emptied_cache=True)
        ledger.engine_resumed("policy", KV_AND_GRAPHS)
        ledger.engine_resumed("reference", KV_AND_GRAPHS)
    return ledger


def replay_colocated_start(
    ledger: DeviceLedger, *, offload: bool = True, reference_engine: bool = True
) -> DeviceLedger:
    """Replay a colocated job's start-up on a GPU's ledger (trainer not built yet, engines up).

    ``trainer/run.py`` and ``ArmorTrainer.start_engines``: the engines come up holding
    ``mem_fraction_static`` and their graphs → every group releases every tag
    (``components.release_engines_at_start``) → the trainer is built on the device → the trainer to
    the host and ``empty_cache`` → per engine group: weights resumed, pushed, KV cache and graphs
    resumed. ``offload=False``: the trainer stays on the device while the engines come back.
    """
    ledger.start("engines up")
    ledger.engine_released("policy", POLICY_RELEASE)
    if reference_engine:
        ledger.engine_released("reference", POLICY_RELEASE)
    ledger.trainer_built()
    if offload:
        ledger.trainer_to_host(emptied_cache=True)
    for role in ("policy", "reference") if reference_engine else ("policy",):
        ledger.engine_resumed(role, ("weights",))
        ledger.weights_pushed(role)
        ledger.engine_resumed(role, KV_AND_GRAPHS)
    return ledger


def replay_disaggregated_step(ledger: DeviceLedger, *, ref_logprobs: bool = True) -> DeviceLedger:
    """A trainer GPU of a disaggregated layout (engines on their own GPUs): the trainer stays on the device.

    Log-probs, update, then the weight export's bucket.
    """
    ledger.start("rollout")
    for _ in range(2 if ref_logprobs else 1):
        ledger.compute("logprobs")
    ledger.compute("update")
    ledger.weights_pushed("policy")
    ledger.checkpoint()
    return ledger
