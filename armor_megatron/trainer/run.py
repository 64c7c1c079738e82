"""Build a whole ARMOR run from a RunConfig on every rank, resume it if asked, and train.

``resume``: ``auto`` (the newest checkpoint in ``checkpoint.dir``), ``none``, a checkpoint path,
or ``force`` (auto, even when ``checkpoint.dir`` holds another run's checkpoints: see
``config.identity``). The driver records the run's config as ``<checkpoint.dir>/run_config.yaml``
and the HF config and tokenizer files of ``model.path`` as ``<checkpoint.dir>/hf_config/``.
A fresh start loads ``model.mcore_path`` or, without one, ``model.path`` directly (each rank its
own slices). ``checkpoint.save_hf`` writes the policy as HF directories (``trainer.hf_save``).

Called by ``armor-train`` inside each distributed process (torchrun / srun start them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from armor_megatron.algo import needs_critic
from armor_megatron.config.identity import check_run_identity, checkpoint_dir, write_run_record
from armor_megatron.config.schema import RunConfig
from armor_megatron.config.validate import model_arch_of
from armor_megatron.errors import MissingInputError
from armor_megatron.trainer import components
from armor_megatron.trainer.adapter_sync import AdapterSync
from armor_megatron.trainer.collectives import broadcast_object
from armor_megatron.trainer.hf_save import (
    export_unfinished,
    prune_hf,
    record_hf_files,
    remove_export_leftovers,
    save_hf,
)
from armor_megatron.trainer.loop import ArmorTrainer
from armor_megatron.trainer.metrics_log import MetricsLogger


def needs_reference(cfg: RunConfig) -> bool:
    """A trainer-side reference model is needed for the mixed ratio (α<1), the KL penalty or to source anchors."""
    return cfg.algorithm.alpha < 1.0 or cfg.algorithm.kl_loss.coef > 0 or cfg.anchor.enabled


def initial_weights(cfg: RunConfig) -> str:
    """Where a fresh run's weights come from.

    ``model.mcore_path`` (a torch_dist checkpoint) or else the HF directory ``model.path`` itself,
    from which every rank reads only its own TP/PP/EP slices (``megatron.hf_weights``): no converted
    copy is written.
    """
    return cfg.model.mcore_path or cfg.model.path


def train(cfg: RunConfig, resume: str | None = None) -> dict[str, Any]:
    """Run ``cfg`` in this process (one rank of the job); returns the driver's final metrics."""
    from armor_megatron.megatron import checkpoint as ckpt
    from armor_megatron.megatron import lora
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.dist import ParallelConfig, initialize
    from armor_megatron.megatron.lora import LoRAReference, LoRASettings, export_chunks
    from armor_megatron.megatron.reference import ReferenceModel
    from armor_megatron.megatron.trained_model import ModelSettings
    from armor_megatron.megatron.weight_export import HFWeightExport
    from armor_megatron.models.arch import load_hf_config
    from armor_megatron.models.tokenizer import load_tokenizer

    resume = resume or cfg.checkpoint.resume
    check_run_identity(cfg, resume)  # before any model is built: another run's checkpoint is refused
    if resume == "force":
        resume = "auto"
    if not os.path.isdir(cfg.model.path):  # its tokenizer (and, without model.mcore_path, its weights) load below
        raise MissingInputError(f"{cfg.model.path}: not a directory")
    arch = model_arch_of(cfg)
    if arch is None:
        raise MissingInputError(f"{cfg.model.path}: no config.json, and no model.arch, describes the model")
    parallel = ParallelConfig.from_run_config(cfg.parallelism)
    initialize(
        parallel,
        arch,
        seed=cfg.train.seed,
        deterministic=cfg.train.deterministic,
        timeout_minutes=cfg.train.collective_timeout_minutes,
    )
    components.release_engines_at_start(cfg)  # colocated: the engines' memory is free before any model is built
    # every model's weights are loaded below (a checkpoint or the initial weights); the critic's
    # value head keeps its own initialisation
    settings = ModelSettings.of(cfg, arch, parallel, init_weights=False)
    total_updates = cfg.train.steps * cfg.train.mini_batches_per_step * cfg.train.epochs_per_step
    actor = MegatronActor(
        settings,
        optimizer=cfg.optimizer,
        loss=components.loss_config(cfg),
        total_steps=total_updates,
        seed=cfg.train.seed,
        temperature=cfg.rollout.temperature,  # π_old and π_ref of the ratio are the sampling distributions
        loss_name=cfg.algorithm.policy_loss,
        stability=cfg.stability,
        lora=LoRASettings.of(cfg.lora, seed=cfg.train.seed),
    )
    critic = None
    if needs_critic(cfg.algorithm.estimator):
        from armor_megatron.megatron.critic import MegatronCritic

        critic = MegatronCritic(
            settings,
            optimizer=cfg.critic.optimizer,
            loss=components.value_loss_config(cfg),
            total_steps=total_updates,
            seed=cfg.train.seed,
            value_head_init_std=cfg.critic.value_head_init_std,
            stability=cfg.stability,
        )
    reference: ReferenceModel | LoRAReference | None = None
    if needs_reference(cfg) and actor.lora is not None:  # the actor's base, adapters off: no second model
        reference = LoRAReference(actor)
    elif needs_reference(cfg):
        reference = ReferenceModel(settings, offload=cfg.reference.offload, temperature=cfg.rollout.temperature)
    weights = initial_weights(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    hf_config = load_hf_config(cfg.model.path)
    make_engines = components.engine_factory(cfg, hf_config, tokenizer)
    adapter_sync = None
    if actor.lora is not None and cfg.lora.sync == "adapter":  # the engines get A and B, and the base after resets
        adapter_sync = AdapterSync(
            adapter=lambda: lora.peft_adapter_tensors(actor.model_chunks),
            config=lora.peft_adapter_config(actor.lora),
            base=lambda: HFWeightExport(lora.base_export_chunks(actor.model_chunks), arch),
        )
    trainer = ArmorTrainer(
        cfg,
        arch,
        actor,
        reference,
        tokenizer,
        make_engines,
        # each owner delivers its share; a LoRA reference exports the actor's base (`lora.export_chunks`)
        export_weights=lambda model: HFWeightExport(export_chunks(model), arch),
        critic=critic,
        adapter_sync=adapter_sync,
    )

    if os.path.isdir(checkpoint_dir(cfg)) and (not dist.is_initialized() or dist.get_rank() == 0):
        ckpt.remove_save_leftovers(checkpoint_dir(cfg))  # interrupted saves, whatever the resume mode
    path = ckpt.find_latest(checkpoint_dir(cfg)) if resume == "auto" else (None if resume == "none" else resume)
    if path:
        step, extra = ckpt.load_checkpoint(path, actor, reference, critic=critic)
        ckpt.adopt_as_latest(checkpoint_dir(cfg), path)
        trainer.load_trainer_state(broadcast_object(extra), source=path)
        _log(f"resumed from {path} at step {step}", cfg.name)
    else:
        actor.load_weights(weights)
        if reference is not None:
            reference.load_weights(weights)
        if critic is not None:  # the backbone; the value head keeps its initialisation
            critic.load_weights(weights)
    if reference is not None and cfg.reference.init_from and (not path or resume not in ("auto", None)):
        # Recovery mode: a degraded run restarts with the reference set to an earlier, better
        # checkpoint. Applied on a fresh start or an explicit --resume PATH, never on auto-resume
        # (the checkpoint then already holds the reference, resets included).
        reference.load_weights(cfg.reference.init_from)
        trainer.reference_replaced()
        _log(f"reference initialised from {cfg.reference.init_from}", cfg.name)
    if trainer.is_driver:
        write_run_record(cfg)  # this directory now belongs to this run (read by check_run_identity on resume)
        record_hf_files(cfg.model.path, checkpoint_dir(cfg))  # config + tokenizer for HF copies and armor-convert

    def save_hf_copy() -> None:
        path = save_hf(HFWeightExport(actor.model_chunks, arch), checkpoint_dir(cfg), trainer.step)
        if trainer.is_driver:
            prune_hf(checkpoint_dir(cfg), cfg.checkpoint.save_hf.keep_last)
            _log(f"policy of step {trainer.step} written as an HF model to {path}", cfg.name)

    if path:
        _finish_killed_export(cfg, trainer, save_hf_copy)
    trainer.start_engines()

    logger = None
    if trainer.is_driver:
        lg = cfg.logging
        logger = MetricsLogger(
            os.path.join(lg.dir, cfg.name),
            jsonl=lg.jsonl,
            tensorboard=lg.tensorboard,
            wandb_project=lg.wandb.project,
            wandb_entity=lg.wandb.entity,
            run_name=lg.wandb.name or cfg.name,
            resume_step=trainer.step if path else None,
            fresh_start=not path,
        )
        if logger.set_aside:
            _log(
                f"this run starts at step 0: the earlier metrics in {logger.log_dir} were moved to {logger.set_aside}",
                cfg.name,
            )

    def save() -> None:
        root = checkpoint_dir(cfg)
        ckpt.save_checkpoint(
            root, trainer.step, actor, reference, trainer.trainer_state() if trainer.is_driver else {}, critic=critic
        )
        if trainer.is_driver:
            ckpt.prune_checkpoints(root, cfg.checkpoint.keep_last)

    try:
        return trainer.run(save, logger, save_hf=save_hf_copy)
    finally:
        if logger is not None:
            logger.close()


def _finish_killed_export(cfg: RunConfig, trainer: ArmorTrainer, save_hf_copy: Callable[[], None]) -> None:
    """A resumed run writes the HF copy its checkpoint's step was due and lacks (the previous job died exporting it).

    Stale staging directories go first. Every rank calls it (the export is collective); the driver decides.
    """
    root = checkpoint_dir(cfg)
    unfinished = False
    if trainer.is_driver:
        remove_export_leftovers(root)
        unfinished = export_unfinished(cfg.checkpoint.save_hf, root, trainer.step, cfg.train.steps)
    if broadcast_object(unfinished):
        _log(f"the HF copy of step {trainer.step} was due but never finished: writing it now", cfg.name)
        save_hf_copy()


def _log(msg: str, name: str = "armor") -> None:
    """One line from rank 0, prefixed by the run's name (``[dapo] resumed from ...``)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{name}] {msg}", flush=True)
