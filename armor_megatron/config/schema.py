"""The run configuration: one dataclass per YAML section.

Defaults are the paper's DAPO + ARMOR settings where the paper gives one (G=16,
α=0.9375, τ=160, anchor tries 4, ε 0.2/0.28, no KL term). Each field states its check next
to it; checks that involve several fields live in ``armor_megatron.config.validate``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from armor_megatron.algo.advantages import ADVANTAGE_ESTIMATORS
from armor_megatron.algo.loss import POLICY_LOSSES
from armor_megatron.config.typed import at_least, checked, in_range, non_empty, positive, registered

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


@dataclasses.dataclass
class ModelConfig:
    path: str = checked(check=non_empty, help="HF model directory (config.json, safetensors, tokenizer)")
    mcore_path: str | None = checked(
        None, help="torch_dist checkpoint to start from; unset: each rank reads its slices of `path` directly"
    )
    arch: dict[str, Any] = checked(
        factory=dict, help="HF config.json fields used for checks when `path` is not on this machine"
    )
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    spec: Literal["auto", "local", "te"] = checked("auto", help="Megatron layer spec; auto = TE when importable")


@dataclasses.dataclass
class ParallelismConfig:
    tp: int = checked(1, check=at_least(1), help="tensor parallel size")
    pp: int = checked(1, check=at_least(1), help="pipeline parallel size")
    ep: int = checked(1, check=at_least(1), help="expert parallel size (MoE)")
    vpp: int | None = checked(None, check=at_least(1), help="virtual pipeline chunks per stage")
    cp: int = checked(1, check=at_least(1), help="context parallel size")
    sp: bool = checked(False, help="sequence parallelism (needs tp > 1)")


@dataclasses.dataclass
class SGLangRouterConfig:
    """``sglang-router`` in front of each engine group (policy, reference), started by the trainer's driver."""

    enabled: bool = checked(
        False, help="route generation through sglang-router (weight sync and memory release still go to each engine)"
    )
    policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = "cache_aware"
    host: str = checked("127.0.0.1", check=non_empty, help="where the routers listen (they run on the driver's node)")
    port: int = checked(
        0,
        check=lambda p: None if p == 0 or 1024 <= p <= 65534 else f"{p!r} must be 0 (a free port) or in [1024, 65534]",
        help="the policy group's router; the reference group's gets port + 1",
    )
    health_check_interval_s: int = checked(5, check=at_least(1), help="seconds between the router's engine checks")
    health_failure_threshold: int = checked(
        2, check=at_least(1), help="failed checks in a row before the router stops sending to an engine"
    )
    startup_timeout_s: float = checked(300.0, check=positive, help="until the router routes to every engine")


@dataclasses.dataclass
class SGLangConfig:
    urls: list[str] = checked(factory=list, help="attach to running servers instead of launching")
    num_engines: int = checked(1, check=at_least(1))
    tp_per_engine: int = checked(1, check=at_least(1))
    host: str = "127.0.0.1"
    base_port: int = checked(30000, check=in_range(1024, 65535))
    api_key: str | None = checked(
        None, secret=True, help="required by the engines; redacted in printed configs, passed to servers by environment"
    )
    allow_unauthenticated: bool = checked(
        False, help="let engines listen on all interfaces (host 0.0.0.0) without an api_key: a trusted network only"
    )
    mem_fraction_static: float = checked(0.7, check=in_range(0, 1, lo_open=True, hi_open=True))
    placement: Literal["colocated", "disaggregated"] = "colocated"
    weight_sync: Literal["tensor", "distributed", "disk"] = "tensor"
    disk_dir: str | None = checked(
        None,
        help="weight_sync disk: where HF checkpoints for the engines are written (default <checkpoint.dir>/engine_weights)",
    )
    bucket_mb: int = checked(512, check=at_least(1))
    request_timeout_s: float = checked(600.0, check=positive)
    max_retries: int = checked(5, check=at_least(0))
    max_concurrency: int = checked(256, check=at_least(1))
    router: SGLangRouterConfig = dataclasses.field(default_factory=SGLangRouterConfig)


