"""Low-rank adapters (LoRA) on megatron-core's tensor-parallel linears, and the reference they make free.

Public interface (after `dist.initialize(parallel, arch)`; every rank calls every function)::

    lora = LoRASettings(rank=16, alpha=32.0, targets=("linear_qkv", ...), seed=1234)   # or LoRASettings.of(cfg.lora, seed)
    attach_adapters(model_chunks, lora)     # freezes the base, adds the adapters (before DDP wraps the chunks)
    with adapters_disabled(model_chunks):   # forwards see the base alone: π_ref
        ...
    merge_adapters(model_chunks)            # W += s·B·A on every shard, then new adapters (A fresh, B = 0)
    adapter_sharded_state_dict(model_chunks, prefix)   # {"chunk<i>": {...}} of the adapters, for checkpoints
    adapters_of(model_chunks)               # [(module path, LoRALinear)] of this rank
    ref = LoRAReference(actor)              # π_ref: the actor's own chunks with the adapters off

The math. A targeted linear y = x·Wᵀ gets y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with A [r, in], B [out, r] and
s = alpha / r. B starts at 0 (the model starts as the base, exactly); A is drawn as HF PEFT draws
it (kaiming-uniform with a = √5: U(−1/√in, 1/√in)) from a generator seeded by (seed, layer, module,
projection, generation), so every TP/PP layout draws the same A. Fused linears get one adapter per
logical projection, as HF PEFT has them on the HF model: ``linear_qkv`` -> ``q_proj``, ``k_proj``,
``v_proj`` (GQA: their rows are interleaved per query group g as the base's are: g's q heads, then
k head g, then v head g), ``linear_fc1`` -> ``gate_proj``, ``up_proj`` ([gate; up] on every TP rank),
``linear_proj`` -> ``o_proj``, ``linear_fc2`` -> ``down_proj``.

Sharding follows the base weight (TP size t):

* column-parallel (``linear_qkv``, ``linear_fc1``; W split on output rows): A [r, in] whole on every
  rank, B split on its rows like W. h = x·Aᵀ passes megatron's ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce of ∂h backward), so A's gradient, the same on every rank, is the
  full one and x's gradient adds s·∂h·A once;
* row-parallel (``linear_proj``, ``linear_fc2``; W split on input columns, output all-reduced): A split
  on its columns like W, B [out, r] whole. The r-wide partial products x_i·A_iᵀ are all-reduced
  (``reduce_from_tensor_model_parallel_region``) before B, one all-reduce of [tokens, r] beside the
  base's [tokens, out]: B, held whole, then gets its whole gradient s·∂yᵀ·h on every rank (reducing
  the partial s·h_i·Bᵀ with the base output instead would leave B's gradient partial on each rank).

Only the adapters train: `attach_adapters` sets ``requires_grad=False`` on every base parameter, so
megatron's DDP gives them no gradient buffer, its optimizer no fp32 master copy and no Adam moments
(megatron-core 0.16.1 skips parameters without ``requires_grad`` in both), and its linears take the
frozen-weight path (``linear_with_frozen_weight``: same values, no weight gradient).

Checkpoint keys: the base's are unchanged (`model.sharded_state_dict()`, the converter's layout: a
base checkpoint or HF directory loads into an adapted model, which keeps its adapters); the
adapters are ``decoder.layers.<path>.lora.{A,B}.<projection>``, layers stacked on a leading axis like
the base, TP shards recorded as offsets, so they reshard at any TP/PP.

Supported: the local layer spec, dense attention and MLP; MoE models' attention (``linear_qkv``,
``linear_proj``). Refused in one line: the TE spec (its linears fuse the input norm, so the adapter
would see the un-normalised input), MoE experts, MLA attention, sequence parallelism, dropout at tp > 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from armor_megatron.config.schema import LORA_PEFT_MODULES, LORA_TARGETS, lora_peft_modules
from armor_megatron.errors import UserInputError
from armor_megatron.megatron.logprobs import LogProbs

TARGETS = LORA_TARGETS
_OWNER = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
PROJECTIONS = LORA_PEFT_MODULES  # HF PEFT's names of each target's logical projections (one adapter each)
CHECKPOINT_KEY = "lora"  # the adapter module's attribute on its linear, and its key segment
LORA_SETTINGS = "lora_settings"  # the key of a checkpoint's common state recording `LoRASettings.to_state`


class LoRAError(UserInputError):
    """A model or layout the adapters cannot be built on."""


@dataclasses.dataclass(frozen=True)
class LoRASettings:
    """Rank r, alpha (scale s = alpha / r), input dropout, targeted linears and the seed A is drawn from."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    seed: int = 1234

    def __post_init__(self) -> None:
        unknown = [t for t in self.targets if t not in TARGETS]
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1 or unknown or not self.targets:
            raise LoRAError(
                f"lora settings {self} are not rank >= 1, alpha > 0, 0 <= dropout < 1, targets in {TARGETS}"
            )

    @property
    def scale(self) -> float:
        """The scale s = alpha / rank."""
        return self.alpha / self.rank

    def to_state(self) -> dict[str, Any]:
        """What a checkpoint's common state records of the adapters (``LORA_SETTINGS``): rank, alpha, dropout, targets."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}

    @classmethod
    def of(cls, lora: Any, seed: int) -> LoRASettings | None:
        """From a run config's ``lora`` section; None when it is not enabled."""
        if not lora.enabled:
            return None
        return cls(lora.rank, float(lora.alpha), float(lora.dropout), tuple(lora.target_modules), seed)


