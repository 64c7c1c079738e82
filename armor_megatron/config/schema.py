"""The run configuration: one dataclass per YAML section.

Defaults are the paper's DAPO + ARMOR settings where the paper gives one (G=16,
α=0.9375, τ=160, anchor tries 4, ε 0.2/0.28, no KL term). Each field states its check next
to it; checks that involve several fields live in ``armor_megatron.config.validate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from armor_megatron.algo.advantages import ADVANTAGE_ESTIMATORS
from armor_megatron.algo.loss import POLICY_LOSSES
from armor_megatron.algo.reset import RESET_SCHEDULES
from armor_megatron.config.typed import (
    at_least,
    at_least_or_null,
    checked,
    described,
    in_range,
    non_empty,
    path_component,
    positive,
    registered,
)
from armor_megatron.registry import Registry

API_KEY_ENV = "ARMOR_ENGINE_API_KEY"  # rollout.sglang.api_key by environment: never on a command line

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclasses.dataclass
class ModelConfig:
    """The model to train: its HF directory (weights, config, tokenizer) and how Megatron builds it."""

    path: str = checked(check=non_empty, help="HF model directory (config.json, safetensors, tokenizer)")
    mcore_path: str | None = checked(
        None, help="torch_dist checkpoint to start from; unset: each rank reads its slices of `path` directly"
    )
    arch: dict[str, Any] = checked(
        factory=dict, help="HF config.json fields used for checks when `path` is not on this machine"
    )
    dtype: Literal["bfloat16", "float16", "float32"] = checked(
        "bfloat16",
        help="dtype of the trained models' weights and compute (bf16/fp16 keep an fp32 master copy and fp32 gradients)",
    )
    spec: Literal["auto", "local", "te"] = checked("auto", help="Megatron layer spec; auto = TE when importable")


@dataclasses.dataclass
class ParallelismConfig:
    """How the trained models are split over the trainer's ranks (data parallelism takes the remaining ranks)."""

    tp: int = checked(1, check=at_least(1), help="tensor parallel size")
    pp: int = checked(1, check=at_least(1), help="pipeline parallel size")
    ep: int = checked(1, check=at_least(1), help="expert parallel size (MoE)")
    vpp: int | None = checked(None, check=at_least(1), help="virtual pipeline chunks per stage")
    sp: bool = checked(False, help="sequence parallelism (needs tp > 1)")


@dataclasses.dataclass
class SGLangRouterConfig:
    """``sglang-router`` in front of each engine group (policy, reference), started by the trainer's driver."""

    enabled: bool = checked(
        False, help="route generation through sglang-router (weight sync and memory release still go to each engine)"
    )
    policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = checked(
        "cache_aware", help="how sglang-router picks the engine of each request"
    )
    host: str = checked("127.0.0.1", check=non_empty, help="where the routers listen (they run on the driver's node)")
    port: int = checked(
        0,
        check=described(
            "0 (a free port) or [1024, 65534]",
            lambda p: None if p == 0 or 1024 <= p <= 65534 else f"{p!r} must be 0 (a free port) or in [1024, 65534]",
        ),
        help="the policy group's router; the reference group's gets port + 1",
    )
    health_check_interval_s: int = checked(5, check=at_least(1), help="seconds between the router's engine checks")
    health_failure_threshold: int = checked(
        2, check=at_least(1), help="failed checks in a row before the router stops sending to an engine"
    )
    startup_timeout_s: float = checked(300.0, check=positive, help="until the router routes to every engine")


WEIGHT_SYNC_MODES = Registry("weight sync mode")
"""``rollout.sglang.weight_sync``: each mode a ``WeightSync`` class registered in
``rollout/sglang/weight_sync.py``. The config sits below the engines, so it names the built-in
modes by where they live, imported on first use."""
for _mode, _cls in (
    ("tensor", "TensorWeightSync"),
    ("distributed", "DistributedWeightSync"),
    ("disk", "DiskWeightSync"),
):
    WEIGHT_SYNC_MODES.register_lazy(_mode, f"armor_megatron.rollout.sglang.weight_sync:{_cls}")

ROLLOUT_ENGINES = Registry("rollout engine")
"""``rollout.engine``: each kind a factory ``(cfg, hf_config, tokenizer) -> make``, where ``make(policy_weights,
reference_weights, *, policy_version, reference_version) -> (policy engine, reference engine or None)``
runs once on the driver (`trainer.components.engine_factory`). The built-in kinds live above the
config and are named by where they are; a plugin registers its own (``ROLLOUT_ENGINES.register``)."""
ROLLOUT_ENGINES.register_lazy("local", "armor_megatron.trainer.components:make_local_engines")
ROLLOUT_ENGINES.register_lazy("sglang", "armor_megatron.trainer.components:make_sglang_engines")


