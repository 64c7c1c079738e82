"""Checks that span several fields of a RunConfig (single-field checks sit on the fields)."""

from __future__ import annotations

import os

from armor_megatron.config.schema import RunConfig
from armor_megatron.config.typed import ConfigError
from armor_megatron.models.arch import ModelArch, ParallelismError, UnsupportedModelError, load_hf_config


def validate_run_config(cfg: RunConfig) -> None:
    _check_parallelism(cfg)
    _check_model_fits_parallelism(cfg)
    _check_lengths_fit_context(cfg)
    _check_rollout(cfg)
    _check_reference(cfg)
    _check_eval(cfg)
    _check_critic(cfg)
    _check_stability(cfg)


def model_arch_of(cfg: RunConfig) -> ModelArch | None:
    """The model description: from ``model.path``/config.json when present, else ``model.arch``, else None."""
    try:
        if os.path.isfile(os.path.join(cfg.model.path, "config.json")):
            return ModelArch.from_hf_config(load_hf_config(cfg.model.path))
        if cfg.model.arch:
            return ModelArch.from_hf_config(cfg.model.arch)
    except UnsupportedModelError as err:
        raise ConfigError("model", str(err)) from None
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError("model.arch", f"incomplete or invalid HF config ({err})") from None
    return None


def _check_parallelism(cfg: RunConfig) -> None:
    par = cfg.parallelism
    if par.sp and par.tp == 1:
        raise ConfigError("parallelism.sp", "sequence parallelism needs tp > 1")
    if par.cp > 1:
        raise ConfigError(
            "parallelism.cp",
            f"{par.cp}: context parallelism is not supported yet (the trainer does "
            "not split sequences over cp ranks); use cp: 1",
        )
    if par.vpp is not None and par.pp == 1:
        raise ConfigError("parallelism.vpp", "virtual pipeline chunks need pp > 1")
    launch = cfg.launch
    if launch.gpus_per_node:
        total = launch.nodes * launch.gpus_per_node
        if launch.engine_gpus >= total:
            raise ConfigError("launch.engine_gpus", f"{launch.engine_gpus} leaves no GPU for training out of {total}")
        trainer_gpus = total - launch.engine_gpus
        model_parallel = par.tp * par.pp * par.cp
        if trainer_gpus % model_parallel:
            raise ConfigError(
                "parallelism.tp",
                f"tp·pp·cp={model_parallel} does not divide the {trainer_gpus} trainer GPUs",
            )
        dp = trainer_gpus // model_parallel
        if (dp * par.tp) % par.ep:
            raise ConfigError("parallelism.ep", f"ep={par.ep} does not divide dp·tp={dp * par.tp}")


def _check_model_fits_parallelism(cfg: RunConfig) -> None:
    arch = model_arch_of(cfg)
    if arch is None:
        return
    par = cfg.parallelism
    try:
        arch.validate_parallelism(tp=par.tp, pp=par.pp * (par.vpp or 1), ep=par.ep)
    except ParallelismError as err:
        raise ConfigError(f"parallelism.{err.axis}", f"{err} (model {cfg.model.path})") from None
    if arch.is_moe and par.tp > 1 and not par.sp:
        raise ConfigError("parallelism.sp", "MoE training with tp > 1 needs sequence parallelism (sp: true)")


def _check_lengths_fit_context(cfg: RunConfig) -> None:
    """Prompt + response lengths must fit the model's context (``max_position_embeddings``).

    An engine refuses a longer request (SGLang 0.5.x answers HTTP 400 when prompt +
    ``max_new_tokens`` exceeds the context length), so every rollout, anchor and eval request
    would fail. Rollouts and anchors sample ``rollout.max_response_len`` tokens after a prompt of
    up to ``rollout.max_prompt_len``; evaluation samples ``eval.max_response_len`` after the same.
    The context is read from the model's config.json (or ``model.arch``); without one, or
    without the key there, nothing is checked (ModelArch's 4096 is a default, not a fact).
    """
    if os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        hf_config = load_hf_config(cfg.model.path)
    else:
        hf_config = cfg.model.arch or {}
    if not hf_config.get("max_position_embeddings"):
        return
    context, prompt = int(hf_config["max_position_embeddings"]), cfg.rollout.max_prompt_len
    for key, response in (
        ("rollout.max_response_len", cfg.rollout.max_response_len),  # on-policy rollouts and anchors
        ("eval.max_response_len", cfg.eval.max_response_len),
    ):
        if prompt + response > context:
            raise ConfigError(
                key,
                f"{response} + rollout.max_prompt_len={prompt} = {prompt + response} tokens exceed the model's "
                f"context of {context} (max_position_embeddings); the engine would refuse every such request",
            )