class LoRALinear(torch.nn.Module):
    """The adapters of one megatron linear: ``A[p]``, ``B[p]`` per logical projection p (module docstring).

    ``column``: the base splits its output rows over TP (A whole, B split); else it splits its input
    columns (A split, B whole). ``rows[p]``: projection p's local output rows (column) or the full
    output (row); ``in_local``: the local input width. ``groups``: for ``linear_qkv``, the local query
    groups whose rows interleave q, k and v.
    """

    def __init__(
        self,
        *,
        target: str,
        layer: int,
        column: bool,
        rows: dict[str, int],
        in_local: int,
        tp_rank: int,
        tp_size: int,
        tp_group: Any,
        settings: LoRASettings,
        dtype: torch.dtype,
        device: torch.device,
        groups: int | None = None,
    ):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.target, self.layer, self.column, self.groups = target, layer, column, groups
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.rank, self.scale, self.seed = settings.rank, settings.scale, settings.seed
        self.in_local, self.in_full = in_local, in_local * (1 if column else tp_size)
        self.enabled = True
        self.drop = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for p, out in rows.items():
            a = torch.nn.Parameter(torch.empty(self.rank, in_local, dtype=dtype, device=device))
            b = torch.nn.Parameter(torch.zeros(out, self.rank, dtype=dtype, device=device))
            # the TP-split one is this rank's shard (counted once per rank in the grad norm); the whole one is TP-replicated
            set_tensor_model_parallel_attributes(b if column else a, True, 0 if column else 1, 1)
            self.A[p], self.B[p] = a, b
        self.reinit(generation=0)

    @torch.no_grad()
    def reinit(self, generation: int) -> None:
        """A drawn fresh (PEFT's kaiming-uniform, a = √5), B = 0: the adapted linear equals its base again."""
        bound = 1.0 / math.sqrt(self.in_full)
        for p, a in self.A.items():
            key = f"{self.seed}/{self.layer}/{self.target}/{p}/{generation}".encode()
            g = torch.Generator().manual_seed(zlib.crc32(key))
            full = torch.empty(self.rank, self.in_full).uniform_(-bound, bound, generator=g)
            if not self.column:
                full = full[:, self.tp_rank * self.in_local : (self.tp_rank + 1) * self.in_local]
            a.copy_(full)
            self.B[p].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update s·(x·Aᵀ)·Bᵀ on this rank's output shard (column) or the whole output (row); x as the base sees it."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        a = torch.cat(list(self.A.values())) if len(self.A) > 1 else next(iter(self.A.values()))
        h = self.drop(x) @ a.t()
        if self.column:
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        r = self.rank
        parts = [h[..., i * r : (i + 1) * r] @ b.t() for i, b in enumerate(self.B.values())]
        return self.combine(parts) * self.scale

    def delta_weight(self, device: torch.device) -> torch.Tensor:
        """s·B·A in fp32 on ``device``, shaped as this rank's shard of the base weight (rows in the base's order).

        The product runs on ``device`` (the weight's): adapters read from a host copy (an offloaded
        trainer's weight sync) are moved there first, r columns at a time.
        """
        parts = [(b.to(device).float() @ a.to(device).float()) for a, b in zip(self.A.values(), self.B.values())]
        return self.combine([d.t() for d in parts]).t() * self.scale

    def combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The projections' outputs (last dim) in the base's row order: q/k/v interleaved per query group, else [gate; up]."""
        if len(parts) == 1:
            return parts[0]
        if self.groups is None:
            return torch.cat(parts, dim=-1)
        lead = parts[0].shape[:-1]
        grouped = [t.reshape(*lead, self.groups, -1) for t in parts]
        return torch.cat(grouped, dim=-1).reshape(*lead, -1)


# ----------------------------------------------------------------------------- building
def attach_adapters(model_chunks: Sequence[torch.nn.Module], settings: LoRASettings) -> None:
    """Freeze every base parameter and give each targeted linear its `LoRALinear` (before DDP wraps the chunks)."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        for path, linear, layer in _targeted_linears(chunk, settings.targets):
            adapter = _adapter_for(linear, path, layer, settings)
            linear.add_module(CHECKPOINT_KEY, adapter)
            linear.register_forward_hook(_add_adapter_output, with_kwargs=True)
            # the linear's own sharded state stays the base's (megatron would file the adapters as replicated
            # tensors of it); the actor adds the adapters, sharded right (`adapter_sharded_state_dict`)
            linear.sharded_state_dict = functools.partial(_base_sharded_state_dict, linear)
            # base checkpoints and HF directories hold no adapter: a load without them keeps them as they are
            adapter.register_load_state_dict_pre_hook(_keep_missing_adapters)  # type: ignore[no-untyped-call]