@dataclasses.dataclass
class RolloutConfig:
    engine: Literal["local", "sglang"] = "sglang"
    prompts_per_step: int = checked(128, check=at_least(1), help="prompts per RL step (before oversampling)")
    group_size: int = checked(16, check=at_least(2), help="G: responses per prompt, the anchor included")
    temperature: float = checked(1.0, check=positive)
    top_p: float = checked(1.0, check=in_range(0, 1, lo_open=True))
    top_k: int = checked(-1, check=lambda k: None if k == -1 or k >= 1 else f"{k!r} must be -1 (off) or >= 1")
    max_prompt_len: int = checked(1024, check=at_least(1))
    max_response_len: int = checked(8192, check=at_least(1))
    seed: int = 0
    local_device: str = checked(
        "cpu", check=non_empty, help="engine local: where the transformers model runs (cpu, cuda, cuda:1)"
    )
    sglang: SGLangConfig = dataclasses.field(default_factory=SGLangConfig)


@dataclasses.dataclass
class AnchorConfig:
    enabled: bool = True
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
    cache_size_per_prompt: int = checked(4, check=at_least(1))
    pregenerate: bool = checked(False, help="sample next batch's anchors while the trainer updates")
    temperature: float | None = checked(None, check=positive, help="defaults to rollout.temperature")


@dataclasses.dataclass
class DynamicSamplingConfig:
    enabled: bool = True
    max_oversample_rounds: int = checked(3, check=at_least(0), help="extra rollout rounds to refill dropped groups")


@dataclasses.dataclass
class OverlongConfig:
    enabled: bool = True
    buffer_len: int = checked(4096, check=at_least(1), help="soft-penalty zone before max_response_len")
    penalty: float = checked(1.0, check=in_range(0, None), help="penalty at the hard limit")


@dataclasses.dataclass
class TISConfig:
    """Truncated importance sampling: each on-policy token's loss weighted by min(π_old/π_engine, cap)."""

    enabled: bool = checked(False, help="correct the engine-vs-trainer mismatch of on-policy tokens")
    cap: float = checked(2.0, check=positive, help="C of min(π_old/π_engine, C)")


@dataclasses.dataclass
class AlgorithmConfig:
    estimator: str = checked("dapo", check=registered(ADVANTAGE_ESTIMATORS), help="a registered advantage estimator")
    policy_loss: str = checked("armor", check=registered(POLICY_LOSSES), help="a registered policy loss")
    alpha: float = checked(0.9375, check=in_range(0, 1, lo_open=True), help="mixed-ratio weight; 1 = plain PPO ratio")
    eps_low: float = checked(0.2, check=in_range(0, 1, lo_open=True, hi_open=True))
    eps_high: float = checked(0.28, check=positive)
    dual_clip_c: float | None = checked(None, check=in_range(1, None, lo_open=True))
    loss_agg: LossAgg = "token-mean"
    qae_quantile: float = checked(0.4, check=in_range(0, 1), help="K of the QAE quantile baseline")
    std_eps: float = checked(1e-6, check=positive)
    gamma: float = checked(1.0, check=in_range(0, 1))
    lam: float = checked(1.0, check=in_range(0, 1))
    dynamic_sampling: DynamicSamplingConfig = dataclasses.field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)
    tis: TISConfig = dataclasses.field(default_factory=TISConfig)


@dataclasses.dataclass
class ReferenceConfig:
    reset: Literal["every", "two_stage", "never", "validation_best", "validation_hook"] = "every"
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


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = checked(1e-6, check=positive)
    min_lr: float = checked(0.0, check=in_range(0, None))
    weight_decay: float = checked(0.1, check=in_range(0, None))
    adam_beta1: float = checked(0.9, check=in_range(0, 1, hi_open=True))
    adam_beta2: float = checked(0.999, check=in_range(0, 1, hi_open=True))
    adam_eps: float = checked(1e-8, check=positive)
    clip_grad: float = checked(1.0, check=positive)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = checked(0, check=at_least(0))
    skip_grad_norm_ratio: float = checked(
        10.0, check=in_range(1, None, lo_open=True), help="skip a step whose grad norm exceeds this × running median"
    )


