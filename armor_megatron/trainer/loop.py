"""The ARMOR training loop (the paper's Algorithm 1), on every rank of a Megatron job.

    for step in 1..T:
        rollout:  G−1 on-policy samples + 1 verified anchor from π_ref per prompt     (driver rank)
                  rewards, overlong shaping, dynamic sampling, advantages             (driver rank)
        logprobs: lp_old (actor, before the update), lp_ref (reference)               (all ranks)
        values:   with estimator gae (PPO): V_old from the critic, GAE advantages and
                  returns per response token (outcome reward on the last token)        (all ranks)
        update:   mini-batches × epochs of the mixed-ratio DAPO loss                  (all ranks)
                  and, with a critic, of the clipped value loss on the same mini-batches
        sync:     actor weights -> rollout engine (HF names, new weight_version); with lora.sync
                  adapter, the adapters' A and B only (`trainer.adapter_sync`)
        eval:     the policy of this step, served by the engine                       (driver rank)
        reset:    if the schedule says so (it may read the eval), θ_ref ← θ in the trainer AND the anchor source
        checkpoint, log; on SIGTERM/SIGUSR1 checkpoint and exit for requeue

With ``rollout.overlap: one_step`` (`trainer.overlap`) the driver takes the batch generated during
the last step, starts generating the next one in a background thread (driver work only, no
collective) while every rank computes log-probs and updates, and joins it before the sync: the
engines sample one update behind π_old, which TIS corrects. The phases below stay the same.

Device memory with colocated SGLang engines (never the trainer and the engines' memory at once;
`armor_megatron.launch.device_ledger` replays this order for ``--plan``): rollout and evaluation
with the trainer in host memory → engines release theirs (policy: weights, KV cache, CUDA graphs;
a frozen reference group: KV cache and graphs) → trainer to the device → log-probs and update →
trainer to the host and ``empty_cache`` → policy weights resumed → weights pushed, streamed from
the trainer's host copy → ``empty_cache`` and ``ipc_collect`` → KV cache and graphs resumed. The start
follows the same order: the engines release everything before the trainer is built, and the first
push resumes them as a step does (``start_engines``). A reference reset or a checkpoint brings
the trainer back while the engines keep only their weights.

Rank 0 is the *driver*: it owns the data loader, the engines, the anchor cache, rewards,
evaluation and logging, and broadcasts each step's batch to every rank. The Megatron actor
and reference live on all ranks (TP/PP/DP as configured).

The collective contract: the calls marked ``@collective`` (`trainer.collectives`) are made by every
rank, in this order; what only the driver runs (rollout, evaluation, engine calls, logging) sits
between them and runs no collective. ``tests/trainer/test_collective_contract.py`` records every
rank's sequence at TP=2 × PP=2 and checks that they are identical.

    start_engines          once, after load/resume   the exports' gathers, the policy's then the reference's
    run
      _evaluate_start      step 0, with eval         broadcast_object of the driver's evaluation
      _step                every step:
        broadcast_tensors                            the driver's batch (BATCH_TENSORS), None without signal
        _trainer_on_device release → device → host   a barrier once the engines released, one before they resume
          update                                     Megatron's: TP/PP in the layers, the token count, DDP, grad norm
        sync_weights                                 the actor's export (every owner drives it), or the
                                                     adapters' gather (lora.sync adapter)
        broadcast_object                             the step's metrics, the driver's evaluation included
        _trainer_on_device on a reset or a save      as above
          reset_reference                            θ_ref ← θ, then the reference's export (lora.sync
                                                     adapter: then the base's export and the adapters' gather)
          checkpoint                                 `dist_checkpointing` save (``save`` as passed to run)
        save_hf            when due                  the actor's export into an HF directory
        max_over_ranks                               the peak memory of the throughput metrics
      any_rank             after each step but the last  a preemption signal on any rank; if so
        _trainer_on_device, checkpoint                   unless the step just saved
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from armor_megatron.algo import DynamicSampler, ResetSchedule, explained_variance
from armor_megatron.algo.dynamic_sampling import dynamic_sampling_keep
from armor_megatron.algo.tis import truncated_is_weights
from armor_megatron.config.schema import RunConfig, needs_reference_logprobs
from armor_megatron.data.batch import RolloutBatch
from armor_megatron.data.prompts import PromptDataset, PromptLoader, PromptRow, encode_prompt
from armor_megatron.errors import DatasetError
from armor_megatron.launch.device_ledger import KV_AND_GRAPHS, POLICY_RELEASE, REFERENCE_RELEASE
from armor_megatron.megatron.collective_export import CollectiveExport, NamedTensor
from armor_megatron.megatron.dist import global_rank
from armor_megatron.megatron.offload import HostOffload
from armor_megatron.models.arch import ModelArch
from armor_megatron.rewards import scorable
from armor_megatron.rewards.isolated import CallsInterrupted, allow_calls, calls_interrupted, interrupt_calls
from armor_megatron.rollout.anchor.build import build_anchor_cache, source_keeps_host_weights
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.engine import RolloutEngine, WeightSource
from armor_megatron.rollout.partial import Finished, PartialStateError
from armor_megatron.rollout.partial_generation import GenerationStopped, GroupRequest, PartialGenerator
from armor_megatron.trainer import components
from armor_megatron.trainer.adapter_sync import AdapterEngine, AdapterSync
from armor_megatron.trainer.advantages import gae_targets, group_advantages
from armor_megatron.trainer.collaborators import (
    Actor,
    Critic,
    EngineFactory,
    ModelChunks,
    Reference,
    Tokenizer,
    WeightExporter,
)
from armor_megatron.trainer.collectives import any_rank, barrier, broadcast_object, broadcast_tensors, collective
from armor_megatron.trainer.evaluation import EvalSet, evaluate
from armor_megatron.trainer.hf_save import save_hf_due
from armor_megatron.trainer.metrics_log import MetricsLogger, StepReporter, scalar_metrics
from armor_megatron.trainer.overlap import (
    BackgroundRollout,
    PendingBatch,
    check_lag,
    generate_pending,
    load_pending,
    pending_state,
)
from armor_megatron.trainer.overopt_monitor import OverOptimizationMonitor
from armor_megatron.trainer.partial_anchors import NONE_FOUND, HeldAnchors, holds_anchors
from armor_megatron.trainer.preemption import PreemptionHandler
from armor_megatron.trainer.rollout_phase import (
    anchor_truths,
    check_spans,
    collect_groups,
    group_accuracy,
    kept_anchor,
    replace_stale_anchors,
    score_group,
    stale_anchor_rows,
)
from armor_megatron.trainer.state_format import FORMAT_VERSION, migrated
from armor_megatron.trainer.step_report import StepReport, StepTimer

STOPPED = "stopped"  # the driver's batch when a preemption signal stopped the step's rollout
BATCH_TENSORS = ("input_ids", "lengths", "response_mask", "advantages", "rewards", "engine_logprobs", "is_anchor")
TRAIN_KEYS = ("input_ids", "lengths", "response_mask", "advantages", "old_logprobs", "ref_logprobs", "tis_weights")
CRITIC_KEYS = ("input_ids", "lengths", "response_mask", "old_values", "returns")


def _signal_name(signum: int | None) -> str:
    """``SIGUSR1``; a number that names no signal (on this rank: another rank got it) as is."""
    if signum is None:
        return "a preemption signal"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


_T = TypeVar("_T")


def driver_only(value: _T | None, what: str) -> _T:
    """``value``, which only the driver rank holds; None means driver code ran on another rank (a bug)."""
    if value is None:
        raise RuntimeError(f"{what} exists on the driver rank only")
    return value


class Preempted(Exception):
    """Raised after the preemption checkpoint is written; the CLI exits with the requeue code."""


class ArmorTrainer:
    """Holds the actor, reference, engines and state; ``run()`` trains to ``cfg.train.steps``.

    What each collaborator must provide: `trainer.collaborators`. ``make_engines`` builds
    ``(policy_engine, reference_engine)`` on the driver from the first exported weights (the local
    engine on CPU, SGLang clients on GPUs); ``export_weights`` gives a model's read-once export;
    ``reference``: None when neither the mixed ratio (α < 1) nor the anchors need π_ref;
    ``critic``: the value model of estimator gae, None otherwise; ``adapter_sync``: with
    ``lora.sync: adapter``, what the policy engines get instead of the actor's merged weights
    (`trainer.adapter_sync`).
    """

    def __init__(
        self,
        cfg: RunConfig,
        arch: ModelArch,
        actor: Actor,
        reference: Reference | None,
        tokenizer: Tokenizer,
        make_engines: EngineFactory,
        export_weights: WeightExporter,
        critic: Critic | None = None,
        adapter_sync: AdapterSync | None = None,
    ) -> None:
        self.cfg, self.arch = cfg, arch
        self.adapter_sync = adapter_sync
        # what the policy engines release while the trainer updates: with adapter sync they keep the base
        self._policy_release = REFERENCE_RELEASE if adapter_sync is not None else POLICY_RELEASE
        self.actor, self.reference, self.critic = actor, reference, critic
        self.tokenizer = tokenizer
        self.export_weights = export_weights
        self.rank = global_rank()
        self.is_driver = self.rank == 0
        # progress, replicated on every rank and checkpointed (``trainer_state``)
        self.step = 0
        self.reset_schedule: ResetSchedule = components.reset_schedule(cfg)
        self.ref_resets = 0  # names the reference's weights: "ref-<n>"
        self.last_train_accuracy = 0.0
        # sampling
        eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
        self.sampling = components.rollout_sampling(cfg, eos)
        self.eval_sampling = components.eval_sampling(cfg, eos)
        self.settings = components.rollout_settings(cfg, self.sampling, arch.vocab_size, tokenizer)
        # driver only: engines (``start_engines``), anchors, data, evaluation, monitor
        # trainer memory handed to colocated engines while they generate (bit-exact round trip)
        self.trainer_memory = HostOffload.of(actor, reference, critic) if offloads_during_rollout(cfg) else None
        self._make_engines = make_engines
        self.policy_engine: RolloutEngine | None = None
        self.reference_engine: RolloutEngine | None = None
        self.anchors: AnchorCache | None = None
        self._anchor_state: dict[str, Any] | None = None  # a checkpoint's anchor cache, loaded by start_engines
        self._anchor_tokens_logged = 0  # π_ref tokens already reported (anchor/reference_tokens)
        self.monitor = OverOptimizationMonitor()
        # rollout.overlap one_step (`trainer.overlap`): the next step's batch, generated in the background
        self.overlap = cfg.rollout.overlap == "one_step"
        self._background = BackgroundRollout()
        self._pending: PendingBatch | None = None
        self._generation_beside_update = False  # the next step's batch is generating while this step trains
        # rollout.partial (driver): the generator (built with the engines), a checkpoint's state for it,
        # the rows drawn from the loader and not yet requested, and a running count naming each group
        self._partial: PartialGenerator | None = None
        self._partial_state: dict[str, Any] | None = None
        self._partial_queue: list[int] = []
        self._partial_draws = 0
        self._partial_anchors = HeldAnchors()  # anchors looked up for the head of that queue (with anchors)
        self._preemption: PreemptionHandler | None = None
        self._clock = time.perf_counter()  # the step timeline's origin (``timeline/*``)
        # the last step's metrics as its checkpoint was written; a resumed run logs them if the
        # metrics log lost them (killed between the save and the log line): `_log_checkpointed_step`
        self._step_record: dict[str, Any] | None = None
        self._checkpointed_step: int | None = None  # the step whose state the last checkpoint holds
        self._loader_before_pending: dict[str, Any] | None = None  # the loader before the background generation drew
        self.loader: PromptLoader | None = None
        self.eval_sets: list[EvalSet] = []
        if self.is_driver:
            data = cfg.data
            self.loader = PromptLoader(
                self._training_prompts(), cfg.rollout.prompts_per_step, shuffle=data.shuffle, seed=cfg.train.seed
            )
            self.eval_sets = [
                EvalSet(
                    d.name,
                    scorable(
                        PromptDataset(
                            d.path, d.prompt_key or data.prompt_key, d.answer_key or data.answer_key, data.type_key
                        ),
                        cfg.reward.verifier,
                        cfg.reward.verifiers,
                    ),
                    d.k,
                )
                for d in cfg.eval.datasets
            ]
            self._rows_by_index = {row.index: row for row in self.loader.dataset.rows}  # stale anchors' prompts

    # ------------------------------------------------------------------ set-up and state
    def _training_prompts(self) -> PromptDataset:
        """The training set without the prompts longer than ``rollout.max_prompt_len`` tokens.

        Lengths count the tokens as encoded for the engine (chat and prompt templates applied).
        The long prompts are left out once, up front, with a count in the log.
        """
        data, limit = self.cfg.data, self.cfg.rollout.max_prompt_len
        dataset = scorable(
            PromptDataset(data.train_path, data.prompt_key, data.answer_key, data.type_key),
            self.cfg.reward.verifier,
            self.cfg.reward.verifiers,
        )
        total = len(dataset)
        dropped = dataset.keep(lambda row: len(self.encode(row.prompt)) <= limit)
        if not len(dataset):
            raise DatasetError(
                f"{data.train_path}: all {total} prompts are longer than rollout.max_prompt_len={limit} tokens"
            )
        if dropped:
            print(
                f"[{self.cfg.name}] {data.train_path}: {dropped} of {total} prompts are longer than "
                f"rollout.max_prompt_len={limit} tokens; left out",
                flush=True,
            )
        return dataset

    def encode(self, prompt: Any) -> list[int]:
        """Token ids of a dataset prompt (chat template and prompt template as configured)."""
        data = self.cfg.data
        return encode_prompt(
            self.tokenizer, prompt, apply_chat_template=data.apply_chat_template, template=data.prompt_template
        )

    @collective
    def start_engines(self) -> None:
        """Build the engines from the actor's and reference's current weights (after load/resume).

        Weights stream from the export into the engines: every rank drives the export's
        collectives, the policy's first, then the reference's. Only an anchor source that keeps
        host copies (``swap``, to push them again around anchor requests) gets lists. Colocated,
        the engines released all their memory before the trainer was built
        (`components.release_engines_at_start`): the trainer goes to the host first, and each
        engine group takes its weights' memory back, receives them and then its KV cache and graphs
        (the engine factory), as in `sync_weights`.
        """
        if self._colocated():  # engines released at start (components.release_engines_at_start)
            self._park_trainer()  # the first push follows a step's order: it streams from the host copy
        host = self.trainer_memory.host_views(self.actor, self.reference) if self.trainer_memory else None
        with host or contextlib.nullcontext():
            # with adapter sync the policy engines get the base, then the adapters (`_sync_adapter` below)
            policy_export = self.export_weights(self.actor) if self.adapter_sync is None else self.adapter_sync.base()
            ref_export = self.export_weights(self.reference) if self.reference is not None else None
            policy: WeightSource = policy_export
            ref: WeightSource | None = ref_export
            if source_keeps_host_weights(self.cfg) or not self.is_driver:
                policy, ref = list(policy_export), _materialise(ref_export)
            if not self.is_driver:
                self._sync_adapter()
                return
            self.policy_engine, self.reference_engine = self._make_engines(
                policy, ref, policy_version=f"step-{self.step}", reference_version=self._ref_version()
            )  # on an error, fail here: draining the reference export would wait on ranks still in the policy's
            policy_export.close()  # the policy engine read it to the end (else this raises: the job would hang)
            if ref_export is not None:
                ref_export.drain()  # pushed nowhere (no anchors from a separate engine): still drive its collectives
            self._sync_adapter()
        self.anchors = build_anchor_cache(
            self.cfg,
            self.sampling,
            reference_engine=self.reference_engine,
            policy_engine=self.policy_engine,
            reference_weights=ref,  # host lists where the source keeps them, else spent streams it ignores
            policy_weights=policy,
            reference_version=self._ref_version(),
            **({} if self.settings.environment is None else {"rollout": self.settings.environment.anchor_rollout}),
        )
        if self.anchors is not None and self._anchor_state is not None:
            self.anchors.load_state_dict(self._anchor_state)

    def _anchor_cost(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Tokens π_ref generated since the last step, and the step's relative generation cost.

        Tokens π_ref generated since the last step, pre-generation included (``anchor/generated_tokens``
        counts only this step's cache misses), and the step's generation cost relative to on-policy only.
        """
        total = self._anchor_cache.sampler.stats.generated_tokens
        spent, self._anchor_tokens_logged = total - self._anchor_tokens_logged, total
        policy = metrics.get("rollout/generated_tokens", 0.0)
        return {
            "anchor/reference_tokens": float(spent),
            "anchor/generation_cost": (policy + spent) / policy if policy else 0.0,
        }

    def _ref_version(self) -> str:
        return f"ref-{self.ref_resets}"

    # the driver's state that a background generation (``overlap: one_step``) uses until it is joined
    @property
    def _prompts(self) -> PromptLoader:
        self._background.check_access("the prompt loader")
        return driver_only(self.loader, "the prompt loader")

    @property
    def _engine(self) -> RolloutEngine:
        self._background.check_access("the policy engine")
        return driver_only(self.policy_engine, "the policy engine")

    @property
    def _anchor_cache(self) -> AnchorCache:
        self._background.check_access("the anchor cache")
        return driver_only(self.anchors, "the anchor cache")

    def trainer_state(self) -> dict[str, Any]:
        """Driver-side state that goes into checkpoints next to the model and optimizer (`state_format`)."""
        pending = pending_state(self._settled_pending())  # first: the generation draws from the loader
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "loader": self._prompts.state_dict(),
            "anchor_cache": self.anchors.state_dict()
            if self.anchors is not None and self.cfg.checkpoint.save_anchor_cache
            else None,
            "reset_schedule": self.reset_schedule.state_dict(),
            "monitor": self.monitor.state_dict(),
            "ref_resets": self.ref_resets,
            "last_train_accuracy": self.last_train_accuracy,
            "pending_batch": pending,
            "step_record": self._step_record,
            "partial_rollouts": self._partial_rollout_state(),
        }

    def load_trainer_state(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        """Restore the loop's state from a checkpoint's trainer state of any format it reads (`state_format`)."""
        state = migrated(state, source)
        self.step = self._checkpointed_step = state["step"]
        self.ref_resets = state["ref_resets"]
        self.last_train_accuracy = state["last_train_accuracy"]
        if state["reset_schedule"]:
            self.reset_schedule.load_state_dict(state["reset_schedule"])
        if self.is_driver:
            self._prompts.load_state_dict(state["loader"])
            self.monitor.load_state_dict(state["monitor"])
            self._anchor_state = state["anchor_cache"]
            self._pending = load_pending(state["pending_batch"])
            self._step_record = state["step_record"]
            partial = state["partial_rollouts"]
            if partial is not None and not self.cfg.rollout.partial.enabled:
                raise PartialStateError(
                    f"{source} holds partial rollouts in progress, but rollout.partial.enabled is false"
                )
            if partial is not None and not self.cfg.anchor.enabled and holds_anchors(partial):
                raise PartialStateError(f"{source} holds partial rollouts with anchors, but anchor.enabled is false")
            self._partial_state = None if partial is None else partial["generator"]
            self._partial_queue = [] if partial is None else [int(i) for i in partial["queue"]]
            self._partial_draws = 0 if partial is None else int(partial["draws"])
            self._partial_anchors.load_state_dict([] if partial is None else partial["anchors"])
            if self._partial is not None and self._partial_state is not None:  # a generator already running
                self._partial.load_state_dict(self._partial_state)
                self._partial_state = None

    def reference_replaced(self) -> None:
        """π_ref was loaded from elsewhere (recovery mode) after the state was restored.

        A new reference version, and no anchors pooled under the old one.
        """
        self.ref_resets += 1
        self._anchor_state = None

    # ------------------------------------------------------------------ one step
    def rollout(self, timer: StepTimer, for_step: int | None = None) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """Driver: groups for ``prompts_per_step`` prompts.

        With DAPO dynamic sampling, groups whose accuracies are all equal are dropped and refilled
        from further prompts. ``for_step``: the update the batch feeds (default: the next one),
        which seeds the engines.
        """
        cfg, G = self.cfg, self.cfg.rollout.group_size
        step = self.step if for_step is None else for_step
        pad = self.tokenizer.pad_token_id or 0

        def one_round() -> tuple[RolloutBatch, dict[str, Any]]:
            return collect_groups(
                self._prompts.next_batch(),
                self.encode,
                self._engine,
                self.settings,
                anchors=self.anchors,
                pad_id=pad,
            )

        if self.anchors is not None:
            self.anchors.wait()  # a pre-generation still running would race the reseed below
        self._reseed_engines(step)
        ds = cfg.algorithm.dynamic_sampling
        if cfg.rollout.partial.enabled:
            with timer.phase("rollout"):
                return self._partial_rollout(step)
        with timer.phase("rollout"):
            if not ds.enabled:
                batch, metrics = one_round()
                self._pregenerate_anchors()
                return self._with_advantages(batch, metrics)
            sampler = DynamicSampler(
                cfg.rollout.prompts_per_step,
                pad_values={"input_ids": pad, "response_mask": 0.0, "engine_logprobs": 0.0},
            )
            rounds: list[dict[str, Any]] = []
            for _ in range(1 + ds.max_oversample_rounds):
                batch, round_metrics = one_round()
                rounds.append(round_metrics)
                sampler.add(batch, batch["accuracy"].view(-1, G))
                if sampler.done:
                    break
        self._pregenerate_anchors()
        metrics = _merge_rounds(rounds)
        metrics.update(sampler.stats())
        return self._with_advantages(sampler.take(allow_partial=True), metrics)

    def _partial_rollout(self, step: int) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """Driver: the step's groups from the partial generator (`rollout.partial_generation`).

        The responses the last step left unfinished are continued first; new groups come from
        the loader, ``ceil(P · over_provision)`` in flight; with dynamic sampling each group is
        scored as it completes and kept when its accuracies differ (at most
        ``P · over_provision · (1 + max_oversample_rounds)`` new groups per step, as many as the
        rounds would draw); once P are kept the rest are aborted and buffered. The kept groups
        are then scored (once) and assembled by `collect_groups`, their per-token versions checked.
        With anchors, the groups' anchors are looked up first, before any on-policy request, and
        those a reset made stale are replaced (`trainer.partial_anchors`).
        """
        cfg, G, P = self.cfg, self.cfg.rollout.group_size, self.cfg.rollout.prompts_per_step
        engine, part, ds = self._engine, cfg.rollout.partial, cfg.algorithm.dynamic_sampling
        if self._partial is None:
            self._partial = components.partial_generator(cfg, engine, self.sampling)
            if self._partial_state is not None:
                self._partial.load_state_dict(self._partial_state)
                self._partial_state = None
        max_new = int(self.sampling.max_new_tokens)

        def row_of(request: GroupRequest) -> PromptRow:
            return self._rows_by_index[int(request.key.split(":")[0])]

        new_groups = math.ceil(P * part.over_provision) * (1 + ds.max_oversample_rounds) if ds.enabled else None
        discarded = 0
        if self.anchors is not None:  # the step's anchors, before any on-policy request (`trainer.partial_anchors`)
            if new_groups is None:  # every new group starts at once: as many as free places in flight
                new_groups = max(0, math.ceil(P * part.over_provision) - self._partial.groups_in_progress)
            while len(self._partial_queue) < new_groups:
                self._partial_queue += [r.index for r in self._prompts.next_batch()]
            rows = [self._rows_by_index[i] for i in self._partial_queue[:new_groups]]
            discarded = self._partial_anchors.prepare(
                self._partial,
                rows,
                row_of,
                self._anchor_cache,
                self._ref_version(),
                self.settings,
                self.encode,
                max_new,
            )

        def supply() -> Iterator[GroupRequest]:
            while True:
                if not self._partial_queue:
                    self._partial_queue = [r.index for r in self._prompts.next_batch()]
                index = self._partial_queue.pop(0)
                self._partial_draws += 1
                key, prompt = f"{index}:{self._partial_draws}", self.encode(self._rows_by_index[index].prompt)
                if self.anchors is None:
                    yield GroupRequest(key, tuple(prompt), (max_new,) * G)
                else:
                    yield self._partial_anchors.request(key, prompt, self.settings, max_new)

        scored: dict[str, tuple[list[float], int]] = {}

        def accept(request: GroupRequest, members: list[Finished]) -> bool:
            row, anchor = row_of(request), kept_anchor(request.anchor, self.settings)
            scored[request.key] = score_group(row, [m.sample for m in members], self.settings, anchor)
            accuracy = group_accuracy(row, scored[request.key][0], anchor, self.settings)
            return bool(dynamic_sampling_keep(torch.tensor([accuracy]))[0])

        try:
            accepted, metrics = self._partial.generate(
                itertools.islice(supply(), new_groups), P, engine.weight_version, accept if ds.enabled else None
            )
        except GenerationStopped as stopped:  # the preemption signal: the generator kept every token
            raise CallsInterrupted(str(stopped)) from None
        metrics["partial/anchors_discarded"] += discarded
        if self.anchors is not None:
            self._pregenerate_anchors()  # anchor.cache false: the cache's anchors serve once
        if not accepted:
            return None, metrics
        accepted.sort(key=lambda group: int(group[0].key.split(":")[1]))  # by draw: no row order decided by time
        metrics.update(check_spans([m.spans for _, ms in accepted for m in ms], step, part.max_versions))
        try:
            batch, round_metrics = collect_groups(
                [row_of(r) for r, _ in accepted],
                self.encode,
                engine,
                self.settings,
                pad_id=self.tokenizer.pad_token_id or 0,
                generated=[[m.sample for m in ms] for _, ms in accepted],
                group_scores=([scored[r.key][0] for r, _ in accepted], sum(t for _, t in scored.values()))
                if ds.enabled
                else None,
                resolved=None if self.anchors is None else [r.anchor or NONE_FOUND for r, _ in accepted],
            )
        except CallsInterrupted:  # the signal stopped their scoring: the groups stay with the generator
            self._partial.give_back(accepted)
            raise
        if self.anchors is not None and stale_anchor_rows(batch, self._ref_version()):
            raise RuntimeError(
                f"step {step + 1}: a group holds an anchor of another reference than {self._ref_version()}"
            )
        return self._with_advantages(batch, {**round_metrics, **metrics})

    def _partial_rollout_state(self) -> dict[str, Any] | None:
        """``rollout.partial``'s state for the checkpoint: the generator's, the rows drawn and not requested."""
        if not self.cfg.rollout.partial.enabled:
            return None
        generator = self._partial.state_dict() if self._partial is not None else self._partial_state
        return {
            "generator": generator,
            "queue": list(self._partial_queue),
            "draws": self._partial_draws,
            "anchors": self._partial_anchors.state_dict(),
        }

    def _reseed_engines(self, step: int, salt: int = 0) -> None:
        """Seed both engines from the step, so a resumed run samples what the uninterrupted one did.

        Seed both engines from the step (and ``salt``, for a second draw in one step), so a
        resumed run samples what the uninterrupted one did.
        """
        for offset, engine in enumerate((self.policy_engine, self.reference_engine)):
            if engine is not None:
                engine.reseed(self.cfg.rollout.seed + 1_000_003 * (2 * step + offset) + 7_919 * salt)

    def _with_advantages(
        self, batch: RolloutBatch | None, metrics: dict[str, Any]
    ) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """The step's advantages, once, over the batch that trains (None: no group had signal)."""
        if batch is None:
            return None, metrics
        batch, adv_metrics = group_advantages(batch, self.settings)
        if self.anchors is not None:  # of the groups that train (dynamic sampling keeps some of them)
            adv_metrics["anchor/trained_groups_rate"] = (
                batch["is_anchor"].view(-1, self.cfg.rollout.group_size).any(1).float().mean().item()
            )
        return batch, {**metrics, **adv_metrics}

    def _pregenerate_anchors(self) -> None:
        """After the step's anchors are drawn.

        With ``anchor.cache: false`` they are dropped (never reused). With ``anchor.pregenerate``:
        sample the next batch's anchors in the background while the trainer updates (the loader is
        peeked, not advanced); they serve once.
        """
        if self.anchors is None:
            return
        if not self.cfg.anchor.cache:
            self.anchors.reset(self._ref_version())
        if not self.cfg.anchor.pregenerate:
            return
        loader = self._prompts
        state = loader.state_dict()
        rows = loader.next_batch()
        loader.load_state_dict(state)
        truths = anchor_truths(rows, self.settings)  # as collect_groups asks
        self.anchors.prefetch([self.encode(r.prompt) for r in rows], truths, keys=[r.index for r in rows])

    # ------------------------------------------------------------------ overlap (driver)
    def _generate(self, for_step: int) -> PendingBatch:
        return generate_pending(lambda: self.rollout(StepTimer(), for_step), for_step)

    def _step_batch(self, report: StepReport) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """Driver: this step's batch and rollout metrics; ``report`` learns which generations ran and trains.

        With ``overlap: one_step`` the batch is the one generated during the last step (or now, when
        none is pending), checked (`trainer.overlap.check_lag`) after its anchors of an older
        reference were resampled; then the next step's generation starts in the background (not with
        ``overlap_forced_wait``: the next step generates its own batch, after this update).
        """
        if not self.overlap:
            begin = time.perf_counter()
            batch, metrics = self.rollout(report)
            report.generated(PendingBatch(batch, metrics, self.step, begin, time.perf_counter()))
            return batch, metrics
        with report.phase("rollout"):
            pending, self._pending = self._pending, None
            if pending is None:  # the first step, or after the update with the forced wait
                self._start_pending(self.step)
                pending = self._background.join()
                if pending is None:
                    raise RuntimeError(f"the rollout for step {self.step + 1} returned no batch")
                report.generated(pending)
            batch, metrics = pending.batch, dict(pending.metrics)
            if pending.for_step != self.step:
                raise RuntimeError(
                    f"the pending batch was generated for step {pending.for_step + 1}, not {self.step + 1}"
                )
            if batch is not None and self.anchors is not None:
                batch, metrics = self._resample_stale_anchors(batch, metrics)
            metrics.update(check_lag(batch, self.step, self._ref_version() if self.anchors is not None else None))
        report.trains(pending)
        preempted = self._preemption is not None and self._preemption.requested()
        if not self.cfg.rollout.overlap_forced_wait and self.step + 1 < self.cfg.train.steps and not preempted:
            self._generation_beside_update = True  # before the thread starts: a signal from now on spares it
            self._start_pending(self.step + 1)
        return batch, metrics

    def _resample_stale_anchors(
        self, batch: RolloutBatch, metrics: dict[str, Any]
    ) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """Driver: replace the anchors an older reference produced, and recompute advantages.

        Driver: anchors of an older reference (the batch was generated before a reset) replaced
        by the current reference's (`rollout_phase.replace_stale_anchors`), advantages recomputed;
        ``anchor/stale_resampled`` counts them.
        """
        if not stale_anchor_rows(batch, self._ref_version()):
            return batch, {**metrics, "anchor/stale_resampled": 0.0}
        self._reseed_engines(self.step, salt=1)  # the draws below are the same after a resume
        replaced, stale = replace_stale_anchors(
            batch,
            self._ref_version(),
            self._rows_by_index,
            self.encode,
            self._engine,
            self.settings,
            self._anchor_cache,
            pad_id=self.tokenizer.pad_token_id or 0,
        )
        if not self.cfg.anchor.cache:
            self._anchor_cache.reset(self._ref_version())  # they serve once
        trained, metrics = self._with_advantages(replaced, metrics)
        return trained, {**metrics, "anchor/stale_resampled": float(stale)}

    def _settled_pending(self) -> PendingBatch | None:
        """Driver: the pending batch, once no generation runs (a checkpoint holds it)."""
        if self._background.running:
            self._pending = self._join_pending()
        return self._pending

    def _start_pending(self, for_step: int) -> None:
        """Driver: generate the batch of ``for_step`` in the background (the loader's state kept first)."""
        self._loader_before_pending = self._prompts.state_dict()
        self._background.start(functools.partial(self._generate, for_step))

    def _stop_reward_calls(self) -> None:
        """The preemption signal's handler: stop the reward calls in flight, unless they are the next batch's.

        The rollout a step waits for is stopped at once (`interrupt_calls`): the step trains nothing,
        and the resumed run generates the same batch from the same weights. The next step's batch,
        generated beside this step's update, comes from weights the checkpoint no longer holds; it
        is left to finish, so the checkpoint holds it and the resume stays exact (`_join_pending`
        bounds the wait).
        """
        if not self._generation_beside_update:
            interrupt_calls()

    def _join_pending(self) -> PendingBatch | None:
        """Driver: the background generation's batch.

        After a preemption signal the generation gets ``reward.timeout_s`` (the bound of one
        verifier call) to finish, counted from the signal or from the join, whichever is later;
        then its reward calls are stopped (an engine request in flight still ends within its own
        timeout). Once the batch is in hand the reward calls are stopped too, so the step's
        evaluation is skipped as it is without overlap. None when they were: the loader goes back to where it
        was before that generation drew its prompts, so a resumed run draws them again, from the
        updated weights (lag 0 where the uninterrupted run had 1; logged).
        """
        grace_ends = None
        while self._background.running and not self._background.finished(timeout=0.05):
            if self._preemption is None or not self._preemption.requested():
                continue
            grace_ends = grace_ends or time.monotonic() + self.cfg.reward.timeout_s
            if time.monotonic() >= grace_ends:
                print(
                    f"[{self.cfg.name}] warning: the next step's generation did not finish within "
                    f"reward.timeout_s={self.cfg.reward.timeout_s:g}s of the preemption signal: its reward calls "
                    f"are stopped, and the resumed run regenerates its batch from the updated weights (not "
                    f"bit-exact from step {self.step + 1})",
                    flush=True,
                )
                interrupt_calls()
                break
        self._generation_beside_update = False
        try:
            pending = self._background.join()
        except CallsInterrupted:
            if self._loader_before_pending is not None:
                self._prompts.load_state_dict(self._loader_before_pending)
            return None
        if self._preemption is not None and self._preemption.requested():
            interrupt_calls()  # the batch is in hand: what the step does after this (an evaluation) is skipped
        return pending

    @collective
    def update(self, batch: dict[str, Any], timer: StepTimer) -> dict[str, Any]:
        """The step's update on all ranks: log-probs, then the actor's (and critic's) updates.

        All ranks: recompute lp_old and lp_ref (and, with a critic, V_old and the GAE targets),
        then the mini-batch / epoch updates of the actor and the critic. During the critic's
        warm-up (the first ``critic.warmup_steps`` steps) only the critic trains.

        Devices: the trainer holds host tensors only. The Megatron models take host batches,
        move each micro-batch to their device, and return results on it; ``to_host`` brings
        each result back here, the one crossing on the trainer's side.
        """
        cfg = self.cfg
        with timer.phase("logprobs"):
            batch["old_logprobs"] = to_host(self.actor.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs)
            if self.reference is not None and needs_reference_logprobs(cfg):
                ref = self.reference.compute_logprobs(batch["input_ids"], batch["lengths"])
                batch["ref_logprobs"] = to_host(ref.logprobs)
        metrics: dict[str, Any] = {"rollout/logprob_abs_diff": [engine_trainer_gap(batch)]}
        if "ref_logprobs" in batch and bool(batch["is_anchor"].any()):
            metrics["rollout/anchor_logprob_abs_diff"] = [anchor_reference_gap(batch)]
        if cfg.algorithm.tis.enabled:  # π_old / π_engine on on-policy tokens, truncated; anchors weigh 1
            batch["tis_weights"], tis = truncated_is_weights(
                batch["old_logprobs"],
                batch["engine_logprobs"],
                batch["response_mask"],
                batch["is_anchor"].bool(),
                cap=cfg.algorithm.tis.cap,
            )
            metrics.update({f"train/{k}": [float(v)] for k, v in tis.items()})
        if self.critic is not None:
            with timer.phase("values"):
                batch["old_values"] = to_host(self.critic.compute_values(batch["input_ids"], batch["lengths"]))
                batch["advantages"], batch["returns"] = gae_targets(batch, cfg)
            metrics["critic/old_explained_var"] = [
                explained_variance(batch["old_values"], batch["returns"], batch["response_mask"])
            ]
        train_actor = self.critic is None or self.step >= cfg.critic.warmup_steps
        # mini_batches_per_step near-equal mini-batches, also of a partial batch from dynamic
        # sampling (never more optimizer steps than the LR schedule counts)
        n = len(batch["input_ids"])
        minis = torch.tensor_split(torch.arange(n), min(cfg.train.mini_batches_per_step, n))
        with timer.phase("update"):
            for _ in range(cfg.train.epochs_per_step):
                for rows in minis:
                    mini = {k: v[rows] for k, v in batch.items()}
                    if train_actor:
                        for k, v in self.actor.train_step({k: mini[k] for k in TRAIN_KEYS if k in mini}).items():
                            metrics.setdefault(f"train/{k}", []).append(v)
                    if self.critic is not None:
                        for k, v in self.critic.train_step({k: mini[k] for k in CRITIC_KEYS}).items():
                            metrics.setdefault(f"critic/{k}", []).append(v)
        return {k: sum(v) / len(v) for k, v in metrics.items()}

    @collective
    def sync_weights(self, timer: StepTimer) -> dict[str, float]:
        """All ranks: push the new policy to the engine (the driver talks to it); with adapter sync, its adapters.

        Colocated, the policy engines take their weights' memory back first, the weights stream from
        the trainer's host copy, and the KV cache and graphs come back after. With ``lora.sync:
        adapter`` the engines kept their base weights; only the adapters go (``sync/adapter_bytes``).
        """
        metrics: dict[str, float] = {}
        with timer.phase("weight_sync"):
            self._resume_engines(tuple(t for t in self._policy_release if t not in KV_AND_GRAPHS), ())
            if self.adapter_sync is not None:
                metrics = self._sync_adapter()
            else:
                with self._host_weights(self.actor), self.export_weights(self.actor) as export:
                    if self.is_driver:
                        weights: WeightSource = export
                        if self.anchors is not None:  # the anchor source keeps what it swaps back in
                            weights = self.anchors.sampler.source.policy_weights_pushed(export)
                        self._engine.update_weights(weights, f"step-{self.step}")
                    else:
                        export.drain()
            if self._colocated():
                free_device_cache()  # the push's staged buckets and IPC-shared blocks, before the KV cache returns
                barrier()
            self._resume_engines(KV_AND_GRAPHS, KV_AND_GRAPHS)
        return metrics

    def _sync_adapter(self) -> dict[str, float]:
        """With adapter sync, every rank: the actor's adapters gathered, loaded into the policy engines by the driver."""
        if self.adapter_sync is None:
            return {}
        with self._host_weights(self.actor):
            engine = cast(AdapterEngine, self._engine) if self.is_driver else None
            return self.adapter_sync.push_adapter(engine, f"step-{self.step}", self._ref_version())

    @collective
    def reset_reference(self, timer: StepTimer) -> dict[str, Any]:
        """All ranks, trainer on the device: θ_ref ← θ in the trainer and the anchor source."""
        reference = self.reference
        if reference is None:
            raise RuntimeError("a reference reset without a reference model (the schedule asks only with one)")
        with timer.phase("reference_reset"):
            reference.reset_from(self.actor)
            self.ref_resets += 1
            with self.export_weights(reference) as ref_weights:
                if self.is_driver and self.anchors is not None:
                    self.anchors.wait()
                    self.anchors.sampler.source.reset(ref_weights, self._ref_version())
                    self.anchors.reset(self._ref_version())
                ref_weights.drain()  # drives the export's collectives wherever nothing consumed it
            metrics = {"reference/reset": 1.0}
            if self.adapter_sync is not None:  # the merge changed the base: the policy engines get it, then B = 0
                engine = cast(AdapterEngine, self._engine) if self.is_driver else None
                self.adapter_sync.push_base(engine, f"step-{self.step}")
                metrics.update(self._sync_adapter())
        return metrics

    def _reset_due(self, step_metrics: dict[str, Any]) -> bool:
        """The schedule's decision (it may read this step's validation); asked once per step."""
        return self.reference is not None and self.reset_schedule.should_reset(self.step, step_metrics)

    # ------------------------------------------------------------------ device memory
    def _colocated(self) -> bool:
        return self.cfg.rollout.engine == "sglang" and self.cfg.rollout.sglang.placement == "colocated"

    def _engine_tags(
        self, policy: tuple[str, ...], reference: tuple[str, ...]
    ) -> list[tuple[RolloutEngine, tuple[str, ...]]]:
        """Driver, colocated: (engine, tags) of the engines that share the trainer's GPUs."""
        if not (self.is_driver and self._colocated()):
            return []
        pairs = ((self.policy_engine, policy), (self.reference_engine, reference))
        return [(e, tags) for e, tags in pairs if e is not None and tags]

    def _release_engines(self, policy: tuple[str, ...], reference: tuple[str, ...]) -> None:
        """Colocated engines free GPU memory (``tags`` per group); every rank waits for them."""
        released = self._engine_tags(policy, reference)
        if self.anchors is not None and released:
            self.anchors.wait()  # no background sampling on released engines
        for engine, tags in released:
            engine.release_memory(tags=tags)
        barrier()  # no rank allocates before the engines have let go

    def _resume_engines(self, policy: tuple[str, ...], reference: tuple[str, ...]) -> None:
        for engine, tags in self._engine_tags(policy, reference):
            engine.resume_memory(tags=tags)

    def _park_trainer(self) -> None:
        """Move the trainer to the host and empty the allocator's cache, on every rank.

        Every rank: the trainer's device memory to the host (when it offloads) and the
        allocator's cache emptied, before engines use the GPU.
        """
        if self.trainer_memory is not None:
            self.trainer_memory.offload()

    @collective
    @contextmanager
    def _trainer_on_device(
        self, policy: tuple[str, ...] = KV_AND_GRAPHS, reference: tuple[str, ...] = KV_AND_GRAPHS, resume: bool = True
    ) -> Iterator[None]:
        """Bring the trainer to the device for the block, with colocated engines released.

        Every rank: colocated engines release ``policy`` / ``reference`` tags, then the
        trainer comes to the device; after the block it goes back to the host (``empty_cache``)
        before the engines take their memory back (``resume``; else `sync_weights` does, after
        pushing the new weights into released ones).
        """
        self._release_engines(policy, reference)
        if self.trainer_memory is not None:
            self.trainer_memory.reload()
        try:
            yield
        finally:
            self._park_trainer()
            barrier()
            if resume:
                self._resume_engines(policy, reference)

    def _host_weights(self, model: ModelChunks) -> contextlib.AbstractContextManager[None]:
        """While the trainer is in host memory, ``model``'s weights read their host copy."""
        if self.trainer_memory is None:
            return contextlib.nullcontext()
        return self.trainer_memory.host_views(model)

    def evaluate(self) -> dict[str, Any]:
        """Driver: avg@k / pass@k of the current policy on every eval set."""
        if not self.eval_sets:
            return {}
        from armor_megatron.rewards import flatten_metrics

        if calls_interrupted():  # a preemption signal: generating for an evaluation it cannot score is waste
            print(f"[{self.cfg.name}] evaluation at step {self.step} skipped: a preemption signal arrived", flush=True)
            return {}
        try:
            result = evaluate(
                self._engine,
                self.encode,
                self.eval_sets,
                self.eval_sampling,
                verifier=self.cfg.reward.verifier,
                pass_k=self.cfg.eval.pass_k,
                sample_metrics=self.settings.sample_metrics,
                environment=self.settings.environment,
            )
        except CallsInterrupted:  # a preemption signal: the checkpoint matters, this evaluation does not
            print(f"[{self.cfg.name}] evaluation at step {self.step} stopped by a preemption signal", flush=True)
            return {}
        metrics = flatten_metrics(result.metrics)
        pass1 = [v["pass@1"] for v in result.metrics.values() if "pass@1" in v]
        if pass1:
            metrics["eval/mean/pass@1"] = sum(pass1) / len(pass1)
            if self.step > 0:  # the monitor compares with the training accuracy of a trained step
                gap, warning = self.monitor.update(self.last_train_accuracy, metrics["eval/mean/pass@1"])
                metrics.update(gap)
                if warning:
                    print(f"[{self.cfg.name}] warning: {warning}", flush=True)
        return metrics

    # ------------------------------------------------------------------ the loop
    @collective
    def run(
        self, save: Callable[[], None], logger: MetricsLogger | None = None, save_hf: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Train until ``train.steps``, with evaluations and checkpoints as configured.

        Train until ``train.steps``; ``save()`` writes a checkpoint of the current state (all ranks),
        ``save_hf()`` the policy as an HF directory when ``checkpoint.save_hf`` says it is due.

        Returns the driver's metrics of the last step (evaluation included), {} on other ranks.
        """
        cfg = self.cfg
        save = collective(save, name="checkpoint")
        save_hf = None if save_hf is None else collective(save_hf, name="save_hf")
        last: dict[str, Any] = {}
        reporter = self._progress_bar(logger)
        if reporter is not None:
            self._log_checkpointed_step(reporter)
        self._park_trainer()  # engines generate from here on: the evaluation at step 0 too
        # a preemption signal also stops the reward calls in flight: a step stuck in a verifier ends
        with (
            PreemptionHandler(on_signal=self._stop_reward_calls) as preemption,
            _calls_allowed_after(),
            self._partial_generator_closed(),
        ):
            self._preemption = preemption
            if self.step == 0 and cfg.eval.every_steps:
                last = self._evaluate_start(logger)
            while self.step < cfg.train.steps:
                outcome = self._step(save, save_hf)
                if outcome is None:  # the signal stopped this step's rollout: nothing of it trained
                    if self._checkpointed_step != self.step:
                        with self._trainer_on_device():
                            save()
                        self._checkpointed_step = self.step
                    if reporter is not None:
                        reporter.close()
                    raise Preempted(
                        f"{_signal_name(preemption.received)} during step {self.step + 1}, which stopped its reward "
                        f"calls and did not train: checkpoint of step {self.step} saved"
                    )
                last, saved = outcome
                if reporter is not None:  # the driver's
                    last = self._report(last, reporter)
                if self.step < cfg.train.steps and any_rank(preemption.requested()):  # done: nothing to requeue
                    if not saved:
                        with self._trainer_on_device():
                            save()
                    if reporter is not None:
                        reporter.close()
                    raise Preempted(f"{_signal_name(preemption.received)} at step {self.step}: checkpoint saved")
        if reporter is not None:
            reporter.close()
        return last if self.is_driver else {}

    @contextlib.contextmanager
    def _partial_generator_closed(self) -> Iterator[None]:
        """Driver: the partial generator's requests and threads are stopped when the run ends, however it ends."""
        try:
            yield
        finally:
            if self._partial is not None:
                self._partial.close()

    @collective
    def _step(
        self, save: Callable[[], None], save_hf: Callable[[], None] | None = None
    ) -> tuple[dict[str, Any], bool] | None:
        """One ARMOR step on every rank (module docstring).

        Returns (its metrics, identical on every rank, and whether it saved a checkpoint); None on
        every rank when a preemption signal stopped the driver's rollout (the driver's reward calls
        raised CallsInterrupted): the step trained nothing and its prompts go back to the loader.
        """
        cfg = self.cfg
        report = StepReport(self._clock)
        self._park_trainer()  # a no-op once `run` parked it
        batch, metrics = self._driver_batch(report) if self.is_driver else (None, {})
        tensors = broadcast_tensors(batch, BATCH_TENSORS)
        if isinstance(tensors, str):  # STOPPED
            return None
        with report.update_window(), self._trainer_on_device(self._policy_release, REFERENCE_RELEASE, resume=False):
            if tensors is None:
                metrics["train/skipped_no_signal"] = 1.0  # every group had equal rewards
            else:
                metrics.update(self.update(tensors, report))
                metrics["train/tokens"] = float(tensors["response_mask"].sum())
        self.step += 1
        if self.is_driver and self.overlap:
            with report.phase("rollout"):  # the trainer waits for the next step's batch, if it is not ready
                self._pending = self._join_pending()
            report.generated(self._pending)
        metrics.update(self.sync_weights(report))
        eval_due = bool(cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0)
        if self.is_driver:
            # the policy's own accuracy: anchors score 1 by construction
            train_acc = metrics.get("rollout/on_policy_accuracy", metrics.get("rollout/accuracy"))
            self.last_train_accuracy = self.last_train_accuracy if train_acc is None else train_acc
            if eval_due:
                with report.phase("eval"):  # the policy of this step: its weights are in the engine
                    metrics.update(self.evaluate())
        metrics = broadcast_object(metrics)
        # the guard judges the next updates with this step's engine-vs-trainer gap; rollbacks are
        # refused at --check (stability.max_rollbacks: 0) until the loop restores checkpoints
        self.actor.guard.observe_step(metrics)
        saved = bool(cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0)
        saved = saved or self.step == cfg.train.steps
        reset = self._reset_due(metrics)
        if saved or reset:
            with self._trainer_on_device():  # engines keep their weights
                if reset:
                    metrics.update(self.reset_reference(report))
                if saved:
                    self._checkpoint(save, metrics, report)
        if save_hf is not None and save_hf_due(cfg.checkpoint.save_hf, self.step, cfg.train.steps):
            with report.phase("save_hf"), self._host_weights(self.actor):  # from the host copy, if there
                save_hf()
        metrics.update(
            report.metrics(
                arch=self.arch,
                lengths=None if tensors is None else tensors["lengths"],
                trained_tokens=metrics.get("train/tokens", 0.0),
                epochs=cfg.train.epochs_per_step,
                world_size=dist.get_world_size() if dist.is_initialized() else 1,
                peak_tflops=cfg.launch.gpu_peak_tflops,
                driver=self.is_driver,
                overlap=self.overlap,
            )
        )
        return metrics, saved

    def _driver_batch(self, report: StepReport) -> tuple[RolloutBatch | str | None, dict[str, Any]]:
        """Driver: `_step_batch`, or ``STOPPED`` when a preemption signal stopped its reward calls.

        Then the loader (and a batch generated during the last step) go back to where the step
        began, so the resumed run trains on the same prompts; with ``rollout.partial`` the loader
        stays where it is: the generator kept the groups drawn, with their tokens, for the checkpoint.
        """
        before, pending = self._prompts.state_dict(), self._pending
        try:
            return self._step_batch(report)
        except CallsInterrupted:
            if not self.cfg.rollout.partial.enabled:  # partial rollouts: the generator holds what was drawn
                self._prompts.load_state_dict(before)
            self._pending = pending  # a batch generated during the last step stays for the checkpoint
            return STOPPED, {}

    def _checkpoint(self, save: Callable[[], None], metrics: dict[str, Any], report: StepReport) -> None:
        """All ranks, trainer on the device: save this step; the driver's state carries its metrics so far.

        A resumed run logs that record if the metrics log lost the step (`_log_checkpointed_step`).
        """
        if self.is_driver:
            self._step_record = {"step": self.step, "metrics": scalar_metrics(metrics)}
        with report.phase("checkpoint"):
            save()
        self._checkpointed_step = self.step

    @collective
    def _evaluate_start(self, logger: MetricsLogger | None) -> dict[str, Any]:
        """The evaluation before training (step 0); the reset schedule sees it on every rank."""
        start = self.evaluate() if self.is_driver else {}
        if logger:
            logger.log(0, start)
        self.reset_schedule.observe_start(broadcast_object(start))
        return start

    def _progress_bar(self, logger: MetricsLogger | None) -> StepReporter | None:
        """Driver: the step reporter (text line per step; a tqdm bar only on a terminal)."""
        if not self.is_driver:
            return None
        cfg = self.cfg
        return StepReporter(
            logger,
            every_steps=cfg.logging.every_steps,
            total_steps=cfg.train.steps,
            initial_step=self.step,
            name=cfg.name,
            progress_bar=cfg.logging.progress_bar,
        )

    def _log_checkpointed_step(self, reporter: StepReporter) -> None:
        """Driver, on resume: log the checkpointed step's record if the metrics log lacks it.

        A step's checkpoint is written before its log line (the record holds the save's time), so a
        run killed in between resumes after a step its log never saw. The checkpoint carries the
        step's metrics as they stood at the save (no ``time/*`` of the save and after, no anchor-pool
        statistics); they are logged once, marked ``log/restored_from_checkpoint``.
        """
        record, self._step_record = self._step_record, None
        logger = reporter.logger
        if record is None or record["step"] != self.step or logger is None or not logger.lacks(self.step):
            return
        if reporter.should_log(self.step, record["metrics"]):
            logger.log(self.step, {**record["metrics"], "log/restored_from_checkpoint": 1.0})

    def _report(self, metrics: dict[str, Any], reporter: StepReporter) -> dict[str, Any]:
        """Driver: anchor statistics into the step's metrics, then the log and the step line."""
        if self.anchors is not None:
            metrics.update(self.anchors.stats.as_dict())
            metrics.update(self._anchor_cost(metrics))
        return reporter.report(self.step, metrics)


@contextlib.contextmanager
def _calls_allowed_after() -> Iterator[None]:
    """Reward calls, stopped by a preemption signal inside the block, are allowed again after it."""
    try:
        yield
    finally:
        allow_calls()


def _merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics of a step's rollout rounds.

    The first round describes the policy's samples (``rollout/*``, before dynamic sampling filtered
    anything); anchor rates are averaged over every round, since anchors of later rounds train too,
    and what generation cost is summed.
    """
    merged = dict(rounds[0])
    for key in {k for r in rounds for k in r if k.startswith("anchor/") or k in _SUMMED_OVER_ROUNDS}:
        values = [r[key] for r in rounds if key in r]
        merged[key] = sum(values) if key in _SUMMED_OVER_ROUNDS else sum(values) / len(values)
    return merged


_SUMMED_OVER_ROUNDS = (
    "anchor/tries",
    "anchor/generated_tokens",
    "anchor/dropped",
    "rollout/generated_tokens",
    "reward/timeouts",
)


def offloads_during_rollout(cfg: RunConfig) -> bool:
    """``train.offload_during_rollout``, by default on exactly when SGLang engines share the GPUs."""
    if cfg.train.offload_during_rollout is not None:
        return cfg.train.offload_during_rollout
    return cfg.rollout.engine == "sglang" and cfg.rollout.sglang.placement == "colocated"


def free_device_cache() -> None:
    """Return the caching allocator's free blocks to the device and drop blocks shared over CUDA IPC.

    After a push the allocator still holds the staged parameters and buckets (``pack`` concatenates
    a bucket's list into one more), and a ``tensor`` sync's blocks stay alive until the engines'
    handles are collected; the KV cache resumed next would compete with them.
    """
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # torch leaves it untyped


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A model's result on the host (a no-op for CPU tensors)."""
    return t.detach().cpu()


def engine_trainer_gap(batch: dict[str, Any]) -> float:
    """Mean |lp_engine − lp_old| over on-policy response tokens.

    ~0 when engine and trainer hold the same weights (a weight-sync bug or a precision mismatch
    shows up here first). Anchor rows are left out: the reference engine sampled them. Host tensors.
    """
    mask = batch["response_mask"] * (~batch["is_anchor"].bool()).unsqueeze(1)
    gap = ((batch["engine_logprobs"] - batch["old_logprobs"]).abs() * mask).sum() / mask.sum().clamp(min=1)
    return float(gap)


def anchor_reference_gap(batch: dict[str, Any]) -> float:
    """Mean |lp_engine − lp_ref| over anchor response tokens: ~0 when the anchors' engine sampled π_ref's weights."""
    mask = batch["response_mask"] * batch["is_anchor"].bool().unsqueeze(1)
    gap = ((batch["engine_logprobs"] - batch["ref_logprobs"]).abs() * mask).sum() / mask.sum().clamp(min=1)
    return float(gap)


def _materialise(export: CollectiveExport | None) -> list[NamedTensor] | None:
    """The export read to the end into a list (None for None)."""
    return None if export is None else list(export)
