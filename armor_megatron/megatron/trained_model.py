"""What the actor and the critic share: a trained TP/PP/EP Megatron model.

`TrainedModel` holds this rank's model chunks wrapped in Megatron DDP, the optimizer, LR
schedule and stability guard; it cuts data-parallel rows into micro-batches, runs forward and
backward through megatron's pipeline schedule and takes the guarded optimizer step, and has the
checkpoint hooks (`checkpoint.TrainableState`). Subclasses (`actor.MegatronActor`,
`critic.MegatronCritic`) add their loss in ``train_step`` and may adapt the built chunks
(``_build_chunks``) before DDP wraps them.

Also here: `ModelSettings` (what the actor, critic and reference of one run are built with alike),
`checked_rows` (validation of a train batch), `check_layout` (the initialised
megatron groups are the layout a model was asked for) and `TrainMicroBatch`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from armor_megatron.algo.metrics import reduce_loss_metrics
from armor_megatron.config.schema import OptimizerConfig, StabilityConfig
from armor_megatron.errors import UserInputError
from armor_megatron.megatron import optimizer as optim
from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.megatron.hf_weights import load_weights
from armor_megatron.megatron.logprobs import model_forward
from armor_megatron.megatron.microbatch import (
    MicroBatch,
    TokenBudget,
    data_parallel_shares,
    local_packed_microbatches,
    padded_rows,
    round_up,
    sequence_multiple,
    split_microbatches,
)
from armor_megatron.megatron.model import (
    Recompute,
    build_model_chunks,
    resolve_dtype,
    transformer_config_from_arch,
)
from armor_megatron.megatron.model_state import chunks_sharded_state_dict, load_chunks_state
from armor_megatron.megatron.stability import StabilityGuard
from armor_megatron.models.arch import ModelArch
from armor_megatron.models.megatron_options import MoESettings, Throughput

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """How one run's models are built and run, alike for the actor, the critic and the reference.

    The architecture and parallel layout, the parameter ``dtype`` (a name or a torch dtype), the
    layer spec ``use_te`` (Transformer Engine's, the local one, or None: TE when importable), rows
    per micro-batch, token-budget packing, recomputation, throughput and MoE options, and
    ``init_weights`` (False leaves megatron's ``perform_initialization`` off for a caller that
    loads every weight next: on CPU megatron draws every TP rank's initial weights at full size,
    which costs more than the load). What differs by role (optimizer, loss, seed, temperature,
    ...) is each model's own argument.
    """

    arch: ModelArch
    parallel: ParallelConfig
    dtype: str | torch.dtype
    micro_batch_size: int = 1
    use_te: bool | None = None
    token_budget: TokenBudget = TokenBudget()
    recompute: Recompute = Recompute()
    throughput: Throughput = Throughput()
    moe: MoESettings | None = None
    init_weights: bool = True

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")

    @classmethod
    def of(cls, cfg: Any, arch: ModelArch, parallel: ParallelConfig, *, init_weights: bool = True) -> ModelSettings:
        """From a run config (``model``, ``train``, ``throughput``, ``moe`` sections)."""
        return cls(
            arch,
            parallel,
            dtype=resolve_dtype(cfg.model.dtype),
            micro_batch_size=cfg.train.micro_batch_size,
            use_te={"auto": None, "local": False, "te": True}[cfg.model.spec],
            token_budget=TokenBudget.of(cfg.train),
            recompute=Recompute.of(cfg.train),
            throughput=Throughput.of(cfg.throughput),
            moe=MoESettings.of(cfg.moe),
            init_weights=init_weights,
        )

    def config_kwargs(self) -> dict[str, Any]:
        """The keywords of `model.transformer_config_from_arch` and `model.build_model_chunks` these give."""
        shared = {name: getattr(self, name) for name in ("dtype", "use_te", "recompute", "throughput", "moe")}
        return {**shared, "perform_initialization": self.init_weights}


@dataclasses.dataclass
class TrainMicroBatch:
    """One micro-batch and the per-row loss inputs of its rows, trimmed to its width s (``mb.width``).

    ``rows[key]`` is [b, s] for [N, L] batch tensors and [b] for [N] ones.
    """

    mb: MicroBatch
    rows: dict[str, torch.Tensor]


class TrainedModel:
    """What the actor and the critic share.

    This rank's model chunks wrapped in Megatron DDP, the optimizer, LR schedule and stability
    guard; data-parallel rows cut into micro-batches, the forward/backward through megatron's
    pipeline schedule, the guarded optimizer step, and the checkpoint hooks. Subclasses add their
    loss (``train_step``) and may adapt the built chunks (``_build_chunks``) before DDP wraps them.
    The constructor seeds torch and megatron's model-parallel RNG with ``seed`` before building
    the weights, so a seed gives the same initial weights whatever ran before.
    """

    def __init__(
        self,
        settings: ModelSettings,
        *,
        optimizer: OptimizerConfig,
        total_steps: int,
        seed: int = 1234,
        stability: StabilityConfig | None = None,
    ):
        from megatron.core import tensor_parallel

        check_layout(settings.parallel)
        self.settings = settings
        self.arch, self.parallel = settings.arch, settings.parallel
        self.micro_batch_size, self.token_budget = settings.micro_batch_size, settings.token_budget
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        # calculate_per_token_loss: gradients are summed over micro-batches and DP ranks (see optimizer).
        config = transformer_config_from_arch(
            settings.arch, settings.parallel, **settings.config_kwargs(), calculate_per_token_loss=True
        )
        self.model_chunks = self._build_chunks(config, seed)
        _routers_without_token_scaling(self.model_chunks)
        on_gpu = torch.cuda.is_available()
        self.ddp_chunks = optim.wrap_ddp(self.model_chunks, on_gpu=on_gpu, throughput=settings.throughput)
        no_sync = [c.no_sync for c in self.ddp_chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        config.finalize_model_grads_func = _finalize_grads_without_token_scaling
        self.optimizer, self.scheduler = optim.build_optimizer(
            self.ddp_chunks, optimizer, dtype=settings.dtype, total_steps=total_steps
        )
        self.guard = StabilityGuard(optimizer.skip_grad_norm_ratio, stability)

    def _build_chunks(self, config: Any, seed: int) -> list[Any]:
        s = self.settings
        return build_model_chunks(s.arch, s.parallel, dtype=s.dtype, config=config, use_te=s.use_te)

    @property
    def _interleaved(self) -> bool:
        return len(self.ddp_chunks) > 1

    # ------------------------------------------------------------------ weights
    def load_weights(self, path: str) -> None:
        """Load model weights from a torch_dist checkpoint.

        Keys of ``model.sharded_state_dict()``, no prefix (the converter's output or one of our
        checkpoints), resharded as needed; or from an HF directory (each rank reads its own slices:
        `hf_weights`).
        """
        load_weights(self.model_chunks, path)
        self.optimizer.reload_model_params()  # refresh fp32 master weights of a bf16 model

    # ------------------------------------------------------------------ training
    def _train_on(
        self,
        batch: dict[str, torch.Tensor],
        loss_of: Callable[[TrainMicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    ) -> dict[str, float]:
        """Forward, backward and a guarded optimizer step over every row of `batch` (checked CPU tensors).

        ``loss_of(tmb, output)`` returns (loss / GLOBAL normalizer, metrics with ``num_tokens``) of
        one micro-batch from the last stage's output; the metrics of all micro-batches and
        data-parallel ranks are combined by ``reduce_loss_metrics``.
        """
        calls: list[dict[str, torch.Tensor]] = []
        losses: list[torch.Tensor] = []

        def loss_func(
            tmb: TrainMicroBatch, output: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
            loss, metrics = loss_of(tmb, output)
            calls.append(metrics)
            losses.append(loss.detach())
            return loss, metrics["num_tokens"].to(torch.int), {}

        def forward_step(
            data_iterator: Iterator[TrainMicroBatch], model: Any
        ) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
            tmb = next(data_iterator)
            return model_forward(model, tmb.mb), functools.partial(loss_func, tmb)

        self._forward_backward(self._local_microbatches(batch), forward_step)
        metrics = _step_metrics(calls, losses)
        norm = optim.grad_norm(self.optimizer)
        decision = self.guard.check({**metrics, "grad_norm": norm})
        lr = self._scale_lr(decision.lr_scale)
        if not decision.skip:
            optim.apply_update(self.optimizer, self.scheduler, norm)
        line = decision.log_line()
        if line is not None and dist.get_rank() == 0:
            logger.warning(line)
        metrics.update(grad_norm=norm, lr=lr, **decision.metrics())
        return metrics

    def _scale_lr(self, scale: float) -> float:
        """Set every param group's lr for this update.

        lr = the schedule's lr(k) × the guard's `scale` (the schedule resets it when it advances);
        returns the lr now in force.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = self.scheduler.get_lr(group) * scale
        return optim.current_lr(self.optimizer)

    def _forward_backward(self, microbatches: list[TrainMicroBatch], forward_step: Callable[..., Any]) -> None:
        """Zero the grads, then forward and backward of every micro-batch through megatron's pipeline schedule.

        The grads end summed over micro-batches and data-parallel ranks.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for chunk in self.ddp_chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        many = self._interleaved
        config = self.model_chunks[0].config
        variable, aux_coeff = config.variable_seq_lengths, config.moe_aux_loss_coeff
        config.variable_seq_lengths = variable and not many  # the interleaved schedule gets fixed shapes
        config.moe_aux_loss_coeff = _mean_aux_loss_coeff(aux_coeff, len(microbatches))
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(microbatches) for _ in self.ddp_chunks] if many else iter(microbatches),
                model=self.ddp_chunks if many else self.ddp_chunks[0],
                num_microbatches=len(microbatches),
                seq_length=max(t.mb.tokens.shape[1] for t in microbatches),
                micro_batch_size=max(t.mb.tokens.shape[0] for t in microbatches),
                forward_only=False,
            )
        finally:
            config.variable_seq_lengths, config.moe_aux_loss_coeff = variable, aux_coeff

    def _local_microbatches(self, batch: dict[str, torch.Tensor]) -> list[TrainMicroBatch]:
        """This data-parallel rank's rows cut into micro-batches.

        `micro_batch_size` rows each, or with ``token_budget.train`` set, packed into micro-batches
        of at most that many tokens.

        Padding rows (token 0, length 1, all-zero mask: zero loss, zero gradient) give every
        data-parallel rank as many micro-batches -- which the expert all-to-alls of an MoE model
        (one per micro-batch, across these ranks) require -- and keep a rank without rows in the
        gradient all-reduce. For the interleaved (VPP) schedule, which exchanges fixed
        [L, micro_batch_size, h] activations, they also fill every micro-batch to
        micro_batch_size rows of length L (packed: to the budget) and their number to a
        multiple of pp.
        """
        if self.token_budget.train is not None:
            return self._packed_local_microbatches(batch, self.token_budget.train)
        from megatron.core import parallel_state

        shares, per_rank = data_parallel_shares(batch["input_ids"].shape[0])
        rows = shares[parallel_state.get_data_parallel_rank()]
        if self._interleaved:
            unit = self.micro_batch_size * parallel_state.get_pipeline_model_parallel_world_size()
            target = round_up(per_rank, unit)
        else:
            target = per_rank
        multiple = sequence_multiple(self.model_chunks)
        local = padded_rows({k: v[rows] for k, v in batch.items() if v is not None}, target - len(rows))
        local = _padded_columns(local, round_up(batch["input_ids"].shape[1], multiple))
        out = []
        for mb in split_microbatches(local["input_ids"], local["lengths"], self.micro_batch_size, multiple_of=multiple):
            s = local["input_ids"].shape[1] if self._interleaved else mb.tokens.shape[1]
            tokens = torch.nn.functional.pad(mb.tokens, (0, s - mb.tokens.shape[1]))
            mb = MicroBatch(mb.index, tokens, mb.lengths)
            out.append(TrainMicroBatch(mb=mb, rows=_loss_rows(local, mb)))
        return out

    def _packed_local_microbatches(self, batch: dict[str, torch.Tensor], budget: int) -> list[TrainMicroBatch]:
        """Token-budget micro-batches (`microbatch.local_packed_microbatches`).

        A filler runs one padding row, appended after this rank's rows.
        """
        from megatron.core import parallel_state

        pp = parallel_state.get_pipeline_model_parallel_world_size()
        mbs, shares = local_packed_microbatches(
            batch["input_ids"],
            batch["lengths"],
            budget,
            sequence_multiple(self.model_chunks),
            count_multiple=pp if self._interleaved else 1,
            fixed_width=self._interleaved,
        )
        rows = shares[parallel_state.get_data_parallel_rank()]
        local = padded_rows({k: v[rows] for k, v in batch.items() if v is not None}, 1)
        filler = torch.tensor([len(rows)])
        out = []
        for mb in mbs:
            if len(mb.index) == 0:
                mb = dataclasses.replace(mb, index=filler)
            out.append(TrainMicroBatch(mb=mb, rows=_loss_rows(local, mb)))
        return out

    # ------------------------------------------------------------------ checkpoint hooks
    checkpoint_prefix = ""  # of the model's tensor keys in training checkpoints

    def model_sharded_state_dict(self) -> dict[str, Any]:
        """The model chunks' weights as a sharded state dict (keys prefixed ``checkpoint_prefix``)."""
        return chunks_sharded_state_dict(self.model_chunks, self.checkpoint_prefix)

    def sharded_state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves of this model.

        Model (keys prefixed ``checkpoint_prefix``), optimizer (once it has state), LR schedule
        and guard, for dist_checkpointing.save.
        """
        model = self.model_sharded_state_dict()
        state = {"model": model, "scheduler": self.scheduler.state_dict(), "guard": self.guard.state_dict()}
        if self.has_optimizer_state:  # before the first update Adam has no moments to save
            state["optimizer"] = self.optimizer.sharded_state_dict(model)
        return state

    @property
    def has_optimizer_state(self) -> bool:
        """Whether the optimizer holds state yet (after its first step)."""
        return len(self.optimizer.state) > 0

    def sharded_state_dict_to_load(self, load_optimizer: bool) -> dict[str, Any]:
        """The sharded tensors dist_checkpointing.load should fill: model, and optimizer if asked."""
        state = {"model": self.model_sharded_state_dict()}
        if load_optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(state["model"], is_loading=True)
        return state

    def restore_base(self, checkpoint: str, saved: dict[str, Any] | None) -> None:
        """Called before loading ``checkpoint``; ``saved``: the base it left out (LoRA, `MegatronActor.restore_base`)."""
        if saved is not None:
            raise UserInputError(
                f"{checkpoint} holds LoRA adapters without their base: resume it with the run's lora settings"
            )

    def load_sharded_state_dict(self, loaded: dict[str, Any]) -> None:
        """Restore what :meth:`sharded_state_dict` saved.

        Counterpart of `sharded_state_dict` for the dict dist_checkpointing.load returns
        (``optimizer`` may be absent: model, schedule and guard are restored, Adam starts fresh).
        """
        load_chunks_state(self.model_chunks, loaded["model"], self.checkpoint_prefix)
        if "optimizer" in loaded:
            self.optimizer.load_state_dict(loaded["optimizer"])
        else:
            self.optimizer.reload_model_params()
        self.scheduler.load_state_dict(loaded["scheduler"])
        self.guard.load_state_dict(loaded["guard"])


# ----------------------------------------------------------------------------- helpers
def check_layout(parallel: ParallelConfig) -> None:
    """Raise when megatron's current model-parallel groups are not the layout `parallel` names."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron model parallelism is not initialised: call dist.initialize(parallel, arch) first")
    current = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
    )
    wanted = (parallel.tp, parallel.pp, parallel.ep, parallel.vpp)
    if current != wanted:
        raise ValueError(f"parallel layout (tp, pp, ep, vpp)={wanted} differs from the initialised one {current}")


