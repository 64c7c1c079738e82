"""A per-prompt pool of verified anchors, valid while the reference policy is frozen.

Between two reference resets π_ref does not change, so a verified response sampled from it
earlier is as good an anchor as a fresh one: it is a sample of the same distribution that
passed the same verifier. :meth:`AnchorCache.get` serves a prompt from its pool when it can
(no generation) and rejection-samples only the misses; the correct samples a round produced
beyond the first (``AnchorResult.extra``) fill the pool too. Pools are keyed by the
reference ``version``: when the source reports another version (a reset) every pool is
dropped before use, so an anchor never outlives its reference.

Options: ``max_pool`` anchors kept per prompt; ``max_uses`` times an anchor may be drawn
(None: unlimited); ``give_up_after`` failed rejection rounds (all ``max_tries`` spent)
after which a prompt gets no anchor until the next reset (None: always try again; using it
biases anchors towards prompts the reference solved early, in exchange for cost).
:meth:`prefetch` fills the pools of an upcoming batch in a background thread while the
trainer updates (needs a reference that allows background use: ``separate``); a prompt the prefetch
found no anchor for gets none at its next lookup either (its tries were spent ahead).
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Hashable, Sequence
from typing import Any, cast

from armor_megatron.rewards.isolated import CallsInterrupted
from armor_megatron.rollout.anchor.sampler import AnchorResult, AnchorSampler, VerifiedSample, sample_from_state
from armor_megatron.rollout.engine import Sample


@dataclasses.dataclass
class CacheStats:
    """Counters of the anchor cache."""

    lookups: int = 0
    hits: int = 0
    skipped: int = 0  # prompts given up on (give_up_after)
    invalidations: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of lookups served from the pool."""
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self, prefix: str = "anchor_cache/") -> dict[str, float]:
        """The counters as metrics, keys prefixed ``prefix``."""
        return {f"{prefix}hit_rate": self.hit_rate, f"{prefix}lookups": self.lookups, f"{prefix}skipped": self.skipped}


@dataclasses.dataclass
class _Entry:
    sample: Sample
    reward: float  # as verified when it was sampled
    uses: int = 0