def _targeted_linears(chunk: torch.nn.Module, targets: Sequence[str]) -> Iterator[tuple[str, Any, int]]:
    """(module path in the chunk, linear, global 0-based layer) of every targeted linear of ``chunk``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    module = _unwrapped(chunk)
    for i, layer in enumerate(module.decoder.layers):
        for target in targets:
            owner = getattr(layer, _OWNER[target])
            linear = getattr(owner, target, None)
            path = f"decoder.layers.{i}.{_OWNER[target]}.{target}"
            if linear is None:
                what = type(owner).__name__
                raise LoRAError(f"lora: {path} does not exist ({what}: MoE experts and MLA attention get no adapters)")
            if type(linear) not in (ColumnParallelLinear, RowParallelLinear):
                raise LoRAError(
                    f"lora needs the local layer spec (model.spec: local): {path} is {type(linear).__name__}"
                )
            yield path, linear, layer.layer_number - 1


def _adapter_for(linear: Any, path: str, layer: int, settings: LoRASettings) -> LoRALinear:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    target = path.rsplit(".", 1)[1]
    config = linear.config
    if config.sequence_parallel:
        raise LoRAError("lora does not support sequence parallelism")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if settings.dropout and tp > 1:
        raise LoRAError(f"lora.dropout={settings.dropout} needs tp = 1 (TP ranks would drop differently)")
    out_local, in_local = linear.weight.shape
    column = isinstance(linear, ColumnParallelLinear)
    names, groups = PROJECTIONS[target], None
    if target == "linear_qkv":
        groups = config.num_query_groups // tp
        d, per_group = config.kv_channels, config.num_attention_heads // config.num_query_groups
        rows = {"q_proj": groups * per_group * d, "k_proj": groups * d, "v_proj": groups * d}
    elif target == "linear_fc1" and config.gated_linear_unit:
        rows = {"gate_proj": out_local // 2, "up_proj": out_local // 2}
    else:
        rows = {names[-1] if target == "linear_fc1" else names[0]: out_local}
    if sum(rows.values()) != out_local:
        raise LoRAError(f"lora: {path} has {out_local} rows, its projections {rows} do not add up to them")
    return LoRALinear(
        target=target,
        layer=layer,
        column=column,
        rows=rows,
        in_local=in_local,
        tp_rank=tp_rank,
        tp_size=tp,
        tp_group=linear.tp_group,
        settings=settings,
        dtype=linear.weight.dtype,
        device=linear.weight.device,
        groups=groups,
    )


def _add_adapter_output(
    linear: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: tuple[torch.Tensor, Any]
) -> tuple[torch.Tensor, Any]:
    """Forward hook of an adapted linear: (y + s·(x·Aᵀ)·Bᵀ, bias) while its adapter is enabled."""
    adapter = getattr(linear, CHECKPOINT_KEY)
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


def _base_sharded_state_dict(linear: Any, prefix: str = "", *args: Any, **kwargs: Any) -> dict[str, Any]:
    state = type(linear).sharded_state_dict(linear, prefix, *args, **kwargs)
    return {k: v for k, v in state.items() if not k.startswith(f"{prefix}{CHECKPOINT_KEY}.")}


def _keep_missing_adapters(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    for name, param in module.named_parameters():
        state_dict.setdefault(prefix + name, param)


def adapters_of(model_chunks: Sequence[torch.nn.Module]) -> list[tuple[int, str, LoRALinear]]:
    """(chunk index, module path of the linear, adapter) of every adapter on this rank."""
    found = []
    for i, chunk in enumerate(model_chunks):
        module = _unwrapped(chunk)
        for name, sub in module.named_modules():
            if isinstance(sub, LoRALinear):
                found.append((i, name.removesuffix(f".{CHECKPOINT_KEY}"), sub))
    return found


def has_adapters(model_chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks carry adapters."""
    return bool(adapters_of(model_chunks))