@dataclasses.dataclass
class SGLangConfig:
    """The SGLang servers of ``rollout.engine: sglang``: launched by the SLURM job or given as URLs, and how trained weights reach them."""

    urls: list[str] = checked(factory=list, help="attach to running servers instead of launching")
    num_engines: int = checked(
        1, check=at_least(1), help="servers of the policy group that the SLURM launcher starts (when urls is empty)"
    )
    tp_per_engine: int = checked(1, check=at_least(1), help="GPUs (tensor-parallel size) of each SGLang server")
    host: str = checked(
        "127.0.0.1",
        help="interface the launched servers listen on; all interfaces (0.0.0.0) need api_key or allow_unauthenticated",
    )
    base_port: int = checked(
        30000, check=in_range(1024, 65535), help="port of the first launched server; the others count up from it"
    )
    api_key: str | None = checked(
        None,
        secret=True,
        help=f"required by the engines; redacted in printed configs, passed to servers and trainer ranks by "
        f"environment (${API_KEY_ENV}, which when set is the key)",
    )
    allow_unauthenticated: bool = checked(
        False, help="let engines listen on all interfaces (host 0.0.0.0) without an api_key: a trusted network only"
    )
    mem_fraction_static: float = checked(
        0.7,
        check=in_range(0, 1, lo_open=True, hi_open=True),
        help="SGLang's --mem-fraction-static: share of GPU memory for weights and KV cache",
    )
    placement: Literal["colocated", "disaggregated"] = checked(
        "colocated",
        help="colocated: engines share the trainer's GPUs and release memory in turn; disaggregated: engines on launch.engine_gpus",
    )
    weight_sync: str = checked(
        "tensor",
        check=registered(WEIGHT_SYNC_MODES),
        help="how trained weights reach the engines: tensor (CUDA IPC, same node), distributed (NCCL broadcast), disk (HF safetensors on a shared file system)",
    )
    update_groups: Literal["stage", "owner"] = checked(
        "stage",
        help="weight_sync distributed: stage, one NCCL update group per pipeline stage (the stage's experts handed to "
        "its sender bucket by bucket; pp communicators per engine TP rank); owner, one per trainer rank that owns "
        "tensors (pp x ep communicators, no hand-over)",
    )
    deterministic: bool = checked(
        False,
        help="reproducible rollouts: servers run with --enable-deterministic-inference and each sample carries its own "
        "sampling_seed, so a prompt costs n prefills instead of one and SGLang's batch-invariant kernels run slower; "
        "off: one request with n samples per prompt sharing one prefill, seeds not sent (SGLang ignores them)",
    )
    disk_dir: str | None = checked(
        None,
        help="weight_sync disk: where HF checkpoints for the engines are written (default <checkpoint.dir>/engine_weights)",
    )
    bucket_mb: int = checked(512, check=at_least(1), help="size of one bucket of weights sent to the engines")
    request_timeout_s: float = checked(600.0, check=positive, help="seconds one HTTP request to an engine may take")
    max_retries: int = checked(5, check=at_least(0), help="retries of a failed engine request before the step fails")
    max_concurrency: int = checked(
        256, check=at_least(1), help="generation requests the driver keeps in flight at once"
    )
    router: SGLangRouterConfig = dataclasses.field(default_factory=SGLangRouterConfig)
    python: str | None = checked(
        None,
        check=described(
            "a path, or null",
            lambda x: None if x is None or x.strip() else "must not be empty (null: the trainer's interpreter)",
        ),
        help="interpreter the launched servers run with: the SGLang environment's python (docs/gpu.md, GPU "
        "environments; sglang pins its own torch); null: the trainer's (ARMOR_PYTHON in SLURM jobs)",
    )


@dataclasses.dataclass
class EnvironmentConfig:
    """Multi-turn rollouts with tools (docs/multiturn.md): the user's environment and the limits of one response."""

    spec: str | None = checked(
        None,
        check=described(
            "module:Class, or null",
            lambda x: None if x is None or ":" in x else f"{x!r} is not of the form module:Class",
        ),
        help="the environment class, built from each row and stepped with each model turn (found on "
        "reward.python_path); null: single-turn rollouts",
    )
    max_turns: int = checked(4, check=at_least(1), help="model turns of one response at most")
    tool_timeout_s: float = checked(
        30.0, check=positive, help="seconds one environment step (a tool call) may take; a later one ends the response"
    )
    max_total_tokens: int | None = checked(
        None,
        check=at_least_or_null(2),
        help="prompt + model + environment tokens of one response at most; null: the model's context "
        "(max_position_embeddings), which also sizes a multi-turn row in --plan",
    )
    max_turn_tokens: int | None = checked(
        None,
        check=at_least_or_null(1),
        help="tokens one model turn may generate (the environment still answers a turn cut there); null: what "
        "max_response_len and max_total_tokens leave",
    )
    stop: list[str] = checked(
        factory=list, help="stop strings that end a model turn (e.g. the end of a tool call), besides EOS"
    )


@dataclasses.dataclass
class PartialConfig:
    """Partial rollouts (docs/partial_rollouts.md): over-provisioned groups, the surplus aborted at the target and continued next step."""

    enabled: bool = checked(
        False,
        help="request more groups than a step needs, stop once enough are accepted (after dynamic sampling's "
        "filter), abort the rest and continue their tokens first in the next step (engine sglang only)",
    )
    over_provision: float = checked(
        1.5, check=at_least(1), help="groups kept in flight per group the step needs (ceil(target x this))"
    )
    max_versions: int = checked(
        2,
        check=at_least(2),
        help="policy versions one response may span at most (1 would never continue an aborted response)",
    )
    stale: Literal["finish", "drop"] = checked(
        "finish",
        help="a response at its last allowed version: finish: generated to its end in that step; drop: aborted "
        "like the rest and discarded (its tokens counted in partial/wasted_tokens) when it would span one too many",
    )