class AnchorCache:
    """Verified anchors kept across steps and reused (module docstring), sampled on a miss."""

    def __init__(
        self,
        sampler: AnchorSampler,
        max_pool: int = 4,
        max_uses: int | None = None,
        give_up_after: int | None = None,
        seed: int = 0,
    ):
        if max_pool < 1:
            raise ValueError(f"max_pool must be >= 1, got {max_pool}")
        self.sampler = sampler
        self.max_pool, self.max_uses, self.give_up_after = max_pool, max_uses, give_up_after
        self.version: str | None = None
        self.stats = CacheStats()
        self._pools: dict[Hashable, list[_Entry]] = {}
        self._failures: dict[Hashable, int] = {}
        self._prefetch_failed: set[Hashable] = set()  # failed in a prefetch, not looked up since: no second try
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._prefetch: threading.Thread | None = None
        self._prefetch_error: BaseException | None = None

    # ---- public API ------------------------------------------------------------------------

    def get(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        ground_truths: Sequence[Any],
        keys: Sequence[Hashable] | None = None,
        timeout: float | None = None,
    ) -> list[AnchorResult]:
        """One :class:`AnchorResult` per prompt: from the pool (``cached=True``, zero cost) or freshly sampled.

        ``keys`` identify prompts across steps (e.g. dataset indices); default: the token ids.
        """
        self.wait()
        keys = self._keys(prompts_token_ids, keys)
        with self._lock:
            self._check_version()
            results: list[AnchorResult | None] = [None] * len(keys)
            misses = []
            for i, key in enumerate(keys):
                self.stats.lookups += 1
                entry = self._draw(key)
                prefetch_failed = key in self._prefetch_failed
                self._prefetch_failed.discard(key)
                if entry is not None:
                    self.stats.hits += 1
                    anchor = dataclasses.replace(entry.sample, prompt_index=i)
                    results[i] = AnchorResult(i, anchor, 0, 0, cached=True, reward=entry.reward)
                elif self._given_up(key):
                    self.stats.skipped += 1
                    results[i] = AnchorResult(i, None, 0, 0)
                elif prefetch_failed:  # its tries for this step were spent ahead
                    results[i] = AnchorResult(i, None, 0, 0)
                else:
                    misses.append(i)
        if misses:
            fresh = self.sampler.sample(
                [prompts_token_ids[i] for i in misses], [ground_truths[i] for i in misses], timeout=timeout
            )
            with self._lock:
                for i, r in zip(misses, fresh):
                    self._store(keys[i], r)
                    self._count_use(keys[i], r.anchor)  # it serves this step
                    results[i] = dataclasses.replace(
                        r, prompt_index=i, anchor=r.anchor and dataclasses.replace(r.anchor, prompt_index=i)
                    )
        return cast(list[AnchorResult], results)  # every slot is filled above

    def prefetch(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        ground_truths: Sequence[Any],
        keys: Sequence[Hashable] | None = None,
    ) -> None:
        """Fill the pools of prompts that have none, in a background thread; :meth:`get` waits for it."""
        if not getattr(self.sampler.source, "supports_background", False):
            raise ValueError(
                "anchor pre-generation needs a reference that allows background use (anchor_source 'separate')"
            )
        self.wait()
        keys = self._keys(prompts_token_ids, keys)
        with self._lock:
            self._check_version()
            todo = [i for i, k in enumerate(keys) if not self._pools.get(k) and not self._given_up(k)]
        if not todo:
            return

        def run() -> None:
            try:
                fresh = self.sampler.sample([prompts_token_ids[i] for i in todo], [ground_truths[i] for i in todo])
                with self._lock:
                    for i, r in zip(todo, fresh):
                        self._store(keys[i], r)
                        if not r.found:
                            self._prefetch_failed.add(keys[i])
            except CallsInterrupted:
                pass  # a preemption signal stopped its scoring: those prompts get anchors when looked up
            except BaseException as e:  # noqa: BLE001 - re-raised in the trainer's thread by wait()
                self._prefetch_error = e

        self._prefetch = threading.Thread(target=run, name="anchor-prefetch", daemon=True)
        self._prefetch.start()

    def wait(self, timeout: float | None = None) -> None:
        """Join a running :meth:`prefetch`; re-raise its error here."""
        thread = self._prefetch
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"anchor pre-generation still running after {timeout}s")
            self._prefetch = None
        if self._prefetch_error is not None:
            err, self._prefetch_error = self._prefetch_error, None
            raise RuntimeError(f"anchor pre-generation failed: {err}") from err

    def reset(self, version: str | None = None) -> None:
        """Drop every pool (reference reset); ``version`` defaults to the source's current one."""
        self.wait()
        with self._lock:
            self._clear()
            self.version = self.sampler.version if version is None else str(version)
            self.stats.invalidations += 1

    @property
    def num_anchors(self) -> int:
        """Anchors held in all pools."""
        with self._lock:
            return sum(len(p) for p in self._pools.values())

    # ---- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The cache's pools and counters, for checkpoints."""
        self.wait()
        with self._lock:
            return {
                "version": self.version,
                "pools": [
                    [
                        list(k) if isinstance(k, tuple) else k,
                        [[dataclasses.asdict(e.sample), e.uses, e.reward] for e in p],
                    ]
                    for k, p in self._pools.items()
                ],
                "failures": [[list(k) if isinstance(k, tuple) else k, n] for k, n in self._failures.items()],
                "prefetch_failed": [list(k) if isinstance(k, tuple) else k for k in self._prefetch_failed],
                "stats": dataclasses.asdict(self.stats),
                "rng": self._rng.getstate(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""

        def key(k: Any) -> Hashable:
            return tuple(k) if isinstance(k, list) else k

        with self._lock:
            self.version = state["version"]
            # entries saved before rewards were kept passed the sampler's success reward
            success = self.sampler.config.success_reward
            self._pools = {
                key(k): [_Entry(sample_from_state(e[0]), e[2] if len(e) > 2 else success, e[1]) for e in p]
                for k, p in state["pools"]
            }
            self._failures = {key(k): n for k, n in state["failures"]}
            self._prefetch_failed = {key(k) for k in state.get("prefetch_failed", [])}
            self.stats = CacheStats(**state["stats"])
            rng = state["rng"]
            self._rng.setstate((rng[0], tuple(rng[1]), rng[2]))

    # ---- internals -------------------------------------------------------------------------

    @staticmethod
    def _keys(prompts: Sequence[Sequence[int]], keys: Sequence[Hashable] | None) -> list[Hashable]:
        if keys is None:
            return [tuple(int(t) for t in p) for p in prompts]
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
        return list(keys)

    def _check_version(self) -> None:
        current = self.sampler.version
        if self.version != current:
            if self.version is not None:
                self.stats.invalidations += 1
            self._clear()
            self.version = current

    def _clear(self) -> None:
        self._pools.clear()
        self._failures.clear()
        self._prefetch_failed.clear()

    def _given_up(self, key: Hashable) -> bool:
        return self.give_up_after is not None and self._failures.get(key, 0) >= self.give_up_after

    def _draw(self, key: Hashable) -> _Entry | None:
        pool = self._pools.get(key)
        if not pool:
            return None
        entry = self._rng.choice(pool)
        self._use(pool, entry)
        return entry

    def _use(self, pool: list[_Entry], entry: _Entry) -> None:
        entry.uses += 1
        if self.max_uses is not None and entry.uses >= self.max_uses:
            pool.remove(entry)

    def _store(self, key: Hashable, result: AnchorResult) -> None:
        if not result.found:
            self._failures[key] = self._failures.get(key, 0) + 1
            return
        assert result.anchor is not None and result.reward is not None  # found: an anchor and its reward
        pool = self._pools.setdefault(key, [])
        for v in [VerifiedSample(result.anchor, result.reward), *result.extra]:
            if len(pool) < self.max_pool:
                pool.append(_Entry(v.sample, v.reward))

    def _count_use(self, key: Hashable, sample: Sample | None) -> None:
        pool = self._pools.get(key, [])
        for entry in pool:
            if sample is not None and entry.sample is sample:
                self._use(pool, entry)
                return
