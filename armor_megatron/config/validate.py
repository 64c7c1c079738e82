"""Checks that span several fields of a RunConfig (single-field checks sit on the fields)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from armor_megatron.algo.advantages import ADVANTAGE_ESTIMATORS, needs_critic
from armor_megatron.algo.loss import POLICY_LOSSES
from armor_megatron.algo.reset import RESET_SCHEDULES
from armor_megatron.config.schema import RunConfig
from armor_megatron.config.typed import ConfigError
from armor_megatron.data.token_budget import packed_capacity
from armor_megatron.models.arch import ModelArch, ParallelismError, UnsupportedModelError, load_hf_config
from armor_megatron.models.family import family_of
from armor_megatron.models.megatron_options import MoESettings
from armor_megatron.registry import Registry, RegistryEntry, config_value


def validate_run_config(cfg: RunConfig) -> None:
    """Check the settings of ``cfg`` against each other; one-line ConfigError naming the key otherwise."""
    _check_parallelism(cfg)
    _check_model_fits_parallelism(cfg)
    _check_partial(cfg)  # an unsupported combination first, before what one of its parts needs
    _check_lengths_fit_context(cfg)
    _check_token_budget(cfg)
    _check_rollout(cfg)
    _check_overlap(cfg)
    _check_reference(cfg)
    _check_eval(cfg)
    _check_critic(cfg)
    _check_policy_loss(cfg)
    _check_stability(cfg)
    _check_engines(cfg)
    _check_throughput(cfg)
    _check_moe(cfg)
    _check_lora(cfg)
    _check_step_time(cfg)
    _check_user_code(cfg)


def model_arch_of(cfg: RunConfig) -> ModelArch | None:
    """The model description: from ``model.path``/config.json when present, else ``model.arch``, else None.

    A ``model.arch`` given beside a config.json is checked too (it describes the model to build in
    tiny runs and may not be contradictory nonsense), whether or not the file exists yet.
    """
    source = hf_config_of(cfg)
    if source is None:
        return None
    if cfg.model.arch and source[1] != "model.arch":
        check_hf_config(cfg.model.arch, "model.arch")
        _arch_from(cfg.model.arch, "model.arch", "")
    return _arch_from(*source)


def _arch_from(hf_config: dict[str, Any], key: str, where: str) -> ModelArch:
    try:
        return ModelArch.from_hf_config(hf_config)
    except UnsupportedModelError as err:
        raise ConfigError("model", str(err)) from None
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(key, f"{where}incomplete or invalid HF config ({err})") from None


def hf_config_of(cfg: RunConfig) -> tuple[dict[str, Any], str, str] | None:
    """``(hf_config, key, where)`` from ``model.path``/config.json when present, else from ``model.arch``, else None.

    Its values are checked (:func:`check_hf_config`) so no ModelArch divides by zero.
    """
    config_file = os.path.join(cfg.model.path, "config.json")
    if os.path.isfile(config_file):
        try:
            hf_config = load_hf_config(cfg.model.path)
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ConfigError("model.path", f"{config_file}: unreadable ({str(err).splitlines()[0]})") from None
        if not isinstance(hf_config, dict):
            raise ConfigError("model.path", f"{config_file}: must hold a JSON object")
        source = (hf_config, "model.path", f"{config_file}: ")
    elif cfg.model.arch:
        source = (cfg.model.arch, "model.arch", "")
    else:
        return None
    check_hf_config(*source)
    return source


_POSITIVE_INTS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
_OPTIONAL_POSITIVE_INTS = (
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_OPTIONAL_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")


def check_hf_config(hf: dict[str, Any], key: str, where: str = "") -> None:
    """The sizes a model is built from: required ones positive integers, kv heads dividing the heads.

    ``key`` names the config key in errors (``model.arch`` -> ``model.arch.<field>``;
    ``model.path`` -> ``model.path`` with ``where`` naming the config.json file).
    """

    def bad(name: str, problem: str) -> ConfigError:
        if key == "model.arch":
            return ConfigError(f"model.arch.{name}", problem)
        return ConfigError(key, f"{where}{name}: {problem}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name in _POSITIVE_INTS + _OPTIONAL_POSITIVE_INTS:
        if name not in hf or (hf[name] is None and name in _OPTIONAL_POSITIVE_INTS):
            continue
        value = hf[name]
        if not is_int(value) or value < 1:
            raise bad(name, f"{value!r} must be a positive integer")
    for name in _OPTIONAL_POSITIVE_FLOATS:
        value = hf.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise bad(name, f"{value!r} must be a positive finite number")
    heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise bad("num_key_value_heads", f"{kv} does not divide num_attention_heads={heads}")
    hidden = hf.get("hidden_size")
    if heads and hidden and not hf.get("head_dim") and hidden % heads:
        raise bad("num_attention_heads", f"{heads} does not divide hidden_size={hidden} (and no head_dim is given)")
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    topk = hf.get("num_experts_per_tok")
    if experts and topk and topk > experts:
        raise bad("num_experts_per_tok", f"{topk} exceeds the {experts} experts")


def _check_parallelism(cfg: RunConfig) -> None:
    par = cfg.parallelism
    if par.sp and par.tp == 1:
        raise ConfigError("parallelism.sp", "sequence parallelism needs tp > 1")
    if par.vpp is not None and par.pp == 1:
        raise ConfigError("parallelism.vpp", "virtual pipeline chunks need pp > 1")
    launch = cfg.launch
    if launch.gpus_per_node:
        total = launch.nodes * launch.gpus_per_node
        if launch.engine_gpus >= total:
            raise ConfigError("launch.engine_gpus", f"{launch.engine_gpus} leaves no GPU for training out of {total}")
        trainer_gpus = total - launch.engine_gpus
        model_parallel = par.tp * par.pp
        if trainer_gpus % model_parallel:
            raise ConfigError(
                "parallelism.tp",
                f"tp·pp={model_parallel} does not divide the {trainer_gpus} trainer GPUs",
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
    train, chunk_layers = cfg.train, arch.num_layers // (par.pp * (par.vpp or 1))
    if train.recompute == "full" and train.recompute_method == "uniform" and chunk_layers % train.recompute_num_layers:
        raise ConfigError(
            "train.recompute_num_layers",
            f"{train.recompute_num_layers} does not divide the {chunk_layers} layers of a pipeline chunk "
            "(uniform recomputation groups them evenly)",
        )


def _check_lengths_fit_context(cfg: RunConfig) -> None:
    """Prompt + response lengths must fit the model's context (``max_position_embeddings``).

    An engine refuses a longer request (SGLang 0.5.x answers HTTP 400 when prompt +
    ``max_new_tokens`` exceeds the context length), so every rollout, anchor and eval request
    would fail. Rollouts and anchors sample ``rollout.max_response_len`` tokens after a prompt of
    up to ``rollout.max_prompt_len``; evaluation samples ``eval.max_response_len`` after the same
    (checked only with ``eval.datasets`` to sample). The context is read from the model's config.json (or ``model.arch``); without one, or
    without the key there, nothing is checked (ModelArch's 4096 is a default, not a fact).
    """
    source = hf_config_of(cfg)
    hf_config = source[0] if source else {}
    if not hf_config.get("max_position_embeddings"):
        return
    context, prompt = int(hf_config["max_position_embeddings"]), cfg.rollout.max_prompt_len
    lengths = [("rollout.max_response_len", cfg.rollout.max_response_len)]  # on-policy rollouts and anchors
    if cfg.eval.datasets:  # without one nothing samples eval.max_response_len tokens
        lengths.append(("eval.max_response_len", cfg.eval.max_response_len))
    for key, response in lengths:
        if prompt + response > context:
            raise ConfigError(
                key,
                f"{response} + rollout.max_prompt_len={prompt} = {prompt + response} tokens exceed the model's "
                f"context of {context} (max_position_embeddings); the engine would refuse every such request",
            )
    total = cfg.rollout.environment.max_total_tokens
    if cfg.rollout.environment.spec is not None and total is not None and total > context:
        raise ConfigError(
            "rollout.environment.max_total_tokens",
            f"{total} tokens exceed the model's context of {context} (max_position_embeddings)",
        )


def _check_token_budget(cfg: RunConfig) -> None:
    """A packed micro-batch holds whole rows.

    Each token budget must fit the longest train row, rollout.max_prompt_len +
    rollout.max_response_len tokens (under sequence parallelism within the budget rounded down to a
    multiple of tp, as packs are padded to one).
    """
    longest = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    multiple = cfg.parallelism.tp if cfg.parallelism.sp else 1
    train = cfg.train
    env = cfg.rollout.environment
    if env.spec is not None and (train.max_tokens_per_micro_batch or train.forward_max_tokens_per_micro_batch):
        if env.max_total_tokens is None:  # environment tokens would make rows of any length
            raise ConfigError(
                "rollout.environment.max_total_tokens",
                "must be set with token-budget micro-batches (train.max_tokens_per_micro_batch): it bounds a "
                "multi-turn row, environment tokens included",
            )
        longest = env.max_total_tokens
    for key, budget in (
        ("train.max_tokens_per_micro_batch", train.max_tokens_per_micro_batch),
        ("train.forward_max_tokens_per_micro_batch", train.forward_max_tokens_per_micro_batch),
    ):
        if budget is not None and packed_capacity(budget, multiple) < longest:
            row = (
                "rollout.environment.max_total_tokens"
                if env.spec is not None
                else ("rollout.max_prompt_len + rollout.max_response_len")
            )
            raise ConfigError(
                key,
                f"{budget} tokens cannot hold a row of {row} = {longest} "
                "tokens" + (f" (packs are padded to a multiple of tp={multiple})" if multiple > 1 else ""),
            )
    if train.forward_max_tokens_per_micro_batch is not None and train.max_tokens_per_micro_batch is None:
        raise ConfigError(
            "train.forward_max_tokens_per_micro_batch",
            "needs train.max_tokens_per_micro_batch (token-budget micro-batches are on for training and forwards "
            "together)",
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
            f"{algo.overlong.buffer_len} must be smaller than rollout.max_response_len={ro.max_response_len}: "
            f"set algorithm.overlong.buffer_len={max(1, ro.max_response_len // 4)} (DAPO shapes the last fifth to "
            "quarter of the limit) or algorithm.overlong.enabled=false",
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
    env = ro.environment
    if env.spec is not None and cfg.anchor.enabled and cfg.anchor.source == "swap":
        raise ConfigError(
            "anchor.source",
            "'swap' with rollout.environment would swap π_ref's weights in and out of the policy engine at every "
            "turn of the anchors' environment loop; use anchor.source: separate",
        )
    if env.spec is not None and env.max_total_tokens is not None and env.max_total_tokens <= ro.max_prompt_len:
        raise ConfigError(
            "rollout.environment.max_total_tokens",
            f"{env.max_total_tokens} leaves no room for a response after a prompt of rollout.max_prompt_len="
            f"{ro.max_prompt_len} tokens",
        )


def _check_overlap(cfg: RunConfig) -> None:
    """``rollout.overlap: one_step``'s requirements, all that are unmet in one message with the overrides to set."""
    ro = cfg.rollout
    if ro.overlap_forced_wait and ro.overlap != "one_step":
        raise ConfigError("rollout.overlap_forced_wait", "needs rollout.overlap: one_step")
    if ro.overlap != "one_step":
        return
    unmet: list[str] = []
    if not cfg.algorithm.tis.enabled:
        unmet.append(
            "algorithm.tis.enabled=true (samples come from weights one update behind π_old; only TIS's "
            "min(π_old/π_engine, C) corrects the loss for that)"
        )
    if cfg.anchor.enabled and cfg.anchor.pregenerate:
        unmet.append("anchor.pregenerate=false (one_step already samples the next batch's anchors during the update)")
    sg, launch = ro.sglang, cfg.launch
    if ro.engine == "sglang" and sg.placement == "colocated":
        unmet.append(
            "rollout.sglang.placement=disaggregated (colocated engines share the trainer's GPUs and cannot "
            "generate while it updates)"
        )
    if ro.engine == "sglang" and not sg.urls and launch.gpus_per_node:
        engines = sg.num_engines + launched_reference_engines(cfg)
        need, total = engines * sg.tp_per_engine, launch.nodes * launch.gpus_per_node
        if launch.engine_gpus != need:
            unmet.append(
                f"launch.engine_gpus={need} (the GPUs of {engines} engines x tp_per_engine {sg.tp_per_engine})"
            )
        if need >= total:
            unmet.append(
                f"GPUs left for training: the engines take {need} of the job's {total}; lower "
                f"rollout.sglang.num_engines (or anchor.reference_engines) or raise launch.nodes "
                f"(`armor-train --plan` suggests a split)"
            )
    if unmet:
        raise ConfigError("rollout.overlap", "one_step needs " + "; ".join(unmet))


def _check_partial(cfg: RunConfig) -> None:
    """``rollout.partial``: the combinations the partial generator does not support yet, refused by key."""
    ro = cfg.rollout
    if not ro.partial.enabled:
        return
    if ro.engine != "sglang":
        raise ConfigError(
            "rollout.partial.enabled",
            f"needs rollout.engine sglang (the {ro.engine!r} engine cannot abort a request and keep its tokens)",
        )
    if ro.environment.spec is not None:
        raise ConfigError(
            "rollout.partial.enabled",
            "not supported with rollout.environment (multi-turn responses are not aborted and continued yet)",
        )
    if ro.overlap != "off":
        raise ConfigError(
            "rollout.partial.enabled",
            f"not supported with rollout.overlap {ro.overlap!r} (requests in flight across the update are not "
            "kept yet); set rollout.overlap=off",
        )
    if cfg.anchor.enabled and cfg.anchor.pregenerate:
        raise ConfigError(
            "rollout.partial.enabled",
            "not supported with anchor.pregenerate (a partial step looks its groups' anchors up at its start, "
            "for the rows it may start); set anchor.pregenerate=false",
        )


def registered_variant(section_key: str, section: Any, key: str, registry: Registry) -> RegistryEntry:
    """The registry entry ``<section_key>.<key>`` names, its config keys checked.

    The registry entry that ``<section_key>.<key>`` names (the field's own check has refused an
    unknown name), after checking its config keys: each is a key of the section, and one that
    supplies a parameter without a default is set.
    """
    name = getattr(section, key)
    entry = registry.entry(name)
    for param, config_key in entry.config_keys.items():
        if not _is_config_key(section, config_key):
            raise ConfigError(
                f"{section_key}.{key}",
                f"{registry.kind} {name!r} takes {param} from {section_key}.{config_key}, which is not a config key",
            )
        if config_value(section, config_key) is None and entry.required(param):
            raise ConfigError(f"{section_key}.{config_key}", f"required when {section_key}.{key} is {name!r}")
    return entry


def _is_config_key(section: Any, key: str) -> bool:
    """``key`` (dotted through subsections: ``kl_loss.coef``) names a field of the config ``section``."""
    for part in key.split("."):
        if not dataclasses.is_dataclass(section) or part not in {f.name for f in dataclasses.fields(section)}:
            return False
        section = getattr(section, part)
    return True


def _check_reference(cfg: RunConfig) -> None:
    ref = cfg.reference
    schedule = registered_variant("reference", ref, "reset", RESET_SCHEDULES)
    if schedule.meta["needs_eval"] and cfg.eval.every_steps == 0:
        raise ConfigError("reference.reset", f"{ref.reset!r} needs periodic evaluation (eval.every_steps > 0)")


def _check_eval(cfg: RunConfig) -> None:
    largest_k = max(cfg.eval.pass_k, default=1)
    for i, ds in enumerate(cfg.eval.datasets):
        if ds.k < largest_k:
            raise ConfigError(f"eval.datasets[{i}].k", f"{ds.k} samples cannot give pass@{largest_k}")


def _check_critic(cfg: RunConfig) -> None:
    critic = cfg.critic
    registered_variant("algorithm", cfg.algorithm, "estimator", ADVANTAGE_ESTIMATORS)
    if not needs_critic(cfg.algorithm.estimator):
        return
    if critic.warmup_steps >= cfg.train.steps:
        raise ConfigError(
            "critic.warmup_steps", f"{critic.warmup_steps} leaves no actor update in train.steps={cfg.train.steps}"
        )
    if critic.optimizer.min_lr > critic.optimizer.lr:
        raise ConfigError(
            "critic.optimizer.min_lr", f"{critic.optimizer.min_lr} exceeds critic.optimizer.lr={critic.optimizer.lr}"
        )


def _check_policy_loss(cfg: RunConfig) -> None:
    registered_variant("algorithm", cfg.algorithm, "policy_loss", POLICY_LOSSES)
    kl = cfg.algorithm.kl_loss
    if kl.coef > 0 and cfg.algorithm.alpha < 1.0 and not kl.with_mixed_ratio:
        raise ConfigError(
            "algorithm.kl_loss.coef",
            f"a KL penalty on top of the mixed ratio (algorithm.alpha={cfg.algorithm.alpha} < 1) regularises "
            "toward π_ref twice; set algorithm.alpha: 1.0, or algorithm.kl_loss.with_mixed_ratio: true to mean it",
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


def _check_engines(cfg: RunConfig) -> None:
    """Engine settings the launcher or the engines would refuse only once the job runs."""
    ro, sg, anchor, launch = cfg.rollout, cfg.rollout.sglang, cfg.anchor, cfg.launch
    if anchor.enabled and anchor.source == "swap" and anchor.reference_urls:
        raise ConfigError(
            "anchor.reference_urls",
            "set, but anchor.source is 'swap' (the reference is swapped into the policy engines); "
            "use anchor.source separate to sample anchors from those servers",
        )
    if ro.engine != "sglang":
        return
    if sg.host in ALL_INTERFACES and not sg.api_key and not sg.allow_unauthenticated and not sg.urls:
        raise ConfigError(
            "rollout.sglang.host",
            f"{sg.host} exposes the engines (generation and weight updates) to the whole network without "
            "rollout.sglang.api_key; set one, or rollout.sglang.allow_unauthenticated: true on a trusted network",
        )
    if sg.router.enabled and sg.router.host in ALL_INTERFACES and not sg.api_key and not sg.allow_unauthenticated:
        raise ConfigError(
            "rollout.sglang.router.host",
            f"{sg.router.host} exposes the routers (generation on every engine) to the whole network without "
            "rollout.sglang.api_key; set one, or rollout.sglang.allow_unauthenticated: true on a trusted network",
        )
    if sg.weight_sync == "distributed" and sg.placement == "colocated":
        raise ConfigError(
            "rollout.sglang.weight_sync",
            "distributed puts the driver and the engines in one NCCL group, which cannot hold two ranks on one "
            "GPU as colocated engines do: use tensor (single node) or disk, or placement disaggregated",
        )
    if sg.urls:
        return
    gpn, t = launch.gpus_per_node, sg.tp_per_engine
    n = sg.num_engines + launched_reference_engines(cfg)
    groups = f" ({sg.num_engines} policy + {n - sg.num_engines} reference)" if n > sg.num_engines else ""
    if gpn == 0:
        raise ConfigError(
            "rollout.engine",
            "sglang launches engines on GPUs, but launch.gpus_per_node=0 (use rollout.engine local on CPU, "
            "or give rollout.sglang.urls of running servers)",
        )
    if gpn % t:
        raise ConfigError(
            "rollout.sglang.tp_per_engine",
            f"{t} does not divide launch.gpus_per_node={gpn} (an engine stays on one node)",
        )
    total = launch.nodes * gpn
    if sg.placement == "colocated":
        if launch.engine_gpus:
            raise ConfigError(
                "launch.engine_gpus",
                f"{launch.engine_gpus} reserves GPUs, but rollout.sglang.placement is colocated "
                "(engines share the trainer's GPUs); set it to 0 or use placement disaggregated",
            )
        if n * t > total:
            raise ConfigError(
                "rollout.sglang.num_engines",
                f"{n} engines{groups} x tp_per_engine {t} need {n * t} GPUs, the job has {total} "
                f"(launch.nodes={launch.nodes} x gpus_per_node={gpn})",
            )
    elif launch.engine_gpus != n * t:
        raise ConfigError(
            "launch.engine_gpus",
            f"{launch.engine_gpus}, but disaggregated engines need {n}{groups} x tp_per_engine {t} = {n * t} GPUs",
        )


def _check_throughput(cfg: RunConfig) -> None:
    """CUDA-only kernels on a CPU run (``launch.gpus_per_node: 0``) or TE-only ones with the local spec.

    Whether the job's machines have APEX / Transformer Engine is checked when the models are built.
    """
    th, cpu_run, local = cfg.throughput, cfg.launch.gpus_per_node == 0, cfg.model.spec == "local"
    if th.gradient_accumulation_fusion and cpu_run:
        raise ConfigError(
            "throughput.gradient_accumulation_fusion", "needs CUDA (APEX's fused kernel), but launch.gpus_per_node=0"
        )
    for key in ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion"):
        if getattr(th, key) and (cpu_run or local):
            where = "launch.gpus_per_node=0" if cpu_run else "model.spec is local"
            raise ConfigError(f"throughput.{key}", f"needs the Transformer Engine spec (GPU), but {where}")
    if th.overlap_param_gather:
        if cpu_run:
            raise ConfigError(
                "throughput.overlap_param_gather",
                "needs the distributed optimizer, which CPU runs do not use (launch.gpus_per_node=0)",
            )
        if not th.overlap_grad_reduce:
            raise ConfigError("throughput.overlap_param_gather", "needs throughput.overlap_grad_reduce: true")
        raise ConfigError(
            "throughput.overlap_param_gather",
            "not supported yet: after an update the trainer reads parameters outside forward (weight sync to "
            "the engines, reference reset, checkpoints) before the deferred all-gather has run; use false",
        )
    arch = model_arch_of(cfg)
    refused = family_of(arch).megatron(arch).fused_rope_refused if arch is not None else None
    if th.apply_rope_fusion and refused:
        raise ConfigError("throughput.apply_rope_fusion", f"{refused}; use null")


def _check_moe(cfg: RunConfig) -> None:
    """MoE settings megatron, the trainer or the job's layout refuse (for MoE models; see MoESettings)."""
    moe, par = cfg.moe, cfg.parallelism
    arch = model_arch_of(cfg)
    if arch is not None and not arch.is_moe:
        return
    settings = MoESettings.of(moe)
    if arch is not None:
        problem = settings.trainer_problem(arch)
        if problem:
            raise ConfigError("moe.load_balancing_type", problem.split(" ", 1)[1])
    if moe.expert_capacity_factor is not None and moe.load_balancing_type == "sinkhorn":
        raise ConfigError("moe.expert_capacity_factor", "does not work with load_balancing_type sinkhorn")
    if moe.pad_expert_input_to_capacity and moe.expert_capacity_factor is None:
        raise ConfigError("moe.pad_expert_input_to_capacity", "needs moe.expert_capacity_factor")
    if moe.token_dispatcher_type == "allgather" and (par.ep > 1 or par.pp > 1):
        raise ConfigError(
            "moe.token_dispatcher_type",
            f"allgather needs one token count on every expert-parallel rank and fixed pipeline shapes, but the "
            f"trainer pads each micro-batch to its own length (ep={par.ep}, pp={par.pp}); use alltoall",
        )
    if moe.token_dispatcher_type == "flex":
        if cfg.launch.gpus_per_node == 0:
            raise ConfigError("moe.token_dispatcher_type", "flex needs DeepEP on GPUs, but launch.gpus_per_node=0")
        if moe.pad_expert_input_to_capacity:
            raise ConfigError("moe.pad_expert_input_to_capacity", "is not supported by the flex (DeepEP) dispatcher")


def _check_lora(cfg: RunConfig) -> None:
    """Layouts the actor's adapters (``megatron.lora``) cannot be built on, each refused in one line."""
    lora = cfg.lora
    if not lora.enabled:
        if lora.sync == "adapter":
            raise ConfigError("lora.sync", "adapter sends the adapters of lora.enabled: true, which is off")
        return
    if cfg.model.spec == "te":
        raise ConfigError(
            "model.spec", "lora needs the local layer spec: the TE spec fuses the norms into the linears it adapts"
        )
    if cfg.parallelism.sp:
        raise ConfigError("parallelism.sp", "lora does not support sequence parallelism (it needs the TE spec)")
    if lora.dropout > 0 and cfg.parallelism.tp > 1:
        raise ConfigError("lora.dropout", "dropout > 0 needs tp = 1 (tensor-parallel ranks would drop differently)")
    if cfg.reference.init_from:
        raise ConfigError("reference.init_from", "with lora the reference is the actor's base weights; unset it")
    if cfg.reference.offload:
        raise ConfigError("reference.offload", "with lora the reference is the actor's own base: nothing to offload")
    _check_lora_sync(cfg)
    arch = model_arch_of(cfg)
    if arch is None:
        return
    if arch.is_mla:
        raise ConfigError("lora.enabled", "lora does not support MLA attention (DeepSeek): it has no linear_qkv")
    experts = [t for t in lora.target_modules if t in ("linear_fc1", "linear_fc2")]
    if arch.is_moe and experts:
        raise ConfigError(
            "lora.target_modules", f"{experts[0]} of an MoE model is its experts, which get no adapters; drop it"
        )


def _check_lora_sync(cfg: RunConfig) -> None:
    """``lora.sync: adapter``: what SGLang 0.5.23's run-time adapters take (`rollout.sglang.lora_adapters`)."""
    if cfg.lora.sync != "adapter":
        return
    if cfg.rollout.engine != "sglang":
        raise ConfigError(
            "lora.sync", f"adapter loads A and B into SGLang servers; rollout.engine is {cfg.rollout.engine!r}"
        )
    if cfg.rollout.partial.enabled:
        raise ConfigError(
            "lora.sync", "adapter does not work with rollout.partial (its requests do not name the adapter); use merged"
        )


def _check_step_time(cfg: RunConfig) -> None:
    """``--plan``'s step-time model needs a mean response of at least one token."""
    fraction, longest = cfg.launch.step_time.response_len_fraction, cfg.rollout.max_response_len
    if fraction * longest < 1:
        raise ConfigError(
            "launch.step_time.response_len_fraction",
            f"{fraction:g} x rollout.max_response_len {longest} is under one token per response",
        )


ALL_INTERFACES = ("0.0.0.0", "::", "")


def launched_reference_engines(cfg: RunConfig) -> int:
    """Reference-group servers a job launches: anchors from a separate frozen π_ref, no URLs given."""
    anchor, sg = cfg.anchor, cfg.rollout.sglang
    launches = cfg.rollout.engine == "sglang" and not sg.urls and anchor.enabled and anchor.source == "separate"
    return anchor.reference_engines if launches and not anchor.reference_urls else 0


def _check_user_code(cfg: RunConfig) -> None:
    """``reward.verifier`` must name a registered verifier or import as ``module:function``; so must ``reward.verifiers``.

    So must ``reference.validation_hook`` when the reset schedule reads it (the trainer would fail
    on its first step).
    """
    from armor_megatron.algo.reset import load_callable
    from armor_megatron.rewards.registry import load_verifier

    try:
        load_verifier(cfg.reward.verifier)
    except ValueError as err:  # VerifierSpecError
        raise ConfigError("reward.verifier", str(err).splitlines()[0]) from None
    for i, spec in enumerate(cfg.reward.verifiers):
        try:
            load_verifier(spec)
        except ValueError as err:
            raise ConfigError(f"reward.verifiers[{i}]", str(err).splitlines()[0]) from None
    hook = cfg.reference.validation_hook
    if hook and "validation_hook" in RESET_SCHEDULES.entry(cfg.reference.reset).config_keys.values():
        try:
            load_callable(hook)
        except ValueError as err:
            raise ConfigError("reference.validation_hook", str(err).splitlines()[0]) from None
    if cfg.logging.sample_metrics:
        try:
            load_callable(cfg.logging.sample_metrics)
        except ValueError as err:
            raise ConfigError("logging.sample_metrics", str(err).splitlines()[0]) from None
    if cfg.rollout.environment.spec is not None:
        from armor_megatron.rewards.spec import import_callable

        try:
            import_callable(cfg.rollout.environment.spec)
        except ValueError as err:  # VerifierSpecError, whose words fit a verifier
            raise ConfigError(
                "rollout.environment.spec", str(err).splitlines()[0].replace("verifier spec ", "", 1)
            ) from None