@dataclasses.dataclass
class RolloutConfig:
    """How responses are sampled: batch shape, sampling parameters, lengths and the engine."""

    engine: str = checked(
        "sglang",
        check=registered(ROLLOUT_ENGINES),
        help="sglang: SGLang servers on GPUs; local: a transformers model in the driver process (CPU runs, tests)",
    )
    prompts_per_step: int = checked(128, check=at_least(1), help="prompts per RL step (before oversampling)")
    group_size: int = checked(16, check=at_least(2), help="G: responses per prompt, the anchor included")
    temperature: float = checked(
        1.0, check=positive, help="sampling temperature of rollouts; actor and reference log-probs are computed at it"
    )
    top_p: float = checked(1.0, check=in_range(0, 1, lo_open=True), help="nucleus-sampling mass of rollouts")
    top_k: int = checked(
        -1,
        check=described("-1 or >= 1", lambda k: None if k == -1 or k >= 1 else f"{k!r} must be -1 (off) or >= 1"),
        help="top-k sampling of rollouts; -1: off",
    )
    max_prompt_len: int = checked(
        1024,
        check=at_least(1),
        help="training prompts longer than this many tokens (as encoded) are left out when the dataset loads",
    )
    max_response_len: int = checked(
        8192, check=at_least(1), help="tokens generated per response at most (multi-turn: the model's, over all turns)"
    )
    seed: int = checked(0, help="seed of rollout sampling; each step's engine seed derives from it and the step")
    local_device: str = checked(
        "cpu", check=non_empty, help="engine local: where the transformers model runs (cpu, cuda, cuda:1)"
    )
    overlap: Literal["off", "one_step"] = checked(
        "off",
        help="one_step: the engines generate the next step's batch with the current weights while the trainer "
        "updates on this one (one step of staleness, corrected by algorithm.tis; disaggregated engines only)",
    )
    overlap_forced_wait: bool = checked(
        False,
        help="one_step only, a check: generate the next batch after the update and weight push, through the "
        "overlap's code path; the run then equals overlap off bit for bit",
    )
    sglang: SGLangConfig = dataclasses.field(default_factory=SGLangConfig)
    environment: EnvironmentConfig = dataclasses.field(default_factory=EnvironmentConfig)
    partial: PartialConfig = dataclasses.field(default_factory=PartialConfig)


@dataclasses.dataclass
class AnchorConfig:
    """The anchor rollout: one response per prompt from the reference policy π_ref, kept only when its reward reaches ``success_reward``."""

    enabled: bool = checked(
        True, help="sample one verified anchor response per prompt from π_ref; false: every response on-policy"
    )
    max_tries: int = checked(4, check=at_least(1), help="reference samples drawn per prompt before giving up")
    tries_per_request: int = checked(4, check=at_least(1), help="tries asked for at once (keep the first correct)")
    success_reward: float = checked(1.0, help="reward a reference sample must reach to be an anchor (positive only)")
    source: Literal["separate", "swap"] = checked("separate", help="frozen engine group, or swap weights in place")
    reference_urls: list[str] = checked(
        factory=list, help="SGLang servers of the frozen reference group (source: separate, engine: sglang)"
    )
    reference_engines: int = checked(
        1, check=at_least(1), help="servers the SLURM launcher starts for that group when reference_urls is empty"
    )
    cache: bool = checked(
        False,
        help="reuse each prompt's verified anchors until the next reset (more groups hold an anchor, "
        "the same anchor text repeats; not the paper's estimator)",
    )
    cache_size_per_prompt: int = checked(4, check=at_least(1), help="verified anchors kept per prompt (anchor.cache)")
    pregenerate: bool = checked(False, help="sample next batch's anchors while the trainer updates")
    temperature: float | None = checked(None, check=positive, help="defaults to rollout.temperature")


@dataclasses.dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal and are replaced."""

    enabled: bool = checked(
        True, help="drop groups whose rewards are all equal and refill the batch from extra rollout rounds (DAPO)"
    )
    max_oversample_rounds: int = checked(3, check=at_least(0), help="extra rollout rounds to refill dropped groups")


@dataclasses.dataclass
class OverlongConfig:
    """DAPO's overlong reward shaping: a linear penalty inside ``buffer_len`` tokens before the response-length limit."""

    enabled: bool = checked(
        True, help="soft penalty for responses that end within buffer_len tokens of rollout.max_response_len (DAPO)"
    )
    buffer_len: int = checked(4096, check=at_least(1), help="soft-penalty zone before max_response_len")
    penalty: float = checked(1.0, check=in_range(0, None), help="penalty at the hard limit")


@dataclasses.dataclass
class TISConfig:
    """Truncated importance sampling: each on-policy token's loss weighted by min(π_old/π_engine, cap)."""

    enabled: bool = checked(False, help="correct the engine-vs-trainer mismatch of on-policy tokens")
    cap: float = checked(2.0, check=positive, help="C of min(π_old/π_engine, C)")


@dataclasses.dataclass
class KLLossConfig:
    """A KL penalty to π_ref added to the policy loss: β · (the estimator aggregated like the loss); off by default.

    ARMOR's recipe has none (the mixed ratio regularises instead); the penalty is for DAPO/GRPO runs
    (α = 1) and as a control against ARMOR. Logged as train/kl_loss.
    """

    coef: float = checked(0.0, check=in_range(0, None), help="β; 0: no KL penalty")
    estimator: KLEstimator = checked(
        "k3",
        help="per-token estimate of KL(π_θ‖π_ref), d = log π_θ − log π_ref: k1 = d, k2 = d²/2, "
        "k3 = exp(−d) − 1 + d (verl's low_var_kl)",
    )
    with_mixed_ratio: bool = checked(
        False, help="allow the penalty with algorithm.alpha < 1 (refused otherwise: it regularises toward π_ref twice)"
    )