def _finalize_grads_without_token_scaling(model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
    """Megatron's finalize_model_grads without its 1/num_tokens scaling.

    Megatron's finalize_model_grads (DP all-reduce, tied-embedding and SP norm grads) without
    its 1/num_tokens scaling: our losses are already divided by the global normalizer.
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


def _routers_without_token_scaling(model_chunks: Sequence[torch.nn.Module]) -> None:
    """MoE load-balancing losses as plain per-micro-batch losses (see `_mean_aux_loss_coeff`).

    Under ``calculate_per_token_loss`` megatron's routers multiply each micro-batch's aux loss by
    its token count, for ``finalize_model_grads`` to divide every gradient by the step's tokens;
    our finalize skips that division (the policy and value losses are already divided by their
    global normaliser), which would leave aux gradients ~tokens-per-step times too large.
    """
    from megatron.core.transformer.moe.router import Router

    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, Router):
                module.calculate_per_token_loss = False


def _mean_aux_loss_coeff(coeff: Any, microbatches: int) -> Any:
    """The aux-loss coefficient for one step of `microbatches` per data-parallel rank.

    C / (m · dp), so that the gradients, summed over micro-batches and ranks like the main loss's,
    carry c times the MEAN load-balancing loss over them (megatron's own semantics for it).
    """
    from megatron.core import parallel_state

    scale = microbatches * parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    if isinstance(coeff, (list, tuple)):
        return type(coeff)(c / scale for c in coeff)
    return coeff / scale if coeff else coeff


def _padded_columns(rows: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """Per-token tensors ([B, T, ...]) zero-padded to ``width`` positions; [B] ones untouched."""
    return {
        k: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]))
        if t.dim() >= 2 and t.shape[1] < width
        else t
        for k, t in rows.items()
    }


def _loss_rows(local: dict[str, torch.Tensor], mb: MicroBatch) -> dict[str, torch.Tensor]:
    """The per-row loss inputs of `mb`'s rows: [b, mb.width] of [N, L] tensors, [b] of [N] ones."""
    i, s = mb.index, mb.width
    return {k: (v[i] if v.dim() == 1 else v[i, :s]) for k, v in local.items() if k not in ("input_ids", "lengths")}


def checked_rows(
    batch: Mapping[str, torch.Tensor], required: Sequence[str], token_keys: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Check a train batch.

    Expects input_ids [N, L], lengths [N], response_mask [N, L] (made bool) marking only positions 1 <= t <
    lengths, the `required` keys present, `token_keys` (when given) [N, L]. Returns detached CPU
    tensors; raises one line naming the first problem.
    """
    missing = [k for k in ("input_ids", "lengths", "response_mask", *required) if k not in batch]
    if missing:
        raise KeyError(f"train batch lacks {', '.join(missing)}")
    out = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
    ids, lengths = out["input_ids"], out["lengths"]
    if ids.dim() != 2 or ids.shape[0] == 0 or lengths.shape != ids.shape[:1]:
        raise ValueError(
            f"input_ids must be [N, L] with N >= 1 and lengths [N]; got {tuple(ids.shape)}, {tuple(lengths.shape)}"
        )
    for key in ("response_mask", *token_keys):
        if out.get(key) is not None and out[key].shape != ids.shape:
            raise ValueError(f"{key} has shape {tuple(out[key].shape)}, expected {tuple(ids.shape)} like input_ids")
    mask = out["response_mask"].bool()
    t = torch.arange(ids.shape[1])[None, :]
    if (mask & ((t < 1) | (t >= lengths[:, None]))).any():
        raise ValueError("response_mask marks positions outside 1 <= t < lengths (t is predicted from tokens < t)")
    out["response_mask"] = mask
    return out


def _step_metrics(calls: list[dict[str, torch.Tensor]], losses: list[torch.Tensor]) -> dict[str, float]:
    """Combine the step's per-micro-batch metrics over data-parallel ranks.

    The last pipeline stage's metrics are combined, then handed to every rank of the pipeline
    (object collectives: a few floats per step).
    """
    from megatron.core import parallel_state

    result: list[Any] = [None]
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        local = reduce_loss_metrics(calls)
        local["loss"] = float(sum(losses))
        gathered: list[Any] = [None] * parallel_state.get_data_parallel_world_size()
        dist.all_gather_object(gathered, local, group=parallel_state.get_data_parallel_group())
        combined = reduce_loss_metrics(gathered)
        combined["loss"] = sum(g["loss"] for g in gathered)
        result = [combined]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(
            result,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    metrics: dict[str, float] = result[0]
    return metrics
