"""Device memory with colocated SGLang engines: never the trainer's and the engines' memory at once.

The order a step follows (`armor_megatron.launch.device_ledger` replays it for ``--plan``): rollout
and evaluation with the trainer in host memory → engines release theirs (policy: weights, KV
cache, CUDA graphs; a frozen reference group: KV cache and graphs) → trainer to the device →
log-probs and update → trainer to the host and ``empty_cache`` → policy weights resumed → weights
pushed, streamed from the trainer's host copy → ``empty_cache`` and ``ipc_collect`` → KV cache and
graphs resumed. The start follows the same order: the engines release everything before the
trainer is built, and the first push resumes them as a step does (`ArmorTrainer.start_engines`).
A reference reset or a checkpoint brings the trainer back while the engines keep only their weights.

`ColocatedMemory` makes these moves on every rank; only the driver talks to the engines, and the
barriers keep every rank from allocating before they have let go. Without colocated engines there
is no engine call (the barriers stay: every rank makes the same collectives), and the trainer
moves only when ``train.offload_during_rollout`` says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from armor_megatron.config.schema import RunConfig
from armor_megatron.launch.device_ledger import KV_AND_GRAPHS
from armor_megatron.megatron.offload import HostOffload
from armor_megatron.rollout.engine import RolloutEngine
from armor_megatron.trainer.collectives import barrier
from armor_megatron.trainer.driver_rollout import DriverRollout


def colocated(cfg: RunConfig) -> bool:
    """Whether SGLang engines share the trainer's GPUs."""
    return cfg.rollout.engine == "sglang" and cfg.rollout.sglang.placement == "colocated"


def offloads_during_rollout(cfg: RunConfig) -> bool:
    """``train.offload_during_rollout``, by default on exactly when SGLang engines share the GPUs."""
    if cfg.train.offload_during_rollout is not None:
        return cfg.train.offload_during_rollout
    return colocated(cfg)


def free_device_cache() -> None:
    """Return the caching allocator's free blocks to the device and drop blocks shared over CUDA IPC.

    After a push the allocator still holds the staged parameters and buckets (``pack`` concatenates
    a bucket's list into one more), and a ``tensor`` sync's blocks stay alive until the engines'
    handles are collected; the KV cache resumed next would compete with them.
    """
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # torch leaves it untyped


class ColocatedMemory:
    """Who holds the device: the trainer (``offload``: its memory, None when it stays) or the engines.

    Args:
        cfg: the run's config (placement, offload).
        offload: the trainer's memory handed to colocated engines while they generate.
        driver: the driver's engines and anchor cache (None on the other ranks).
    """

    def __init__(self, cfg: RunConfig, offload: HostOffload | None, driver: DriverRollout | None) -> None:
        self.colocated = colocated(cfg)
        self.offload = offload
        self.driver = driver

    def _engine_tags(
        self, policy: tuple[str, ...], reference: tuple[str, ...]
    ) -> list[tuple[RolloutEngine, tuple[str, ...]]]:
        """Driver, colocated: (engine, tags) of the engines that share the trainer's GPUs."""
        if self.driver is None or not self.colocated:
            return []
        pairs = ((self.driver.policy_engine, policy), (self.driver.reference_engine, reference))
        return [(e, tags) for e, tags in pairs if e is not None and tags]

    def release_engines(self, policy: tuple[str, ...], reference: tuple[str, ...]) -> None:
        """Colocated engines free GPU memory (``tags`` per group); every rank waits for them."""
        released = self._engine_tags(policy, reference)
        if self.driver is not None and self.driver.anchors is not None and released:
            self.driver.anchors.wait()  # no background sampling on released engines
        for engine, tags in released:
            engine.release_memory(tags=tags)
        barrier()  # no rank allocates before the engines have let go

    def resume_engines(self, policy: tuple[str, ...], reference: tuple[str, ...]) -> None:
        """Colocated engines take back the memory of ``tags`` per group."""
        for engine, tags in self._engine_tags(policy, reference):
            engine.resume_memory(tags=tags)

    def park_trainer(self) -> None:
        """Every rank: the trainer's device memory to the host (when it offloads) and the allocator's cache emptied."""
        if self.offload is not None:
            self.offload.offload()

    @contextlib.contextmanager
    def trainer_on_device(
        self, policy: tuple[str, ...] = KV_AND_GRAPHS, reference: tuple[str, ...] = KV_AND_GRAPHS, resume: bool = True
    ) -> Iterator[None]:
        """Bring the trainer to the device for the block, with colocated engines released.

        Every rank: colocated engines release ``policy`` / ``reference`` tags, then the trainer
        comes to the device; after the block it goes back to the host (``empty_cache``) before the
        engines take their memory back (``resume``; else `after_push` does, after pushing the new
        weights into released ones).
        """
        self.release_engines(policy, reference)
        if self.offload is not None:
            self.offload.reload()
        try:
            yield
        finally:
            self.park_trainer()
            barrier()
            if resume:
                self.resume_engines(policy, reference)

    def after_push(self) -> None:
        """Every rank, once the new weights are in the engines: free the push's blocks, then the KV cache and graphs return."""
        if self.colocated:
            free_device_cache()  # the push's staged buckets and IPC-shared blocks, before the KV cache returns
            barrier()
        self.resume_engines(KV_AND_GRAPHS, KV_AND_GRAPHS)

    def host_weights(self, *models: object) -> contextlib.AbstractContextManager[None]:
        """While the trainer is in host memory, ``models``' weights read their host copy."""
        if self.offload is None:
            return contextlib.nullcontext()
        return self.offload.host_views(*models)