@dataclasses.dataclass
class AlgorithmConfig:
    """The policy update: advantage estimator, policy loss, the mixed-ratio weight α and the clip range."""

    estimator: str = checked(
        "dapo",
        check=registered(ADVANTAGE_ESTIMATORS),
        help="a registered advantage estimator (in brackets: the algorithm keys it reads)",
    )
    policy_loss: str = checked("armor", check=registered(POLICY_LOSSES), help="a registered policy loss")
    alpha: float = checked(0.9375, check=in_range(0, 1, lo_open=True), help="mixed-ratio weight; 1 = plain PPO ratio")
    eps_low: float = checked(
        0.2, check=in_range(0, 1, lo_open=True, hi_open=True), help="ε_low: the ratio is clipped below at 1 − ε_low"
    )
    eps_high: float = checked(
        0.28, check=positive, help="ε_high: the ratio is clipped above at 1 + ε_high (clip-higher; at least eps_low)"
    )
    dual_clip_c: float | None = checked(
        None,
        check=in_range(1, None, lo_open=True),
        help="dual clip: a negative-advantage token's loss is at most −A·c; null: off",
    )
    loss_agg: LossAgg = checked(
        "token-mean",
        help="token-mean: mean over all response tokens of the global batch (DAPO); seq-mean-*: per sequence first",
    )
    qae_quantile: float = checked(0.4, check=in_range(0, 1), help="K of the QAE quantile baseline")
    std_eps: float = checked(
        1e-6, check=positive, help="added to a group's reward standard deviation before dividing by it"
    )
    gamma: float = checked(1.0, check=in_range(0, 1), help="discount γ of GAE (estimator gae)")
    lam: float = checked(1.0, check=in_range(0, 1), help="λ of GAE (estimator gae)")
    dynamic_sampling: DynamicSamplingConfig = dataclasses.field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)
    tis: TISConfig = dataclasses.field(default_factory=TISConfig)
    kl_loss: KLLossConfig = dataclasses.field(default_factory=KLLossConfig)


@dataclasses.dataclass
class ReferenceConfig:
    """The reference policy π_ref: when it is reset to the current policy and where it lives."""

    reset: str = checked(
        "every",
        check=registered(RESET_SCHEDULES),
        help="when θ_ref ← θ: every tau steps, two_stage, never, validation_best or validation_hook "
        "(in brackets: the reference keys it reads)",
    )
    tau: int = checked(160, check=at_least(1), help="steps between resets (every) or of stage one (two_stage: 1)")
    stage_one_steps: int = checked(180, check=at_least(0), help="two_stage: reset every step for this many steps")
    validation_metric: str = checked(
        "eval/mean/pass@1", check=non_empty, help="validation_best: reset to the policy that improves this metric"
    )
    validation_hook: str | None = checked(None, help="validation_hook: module:function(step, metrics) -> bool")
    offload: bool = checked(False, help="keep reference weights on CPU between uses")
    init_from: str | None = checked(
        None,
        help="recovery: start the reference from this checkpoint (e.g. the best earlier one) instead of the policy",
    )


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron's names of the adaptable linears
# HF PEFT's names of each target's logical projections (one adapter each), as the adapters are exported
LORA_PEFT_MODULES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def lora_peft_modules(targets: Sequence[str]) -> list[str]:
    """The PEFT ``target_modules`` of megatron ``targets`` (sorted): an adapter's config, SGLang's ``--lora-target-modules``."""
    return sorted({p for t in targets for p in LORA_PEFT_MODULES[t]})


def _lora_targets(x: Any) -> str | None:
    if not isinstance(x, list) or not x:
        return "must be a non-empty list"
    unknown = [t for t in x if t not in LORA_TARGETS]
    if unknown:
        return f"{unknown[0]!r} is not one of {', '.join(LORA_TARGETS)}"
    return "lists a module twice" if len(set(x)) < len(x) else None


@dataclasses.dataclass
class LoRAConfig:
    """Low-rank adapters on the actor (``docs/lora.md``): only A and B train, the base is frozen.

    Each targeted linear W gets W + s·B·A with s = alpha / rank, B = 0 at the start; the fused
    linear_qkv gets one adapter per projection (q, k, v) and linear_fc1 one per half (gate, up),
    as HF PEFT has them. The reference π_ref is the same model with the adapters off; a reference
    reset merges s·B·A into the base and starts new adapters.
    """

    enabled: bool = checked(False, help="train low-rank adapters instead of the whole actor")
    rank: int = checked(16, check=at_least(1), help="r: the adapters' inner width")
    alpha: float = checked(32.0, check=positive, help="scale numerator: the update is (alpha / rank)·B·A")
    dropout: float = checked(
        0.0, check=in_range(0, 1, hi_open=True), help="dropout on the adapters' input in training forwards (tp = 1)"
    )
    target_modules: list[str] = checked(
        factory=lambda: list(LORA_TARGETS),
        check=described(f"non-empty list of {', '.join(LORA_TARGETS)}", _lora_targets),
        help="megatron linears that get adapters (MoE models: linear_qkv and linear_proj only)",
    )
    sync: Literal["merged", "adapter"] = checked(
        "merged",
        help="what the policy engines get each step: merged, the weights W + s·B·A through rollout.sglang.weight_sync; "
        "adapter (SGLang only), A and B alone, loaded at run time and named by policy requests, the base pushed "
        "after each reference reset; with anchor.source swap, anchors are requests without the adapter: no swap "
        "(docs/lora.md)",
    )


@dataclasses.dataclass
class OptimizerConfig:
    """Adam with decoupled weight decay, gradient clipping and a warm-up / decay schedule (megatron's optimizer)."""

    lr: float = checked(1e-6, check=positive, help="peak learning rate (Adam)")
    min_lr: float = checked(
        0.0, check=in_range(0, None), help="learning rate that linear and cosine decay reach at the last update"
    )
    weight_decay: float = checked(
        0.1, check=in_range(0, None), help="decoupled weight decay (AdamW; not on biases and norms)"
    )
    adam_beta1: float = checked(0.9, check=in_range(0, 1, hi_open=True), help="Adam β1")
    adam_beta2: float = checked(0.999, check=in_range(0, 1, hi_open=True), help="Adam β2")
    adam_eps: float = checked(1e-8, check=positive, help="Adam ε")
    clip_grad: float = checked(1.0, check=positive, help="global gradient-norm clip")
    lr_schedule: Literal["constant", "linear", "cosine"] = checked(
        "constant", help="learning rate after warm-up: constant, or decay to min_lr (linear, cosine)"
    )
    warmup_steps: int = checked(0, check=at_least(0), help="updates of linear warm-up from 0 to lr")
    skip_grad_norm_ratio: float = checked(
        10.0, check=in_range(1, None, lo_open=True), help="skip a step whose grad norm exceeds this × running median"
    )