@dataclasses.dataclass
class StabilityConfig:
    """The StabilityGuard of each trained model's optimizer step (``megatron/stability.py``). Its
    grad-norm spike threshold stays ``optimizer.skip_grad_norm_ratio`` (the critic's:
    ``critic.optimizer.skip_grad_norm_ratio``); the drift thresholds below are off when null."""

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
    """The value model of ``algorithm.estimator: gae`` (PPO): the actor's architecture with a
    hidden→1 value head, started from the actor's checkpoint; GAE uses algorithm.gamma / lam."""

    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    clip_eps: float | None = checked(0.5, check=positive, help="ε_v of the clipped value loss; null: unclipped")
    value_head_init_std: float = checked(
        0.0, check=in_range(0, None), help="normal init std of the value head; 0: zeros"
    )
    warmup_steps: int = checked(0, check=at_least(0), help="first steps that train only the critic, not the actor")
    whiten_advantages: bool = checked(True, help="normalise GAE advantages over the batch's response tokens")


@dataclasses.dataclass
class TrainConfig:
    steps: int = checked(500, check=at_least(1))
    mini_batches_per_step: int = checked(1, check=at_least(1), help="optimizer steps per rollout batch")
    epochs_per_step: int = checked(1, check=at_least(1))
    micro_batch_size: int = checked(1, check=at_least(1), help="sequences per forward pass")
    seed: int = 1234
    deterministic: bool = False
    collective_timeout_minutes: int = checked(
        180, check=at_least(1), help="process-group timeout; non-driver ranks wait in a collective through each rollout"
    )
    offload_during_rollout: bool | None = checked(
        None,
        help="move trainer weights, grads and optimizer state to host memory while engines generate "
        "(rollout, evaluation); None: when SGLang engines are colocated",
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
        check=lambda n: None if n is None or n >= 1 else f"{n!r} must be >= 1 or null",
        help="token-budget micro-batches: rows packed back to back (THD) into micro-batches of at most this many "
        "tokens, data-parallel ranks balanced by tokens; null: micro_batch_size padded rows per micro-batch. Must "
        "hold rollout.max_prompt_len + rollout.max_response_len",
    )
    forward_max_tokens_per_micro_batch: int | None = checked(
        None,
        check=lambda n: None if n is None or n >= 1 else f"{n!r} must be >= 1 or null",
        help="the same for the no-grad log-prob / value forwards (they keep no activations, so it can be larger); "
        "null: max_tokens_per_micro_batch",
    )


@dataclasses.dataclass
class DataConfig:
    train_path: str = checked(check=non_empty, help="JSONL or Parquet with prompt/answer columns")
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    type_key: str = checked("type", help="optional per-row verifier name")
    apply_chat_template: bool = True
    prompt_template: str | None = checked(None, help="python format string with {prompt}")
    shuffle: bool = True


@dataclasses.dataclass
class RewardConfig:
    verifier: str = checked("math", check=non_empty, help="registered name or module:function (e.g. a weighted one)")
    workers: int = checked(4, check=at_least(1))


@dataclasses.dataclass
class EvalDataset:
    name: str = checked(check=non_empty)
    path: str = checked(check=non_empty)
    k: int = checked(1, check=at_least(1), help="samples per prompt for avg@k / pass@k")


@dataclasses.dataclass
class EvalConfig:
    every_steps: int = checked(10, check=at_least(0), help="0 disables periodic evaluation")
    datasets: list[EvalDataset] = checked(factory=list)
    temperature: float = checked(0.6, check=in_range(0, None))
    top_p: float = checked(1.0, check=in_range(0, 1, lo_open=True))
    max_response_len: int = checked(8192, check=at_least(1))
    pass_k: list[int] = checked(
        factory=lambda: [1], check=lambda ks: next((f"{k!r} must be >= 1" for k in ks if k < 1), None)
    )


@dataclasses.dataclass
class SaveHFConfig:
    """The policy written as an HF model directory during training: safetensors, config.json and
    the tokenizer files of ``model.path`` under ``<checkpoint.dir>/hf/step_<N>``, by the ranks
    that own the weights, atomically (loadable by transformers and SGLang as it is)."""

    every_steps: int = checked(0, check=at_least(0), help="write the HF directory every N steps; 0: only at the end")
    at_end: bool = checked(True, help="also write it after the last step")
    keep_last: int = checked(0, check=at_least(0), help="HF directories kept (the oldest removed first); 0 keeps all")