@contextlib.contextmanager
def adapters_disabled(model_chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Inside the block every adapter is off: forwards compute the base model, π_ref."""
    adapters = [a for _, _, a in adapters_of(model_chunks)]
    states = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(adapters, states):
            a.enabled = state


@torch.no_grad()
def merge_adapters(model_chunks: Sequence[torch.nn.Module], generation: int) -> None:
    """W ← W + s·B·A on every shard (fp32 sum, rounded once to W's dtype), then A fresh, B = 0.

    The adapted model computes the same function before and after (up to W's rounding); the base,
    π_ref, becomes the policy. ``generation`` (resets so far) seeds the new A.
    """
    for chunk, path, adapter in adapters_of(model_chunks):
        weight = _unwrapped(model_chunks[chunk]).get_submodule(path).weight
        weight.copy_((weight.float() + adapter.delta_weight(weight.device)).to(weight.dtype))
        adapter.reinit(generation)


def _unwrapped(chunk: Any) -> Any:
    """The GPTModel inside a (DDP-wrapped) chunk."""
    return getattr(chunk, "module", chunk)


# ----------------------------------------------------------------------------- checkpoints and export
def adapter_sharded_state_dict(model_chunks: Sequence[torch.nn.Module], prefix: str = "") -> dict[str, dict[str, Any]]:
    """{"chunk<i>": {module key: ShardedTensor}} of the adapters (layers stacked on a leading axis, TP offsets)."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    out: dict[str, dict[str, Any]] = {f"chunk{i}": {} for i in range(len(model_chunks))}
    for chunk, path, adapter in adapters_of(model_chunks):
        layers = _unwrapped(model_chunks[chunk]).config.num_layers
        stacked = path.split(".", 3)
        global_path = ".".join([stacked[0], stacked[1], stacked[3]])  # decoder.layers.<rest>: the layer axis
        offsets = ((0, adapter.layer, layers),)
        for kind, params in (("A", adapter.A), ("B", adapter.B)):
            split = (kind == "B") == adapter.column
            for p, tensor in params.items():
                key = f"{prefix}{global_path}.{CHECKPOINT_KEY}.{kind}.{p}"
                local = f"{path}.{CHECKPOINT_KEY}.{kind}.{p}"
                if split:
                    axis = 0 if adapter.column else 1
                    sharded = make_tp_sharded_tensor_for_checkpoint(tensor, key, axis, prepend_offsets=offsets)
                else:
                    sharded = make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets=offsets)
                out[f"chunk{chunk}"][local] = sharded
    return out


def export_merges(chunk: Any) -> tuple[set[str], dict[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """For the weight export of one chunk: the adapter parameter names to skip, and per adapted weight its merge.

    ``merge(shard)`` returns W_shard + s·B·A (this rank's shard, fp32 sum rounded to W's dtype), one
    weight at a time as the export reaches it: never a merged copy of the model. A `BaseWeights`
    chunk (π_ref) skips the adapters and merges nothing.
    """
    base_only = isinstance(chunk, BaseWeights)
    module = chunk.module if base_only else _unwrapped(chunk)
    skip: set[str] = set()
    merges: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for _, path, adapter in adapters_of([module]):
        skip.update(f"{path}.{CHECKPOINT_KEY}.{n}" for n, _ in adapter.named_parameters())
        if not base_only:
            merges[f"{path}.weight"] = _merger(adapter)
    return skip, merges


def _merger(adapter: LoRALinear) -> Callable[[torch.Tensor], torch.Tensor]:
    def merge(shard: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return (shard.float() + adapter.delta_weight(shard.device)).to(shard.dtype)

    return merge


@dataclasses.dataclass(frozen=True)
class BaseWeights:
    """A model chunk read as its base alone (adapters off): what the weight export sends for π_ref."""

    module: torch.nn.Module


def peft_name(layer: int, target: str, projection: str, kind: str) -> str:
    """HF PEFT's name of an adapter matrix (``kind`` A or B) on the HF model."""
    owner = "self_attn" if _OWNER[target] == "self_attention" else "mlp"
    return f"base_model.model.model.layers.{layer}.{owner}.{projection}.lora_{kind}.weight"


def peft_adapter_tensors(model_chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor] | None:
    """Every adapter matrix at its full shape under HF PEFT's names, on global rank 0 (None elsewhere).

    Every rank calls it: TP shards are all-gathered in their TP group, then the first TP and
    data-parallel replica of each pipeline stage hands its adapters to rank 0 (an object gather:
    the adapters are a few percent of the model).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = {}
    owner = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    for _, _, a in adapters_of(model_chunks):
        for kind, params in (("A", a.A), ("B", a.B)):
            for projection, param in params.items():
                t = param.detach()
                if (kind == "B") == a.column and a.tp_size > 1:
                    t = t.to(_collective_device(a.tp_group))  # a host copy (offloaded trainer) gathers on the GPU
                    parts = [torch.empty_like(t) for _ in range(a.tp_size)]
                    dist.all_gather(parts, t.contiguous(), group=a.tp_group)
                    t = torch.cat(parts, dim=0 if a.column else 1)
                if owner:
                    local[peft_name(a.layer, a.target, projection, kind)] = t.cpu().clone()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    return {k: v for part in gathered for k, v in part.items()} if gathered is not None else None


def peft_adapter_config(settings: LoRASettings, base: str = "") -> dict[str, Any]:
    """HF PEFT's ``adapter_config.json`` of the adapters (``base``: ``base_model_name_or_path``).

    What `save_peft_adapter` writes and what SGLang's ``/load_lora_adapter_from_tensors`` takes as
    ``config_dict`` (it reads ``r``, ``lora_alpha`` and ``target_modules``).
    """
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": lora_peft_modules(settings.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }


def _collective_device(group: Any) -> torch.device:
    """Where ``group``'s collectives take tensors: this rank's GPU under NCCL, else the host."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def save_peft_adapter(
    model_chunks: Sequence[torch.nn.Module], settings: LoRASettings, out_dir: str, base: str = ""
) -> None:
    """Write the adapters as an HF PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``).

    Every rank calls it; rank 0 writes (`write_peft_adapter`). The adapters apply to the actor's
    current base (``base``: where that base is, for ``base_model_name_or_path``): after a
    reference reset that is the merged base, which the reference's export writes, not the model
    the run started from.
    """
    tensors = peft_adapter_tensors(model_chunks)
    if tensors is not None:
        write_peft_adapter(tensors, peft_adapter_config(settings, base), out_dir)


def write_peft_adapter(tensors: dict[str, torch.Tensor], config: dict[str, Any], out_dir: str) -> None:
    """Write an HF PEFT adapter directory: ``adapter_model.safetensors`` (``tensors``) and ``adapter_config.json``.

    Through a temporary directory beside ``out_dir``, renamed into place (an existing ``out_dir``
    is replaced); a failure leaves nothing behind.
    """
    import json
    import os
    import shutil
    import uuid

    from safetensors.torch import save_file

    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{uuid.uuid4().hex[:12]}"
    os.makedirs(tmp)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, "adapter_model.safetensors"))
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if os.path.lexists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def base_export_chunks(model_chunks: Sequence[torch.nn.Module]) -> list[Any]:
    """The chunks read as their base weights (adapters off, nothing merged): what the weight export sends for π_ref."""
    return [BaseWeights(_unwrapped(c)) for c in model_chunks]


def export_chunks(model: Any) -> list[Any]:
    """What the weight export reads of a model: its chunks, or a `LoRAReference`'s base views of the actor's."""
    return model.export_chunks if isinstance(model, LoRAReference) else model.model_chunks


# ----------------------------------------------------------------------------- the reference
class LoRAReference:
    """π_ref of a LoRA actor: the actor's own chunks with the adapters off; no second model.

    Same interface as `reference.ReferenceModel`. A reset (`reset_from`) merges the adapters into
    the base (π_ref ← π_θ up to the base dtype's rounding) and starts new adapters with fresh Adam
    state, so the policy stays what it was. The checkpoint keeps nothing of its own: the base and
    adapters are the actor's. It has no ``model_chunks`` (host offload and views handle the
    actor's); ``export_chunks`` are what the weight export reads for the engines.
    """

    def __init__(self, actor: Any) -> None:
        if not has_adapters(actor.model_chunks):
            raise ValueError("LoRAReference needs an actor with adapters (attach_adapters)")
        self.actor, self.temperature = actor, actor.temperature  # log-probs at the actor's (the rollouts') temperature
        self.arch, self.parallel, self.settings = actor.arch, actor.parallel, actor.settings
        self.resets = 0

    @property
    def export_chunks(self) -> list[BaseWeights]:
        """The actor's chunks read as their base weights (see `export_merges`)."""
        return base_export_chunks(self.actor.model_chunks)

    def compute_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> LogProbs:
        """Log-probs log π_ref [N, L] of every token: the actor's forward with its adapters off, on every rank."""
        with adapters_disabled(self.actor.model_chunks):
            logprobs: LogProbs = self.actor.compute_logprobs(input_ids, lengths)
            return logprobs

    def reset_from(self, actor: Any) -> None:
        """θ_ref ← θ: merge the adapters into the base, new adapters (A fresh, B = 0), fresh Adam state for them."""
        if actor is not self.actor:
            raise ValueError("a LoRA reference resets from its own actor")
        self.resets += 1
        merge_adapters(actor.model_chunks, generation=self._generation(actor))
        actor.base_source = None  # the base is no longer the files it was loaded from: checkpoints hold it now
        actor.restart_adapter_optimizer()

    def _generation(self, actor: Any) -> int:
        """A count that differs at each reset of a run, resumed ones included: the optimizer steps taken so far."""
        return int(actor.scheduler.num_steps) + 1

    def load_weights(self, path: str) -> None:
        """Nothing to load: the base is the actor's (``reference.init_from`` is refused with lora)."""

    def sharded_state_dict(self) -> dict[str, Any]:
        """Empty: the base and the adapters are in the actor's checkpoint state."""
        return {}

    def load_sharded_state_dict(self, loaded: dict[str, Any]) -> None:
        """Nothing: see `sharded_state_dict`."""