@dataclasses.dataclass
class StabilityConfig:
    """The StabilityGuard of each trained model's optimizer step (``megatron/stability.py``).

    Its grad-norm spike threshold stays ``optimizer.skip_grad_norm_ratio`` (the critic's:
    ``critic.optimizer.skip_grad_norm_ratio``); the drift thresholds below are off when null.
    """

    enabled: bool = checked(True, help="false: only non-finite steps are skipped; no spike rule, signals or reductions")
    window: int = checked(50, check=at_least(1), help="accepted grad norms whose median the spike rule compares with")
    min_history: int = checked(5, check=at_least(1), help="accepted grad norms before the spike rule acts (<= window)")
    max_consecutive_skips: int = checked(
        3, check=at_least(1), help="K: unhealthy steps in a row after which the guard lowers LR/clip or rolls back"
    )
    recover_after: int = checked(20, check=at_least(1), help="N: healthy steps in a row that undo one reduction")
    lr_factor: float = checked(0.5, check=in_range(0, 1, lo_open=True), help="LR multiplier of each reduction")
    clip_factor: float = checked(
        0.5, check=in_range(0, 1, lo_open=True), help="eps_low/eps_high multiplier per reduction"
    )
    max_reductions: int = checked(3, check=at_least(0), help="reductions before a rollback is asked for")
    max_rollbacks: int = checked(0, check=at_least(0), help="rollbacks to the last good checkpoint; 0: never")
    max_clip_frac: float | None = checked(
        None, check=in_range(0, 1, lo_open=True), help="drift: clip_frac_low + clip_frac_high above this"
    )
    max_abs_log_ratio: float | None = checked(None, check=positive, help="drift: max |log r| of the step above this")
    max_kl_ref: float | None = checked(None, check=positive, help="drift: approx_kl_ref above this")
    min_entropy: float | None = checked(None, check=positive, help="drift: mean token entropy below this")
    max_logprob_gap: float | None = checked(
        None, check=positive, help="drift: engine-vs-trainer mean |log-prob| gap above this"
    )


@dataclasses.dataclass
class CriticConfig:
    """The value model of ``algorithm.estimator: gae`` (PPO).

    The actor's architecture with a hidden→1 value head, started from the actor's checkpoint; GAE
    uses algorithm.gamma / lam.
    """

    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    clip_eps: float | None = checked(0.5, check=positive, help="ε_v of the clipped value loss; null: unclipped")
    value_head_init_std: float = checked(
        0.0, check=in_range(0, None), help="normal init std of the value head; 0: zeros"
    )
    warmup_steps: int = checked(0, check=at_least(0), help="first steps that train only the critic, not the actor")
    whiten_advantages: bool = checked(True, help="normalise GAE advantages over the batch's response tokens")


@dataclasses.dataclass
class TrainConfig:
    """The training loop: steps, updates per rollout batch, micro-batches, seeds and memory settings."""

    steps: int = checked(500, check=at_least(1), help="RL steps of the run (one rollout batch and its updates each)")
    mini_batches_per_step: int = checked(1, check=at_least(1), help="optimizer steps per rollout batch")
    epochs_per_step: int = checked(1, check=at_least(1), help="passes over each rollout batch")
    micro_batch_size: int = checked(1, check=at_least(1), help="sequences per forward pass")
    seed: int = checked(1234, help="seed of the trainer (initialisation, the prompt order)")
    deterministic: bool = checked(
        False,
        help="deterministic kernels and collectives (slower; bit-reproducible runs); on GPUs also megatron's "
        "deterministic_mode and NVTE_ALLOW_NONDETERMINISTIC_ALGO=0. Rollouts through SGLang: rollout.sglang.deterministic",
    )
    collective_timeout_minutes: int = checked(
        180, check=at_least(1), help="process-group timeout; non-driver ranks wait in a collective through each rollout"
    )
    offload_during_rollout: bool | None = checked(
        None,
        help="keep the trainer (actor with its optimizer state, reference, critic) in host memory except while it computes "
        "(log-probs, update, reference reset, checkpoint save): it comes to the GPUs after colocated engines "
        "released theirs and leaves, with empty_cache, before they resume; weights are pushed and HF-saved from "
        "the host copy; DDP gradient buffers are freed, not copied; None: when SGLang engines are colocated",
    )
    recompute: Literal["none", "selective", "full"] = checked(
        "none",
        help="activation recomputation of actor, critic (and reference) layers: selective = core attention only "
        "(megatron's 'core_attn'), full = whole layers, keeping only their inputs",
    )
    recompute_method: Literal["uniform", "block"] = checked(
        "uniform",
        help="full: uniform = every layer in units of recompute_num_layers; block = only the first "
        "recompute_num_layers layers of each pipeline chunk",
    )
    recompute_num_layers: int = checked(
        1, check=at_least(1), help="full: layers per recomputed unit (uniform) or recomputed layers per chunk (block)"
    )
    max_tokens_per_micro_batch: int | None = checked(
        None,
        check=at_least_or_null(1),
        help="token-budget micro-batches: rows packed back to back (THD) into micro-batches of at most this many "
        "tokens, data-parallel ranks balanced by tokens; null: micro_batch_size padded rows per micro-batch. Must "
        "hold rollout.max_prompt_len + rollout.max_response_len",
    )
    forward_max_tokens_per_micro_batch: int | None = checked(
        None,
        check=at_least_or_null(1),
        help="the same for the no-grad log-prob / value forwards (they keep no activations, so it can be larger); "
        "null: max_tokens_per_micro_batch",
    )


