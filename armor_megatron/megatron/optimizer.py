"""Megatron DDP, optimizer and LR schedule for the actor, and the pieces of one optimizer step.

Public interface::

    ddp_chunks = wrap_ddp(model_chunks, on_gpu=..., throughput=None)    # megatron DDP per chunk
    optimizer, scheduler = build_optimizer(ddp_chunks, cfg, dtype=..., total_steps=...)
    scheduler = build_scheduler(optimizer, cfg, total_steps=...)   # (part of build_optimizer)
    norm = grad_norm(optimizer)                                # after backward; pre-clipping L2 norm
    apply_update(optimizer, scheduler, norm)                   # clip to cfg.clip_grad, step, advance LR

Gradients are SUMMED over data-parallel ranks (megatron's ``calculate_per_token_loss`` mode:
no 1/dp scaling in DDP, no 1/#micro-batches scaling in the schedule): the caller's loss must
already be divided by the global normalizer, so the summed gradient is that of the global loss.

Optimizer: megatron's Adam (AdamW: decoupled weight decay; biases and norms get no weight
decay) with an fp32 master copy for bf16 models. The distributed optimizer (optimizer state
sharded over data-parallel ranks) is used on GPUs; on CPU megatron refuses it, so the plain
one is used there (identical math).

LR schedule (megatron's ``OptimizerParamScheduler``): update k (0-based, counting applied
updates only; skipped steps do not advance it) uses lr(k): linear warmup from 0 over
``warmup_steps`` (lr(0) = 0 when warmup_steps > 0, as in Megatron-LM), then ``constant``, or
``linear`` / ``cosine`` decay from ``lr`` to ``min_lr`` reached at k = total_steps.
"""

from __future__ import annotations

from typing import Any

import torch

from armor_megatron.config.schema import OptimizerConfig
from armor_megatron.megatron.model import resolve_dtype
from armor_megatron.models.megatron_options import Throughput


def wrap_ddp(model_chunks: list[Any], *, on_gpu: bool, throughput: Throughput | None = None) -> list[Any]:
    """Wrap each model chunk in Megatron's ``DistributedDataParallel``.

    Megatron ``DistributedDataParallel`` around each chunk (grads in fp32 buffers; only the first
    chunk is bucketed, as Megatron-LM does). Grads are reduced after the last micro-batch's backward,
    or bucket by bucket during it with ``throughput.overlap_grad_reduce``; with
    ``throughput.overlap_param_gather`` the distributed optimizer's parameter all-gather is left
    to the next forward (GPU only: it needs the distributed optimizer, and overlap_grad_reduce).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    throughput = throughput or Throughput()
    if throughput.overlap_param_gather and not (on_gpu and throughput.overlap_grad_reduce):
        raise ValueError(
            "throughput.overlap_param_gather needs the distributed optimizer (GPU runs) and overlap_grad_reduce"
        )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=throughput.overlap_grad_reduce,
        overlap_param_gather=throughput.overlap_param_gather,
        use_distributed_optimizer=on_gpu,
        check_for_nan_in_grad=False,
    )
    return [
        DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(model_chunks)
    ]


def build_optimizer(
    ddp_chunks: list[Any], cfg: OptimizerConfig, *, dtype: str | torch.dtype, total_steps: int
) -> tuple[Any, Any]:
    """Megatron optimizer over `ddp_chunks` and its LR scheduler (see module docstring)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    dtype = resolve_dtype(dtype)
    megatron_cfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=ddp_chunks[0].ddp_config.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(megatron_cfg, ddp_chunks)
    return optimizer, build_scheduler(optimizer, cfg, total_steps=total_steps)


def build_scheduler(optimizer: Any, cfg: OptimizerConfig, *, total_steps: int) -> Any:
    """Megatron's ``OptimizerParamScheduler`` for `cfg` (see module docstring).

    Sets the lr of every param group of `optimizer` (anything with ``param_groups``) to lr(0) at
    once.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if cfg.min_lr > cfg.lr:
        raise ValueError(f"min_lr={cfg.min_lr} exceeds lr={cfg.lr}")
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=max(total_steps, cfg.warmup_steps + 1),
        lr_decay_style=cfg.lr_schedule,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )


def current_lr(optimizer: Any) -> float:
    """The learning rate of the optimizer's first param group."""
    return float(optimizer.param_groups[0]["lr"])


@torch.no_grad()
def grad_norm(optimizer: Any) -> float:
    """Move the reduced grads to the optimizer's params; their global L2 norm.

    The norm is over every model-parallel shard, counting tensor-parallel duplicates once.
    """
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm())


@torch.no_grad()
def apply_update(optimizer: Any, scheduler: Any, norm: float) -> None:
    """Clip the grads by ``norm``, step the optimizer and the LR schedule.

    Clip the prepared grads by `norm` (coefficient clip_grad / (norm + 1e-6) when below 1),
    take the optimizer step and advance the LR schedule by one update.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in optimizer.chained_optimizers:
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                params,
                opt.config.clip_grad,
                norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    if not optimizer.step_with_ready_grads():
        raise RuntimeError("megatron optimizer step reported failure")
    scheduler.step(increment=1)
