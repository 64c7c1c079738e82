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

`ArmorTrainer._step` is that step; the plumbing lives beside it: the driver's rollout routes
(`trainer.driver_rollout`: one round, dynamic sampling, partial rollouts in `trainer.partial_rollout`,
the one-step overlap in `trainer.overlap`), the update on the broadcast batch (`trainer.update_phase`),
colocated engines' device memory (`trainer.device_memory`), time and throughput (`trainer.step_report`),
the step line and the anchors' cost (`trainer.run_report`), checkpoint bookkeeping
(`trainer.checkpoint_record`) and preemption (`trainer.preemption`).

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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch.distributed as dist

from armor_megatron.algo import ResetSchedule
from armor_megatron.config.schema import RunConfig
from armor_megatron.data.prompts import PromptLoader, encode_prompt
from armor_megatron.launch.device_ledger import KV_AND_GRAPHS, POLICY_RELEASE, REFERENCE_RELEASE
from armor_megatron.megatron.dist import global_rank
from armor_megatron.megatron.offload import HostOffload
from armor_megatron.models.arch import ModelArch
from armor_megatron.rewards.isolated import allow_calls, interrupt_calls
from armor_megatron.rollout.anchor.build import build_anchor_cache, source_keeps_host_weights
from armor_megatron.rollout.engine import WeightSource
from armor_megatron.trainer import components
from armor_megatron.trainer.adapter_sync import AdapterEngine, AdapterSync
from armor_megatron.trainer.checkpoint_record import CheckpointRecord
from armor_megatron.trainer.collaborators import Actor, Critic, EngineFactory, Reference, Tokenizer, WeightExporter
from armor_megatron.trainer.collectives import any_rank, broadcast_object, broadcast_tensors, collective
from armor_megatron.trainer.device_memory import ColocatedMemory, offloads_during_rollout
from armor_megatron.trainer.driver_rollout import DriverRollout, driver_only
from armor_megatron.trainer.evaluation import EvalSet, evaluate_during_training
from armor_megatron.trainer.hf_save import save_hf_due
from armor_megatron.trainer.metrics_log import MetricsLogger
from armor_megatron.trainer.overlap import load_pending, pending_state
from armor_megatron.trainer.overopt_monitor import OverOptimizationMonitor
from armor_megatron.trainer.preemption import Preempted, PreemptionHandler, signal_name
from armor_megatron.trainer.run_report import RunReport
from armor_megatron.trainer.state_format import FORMAT_VERSION, migrated
from armor_megatron.trainer.step_report import StepReport, StepTimer
from armor_megatron.trainer.update_phase import update_on_batch