@dataclasses.dataclass
class DataConfig:
    """The training prompts: one JSONL or Parquet file and the fields that hold each row's prompt, ground truth and verifier (docs/data.md)."""

    train_path: str = checked(check=non_empty, help="JSONL or Parquet with prompt/answer columns")
    prompt_key: str = checked(
        "prompt", help="field holding a row's prompt (text or chat messages); a dotted key reads a nested field"
    )
    answer_key: str = checked(
        "answer",
        help="field holding a row's ground truth (else its `label` column); a dotted key reads a nested field, e.g. reward_model.ground_truth",
    )
    type_key: str = checked(
        "type",
        help="field naming a row's verifier (registered name or module:function); rows without it use reward.verifier",
    )
    apply_chat_template: bool = checked(
        True,
        help="wrap text prompts as one user message in the tokenizer's chat template when it has one (chat-message prompts always use it)",
    )
    prompt_template: str | None = checked(None, help="python format string with {prompt}")
    shuffle: bool = checked(
        True, help="a fresh permutation of the training rows each epoch, seeded by train.seed; false: file order"
    )


def _judge_url(url: Any) -> str | None:
    if url is None or (isinstance(url, str) and url.startswith(("http://", "https://")) and len(url) > 8):
        return None
    return f"{url!r} is not an http:// or https:// URL"


def _env_name(name: Any) -> str | None:
    if name is None or (isinstance(name, str) and name.replace("_", "a").isalnum() and not name[0].isdigit()):
        return None
    return f"{name!r} is not an environment variable's name (the variable holds the key; the key never goes here)"


@dataclasses.dataclass
class RemoteJudgeConfig:
    """A judge served over HTTP, the verifier ``remote`` (docs/rewards.md, "A remote judge")."""

    url: str | None = checked(
        None,
        check=described("null or an http(s):// URL", _judge_url),
        help="the judge's URL (POST, JSON protocol in docs/rewards.md); set: reward.verifier or a row's type may "
        "name the verifier 'remote'",
    )
    concurrency: int = checked(4, check=at_least(1), help="requests in flight at once, over the whole process")
    timeout_s: float = checked(
        60.0, check=in_range(0, None, lo_open=True), help="seconds a request may wait for the judge's reply"
    )
    retries: int = checked(
        3,
        check=at_least(0),
        help="retries of a failed request (no reply, HTTP 5xx/408/429, malformed reply) before the step fails",
    )
    backoff_s: float = checked(1.0, check=at_least(0), help="seconds before the first retry, doubling after each")
    batch_size: int = checked(16, check=at_least(1), help="responses per request")
    api_key_env: str | None = checked(
        None,
        check=described("null or a variable name", _env_name),
        help="name of the environment variable holding the judge's API key (sent as 'Authorization: Bearer'); "
        "never the key itself",
    )


@dataclasses.dataclass
class RewardConfig:
    """How responses are scored: the default verifier and where user verifiers are found (docs/rewards.md)."""

    verifier: str = checked("math", check=non_empty, help="registered name or module:function (e.g. a weighted one)")
    workers: int = checked(
        4,
        check=at_least(1),
        help="threads scoring responses at once (the math verifier runs each in a killable worker process)",
    )
    python_path: list[str] = checked(
        factory=lambda: ["."],
        help="directories searched (after the installed packages) for the modules of module:function verifiers "
        "and hooks; relative to the config file, whose own directory is the default",
    )
    verifiers: list[str] = checked(
        factory=list,
        check=described(
            "each module:function",
            lambda specs: next((f"{s!r} is not of the form module:function" for s in specs if ":" not in s), None),
        ),
        help="module:function verifiers a dataset row's type may name, besides the registered ones and "
        "reward.verifier; a row naming any other function is refused at start-up",
    )
    timeout_s: float = checked(
        60.0,
        check=in_range(0, None, lo_open=True),
        help="seconds a user (module:function) verifier may take on one response (a group or batch verifier: on one "
        "call); it runs in a killable worker "
        "process, and a call that runs longer is stopped and scores 0 (reward/timeouts)",
    )
    max_consecutive_timeouts: int = checked(
        8,
        check=at_least(1),
        help="user-verifier timeouts in a row that fail the step (the verifier hangs, not one hard response)",
    )
    memory_limit_mb: int = checked(
        4096,
        check=at_least(0),
        help="address-space cap of each reward worker process (math and user verifiers); 0: none",
    )
    remote: RemoteJudgeConfig = dataclasses.field(default_factory=RemoteJudgeConfig)


@dataclasses.dataclass
class EvalDataset:
    """One validation set."""

    name: str = checked(check=non_empty, help="the set's name in metrics (eval/<name>/...)")
    path: str = checked(check=non_empty, help="JSONL or Parquet, read like data.train_path")
    k: int = checked(1, check=at_least(1), help="samples per prompt for avg@k / pass@k")
    prompt_key: str | None = checked(None, check=non_empty, help="field holding the prompt; null: data.prompt_key")
    answer_key: str | None = checked(
        None, check=non_empty, help="field holding the ground truth; null: data.answer_key"
    )


@dataclasses.dataclass
class EvalConfig:
    """Periodic validation: the datasets, how they are sampled and which pass@k are reported."""

    every_steps: int = checked(10, check=at_least(0), help="0 disables periodic evaluation")
    datasets: list[EvalDataset] = checked(
        factory=list, help="validation sets, each a mapping of the eval.datasets[] keys (name, path, k, ...)"
    )
    temperature: float = checked(0.6, check=in_range(0, None), help="sampling temperature of evaluation; 0: greedy")
    top_p: float = checked(1.0, check=in_range(0, 1, lo_open=True), help="nucleus-sampling mass of evaluation")
    max_response_len: int = checked(
        8192,
        check=at_least(1),
        help="tokens generated per evaluation response at most (checked against the model's context only with "
        "eval.datasets)",
    )
    pass_k: list[int] = checked(
        factory=lambda: [1],
        check=described("each >= 1", lambda ks: next((f"{k!r} must be >= 1" for k in ks if k < 1), None)),
        help="the k of each reported pass@k (at most a dataset's k)",
    )


