"""Turn a RunConfig into the pieces the loop uses.

Losses, reset schedule, sampling, rollout settings, the training and evaluation prompts and the
rollout engine factories (the anchor side: `armor_megatron.rollout.anchor.build`). Nothing here
runs a step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from armor_megatron.algo import ADVANTAGE_ESTIMATORS, RESET_SCHEDULES, PolicyLossConfig, ResetSchedule, ValueLossConfig
from armor_megatron.algo.loss import POLICY_LOSSES
from armor_megatron.algo.reset import load_callable
from armor_megatron.config.identity import checkpoint_dir
from armor_megatron.config.schema import ROLLOUT_ENGINES, RunConfig
from armor_megatron.config.validate import hf_config_of
from armor_megatron.data.prompts import PromptDataset
from armor_megatron.errors import DatasetError
from armor_megatron.rewards import scorable
from armor_megatron.rewards.isolated import calls_interrupted
from armor_megatron.rollout.engine import RolloutEngine, SamplingParams, WeightSource
from armor_megatron.rollout.multiturn import EnvironmentSettings, MultiTurnRollout
from armor_megatron.rollout.partial import PartialBuffer
from armor_megatron.rollout.partial_generation import PartialGenerator
from armor_megatron.trainer.collaborators import EngineFactory
from armor_megatron.trainer.evaluation import EvalSet
from armor_megatron.trainer.rollout_phase import RolloutSettings


def loss_config(cfg: RunConfig) -> PolicyLossConfig:
    """The hyper-parameters of the registered policy loss ``algorithm.policy_loss``, from the keys it declares."""
    config: PolicyLossConfig = POLICY_LOSSES.configure(cfg.algorithm.policy_loss, cfg.algorithm)
    return config


def value_loss_config(cfg: RunConfig) -> ValueLossConfig:
    """The critic's loss: its value clip, aggregated like the policy loss."""
    return ValueLossConfig(clip_eps=cfg.critic.clip_eps, loss_agg=cfg.algorithm.loss_agg)


def partial_generator(cfg: RunConfig, engine: RolloutEngine, sampling: SamplingParams) -> PartialGenerator:
    """``rollout.partial``'s generator over the policy engine's SGLang servers (each request to one server, by rid)."""
    from armor_megatron.rollout.sglang.engine import SGLangEngine, sglang_sampling_params

    if not isinstance(engine, SGLangEngine):
        raise TypeError(f"rollout.partial needs SGLang engines, got {type(engine).__name__}")
    params = sglang_sampling_params(sampling, 1)
    if not isinstance(params, dict):  # no seed was asked for: one dict
        raise TypeError("per-sample sampling params for partial rollouts")
    part = cfg.rollout.partial
    return PartialGenerator(
        engine.workers,
        params,
        PartialBuffer(part.max_versions, part.stale),
        over_provision=part.over_provision,
        timeout=cfg.rollout.sglang.request_timeout_s,
        seed=cfg.rollout.seed if engine.deterministic else None,  # a seed per request, as the engine sends them
        stop=calls_interrupted,  # the preemption signal: abort what is in flight, keep its tokens
    )


def reset_schedule(cfg: RunConfig) -> ResetSchedule:
    """The registered reset schedule ``reference.reset``, built from the ``reference`` keys it takes."""
    schedule: ResetSchedule = RESET_SCHEDULES.call_configured(cfg.reference.reset, cfg.reference)
    return schedule