BATCH_TENSORS = ("input_ids", "lengths", "response_mask", "advantages", "rewards", "engine_logprobs", "is_anchor")


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
        self._make_engines = make_engines
        self.rank = global_rank()
        self.is_driver = self.rank == 0
        # progress, replicated on every rank and checkpointed (``trainer_state``)
        self.step = 0
        self.reset_schedule: ResetSchedule = components.reset_schedule(cfg)
        self.ref_resets = 0  # names the reference's weights: "ref-<n>"
        self.last_train_accuracy = 0.0
        self.checkpoints = CheckpointRecord()
        # sampling
        eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
        self.sampling = components.rollout_sampling(cfg, eos)
        self.eval_sampling = components.eval_sampling(cfg, eos)
        self.settings = components.rollout_settings(cfg, self.sampling, arch.vocab_size, tokenizer)
        self.overlap = cfg.rollout.overlap == "one_step"
        self._clock = time.perf_counter()  # the step timeline's origin (``timeline/*``)
        # driver only: data and engines (``start_engines``), evaluation, the over-optimisation monitor
        self.driver: DriverRollout | None = None
        self.eval_sets: list[EvalSet] = []
        self.monitor = OverOptimizationMonitor()
        if self.is_driver:
            loader = PromptLoader(
                components.training_prompts(cfg, self.encode),
                cfg.rollout.prompts_per_step,
                shuffle=cfg.data.shuffle,
                seed=cfg.train.seed,
            )
            pad = tokenizer.pad_token_id or 0
            self.driver = DriverRollout(cfg, self.settings, self.encode, loader, pad, self._ref_version)
            self.eval_sets = components.eval_sets(cfg)
        # trainer memory handed to colocated engines while they generate (bit-exact round trip)
        self.trainer_memory = HostOffload.of(actor, reference, critic) if offloads_during_rollout(cfg) else None
        self.memory = ColocatedMemory(cfg, self.trainer_memory, self.driver)

    # ------------------------------------------------------------------ set-up and state
    def encode(self, prompt: Any) -> list[int]:
        """Token ids of a dataset prompt (chat template and prompt template as configured)."""
        data = self.cfg.data
        return encode_prompt(
            self.tokenizer, prompt, apply_chat_template=data.apply_chat_template, template=data.prompt_template
        )

    def _ref_version(self) -> str:
        return f"ref-{self.ref_resets}"

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
        if self.memory.colocated:  # engines released at start (components.release_engines_at_start)
            self.memory.park_trainer()  # the first push follows a step's order: it streams from the host copy
        with self.memory.host_weights(self.actor, self.reference):
            # with adapter sync the policy engines get the base, then the adapters (`_sync_adapter` below)
            policy_export = self.export_weights(self.actor) if self.adapter_sync is None else self.adapter_sync.base()
            ref_export = self.export_weights(self.reference) if self.reference is not None else None
            policy: WeightSource = policy_export
            ref: WeightSource | None = ref_export
            if source_keeps_host_weights(self.cfg) or self.driver is None:
                policy, ref = list(policy_export), None if ref_export is None else list(ref_export)
            if self.driver is None:
                self._sync_adapter()
                return
            driver = self.driver
            driver.policy_engine, driver.reference_engine = self._make_engines(
                policy, ref, policy_version=f"step-{self.step}", reference_version=self._ref_version()
            )  # on an error, fail here: draining the reference export would wait on ranks still in the policy's
            policy_export.close()  # the policy engine read it to the end (else this raises: the job would hang)
            if ref_export is not None:
                ref_export.drain()  # pushed nowhere (no anchors from a separate engine): still drive its collectives
            self._sync_adapter()
        driver.anchors = build_anchor_cache(
            self.cfg,
            self.sampling,
            reference_engine=driver.reference_engine,
            policy_engine=driver.policy_engine,
            reference_weights=ref,  # host lists where the source keeps them, else spent streams it ignores
            policy_weights=policy,
            reference_version=self._ref_version(),
            **({} if self.settings.environment is None else {"rollout": self.settings.environment.anchor_rollout}),
        )
        if driver.anchors is not None and driver.anchor_state is not None:
            driver.anchors.load_state_dict(driver.anchor_state)

    def trainer_state(self) -> dict[str, Any]:
        """Driver-side state that goes into checkpoints next to the model and optimizer (`state_format`)."""
        driver = driver_only(self.driver, "the trainer state")
        pending = driver.overlap.settled(self.step, driver.preemption)
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "loader": driver.prompts.state_dict(),  # after the pending batch: its generation draws from the loader
            "anchor_cache": driver.anchors.state_dict()
            if driver.anchors is not None and self.cfg.checkpoint.save_anchor_cache
            else None,
            "reset_schedule": self.reset_schedule.state_dict(),
            "monitor": self.monitor.state_dict(),
            "ref_resets": self.ref_resets,
            "last_train_accuracy": self.last_train_accuracy,
            "pending_batch": pending_state(pending),
            "step_record": self.checkpoints.record,
            "partial_rollouts": driver.partial.state_dict(),
        }

    def load_trainer_state(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        """Restore the loop's state from a checkpoint's trainer state of any format it reads (`state_format`)."""
        state = migrated(state, source)
        self.step = self.checkpoints.step = state["step"]
        self.ref_resets = state["ref_resets"]
        self.last_train_accuracy = state["last_train_accuracy"]
        if state["reset_schedule"]:
            self.reset_schedule.load_state_dict(state["reset_schedule"])
        if self.driver is not None:
            self.driver.prompts.load_state_dict(state["loader"])
            self.monitor.load_state_dict(state["monitor"])
            self.driver.anchor_state = state["anchor_cache"]
            self.driver.overlap.pending = load_pending(state["pending_batch"])
            self.checkpoints.record = state["step_record"]
            self.driver.partial.load_state_dict(state["partial_rollouts"], source)

    def reference_replaced(self) -> None:
        """π_ref was loaded from elsewhere (recovery mode) after the state was restored.

        A new reference version, and no anchors pooled under the old one.
        """
        self.ref_resets += 1
        if self.driver is not None:
            self.driver.anchor_state = None

    # ------------------------------------------------------------------ the loop
    @collective
    def run(
        self, save: Callable[[], None], logger: MetricsLogger | None = None, save_hf: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Train until ``train.steps``, with evaluations and checkpoints as configured.

        ``save()`` writes a checkpoint of the current state (all ranks), ``save_hf()`` the policy as
        an HF directory when ``checkpoint.save_hf`` says it is due. Returns the driver's metrics of
        the last step (evaluation included), {} on other ranks.
        """
        cfg, driver = self.cfg, self.driver
        save = collective(save, name="checkpoint")
        save_hf = None if save_hf is None else collective(save_hf, name="save_hf")
        last: dict[str, Any] = {}
        report = RunReport(cfg, logger, self.step) if self.is_driver else None
        if report is not None:
            self.checkpoints.log_if_lost(report.reporter, self.step)
        self.memory.park_trainer()  # engines generate from here on: the evaluation at step 0 too
        # a preemption signal also stops the reward calls in flight: a step stuck in a verifier ends
        stop_reward_calls = interrupt_calls if driver is None else driver.overlap.stop_reward_calls
        with (
            PreemptionHandler(on_signal=stop_reward_calls) as preemption,
            _calls_allowed_after(),
            contextlib.nullcontext() if driver is None else contextlib.closing(driver),  # the partial generator
        ):
            if driver is not None:
                driver.preemption = preemption
            if self.step == 0 and cfg.eval.every_steps:
                last = self._evaluate_start(logger)
            while self.step < cfg.train.steps:
                outcome = self._step(save, save_hf)
                if outcome is None:  # the signal stopped this step's rollout: nothing of it trained
                    if self.checkpoints.step != self.step:
                        with self._trainer_on_device():
                            save()
                        self.checkpoints.step = self.step
                    if report is not None:
                        report.close()
                    raise Preempted(
                        f"{signal_name(preemption.received)} during step {self.step + 1}, which stopped its reward "
                        f"calls and did not train: checkpoint of step {self.step} saved"
                    )
                last, saved = outcome
                if report is not None and driver is not None:  # the driver's
                    last = report.report(self.step, last, driver.anchors)
                if self.step < cfg.train.steps and any_rank(preemption.requested()):  # done: nothing to requeue
                    if not saved:
                        with self._trainer_on_device():
                            save()
                    if report is not None:
                        report.close()
                    raise Preempted(f"{signal_name(preemption.received)} at step {self.step}: checkpoint saved")
        if report is not None:
            report.close()
        return last if self.is_driver else {}

    @collective
    def _step(
        self, save: Callable[[], None], save_hf: Callable[[], None] | None = None
    ) -> tuple[dict[str, Any], bool] | None:
        """One ARMOR step on every rank: the paper's Algorithm 1.

        1. driver: per prompt, G−1 responses from π_old and one anchor from π_ref by rejection
           sampling (none verified: one more on-policy response); rewards; dynamic sampling;
           group advantages over each whole group, anchor included; broadcast to every rank
        2. lp_old and lp_ref (V_old with a critic), then the mixed-ratio DAPO update
        3. sync the new weights to the engines; the driver evaluates the policy when due
        4. every τ steps (the reset schedule) π_ref ← π_θ, in the trainer and the anchor source;
           checkpoint when due

        Returns (its metrics, identical on every rank, and whether it saved a checkpoint); None on
        every rank when a preemption signal stopped the driver's rollout (the driver's reward calls
        raised CallsInterrupted): the step trained nothing and its prompts go back to the loader.
        """
        report = StepReport(self._clock)
        self.memory.park_trainer()  # a no-op once `run` parked it
        # 1. the driver's groups: on-policy responses, anchors, rewards, advantages; to every rank
        batch, metrics = self.driver.step_batch(self.step, report) if self.driver is not None else (None, {})
        tensors = broadcast_tensors(batch, BATCH_TENSORS)
        if isinstance(tensors, str):  # STOPPED (`trainer.driver_rollout`)
            return None
        # 2. lp_old, lp_ref and the mixed-ratio DAPO update, the trainer on the device
        with report.update_window(), self._trainer_on_device(self._policy_release, REFERENCE_RELEASE, resume=False):
            if tensors is None:
                metrics["train/skipped_no_signal"] = 1.0  # every group had equal rewards
            else:
                metrics.update(self.update(tensors, report))
        self.step += 1
        # 3. the new weights to the engines (overlap: once the next step's batch, generated beside the update, is in)
        if self.driver is not None:
            self.driver.join_next(self.step, report)
        metrics.update(self.sync_weights(report))
        metrics.update(self._driver_evaluation(metrics, report))
        metrics = broadcast_object(metrics)
        # the guard judges the next updates with this step's engine-vs-trainer gap; rollbacks are
        # refused at --check (stability.max_rollbacks: 0) until the loop restores checkpoints
        self.actor.guard.observe_step(metrics)
        # 4. π_ref ← π_θ when the reset schedule says so (every τ steps; it may read the evaluation); checkpoint
        saved, reset = self._checkpoint_due(), self._reset_due(metrics)
        if saved or reset:
            with self._trainer_on_device():  # engines keep their weights
                if reset:
                    metrics.update(self.reset_reference(report))
                if saved:
                    self.checkpoints.save(save, self.step, metrics, report, self.is_driver)
        self._save_hf_if_due(save_hf, report)
        metrics.update(self._timing(report, tensors, metrics))
        return metrics, saved

    # ------------------------------------------------------------------ the step's phases
    @collective
    def update(self, batch: dict[str, Any], timer: StepTimer) -> dict[str, Any]:
        """The step's update on all ranks: log-probs, then the actor's (and critic's) updates.

        All ranks: recompute lp_old and lp_ref (and, with a critic, V_old and the GAE targets),
        then the mini-batch / epoch updates of the actor and the critic (`trainer.update_phase`).
        During the critic's warm-up (the first ``critic.warmup_steps`` steps) only the critic trains.
        """
        train_actor = self.critic is None or self.step >= self.cfg.critic.warmup_steps
        metrics = update_on_batch(batch, self.cfg, self.actor, self.reference, self.critic, train_actor, timer)
        metrics["train/tokens"] = float(batch["response_mask"].sum())
        return metrics

    @collective
    def sync_weights(self, timer: StepTimer) -> dict[str, float]:
        """All ranks: push the new policy to the engine (the driver talks to it); with adapter sync, its adapters.

        Colocated, the policy engines take their weights' memory back first, the weights stream from
        the trainer's host copy, and the KV cache and graphs come back after. With ``lora.sync:
        adapter`` the engines kept their base weights; only the adapters go (``sync/adapter_bytes``).
        """
        metrics: dict[str, float] = {}
        with timer.phase("weight_sync"):
            self.memory.resume_engines(tuple(t for t in self._policy_release if t not in KV_AND_GRAPHS), ())
            if self.adapter_sync is not None:
                metrics = self._sync_adapter()
            else:
                with self.memory.host_weights(self.actor), self.export_weights(self.actor) as export:
                    if self.driver is not None:
                        weights: WeightSource = export
                        if self.driver.anchors is not None:  # the anchor source keeps what it swaps back in
                            weights = self.driver.anchors.sampler.source.policy_weights_pushed(export)
                        self.driver.engine.update_weights(weights, f"step-{self.step}")
                    else:
                        export.drain()
            self.memory.after_push()
        return metrics

    def _sync_adapter(self) -> dict[str, float]:
        """With adapter sync, every rank: the actor's adapters gathered, loaded into the policy engines by the driver."""
        if self.adapter_sync is None:
            return {}
        with self.memory.host_weights(self.actor):
            engine = cast(AdapterEngine, self.driver.engine) if self.driver is not None else None
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
                if self.driver is not None and self.driver.anchors is not None:
                    self.driver.anchors.wait()
                    self.driver.anchors.sampler.source.reset(ref_weights, self._ref_version())
                    self.driver.anchors.reset(self._ref_version())
                ref_weights.drain()  # drives the export's collectives wherever nothing consumed it
            metrics = {"reference/reset": 1.0}
            if self.adapter_sync is not None:  # the merge changed the base: the policy engines get it, then B = 0
                engine = cast(AdapterEngine, self.driver.engine) if self.driver is not None else None
                self.adapter_sync.push_base(engine, f"step-{self.step}")
                metrics.update(self._sync_adapter())
        return metrics

    @collective
    @contextmanager
    def _trainer_on_device(
        self, policy: tuple[str, ...] = KV_AND_GRAPHS, reference: tuple[str, ...] = KV_AND_GRAPHS, resume: bool = True
    ) -> Iterator[None]:
        """Bring the trainer to the device for the block, with colocated engines released (`ColocatedMemory`)."""
        with self.memory.trainer_on_device(policy, reference, resume):
            yield

    def _checkpoint_due(self) -> bool:
        """Whether the step just trained saves a checkpoint: every ``checkpoint.every_steps``, and the last."""
        every = self.cfg.checkpoint.every_steps
        return bool(every and self.step % every == 0) or self.step == self.cfg.train.steps

    def _reset_due(self, step_metrics: dict[str, Any]) -> bool:
        """The schedule's decision (it may read this step's validation); asked once per step."""
        return self.reference is not None and self.reset_schedule.should_reset(self.step, step_metrics)

    def _save_hf_if_due(self, save_hf: Callable[[], None] | None, report: StepReport) -> None:
        """Every rank: the policy as an HF directory when ``checkpoint.save_hf`` says so, from the host copy if there."""
        if save_hf is not None and save_hf_due(self.cfg.checkpoint.save_hf, self.step, self.cfg.train.steps):
            with report.phase("save_hf"), self.memory.host_weights(self.actor):
                save_hf()

    def _driver_evaluation(self, metrics: dict[str, Any], report: StepReport) -> dict[str, Any]:
        """Driver, after the sync: this step's training accuracy noted, then its evaluation when due ({} elsewhere)."""
        if self.driver is None:
            return {}
        # the policy's own accuracy: anchors score 1 by construction
        train_acc = metrics.get("rollout/on_policy_accuracy", metrics.get("rollout/accuracy"))
        self.last_train_accuracy = self.last_train_accuracy if train_acc is None else train_acc
        if not (self.cfg.eval.every_steps and self.step % self.cfg.eval.every_steps == 0):
            return {}
        with report.phase("eval"):  # the policy of this step: its weights are in the engine
            return self.evaluate()

    def evaluate(self) -> dict[str, Any]:
        """Driver: avg@k / pass@k of the current policy on every eval set, and the over-optimisation monitor's gap."""
        if not self.eval_sets:
            return {}
        metrics = evaluate_during_training(
            driver_only(self.driver, "the policy engine").engine,
            self.encode,
            self.eval_sets,
            self.eval_sampling,
            self.cfg,
            self.step,
            sample_metrics=self.settings.sample_metrics,
            environment=self.settings.environment,
        )
        if "eval/mean/pass@1" in metrics and self.step > 0:  # the monitor compares with a trained step's accuracy
            gap, warning = self.monitor.update(self.last_train_accuracy, metrics["eval/mean/pass@1"])
            metrics.update(gap)
            if warning:
                print(f"[{self.cfg.name}] warning: {warning}", flush=True)
        return metrics

    @collective
    def _evaluate_start(self, logger: MetricsLogger | None) -> dict[str, Any]:
        """The evaluation before training (step 0); the reset schedule sees it on every rank."""
        start = self.evaluate() if self.is_driver else {}
        if logger:
            logger.log(0, start)
        self.reset_schedule.observe_start(broadcast_object(start))
        return start

    def _timing(self, report: StepReport, tensors: dict[str, Any] | None, metrics: dict[str, Any]) -> dict[str, float]:
        """Every rank: the step's time and throughput metrics (`trainer.step_report`; the peak memory is a collective)."""
        return report.metrics(
            arch=self.arch,
            lengths=None if tensors is None else tensors["lengths"],
            trained_tokens=metrics.get("train/tokens", 0.0),
            epochs=self.cfg.train.epochs_per_step,
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            peak_tflops=self.cfg.launch.gpu_peak_tflops,
            driver=self.is_driver,
            overlap=self.overlap,
        )


@contextlib.contextmanager
def _calls_allowed_after() -> Iterator[None]:
    """Reward calls, stopped by a preemption signal inside the block, are allowed again after it."""
    try:
        yield
    finally:
        allow_calls()