@dataclasses.dataclass
class CheckpointConfig:
    dir: str | None = checked(
        None,
        check=lambda d: None if d is None else non_empty(d),
        help="this run's checkpoints; default checkpoints/<name>",
    )
    every_steps: int = checked(20, check=at_least(0), help="0 saves only at the end and on preemption")
    keep_last: int = checked(3, check=at_least(1))
    resume: str = checked("auto", check=non_empty, help="auto | none | path of a checkpoint")
    save_anchor_cache: bool = True
    save_hf: SaveHFConfig = checked(
        factory=SaveHFConfig, help="HF copies of the policy during training (<checkpoint.dir>/hf/step_<N>)"
    )


@dataclasses.dataclass
class WandbConfig:
    project: str | None = None
    entity: str | None = None
    name: str | None = None


@dataclasses.dataclass
class LoggingConfig:
    dir: str = checked("runs", check=non_empty)
    every_steps: int = checked(1, check=at_least(1))
    jsonl: bool = True
    tensorboard: bool = False
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    progress_bar: bool = True
    reference_kl: bool = checked(
        False, help="with algorithm.alpha = 1 (no mixed ratio), still compute π_ref log-probs for train/approx_kl_ref"
    )


@dataclasses.dataclass
class LaunchConfig:
    nodes: int = checked(1, check=at_least(1))
    gpus_per_node: int = checked(8, check=at_least(0), help="0 = CPU run")
    engine_gpus: int = checked(0, check=at_least(0), help="GPUs reserved for rollout engines (disaggregated)")
    partition: str | None = None
    account: str | None = None
    time: str = "48:00:00"
    requeue_exit_code: int = checked(
        85, check=in_range(3, 127), help="3..127: not a failure (1), bad input (2) or a death by signal (128+n)"
    )
    gpu_peak_tflops: float | None = checked(
        None, check=positive, help="dense bf16 peak of one GPU (989 for H100/H200 SXM); perf/mfu is logged when set"
    )
    gpu_memory_gib: float = checked(
        80.0, check=positive, help="device memory of one GPU; `armor-train --plan` refuses layouts that exceed it"
    )


@dataclasses.dataclass
class ThroughputConfig:
    """Speed options of the trained models (``models.megatron_options.Throughput``): overlapped communication
    and fused kernels, none changing what is computed. Off by default (CPU runs cannot use them);
    the GPU recipes turn them on. ``armor-train --check`` refuses the CUDA-only ones for a CPU run
    (``launch.gpus_per_node: 0``) or the local spec; the job refuses them, in one line, on a machine
    without the kernels."""

    overlap_grad_reduce: bool = checked(
        False, help="reduce each gradient bucket during backward (megatron DDP overlap_grad_reduce)"
    )
    overlap_param_gather: bool = checked(
        False,
        help="all-gather updated parameters during the next forward (distributed optimizer, GPU; needs "
        "overlap_grad_reduce); refused for now: the trainer reads parameters outside forward after each update",
    )
    gradient_accumulation_fusion: bool = checked(
        False, help="accumulate weight grads into the fp32 main_grad inside the GEMM (CUDA + APEX)"
    )
    apply_rope_fusion: bool | None = checked(None, help="TE's fused RoPE; null: on with the TE spec (not for MLA)")
    bias_activation_fusion: bool | None = checked(None, help="fused SwiGLU; null: on with the TE spec")
    bias_dropout_fusion: bool | None = checked(None, help="fused bias-dropout-add; null: on with the TE spec")


@dataclasses.dataclass
class MoEConfig:
    """Routing and token dispatch of MoE models (``models.megatron_options.MoESettings``; ignored for dense
    models). Defaults: dropless, no load-balancing loss, fp32 router, all-to-all dispatch."""

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
    name: str = checked("armor", check=non_empty)
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    anchor: AnchorConfig = dataclasses.field(default_factory=AnchorConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    reference: ReferenceConfig = dataclasses.field(default_factory=ReferenceConfig)
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