def _check_rollout(cfg: RunConfig) -> None:
    ro, anchor, algo = cfg.rollout, cfg.anchor, cfg.algorithm
    if anchor.enabled and anchor.pregenerate and anchor.source != "separate":
        raise ConfigError(
            "anchor.pregenerate",
            "needs anchor.source 'separate' (a swapped-in reference cannot sample in the background)",
        )
    if anchor.enabled and anchor.pregenerate and ro.engine == "sglang" and ro.sglang.placement == "colocated":
        raise ConfigError(
            "anchor.pregenerate",
            "colocated engines release their GPU memory while the trainer updates, "
            "so nothing samples in the background; use rollout.sglang.placement disaggregated",
        )
    if anchor.enabled and anchor.tries_per_request > anchor.max_tries:
        raise ConfigError(
            "anchor.tries_per_request", f"{anchor.tries_per_request} exceeds anchor.max_tries={anchor.max_tries}"
        )
    if anchor.enabled and anchor.temperature not in (None, ro.temperature) and algo.alpha < 1.0:
        raise ConfigError(
            "anchor.temperature",
            f"{anchor.temperature} differs from rollout.temperature={ro.temperature}: with alpha < 1 the "
            "mixed ratio reads π_ref at the rollout temperature, so anchors must be sampled at it",
        )
    if algo.overlong.enabled and algo.overlong.buffer_len >= ro.max_response_len:
        raise ConfigError(
            "algorithm.overlong.buffer_len",
            f"{algo.overlong.buffer_len} must be smaller than rollout.max_response_len={ro.max_response_len}",
        )
    if algo.eps_high < algo.eps_low:
        raise ConfigError(
            "algorithm.eps_high",
            f"{algo.eps_high} is below eps_low={algo.eps_low} (clip-higher needs eps_high >= eps_low)",
        )
    samples = ro.prompts_per_step * ro.group_size
    if samples % cfg.train.mini_batches_per_step:
        raise ConfigError(
            "train.mini_batches_per_step",
            f"{cfg.train.mini_batches_per_step} does not divide the {samples} samples of a step",
        )
    if ro.engine == "local" and ro.sglang.urls:
        raise ConfigError("rollout.sglang.urls", "set, but rollout.engine is 'local'")


def _check_reference(cfg: RunConfig) -> None:
    ref = cfg.reference
    if ref.reset == "validation_hook" and not ref.validation_hook:
        raise ConfigError("reference.validation_hook", "required when reference.reset is 'validation_hook'")
    if ref.reset == "validation_best" and cfg.eval.every_steps == 0:
        raise ConfigError("reference.reset", "'validation_best' needs periodic evaluation (eval.every_steps > 0)")


def _check_eval(cfg: RunConfig) -> None:
    largest_k = max(cfg.eval.pass_k, default=1)
    for i, ds in enumerate(cfg.eval.datasets):
        if ds.k < largest_k:
            raise ConfigError(f"eval.datasets[{i}].k", f"{ds.k} samples cannot give pass@{largest_k}")


def _check_critic(cfg: RunConfig) -> None:
    critic = cfg.critic
    if cfg.algorithm.estimator != "gae":
        return
    if critic.warmup_steps >= cfg.train.steps:
        raise ConfigError(
            "critic.warmup_steps", f"{critic.warmup_steps} leaves no actor update in train.steps={cfg.train.steps}"
        )
    if critic.optimizer.min_lr > critic.optimizer.lr:
        raise ConfigError(
            "critic.optimizer.min_lr", f"{critic.optimizer.min_lr} exceeds critic.optimizer.lr={critic.optimizer.lr}"
        )


def _check_stability(cfg: RunConfig) -> None:
    st = cfg.stability
    if st.min_history > st.window:
        raise ConfigError("stability.min_history", f"{st.min_history} exceeds stability.window={st.window}")
    if st.max_rollbacks > 0:
        raise ConfigError(
            "stability.max_rollbacks",
            "rolling back to the last good checkpoint is not available in the trainer yet; use 0 "
            "(the guard then stays at its lowest learning rate and clip range)",
        )