@dataclasses.dataclass
class SaveHFConfig:
    """The policy written as an HF model directory during training.

    Safetensors, config.json and the tokenizer files of ``model.path`` under
    ``<checkpoint.dir>/hf/step_<N>``, by the ranks that own the weights, atomically (loadable by
    transformers and SGLang as it is).
    """

    every_steps: int = checked(0, check=at_least(0), help="write the HF directory every N steps; 0: only at the end")
    at_end: bool = checked(True, help="also write it after the last step")
    keep_last: int = checked(0, check=at_least(0), help="HF directories kept (the oldest removed first); 0 keeps all")


@dataclasses.dataclass
class CheckpointConfig:
    """Where and how often the run checkpoints, and what it resumes from."""

    dir: str | None = checked(
        None,
        check=non_empty,
        help="this run's checkpoints; default checkpoints/<name>",
    )
    every_steps: int = checked(20, check=at_least(0), help="0 saves only at the end and on preemption")
    keep_last: int = checked(3, check=at_least(1), help="complete checkpoints kept; older ones are removed")
    resume: str = checked("auto", check=non_empty, help="auto | none | path of a checkpoint")
    save_anchor_cache: bool = checked(
        True, help="save the anchor cache in checkpoints, so a resumed run serves the same anchors"
    )
    save_hf: SaveHFConfig = checked(
        factory=SaveHFConfig, help="HF copies of the policy during training (<checkpoint.dir>/hf/step_<N>)"
    )


@dataclasses.dataclass
class WandbConfig:
    """Weights & Biases logging, off unless ``project`` is set."""

    project: str | None = checked(None, help="W&B project; set: log to W&B too (needs wandb)")
    entity: str | None = checked(None, help="W&B entity (team or user)")
    name: str | None = checked(None, help="W&B run name; null: the run's name")


@dataclasses.dataclass
class LoggingConfig:
    """Where metrics go: ``<dir>/<name>/metrics.jsonl``, TensorBoard, W&B, and the line printed per step."""

    dir: str = checked("runs", check=non_empty, help="root of the runs' logs: <dir>/<name>/metrics.jsonl")
    every_steps: int = checked(
        1, check=at_least(1), help="steps between logged records (evaluation steps are always logged)"
    )
    jsonl: bool = checked(True, help="write metrics.jsonl")
    tensorboard: bool = checked(False, help="also write TensorBoard events (needs tensorboard)")
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    progress_bar: bool = checked(True, help="a progress bar on a terminal instead of one line per step")
    reference_kl: bool = checked(
        False, help="with algorithm.alpha = 1 (no mixed ratio), still compute π_ref log-probs for train/approx_kl_ref"
    )
    sample_metrics: str | None = checked(
        None,
        help="module:function(samples) -> {name: value}, called on each step's scored rollouts (dicts with prompt, "
        "response, score, is_anchor, weight_version; logged as rollout/<name>) and each evaluation's (eval/<dataset>/<name>)",
    )


@dataclasses.dataclass
class StepTimeConfig:
    """The figures of ``--plan``'s step-time model (``armor_megatron.launch.step_time``).

    How fast the engines decode, how well the trainer uses its GPUs, how fast weights reach the
    engines. Planning figures only: nothing at run time reads them.
    """

    decode_tokens_per_s_per_gpu: float | None = checked(
        None,
        check=positive,
        help="tokens one engine GPU generates per second at a full batch; null: 4000 x 7.50e9 / (weights a token "
        "goes through), SGLang's published offline output throughput of Llama-3-8B in bf16 on one A100-80GB "
        "(about 4000 tokens/s: https://lmsys.org/blog/2024-07-25-sglang-llama3/) scaled by active weights; H100s "
        "decode faster: set it from a run, (rollout/generated_tokens + anchor/generated_tokens) / time/rollout / "
        "engine GPUs",
    )
    mfu: float = checked(
        0.35,
        check=in_range(0, 1, lo_open=True),
        help="model FLOPs utilisation of the trainer's log-prob and update passes (what a run logs as perf/mfu); "
        "0.35 = Megatron-Core's published 47% on H100 x 3/4 for full recompute's extra forward",
    )
    sync_gb_per_s: float | None = checked(
        None,
        check=positive,
        help="GB/s at which the trained weights reach the engines; null: by rollout.sglang.weight_sync, tensor 100 "
        "(NVLink within a node), distributed 25 (NCCL broadcast over a 400 Gb/s NIC), disk 2 (shared file "
        "system write + read): assumptions, not measurements",
    )
    response_len_fraction: float = checked(
        1.0,
        check=in_range(0, 1, lo_open=True),
        help="mean response length / rollout.max_response_len; 1: the worst case, every response at the limit "
        "(a run's rollout/response_len over max_response_len plans from measured lengths)",
    )
    response_len_sigma: float = checked(
        0.47,
        check=in_range(0, 5),
        help="shape σ of the lognormal response lengths (truncated at rollout.max_response_len, mean from "
        "response_len_fraction) behind the partial-rollout gain --plan shows with rollout.partial on; 0.47: "
        "p99/p50 = 3 before truncation, bench/partial_rollouts.py's lengths",
    )