def rollout_sampling(cfg: RunConfig, eos_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The sampling parameters of training rollouts."""
    ro = cfg.rollout
    # No per-request seed: every request must draw fresh samples; the loop reseeds the engines
    # at each step from rollout.seed and the step, so runs are reproducible and resumable.
    return SamplingParams(
        max_new_tokens=ro.max_response_len,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        stop_token_ids=eos_ids,
    )


def eval_sampling(cfg: RunConfig, eos_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The sampling parameters of evaluation."""
    ev = cfg.eval
    return SamplingParams(
        max_new_tokens=ev.max_response_len,
        temperature=ev.temperature,
        top_p=ev.top_p,
        stop_token_ids=eos_ids,
        seed=cfg.rollout.seed,
    )


def rollout_settings(
    cfg: RunConfig, sampling: SamplingParams, vocab_size: int | None = None, tokenizer: Any = None
) -> RolloutSettings:
    """The rollout phase's settings: group size, sampling, advantage estimator and its parameters.

    ``vocab_size``: the model's, which every sampled token id must lie below. ``tokenizer``: the
    model's, which tokenises a multi-turn run's observations (``rollout.environment``).
    """
    algo = cfg.algorithm
    return RolloutSettings(
        group_size=cfg.rollout.group_size,
        sampling=sampling,
        estimator=algo.estimator,
        estimator_kwargs=ADVANTAGE_ESTIMATORS.entry(algo.estimator).config_kwargs(algo),
        verifier=cfg.reward.verifier,
        anchor_success_reward=cfg.anchor.success_reward,
        overlong_buffer=algo.overlong.buffer_len if algo.overlong.enabled else None,
        overlong_penalty=algo.overlong.penalty,
        reward_workers=cfg.reward.workers,
        timeout=cfg.rollout.sglang.request_timeout_s if cfg.rollout.engine == "sglang" else None,
        vocab_size=vocab_size,
        sample_metrics=load_callable(cfg.logging.sample_metrics) if cfg.logging.sample_metrics else None,
        environment=multi_turn_rollout(cfg, tokenizer),
    )


def training_prompts(cfg: RunConfig, encode: Callable[[Any], list[int]]) -> PromptDataset:
    """The training set without the prompts longer than ``rollout.max_prompt_len`` tokens.

    Lengths count the tokens as ``encode`` gives them to the engine (chat and prompt templates
    applied). The long prompts are left out once, up front, with a count in the log.
    """
    data, limit = cfg.data, cfg.rollout.max_prompt_len
    dataset = scorable(
        PromptDataset(data.train_path, data.prompt_key, data.answer_key, data.type_key),
        cfg.reward.verifier,
        cfg.reward.verifiers,
    )
    total = len(dataset)
    dropped = dataset.keep(lambda row: len(encode(row.prompt)) <= limit)
    if not len(dataset):
        raise DatasetError(
            f"{data.train_path}: all {total} prompts are longer than rollout.max_prompt_len={limit} tokens"
        )
    if dropped:
        print(
            f"[{cfg.name}] {data.train_path}: {dropped} of {total} prompts are longer than "
            f"rollout.max_prompt_len={limit} tokens; left out",
            flush=True,
        )
    return dataset


def eval_sets(cfg: RunConfig) -> list[EvalSet]:
    """The evaluation sets of ``eval.datasets``, each with its k (keys a dataset leaves out: ``data``'s)."""
    data = cfg.data
    return [
        EvalSet(
            d.name,
            scorable(
                PromptDataset(d.path, d.prompt_key or data.prompt_key, d.answer_key or data.answer_key, data.type_key),
                cfg.reward.verifier,
                cfg.reward.verifiers,
            ),
            d.k,
        )
        for d in cfg.eval.datasets
    ]


def multi_turn_rollout(cfg: RunConfig, tokenizer: Any) -> MultiTurnRollout | None:
    """The environment loop of ``rollout.environment`` (None without a spec); observations tokenised by ``tokenizer``."""
    env = cfg.rollout.environment
    if env.spec is None:
        return None
    if tokenizer is None:
        raise ValueError("rollout.environment needs the model's tokenizer to tokenise observations")
    source = hf_config_of(cfg)  # unset, the total is bounded by the model's context
    context = (source[0] if source else {}).get("max_position_embeddings")
    settings = EnvironmentSettings(
        spec=env.spec,
        max_turns=env.max_turns,
        tool_timeout_s=env.tool_timeout_s,
        max_total_tokens=env.max_total_tokens or (int(context) if context else None),
        max_turn_tokens=env.max_turn_tokens,
        stop=tuple(env.stop),
    )
    return MultiTurnRollout(settings, lambda text: tokenizer.encode(text, add_special_tokens=False))


# ----------------------------------------------------------------------------- engines
def engine_factory(cfg: RunConfig, hf_config: dict[str, Any], tokenizer: Any) -> EngineFactory:
    """A factory of the policy and reference engines the config asks for.

    ``make(policy_weights, reference_weights, *, policy_version, reference_version) ->
    (policy_engine, reference_engine or None)``, called once on the driver, from the rollout engine
    registered as ``rollout.engine`` (`config.schema.ROLLOUT_ENGINES`): the local transformers
    engine (``local``), clients of SGLang servers (``sglang``) or a plugin's.
    """
    factory: EngineFactory = ROLLOUT_ENGINES.call(cfg.rollout.engine, cfg, hf_config, tokenizer)
    return factory


def make_local_engines(cfg: RunConfig, hf_config: dict[str, Any], tokenizer: Any) -> EngineFactory:
    """Driver-side engine factory for CPU runs.

    The in-process transformers engine, twice when the reference samples anchors from its own
    engine.
    """
    from armor_megatron.rollout.local import LocalEngine

    def make(
        policy: WeightSource,
        reference: WeightSource | None,
        *,
        policy_version: str,
        reference_version: str,
    ) -> tuple[RolloutEngine, RolloutEngine | None]:
        policy_engine = LocalEngine(
            hf_config,
            policy,
            tokenizer=tokenizer,
            weight_version=policy_version,
            seed=cfg.rollout.seed,
            device=cfg.rollout.local_device,
        )
        reference_engine = None
        if reference is not None and cfg.anchor.enabled and cfg.anchor.source == "separate":
            reference_engine = LocalEngine(
                hf_config,
                reference,
                tokenizer=tokenizer,
                weight_version=reference_version,
                seed=cfg.rollout.seed + 1,
                device=cfg.rollout.local_device,
            )
        return policy_engine, reference_engine

    return make


def release_engines_at_start(cfg: RunConfig) -> None:
    """Colocated SGLang engines give back all their device memory before the trainer is built.

    Every rank calls it, before building any model: the driver asks every engine the job launched
    (``rollout.sglang.urls``, ``anchor.reference_urls``) to release weights, KV cache and CUDA graphs,
    the others wait at a barrier. The engines started with ``mem_fraction_static`` of each GPU
    (and their graphs); building the actor, reference and critic beside that does not fit a 7B
    model on one 80 GB GPU. The first weight push (`ArmorTrainer.start_engines`) then follows a
    step's order: weights resumed, pushed from the trainer's host copy, KV cache and graphs resumed.
    slime does the same (slime/ray/placement_group.py, ``create_rollout_manager``: ``offload`` right
    after the engines are created). A no-op unless the engines are SGLang's, colocated.
    """
    import torch.distributed as dist

    from armor_megatron.trainer.collectives import barrier

    sg = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang" or sg.placement != "colocated":
        return
    if not dist.is_initialized() or dist.get_rank() == 0:
        from armor_megatron.launch.plan import API_KEY_ENV
        from armor_megatron.rollout.sglang.engine import SGLangEngine

        api_key = sg.api_key or os.environ.get(API_KEY_ENV)
        groups = [sg.urls] + ([cfg.anchor.reference_urls] if cfg.anchor.reference_urls else [])
        for urls in groups:
            engine = SGLangEngine(urls, api_key=api_key, request_timeout=sg.request_timeout_s, weight_version="start")
            try:
                engine.release_memory()  # every tag: the first push brings the weights back
            finally:
                engine.shutdown()
    barrier()


def make_sglang_engines(cfg: RunConfig, hf_config: dict[str, Any], tokenizer: Any = None) -> EngineFactory:
    """Driver-side engine factory for GPU runs (``tokenizer`` is unused: the servers load the model's own).

    Clients of the SGLang servers the launcher started (``rollout.sglang.urls``) and, for anchors
    from a separate group, of ``anchor.reference_urls``.

    With ``rollout.sglang.router.enabled`` each group gets its own ``sglang-router`` process on
    this node (the policy group's on ``router.port``, the reference group's on ``port + 1``; 0:
    free ports), started before the engine client and stopped by its ``shutdown``: generation
    goes through it, weight sync and memory release to each engine directly. Colocated, the
    routers run without health checks (an engine whose memory is released must get no request).
    """
    from armor_megatron.rollout.sglang.client import RetryPolicy
    from armor_megatron.rollout.sglang.engine import SGLangEngine
    from armor_megatron.rollout.sglang.router import SGLangRouter
    from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig

    sg = cfg.rollout.sglang
    colocated = sg.placement == "colocated"
    disk_root = sg.disk_dir or os.path.join(checkpoint_dir(cfg), "engine_weights")
    api_key = sg.api_key  # load_config takes $ARMOR_ENGINE_API_KEY, how the SLURM plan hands it over

    def router(urls: Sequence[str], group: str) -> SGLangRouter | None:
        rc = sg.router
        if not rc.enabled:
            return None
        log_dir = os.path.join(cfg.logging.dir, cfg.name)  # beside the run's metrics.jsonl
        os.makedirs(log_dir, exist_ok=True)
        return SGLangRouter(
            urls,
            host=rc.host,
            port=rc.port + (group == "reference") if rc.port else 0,
            policy=rc.policy,
            api_key=api_key,
            health_check_interval_s=rc.health_check_interval_s,
            health_failure_threshold=rc.health_failure_threshold,
            health_check=sg.placement != "colocated",  # its /health probes must not reach released engines
            request_timeout=sg.request_timeout_s,
            startup_timeout=rc.startup_timeout_s,
            log_path=os.path.join(log_dir, f"sglang-router-{group}.log"),
        ).start()

    def engine(urls: Sequence[str], group: str, weights: WeightSource, version: str) -> SGLangEngine:
        sync = WeightSyncConfig(
            mode=sg.weight_sync,
            update_groups=sg.update_groups,
            bucket_bytes=sg.bucket_mb << 20,
            tp_size=sg.tp_per_engine,
            disk_dir=os.path.join(disk_root, group),
            hf_config=hf_config,
            master_address=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            timeout=sg.request_timeout_s,
            group_name=f"armor_{group}_weights",
        )
        front = router(urls, group)
        try:
            client = SGLangEngine(
                urls,
                api_key=api_key,
                weight_sync=sync,
                retry=RetryPolicy(max_attempts=1 + sg.max_retries),
                request_timeout=sg.request_timeout_s,
                max_concurrency=sg.max_concurrency,
                router_process=front,
                deterministic=sg.deterministic,
                vocab_size=int(hf_config["vocab_size"]),
            )
        except BaseException:
            if front is not None:
                front.stop()
            raise
        try:
            if colocated:  # released at start (`release_engines_at_start`): the step's order
                client.resume_memory(tags=("weights",))
            client.update_weights(weights, version)
            if colocated:
                client.resume_memory(tags=("kv_cache", "cuda_graph"))
        except BaseException:
            client.shutdown()
            raise
        return client

    def make(
        policy: WeightSource,
        reference: WeightSource | None,
        *,
        policy_version: str,
        reference_version: str,
    ) -> tuple[RolloutEngine, RolloutEngine | None]:
        policy_engine = engine(sg.urls, "policy", policy, policy_version)
        reference_engine = None
        if reference is not None and cfg.anchor.enabled and cfg.anchor.source == "separate":
            reference_engine = engine(cfg.anchor.reference_urls, "reference", reference, reference_version)
        return policy_engine, reference_engine

    return make