@dataclasses.dataclass
class LaunchConfig:
    """The job's resources: SLURM nodes, GPUs and the device facts ``--plan`` uses."""

    nodes: int = checked(1, check=at_least(1), help="SLURM nodes of the job")
    gpus_per_node: int = checked(8, check=at_least(0), help="0 = CPU run")
    engine_gpus: int = checked(0, check=at_least(0), help="GPUs reserved for rollout engines (disaggregated)")
    partition: str | None = checked(None, help="SLURM partition; null: the cluster's default")
    account: str | None = checked(None, help="SLURM account; null: the user's default")
    time: str = checked("48:00:00", help="SLURM time limit (quote it in YAML)")
    requeue_exit_code: int = checked(
        85, check=in_range(3, 127), help="3..127: not a failure (1), bad input (2) or a death by signal (128+n)"
    )
    gpu_peak_tflops: float | None = checked(
        None, check=positive, help="dense bf16 peak of one GPU (989 for H100/H200 SXM); perf/mfu is logged when set"
    )
    gpu_memory_gib: float = checked(
        80.0, check=positive, help="device memory of one GPU; `armor-train --plan` refuses layouts that exceed it"
    )
    network_interface: str | None = checked(
        None,
        check=described(
            "an interface name without spaces",
            lambda x: None if x is None or (x and not any(c.isspace() for c in x)) else f"{x!r} is no interface name",
        ),
        help="the fabric's network interface (e.g. ib0; NCCL's forms such as ^docker,lo too) for a multi-node job: "
        "the SLURM plan exports it as NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to the trainer and the engines, so "
        "training collectives and the weight sync's broadcasts use it",
    )
    step_time: StepTimeConfig = checked(
        factory=StepTimeConfig,
        help="figures of the step-time model that `armor-train --plan` prints (generation, training, weight sync)",
    )


@dataclasses.dataclass
class ThroughputConfig:
    """Speed options of the trained models, none changing what is computed.

    Overlapped communication and fused kernels (``models.megatron_options.Throughput`` says why
    each default is what it is). The defaults run on an image installed from the lock files alone (no APEX, no C
    compiler needed). ``armor-train --check`` refuses the CUDA-only ones for a CPU run
    (``launch.gpus_per_node: 0``) or the local spec, and says what the chosen ones need on the job's
    machines (checking this machine unless ``--no-files``); the job refuses them, in one line, on a
    machine without the kernels.
    """

    overlap_grad_reduce: bool = checked(
        False, help="reduce each gradient bucket during backward (megatron DDP overlap_grad_reduce)"
    )
    overlap_param_gather: bool = checked(
        False,
        help="all-gather updated parameters during the next forward (distributed optimizer, GPU; needs "
        "overlap_grad_reduce); refused for now: the trainer reads parameters outside forward after each update",
    )
    gradient_accumulation_fusion: bool = checked(
        False,
        help="accumulate weight grads into the fp32 main_grad inside the GEMM; needs CUDA and APEX (a source "
        "build: not in the lock files)",
    )
    apply_rope_fusion: bool | None = checked(None, help="TE's fused RoPE; null: on with the TE spec (not for MLA)")
    bias_activation_fusion: bool | None = checked(
        None, help="megatron's fused SwiGLU (keeps only its input for backward); null: on with the TE spec"
    )
    bias_dropout_fusion: bool = checked(
        False, help="megatron's fused bias-dropout-add: nothing to fuse without biases and dropout (TE spec)"
    )
    torch_compile: bool = checked(
        False,
        help="compile megatron's jit_fuser functions with torch.compile (needs Triton and a C compiler on every "
        "node; compiles at the first step and again as lengths vary); false: they run eagerly",
    )


@dataclasses.dataclass
class MoEConfig:
    """Routing and token dispatch of MoE models (``models.megatron_options.MoESettings``; ignored for dense models).

    Defaults: dropless, no load-balancing loss, fp32 router, all-to-all dispatch.
    """

    aux_loss_coeff: float = checked(
        0.0,
        check=in_range(0, None),
        help="megatron moe_aux_loss_coeff: weight of the load-balancing loss, its mean over micro-batches and "
        "data-parallel ranks added to the policy (and value) loss; 0: none",
    )
    load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"] | None = checked(
        None,
        help="megatron moe_router_load_balancing_type; null: aux_loss (DeepSeek: seq_aux_loss) when "
        "aux_loss_coeff > 0, else none; sinkhorn is refused (it routes differently in training)",
    )
    token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = checked(
        "alltoall",
        help="alltoall; allgather only at ep = pp = 1 (it needs one token count on every rank); flex needs "
        "DeepEP on the GPUs (checked when the job starts, not by --check)",
    )
    router_dtype: Literal["fp32", "fp64"] | None = checked(
        "fp32", help="precision of router logits, softmax and expert-output weighting; null: the model dtype"
    )
    expert_capacity_factor: float | None = checked(
        None,
        check=positive,
        help="null: dropless; c > 0: at most c·tokens·topk/experts tokens per expert and micro-batch (drops "
        "depend on the micro-batch's other tokens; the rollout engine never drops)",
    )
    token_drop_policy: Literal["probs", "position"] = checked(
        "probs", help="with a capacity: drop the lowest router probabilities (probs) or the last tokens (position)"
    )
    pad_expert_input_to_capacity: bool = checked(
        False, help="pad every expert's input to its capacity (static shapes; needs expert_capacity_factor)"
    )


@dataclasses.dataclass
class RunConfig:
    """A whole run; YAML top-level keys are these section names."""

    model: ModelConfig
    data: DataConfig
    name: str = checked(
        "armor",
        check=path_component,
        help="the run's name: metrics in <logging.dir>/<name>, checkpoints in checkpoints/<name> unless checkpoint.dir is set",
    )
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    anchor: AnchorConfig = dataclasses.field(default_factory=AnchorConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    reference: ReferenceConfig = dataclasses.field(default_factory=ReferenceConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    stability: StabilityConfig = dataclasses.field(default_factory=StabilityConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)
    throughput: ThroughputConfig = dataclasses.field(default_factory=ThroughputConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)


def needs_reference_logprobs(cfg: RunConfig) -> bool:
    """The trainer computes log π_ref per step: for the mixed ratio (α < 1), the KL penalty or the logged KL."""
    return cfg.algorithm.alpha < 1.0 or cfg.algorithm.kl_loss.coef > 0 or cfg.logging.reference_kl
